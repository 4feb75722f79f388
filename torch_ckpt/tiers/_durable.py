"""The durable tier: a checkpoint root on any fsspec store (``s3://``, ``gs://``, ``file://``, ``memory://``).

Layout mirrors the local root (``URL/step_000000100/<files>``). Object stores have no atomic
rename, so a durable checkpoint is committed by writing its ``manifest.json`` *last*, after every
other file has been uploaded and verified (:func:`torch_ckpt.format._files.verify_files`, the same
check and messages as for a local checkpoint); a step without a manifest is invisible, deleting
removes the manifest first, and a manifest-less prefix left by a crashed uploader is removed once
idle (:func:`remove_abandoned`). URLs stay strings end to end; none goes through ``pathlib``.

A file an incremental save hard-linked is not stored twice: the durable manifest references the
object of the earlier step (``stored``), and an object is deleted only once no committed manifest
references it (:meth:`DurableTier.sweep`).

Node-local checkpoints (:mod:`torch_ckpt.root._nodes`) go up once per tensor: each node uploads
the files it is the uploader of (:func:`durable_manifest`: every file but the nodes' replica files)
and writes an upload record; node 0 waits for every record, checks it against the manifest and
writes the durable manifest last (:meth:`DurableTier.upload_node`). A replaced node fetches only
what its ranks load at the same rank layout (:func:`fetch_set`, :func:`node_fetch_manifest`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, cast

from fsspec.asyn import sync
from tqdm import tqdm

from torch_ckpt._logging import get_logger
from torch_ckpt._values import check_int, to_seconds
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, ConfigError
from torch_ckpt.format._files import (
    LINKED_FROM,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    MAX_MANIFEST_INT_DIGITS,
    METADATA_NAME,
    STORED,
    Manifest,
    read_manifest,
    verify_files,
)
from torch_ckpt.policy._naming import Naming, StepNaming
from torch_ckpt.root._layout import commit_dir, write_json_durable
from torch_ckpt.root._nodes import is_replica_file
from torch_ckpt.storage._crc import crc32
from torch_ckpt.storage._locations import (
    CHUNK_BYTES,
    DurableUnavailableError,
    Location,
    Watch,
    bounded,
    corrupt,
    loads_bounded,
    object_mtime,
    store_call,
    url_to_fs,
)

__all__ = ["DurableTier", "DurableUnavailableError", "abandoned_uploads", "durable_manifest", "fetch_set",
           "idle_seconds", "node_fetch_manifest", "remove_abandoned"]

log = get_logger(__name__)

#: Per thread: the watch of the bounded call (:meth:`DurableTier.listed`) running on this worker thread.
_calls = threading.local()
#: Protocols whose root lies in a bucket that must exist (and is never created unless asked).
_BUCKET_STORES = ("s3", "s3a", "gs", "gcs", "abfs", "az", "adl")
#: The upload record a node writes into a step's prefix once its files are uploaded and verified.
_MARKER = "_uploaded_node_{:05d}.json"


class DurableTier:
    """A checkpoint root on an fsspec store.

    Args:
        url: fsspec URL of the durable run root, e.g. ``s3://bucket/runs/exp1``.
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, ``client_kwargs``...).
        verify: "checksum" (check every uploaded object's content) or "size" (sizes only).
        naming: directory names of steps (the local root's naming; default ``step_000000042``).
        part_bytes: multipart part size on S3-compatible stores (bytes); files of at least twice
            this size are uploaded in parts.
        upload_threads: large files uploaded (and downloaded) at once by this process (>= 1): at most
            ``upload_threads * part_bytes`` bytes in flight (``CHUNK_BYTES`` for downloads), small
            files beside them (:func:`_run_all`).
        timeout_seconds: longest silence of the store that a call from the caller's thread
            (:meth:`listed`, :meth:`fetch`) waits out (seconds, > 0); on S3-compatible stores also
            the botocore connect and read timeouts (3 attempts, "standard" retries) unless
            ``storage_options["config_kwargs"]`` sets them.
        create: create a missing bucket (or the missing parent directory of a ``file://`` root)
            at the first upload; by default a missing one is an error (:meth:`check_container`).

    An S3 object sent in one request is verified by the ETag its ``PutObject`` answer carries: the MD5
    of the bytes sent, whose size and CRC-32 were checked against the manifest (no further request).
    With ``verify="checksum"``, one sent in parts is verified by the ETag its HEAD gives (the MD5 of
    the parts' MD5s) and any other object is read back (``bytes_read_back`` counts those bytes).
    Downloads are checked (size and CRC-32) before they are committed.

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed (the message
            names the package to install), or an argument is invalid.
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None, verify: str = "checksum",
                 naming: Naming | None = None, part_bytes: int = 64 << 20, upload_threads: int = 1,
                 timeout_seconds: float = 30.0, create: bool = False) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigError(f"durable_url must be a non-empty fsspec URL string, got {url!r}")
        if verify not in ("checksum", "size"):
            raise ConfigError(f"verify must be 'checksum' or 'size', got {verify!r}")
        self.timeout_seconds = to_seconds("durable_timeout_seconds", timeout_seconds, positive=True)
        self.create = bool(create)
        self.fs, self.root = url_to_fs(url, _with_timeouts(url, storage_options, self.timeout_seconds))
        self.url = url.rstrip("/")
        check_int("part_bytes (S3's smallest part is 5 MiB)", part_bytes, 5 << 20)
        check_int("upload_threads", upload_threads, 1, 256)  # the bound CheckpointConfig sets
        self.verify = verify
        self.naming = naming or StepNaming()
        self.part_bytes = part_bytes
        self.upload_threads = upload_threads
        self.bytes_read_back = 0  # bytes read back from the store to verify uploads (0 when it verifies itself)
        self.bytes_uploaded = 0  # bytes of files uploaded
        self.bytes_referenced = 0  # bytes of files not uploaded: the object of an earlier step (incremental saves)
        self._store_checked: bool | None = None  # None: not tried yet; False: ETags are not MD5s
        self._bucket_seen = False  # check_container() found the bucket (bucket stores)
        self._manifests: dict[str, Manifest] = {}  # directory name: manifest this tier committed or read
        self._uncommitted: set[str] = set()  # directory names found without a manifest (list_steps(reuse=True))
        self._lock = threading.Lock()  # the fields above, updated by upload threads
        self.last_download: list[str] = []  # files fetched by the last download()
        protocol = self.fs.protocol
        self._protocol = protocol if isinstance(protocol, str) else protocol[0]

    def is_inside(self, local_root: Path) -> bool:
        """True when this tier is a local path equal to, inside or containing ``local_root``."""
        if self._protocol not in ("file", "local"):
            return False
        mine, theirs = Path(self.root).resolve(), Path(local_root).resolve()
        return mine == theirs or theirs in mine.parents or mine in theirs.parents

    def describe(self, step: int) -> str:
        """URL of a step directory (for messages)."""
        return f"{self.url}/{self.naming.name(step)}"

    def location(self, step: int) -> Location:
        """The directory of ``step`` in this tier (whether or not it exists or is committed)."""
        name = self.naming.name(step)
        return Location.on(self.fs, f"{self.root}/{name}", f"{self.url}/{name}")

    def refresh(self) -> None:
        """Drop the file system's listing cache (after this process or another one wrote objects)."""
        self.fs.invalidate_cache()

    # -- the container: a bucket, or the parent directory of a file:// root ---------------------
    def check_container(self) -> None:
        """Check that the container exists: the bucket or the parent directory of a ``file://`` root
        (``memory://``... have none); a missing root in it is an empty tier, a missing container an error
        (deleted, misspelt or not mounted). With ``create``, create a missing one.

        Raises:
            DurableUnavailableError: it does not exist (and ``create`` is False), or the store
                cannot be asked.
        """
        if self._protocol in ("file", "local"):
            container, kind = os.path.dirname(self.root) or "/", "parent directory"
        elif self._protocol in _BUCKET_STORES:
            container, kind = self.root.lstrip("/").split("/", 1)[0], "bucket"
        else:
            return
        try:
            store_call(f"cannot read durable tier {self.url} ({kind} {container!r})", self.fs.info, container)
            return
        except FileNotFoundError:
            if not self.create:
                raise DurableUnavailableError(
                    f"durable tier {self.url}: its {kind} {container!r} does not exist (deleted, misspelt or not "
                    f"mounted); create it, or pass durable_create=True to have it created") from None
        try:
            region = (getattr(self.fs, "client_kwargs", None) or {}).get("region_name")
            if self._protocol in ("s3", "s3a") and region in (None, "us-east-1"):
                # s3fs would send us-east-1 as a LocationConstraint, which S3 refuses for that region
                self.fs.call_s3("create_bucket", Bucket=container)
                self.fs.invalidate_cache()
            else:
                self.fs.makedirs(container, exist_ok=True)
        except Exception as exc:  # noqa: BLE001
            raise DurableUnavailableError(f"durable tier {self.url}: cannot create its {kind} {container!r}: "
                                          f"{type(exc).__name__}: {exc}") from exc
        log.warning("durable tier %s: created its %s %r (durable_create=True)", self.url, kind, container)

    @contextmanager
    def _naming_a_gone_bucket(self) -> Iterator[None]:
        """Writes into the bucket :meth:`make_step_dir` saw: a FileNotFoundError from them checks it again, so a
        bucket deleted since raises DurableUnavailableError naming it (else the error propagates as it is)."""
        try:
            yield
        except FileNotFoundError:
            self._bucket_seen = False
            self.check_container()
            raise

    def make_step_dir(self, path: str) -> None:
        """Before an upload into ``path``: :meth:`check_container` (a bucket once: an upload into a bucket
        deleted since fails, and :meth:`put_all` then names it), and create ``path`` on stores with directories."""
        if not self._bucket_seen:
            self.check_container()
            self._bucket_seen = self._protocol in _BUCKET_STORES
        if self._protocol not in _BUCKET_STORES:
            self.fs.makedirs(path, exist_ok=True)

    # -- listing -------------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        """Names of the entries directly under the durable root, sorted ([] when it does not exist yet).

        Raises:
            DurableUnavailableError: the store cannot be listed (distinct from an empty root), or
                the container does not exist (:meth:`check_container`).
        """
        self.refresh()
        root = Location.on(self.fs, self.root, self.url)
        what = f"cannot list durable tier {self.url}"
        try:
            return sorted(store_call(what, root.entries))
        except FileNotFoundError:
            pass
        self.check_container()  # an absent root is empty only when its bucket exists
        return []

    def listed(self) -> dict[int, Manifest]:
        """:meth:`list_steps` for the caller's thread: DurableUnavailableError after ``timeout_seconds``
        without an answer (:func:`torch_ckpt.storage._locations.bounded`)."""
        def run(watch: Watch) -> dict[int, Manifest]:
            _calls.watch = watch  # list_steps runs on this worker thread: it ticks the watch
            return self.list_steps()

        return bounded(run, timeout_seconds=self.timeout_seconds, what=f"listing durable tier {self.url}")

    def fetch(self, step: int, local_root: Path, *, node: int | None = None) -> Path:
        """:meth:`download` for the caller's thread: DurableUnavailableError after ``timeout_seconds``
        without an answer (a download receiving bytes goes on); nothing is committed after that."""
        return bounded(lambda watch: self.download(step, local_root, node=node, watch=watch),
                       timeout_seconds=self.timeout_seconds, what=f"downloading {self.describe(step)}")

    def list_steps(self, *, reuse: bool = False) -> dict[int, Manifest]:
        """``{step: manifest}`` of committed durable checkpoints (called by :meth:`listed`, it tells
        the caller's watch of every answer). ``reuse``: the manifests this tier committed or read
        before are not read again (only for the process that alone writes the tier: its
        retention), the names are always listed.

        Raises:
            DurableUnavailableError: the store cannot be listed (distinct from an empty root).
        """
        found: dict[int, Manifest] = {}
        watch: Watch | None = getattr(_calls, "watch", None)
        names = self.list_names()
        for name in names:
            if watch is not None:
                watch.tick()
            named_step = self.naming.step_of(name)
            if named_step is None:
                continue
            with self._lock:
                manifest = self._manifests.get(name) if reuse else None
                if reuse and name in self._uncommitted:
                    continue
            if manifest is None:
                try:
                    manifest = store_call(f"cannot read {self.url}/{name}", self.read_manifest, named_step)
                except FileNotFoundError:
                    with self._lock:
                        self._uncommitted.add(name)
                    continue  # an upload in progress or abandoned: not committed
                except CheckpointCorruptError as exc:
                    log.warning("durable tier: ignoring %s/%s: %s", self.url, name, exc)
                    continue
            if manifest.step == named_step:
                found[manifest.step] = manifest
                with self._lock:
                    self._manifests[name] = manifest
        with self._lock:
            for name in set(self._manifests) - set(names):
                del self._manifests[name]
            self._uncommitted &= set(names)
        return dict(sorted(found.items()))

    def read_manifest(self, step: int) -> Manifest:
        """The durable manifest of ``step`` (:func:`torch_ckpt.format._files.read_manifest`, which raises)."""
        return read_manifest(self.location(step))

    # -- upload --------------------------------------------------------------------------------
    def _store_digest(self, local: Path, info: dict[str, int]) -> str | None:
        """The ETag S3 computes for ``local`` uploaded here in parts (the MD5 of the parts' MD5s and
        ``-<parts>``), in one pass with the CRC-32; None when the file no longer matches the manifest."""
        size, crc, parts = 0, 0, []
        with open(local, "rb") as f:
            while chunk := f.read(self.part_bytes):
                size, crc = size + len(chunk), crc32(chunk, crc)
                parts.append(hashlib.md5(chunk, usedforsecurity=False).digest())
        if size != info["bytes"] or crc != info["crc32"]:
            return None
        return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"

    def _durable_manifest(self, step: int) -> Manifest | None:
        """The committed manifest of ``step`` on this tier (as this tier committed or read it, else read;
        None when the tier does not hold it)."""
        directory = self.naming.name(step)
        with self._lock:
            held = self._manifests.get(directory)
        if held is None:
            try:
                held = self.read_manifest(step)
            except (CheckpointError, OSError):  # not uploaded (replicate_every_n_saves), or deleted by retention
                return None
            with self._lock:
                self._manifests[directory] = held
        return held

    def _references(self, files: dict[str, dict[str, int]], local_root: Path) -> dict[str, str]:
        """``{name: directory holding its object}`` for the files an incremental save hard-linked whose
        checkpoint is committed on this tier with the same file (bytes and CRC-32 in its durable manifest):
        the candidates for not being uploaded again (:attr:`Manifest.stored`), once :meth:`put_all` has
        found each object there with its size. A file linked from a step this tier does not hold (with
        ``replicate_every_n_saves``) is followed through that step's local manifest in ``local_root`` to the
        step it was linked from there, and so on, while those local checkpoints are there: the same bytes
        (a hard link of a hard link), referenced where the tier holds them."""
        found: dict[str, str] = {}
        local: dict[int, Manifest | None] = {}
        for name, info in files.items():
            step, seen = info.get(LINKED_FROM), set()
            while isinstance(step, int) and step not in seen:
                seen.add(step)
                held = self._durable_manifest(step)
                listed = held.files.get(name) if held is not None else None
                if held is not None and listed is not None and \
                        (listed["bytes"], listed["crc32"]) == (info["bytes"], info["crc32"]):
                    found[name] = held.stored.get(name, self.naming.name(step))
                    break
                if step not in local:
                    try:
                        local[step] = read_manifest(local_root / self.naming.name(step))
                    except (CheckpointError, OSError):  # deleted by local retention: uploaded instead
                        local[step] = None
                mine = local[step]
                there = mine.files.get(name) if mine is not None else None
                if there is None or (there["bytes"], there["crc32"]) != (info["bytes"], info["crc32"]):
                    break
                step = there.get(LINKED_FROM)
        return found

    def _sizes(self, directories: set[str]) -> dict[tuple[str, str], int]:
        """``{(directory, name): size in bytes}`` of the objects in those step directories (one listing each)."""
        out: dict[tuple[str, str], int] = {}
        for where in sorted(directories):
            path = f"{self.root}/{where}"
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                continue
            for info in entries:
                if info.get("type") != "directory":
                    out[(where, str(info["name"]).rstrip("/").rsplit("/", 1)[-1])] = int(info.get("size") or 0)
        return out

    def _parts_at_once(self, size: int) -> int:
        """Parts of a file of ``size`` bytes sent at once (s3fs reads that many parts into memory, and would
        read up to its own ``max_concurrency``, 10 by default): at most ``upload_threads``."""
        parts = -(-size // self.part_bytes)
        return max(1, min(self.upload_threads, int(getattr(self.fs, "max_concurrency", 1) or 1), parts))

    def _multipart(self, size: int) -> bool:
        """Whether a file of ``size`` bytes goes up in parts (s3fs: from twice the part size, or 5 GiB)."""
        return size >= min(5 << 30, 2 * self.part_bytes)

    def _put_object(self, local: Path, loc: Location, name: str, info: dict[str, int]) -> bool:
        """Upload one file in one S3 ``PutObject`` request (what s3fs sends for it, with the same
        additional arguments); True when the store answered the MD5 of the bytes sent as its ETag.

        Raises:
            CheckpointCorruptError: the local file no longer matches the manifest (size or CRC-32);
                nothing is sent.
        """
        body = local.read_bytes()
        if len(body) != info["bytes"]:
            raise corrupt(str(local), f"size {len(body)} bytes, manifest says {info['bytes']} (changed since its "
                                      "commit; not uploaded)")
        if (crc := crc32(body)) != info["crc32"]:
            raise corrupt(str(local), f"CRC-32 {crc:#010x} does not match the manifest ({info['crc32']:#010x}); "
                                      "the file changed since its commit and is not uploaded")
        bucket, key, _ = self.fs.split_path(f"{loc.path}/{name}")
        answer = sync(self.fs.loop, self.fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=body)
        return str(answer.get("ETag", "")).strip('"') == hashlib.md5(body, usedforsecurity=False).hexdigest()

    def _put_verified(self, local: Path, loc: Location, name: str, info: dict[str, int]) -> None:
        """Upload one file, then check the stored object: by the ETag of the S3 request that stored it
        (one request), else by its digest (HEAD), else read back."""
        checksums, s3 = self.verify == "checksum", self._protocol in ("s3", "s3a")
        one_request = s3 and not self._multipart(info["bytes"])
        if one_request:
            verified = self._put_object(local, loc, name, info)
        else:
            extra = {"chunksize": self.part_bytes, "max_concurrency": self._parts_at_once(info["bytes"])} \
                if s3 else {}
            self.fs.put_file(str(local), f"{loc.path}/{name}", **extra)
        with self._lock:
            self.bytes_uploaded += info["bytes"]
        self.refresh()
        if one_request and verified:  # the store answered the MD5 of bytes whose size and CRC-32 were checked
            with self._lock:
                self._store_checked = True
            return
        digests = None
        if checksums and s3 and not one_request and self._store_checked is not False:
            digest = self._store_digest(local, info)
            digests = {name: digest} if digest is not None else None
        read = verify_files(loc, _only(name, info), checksums=checksums, store_digests=digests)
        with self._lock:
            self.bytes_read_back += read
            if checksums and s3 and info["bytes"] and self._store_checked is None:
                self._store_checked = read == 0
                if read:  # read back (and equal): this store's ETags are not MD5s
                    log.warning("durable tier %s: object ETags are not MD5 digests; verifying uploads by reading "
                                "them back", self.url)

    def put_all(self, local_dir: Path, step: int, files: dict[str, dict[str, int]]) -> dict[str, str]:
        """Upload and verify ``files`` (``{name: {"bytes", "crc32"}}``) of ``local_dir`` into the
        directory of ``step`` (at most ``upload_threads * part_bytes`` bytes in flight, see :func:`_run_all`);
        writes no manifest (raises as :meth:`upload`).

        A file an incremental save hard-linked (``linked_from``) is not uploaded when the tier holds that
        step's object with the same bytes and CRC-32 (:attr:`bytes_referenced`): the returned
        ``{name: directory}`` (the durable manifest's :attr:`~torch_ckpt.format._files.Manifest.stored`)
        says where it is, and :meth:`delete` keeps an object while a committed manifest references it.
        Each referenced object is found there with its size by one listing per directory, made while the
        other files are uploaded; one that is gone is uploaded instead."""
        loc = self.location(step)
        candidates = self._references(files, local_dir.parent)
        budget = self.upload_threads * self.part_bytes

        def held(size: int) -> int:  # bytes an upload holds: a file sent in one request is read whole
            return self._parts_at_once(size) * self.part_bytes if self._multipart(size) else size

        def put(names: list[str], *also: tuple[int, Callable[..., None], tuple[Any, ...]]) -> None:
            _run_all([(held(files[n]["bytes"]), self._put_verified, (local_dir / n, loc, n, files[n]))
                      for n in names] + list(also), budget, "torch_ckpt_upload")

        sizes: dict[tuple[str, str], int] = {}
        with self._naming_a_gone_bucket():  # the listing of the referenced directories goes beside the uploads
            put(sorted(set(files) - set(candidates)),
                (0, lambda: sizes.update(self._sizes(set(candidates.values()))), ()))
            refs = {name: where for name, where in candidates.items()
                    if sizes.get((where, name)) == files[name]["bytes"]}
            put(sorted(set(candidates) - set(refs)))
        with self._lock:
            self.bytes_referenced += sum(files[name]["bytes"] for name in refs)
        return refs

    def _check_references(self, manifest: Manifest) -> None:
        """Before a commit of references other processes found: each object is there with its size."""
        held = self._sizes(set(manifest.stored.values()))
        for name, where in sorted(manifest.stored.items()):
            if held.get((where, name)) != manifest.files[name]["bytes"]:
                raise corrupt(f"{self.url}/{where}/{name}", f"referenced by step {manifest.step} but missing or "
                                                            "of another size; the step is not committed")

    def _commit(self, loc: Location, manifest: Manifest) -> None:
        with self._naming_a_gone_bucket():
            self.fs.pipe_file(f"{loc.path}/{MANIFEST_NAME}",
                              json.dumps(manifest.to_json(), separators=(",", ":")).encode())
        self.refresh()
        with self._lock:
            self._manifests[loc.name] = manifest
            self._uncommitted.discard(loc.name)

    def upload(self, local_dir: Path, manifest: Manifest) -> None:
        """Upload a committed local checkpoint, verify every file, then write the manifest (commit).

        Raises:
            CheckpointCorruptError: an uploaded object does not match the manifest (its URL named).
            Exception: backend errors propagate (the replicator retries them).
        """
        loc = self.location(manifest.step)
        self.make_step_dir(loc.path)
        stored = self.put_all(local_dir, manifest.step, manifest.files)
        self._commit(loc, dataclasses.replace(manifest, stored=stored))

    def upload_node(self, local_dir: Path, manifest: Manifest, *, commit: bool, wait_seconds: float = 600.0,
                    poll_seconds: float = 0.2, abandon: Callable[[], bool] = lambda: False) -> None:
        """Upload one node's copy of a node-local checkpoint; on the committing node, also commit it.

        A step whose uploader died midway never gets a manifest, so the tier never shows it.

        Args:
            local_dir: this node's committed copy.
            manifest: its manifest (``node`` set).
            commit: write the durable manifest once every node's record is there.
            wait_seconds: how long the committing node waits for the other nodes' records (seconds).
            poll_seconds: first delay between looks for records (doubles up to 5 s).
            abandon: returns True when waiting is pointless (a newer step is queued).

        Raises:
            ValueError: ``manifest`` is not one node's copy.
            CheckpointCorruptError: an upload or a node's record does not match the manifest (named).
            TimeoutError: a node's record did not appear within ``wait_seconds`` (or ``abandon``).
        """
        if manifest.node is None:
            raise ValueError("upload_node() needs one node's copy (manifest.node is set)")
        step, node, loc = manifest.step, manifest.node, self.location(manifest.step)
        self.make_step_dir(loc.path)
        durable = durable_manifest(manifest)  # without the nodes' extra copies: each tensor is uploaded once
        file_node = durable.nodes["file_node"]
        mine = {name: info for name, info in durable.files.items() if file_node[name] == node}
        stored = self.put_all(local_dir, step, mine)
        self.fs.pipe_file(f"{loc.path}/{_MARKER.format(node)}",
                          json.dumps({"node": node, "files": mine, STORED: stored}).encode())
        self.refresh()
        if not commit:
            return
        nodes = max(manifest.nodes["rank_node"]) + 1
        deadline, delay, missing = time.monotonic() + wait_seconds, poll_seconds, list(range(nodes))
        while True:
            self.refresh()
            missing = [n for n in missing if not loc.exists(_MARKER.format(n))]
            if not missing:
                break
            if abandon() or time.monotonic() > deadline:
                raise TimeoutError(f"durable tier {self.url}: step {step} is not committed: node(s) {missing} have "
                                   f"not finished uploading their shards")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        stored = {}
        for n in range(nodes):
            source = loc.describe(_MARKER.format(n))
            raw = loc.read_bytes(_MARKER.format(n), MAX_MANIFEST_BYTES, what="upload record")
            doc: Any = loads_bounded(raw, source, what="upload record", max_depth=MAX_MANIFEST_DEPTH,
                                     max_int_digits=MAX_MANIFEST_INT_DIGITS)
            theirs = {k: v for k, v in durable.files.items() if file_node[k] == n}
            if not isinstance(doc, dict) or doc.get("files") != theirs or not isinstance(doc.get(STORED, {}), dict) \
                    or not set(doc.get(STORED, {})) <= set(theirs):
                raise corrupt(source, f"node {n}'s upload record of step {step} does not match the manifest")
            stored.update(doc.get(STORED, {}))
        try:
            durable = dataclasses.replace(durable, stored=stored)
            Manifest.from_json(durable.to_json(), loc.describe(MANIFEST_NAME))  # the records' directory names
        except CheckpointCorruptError as exc:
            raise corrupt(loc.describe(), f"the upload records of step {step} do not make a valid manifest "
                                          f"({exc})") from None
        self._check_references(durable)  # the other nodes looked before their records, maybe long ago
        self._commit(loc, durable)

    def delete(self, step: int, *, listed: Mapping[int, Manifest] | None = None) -> None:
        """Delete a durable checkpoint: its manifest first (un-commit), then every object of its directory
        that no committed manifest references (:attr:`~torch_ckpt.format._files.Manifest.stored`), and the
        objects it referenced in the directories of deleted steps once nothing references them. A kill at
        any point leaves objects no manifest needs (removed by a later deletion or :func:`remove_abandoned`),
        never a committed manifest missing one. ``listed``: the committed steps as the caller, the tier's
        only writer, just listed them (:meth:`list_steps` with ``reuse``), so they are not listed again."""
        name = self.naming.name(step)
        with self._lock:
            manifest = self._manifests.pop(name, None)
        try:
            referenced = set((manifest or self.read_manifest(step)).stored.values())
        except (CheckpointError, OSError, ValueError):
            referenced = set()
        with suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.root}/{name}/{MANIFEST_NAME}")  # first: un-commit
        with self._lock:
            self._uncommitted.add(name)
        self.refresh()
        self.sweep([name, *sorted(referenced)],
                   listed=None if listed is None else {s: m for s, m in listed.items() if s != step})

    def sweep(self, names: list[str], *, listed: Mapping[int, Manifest] | None = None) -> int:
        """Delete the objects of the uncommitted step directories ``names`` that no committed manifest of
        this tier references (those ``listed``, else listed now); returns how many were deleted (a
        committed directory is left alone)."""
        kept: dict[str, set[str]] = {}
        for manifest in (self.list_steps(reuse=True) if listed is None else listed).values():
            for file, where in manifest.stored.items():
                kept.setdefault(where, set()).add(file)
        deleted = 0
        for name in dict.fromkeys(names):
            path = f"{self.root}/{name}"
            try:
                objects = [str(p) for p in self.fs.find(path)]
            except FileNotFoundError:
                continue
            if any(p.rstrip("/").endswith("/" + MANIFEST_NAME) for p in objects):
                continue  # committed (again, or still): not garbage
            gone = [p for p in objects if p.rstrip("/").rsplit("/", 1)[-1] not in kept.get(name, ())]
            if gone:
                try:
                    self.fs.rm(gone)  # one request on S3 (DeleteObjects), whatever the number
                except FileNotFoundError:  # one went meanwhile: a local or memory store stopped at it
                    for p in gone:
                        with suppress(FileNotFoundError):
                            self.fs.rm_file(p)
            if len(gone) == len(objects) and self._protocol not in _BUCKET_STORES:
                with suppress(FileNotFoundError):
                    self.fs.rm(path, recursive=True)  # the emptied directory
            deleted += len(gone)
        self.refresh()
        return deleted

    def set_aside(self, step: int, *, reason: str = "superseded") -> str:
        """Move a durable checkpoint aside to the hidden prefix ``.<reason>_<name>.<time>``; returns its URL.

        The files its manifest lists (also those it references in earlier steps' directories) are copied
        there (hard-linked on a ``file://`` root), then its manifest without references, then the step is
        deleted (:meth:`delete`; a crash before leaves the step listed). Backend errors propagate (the
        replicator retries them).
        """
        name = self.naming.name(step)
        manifest = self.read_manifest(step)
        base = f".{reason}_{name}.{int(time.time())}"
        taken = set(self.list_names())
        target = next(t for t in (f"{base}.{n}" if n else base for n in range(10_000)) if t not in taken)
        src, dst = self.location(step).resolving(manifest.stored), f"{self.root}/{target}"
        self.make_step_dir(dst)
        for file in sorted(manifest.files):
            if self._protocol in ("file", "local"):
                try:
                    os.link(src.path_of(file), f"{dst}/{file}")
                    continue
                except OSError:
                    pass
            self.fs.copy(src.path_of(file), f"{dst}/{file}")
        self.fs.pipe_file(f"{dst}/{MANIFEST_NAME}", json.dumps(dataclasses.replace(manifest, stored={}).to_json(),
                                                               separators=(",", ":")).encode())
        self.refresh()
        self.delete(step)
        log.warning("durable tier %s: moved %s checkpoint %s aside to %s", self.url, reason, name, target)
        return f"{self.url}/{target}"

    # -- download ------------------------------------------------------------------------------
    def _fetch_file(self, src: Location, name: str, info: dict[str, int], tmp: Path, bar: Any, watch: Watch) -> None:
        """Copy one object into ``tmp`` and check the copy (errors as :meth:`download`)."""
        what = f"cannot read {src.describe(name)}"  # the store's failures, not the local disk's, are an outage
        try:
            # no read-ahead cache: each read asks for one chunk (the "readahead" default asks for two and keeps them)
            fin = store_call(what, self.fs.open, src.path_of(name), "rb", block_size=CHUNK_BYTES, cache_type="none")
        except FileNotFoundError:  # deleted from the store after its manifest was written: a damaged copy
            raise corrupt(src.describe(name), "listed in the manifest but missing") from None
        with fin, open(tmp / name, "wb") as fout:
            while chunk := store_call(what, fin.read, CHUNK_BYTES):
                watch.tick()
                with watch.local_work():
                    fout.write(chunk)
                bar.update(len(chunk))
            with watch.local_work():
                fout.flush()
                os.fsync(fout.fileno())
        problems: list[tuple[str, str]] = []
        with watch.local_work():
            verify_files(tmp, _only(name, info), checksums=True, collect=problems)
        if problems:
            raise corrupt(src.describe(name), problems[0][1])

    def download(self, step: int, local_root: Path, *, node: int | None = None, watch: Watch | None = None) -> Path:
        """Download a durable checkpoint into ``local_root`` (verified, then committed atomically).

        ``node``: for a node-local checkpoint, fetch only what this node's ranks load at the same rank
        layout (:func:`fetch_set`), committed as that node's copy. ``watch`` is told of every answer of
        the store, and the commit goes through it (:meth:`fetch`). Returns the committed directory.

        Raises:
            CheckpointCorruptError: a fetched file does not have the manifest's size or CRC-32 (the
                message names the object's URL).
            ValueError: ``node`` is given but the checkpoint was not written to node-local roots.
            DurableUnavailableError: the store cannot be reached or failed during the download.
        """
        watch = watch if watch is not None else Watch()
        manifest = self.read_manifest(step)
        watch.tick()
        if node is not None:
            manifest = node_fetch_manifest(manifest, node, self.describe(step))
        files = manifest.local_files()
        final = local_root / self.naming.name(step)
        tmp = local_root / f".{final.name}.download.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        bar = tqdm(total=sum(i["bytes"] for i in files.values()), desc=f"download step {step}", unit="B",
                   unit_scale=True, unit_divisor=1024, leave=False, dynamic_ncols=True, disable=None)  # None: TTY only
        try:
            src = self.location(step).resolving(manifest.stored)
            _run_all([(min(info["bytes"], CHUNK_BYTES), self._fetch_file, (src, name, info, tmp, bar, watch))
                      for name, info in sorted(files.items())], self.upload_threads * CHUNK_BYTES,
                     "torch_ckpt_download")
            # every file is in the local copy, written by this download: it references no other directory, links
            # nothing (no linked_from), and its durable copy is this tier's (the next start does not upload it again)
            local = dataclasses.replace(
                manifest, stored={}, files={n: {k: v for k, v in i.items() if k != LINKED_FROM}
                                            for n, i in manifest.files.items()},
                tiers={**manifest.tiers, "durable": {"url": self.url}})
            with watch.local_work():
                write_json_durable(tmp / MANIFEST_NAME, local.to_json())
            watch.publish(lambda: commit_dir(tmp, final, replace=final.exists()))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
        self.last_download = sorted(files)
        return final


# -- node-local checkpoints -----------------------------------------------------------------------
def durable_manifest(manifest: Manifest) -> Manifest:
    """The manifest of the durable copy of a node-local checkpoint: every file except the nodes'
    replica files and per-node metadata (node 0's ``.metadata`` is the complete one); ``node`` None."""
    keep = {n: i for n, i in manifest.files.items()
            if not is_replica_file(n) and not (n.startswith("node_") and n.endswith(".metadata"))}
    nodes = {"rank_node": manifest.nodes["rank_node"],
             "file_node": {n: v for n, v in manifest.nodes["file_node"].items() if n in keep},
             "shared": list(manifest.nodes.get("shared", []))}
    return dataclasses.replace(manifest, files=keep, nodes=nodes, node=None, tiers={})


def fetch_set(manifest: Manifest, node: int) -> list[str]:
    """Files a node fetches from the durable copy to restore its ranks at the same layout: its
    ranks' uploaded files, the files holding replicated tensors, and the complete ``.metadata``."""
    own = {n for n, v in manifest.nodes["file_node"].items() if v == node}
    return sorted(own | set(manifest.nodes.get("shared", [])) | {METADATA_NAME})


def node_fetch_manifest(manifest: Manifest, node: int, where: str) -> Manifest:
    """The manifest of ``node``'s copy fetched from the durable ``manifest`` (``held``: :func:`fetch_set`).

    Raises:
        ValueError: the checkpoint was written to a shared root (it has no node copies); names ``where``.
    """
    if not manifest.nodes:
        raise ValueError(f"{where} was written to a shared root: it has no node copies")
    return dataclasses.replace(manifest, node=node, nodes={**manifest.nodes, "held": fetch_set(manifest, node),
                                                           "metadata": METADATA_NAME})


# -- uploads abandoned by a crash: step prefixes that never got their manifest ---------------------
def abandoned_uploads(tier: DurableTier, *, older_than_seconds: float,
                      exclude: set[int] | frozenset[int] = frozenset(), now: float | None = None) -> dict[int, float]:
    """``{step: age in seconds}`` of the manifest-less step prefixes idle for over ``older_than_seconds``
    (none holding an object without a modification time: it may still be uploading), except
    ``exclude``; ``now``: Unix time (seconds; default ``time.time()``). DurableUnavailableError when
    the store cannot be listed."""
    now = time.time() if now is None else now
    found: dict[int, float] = {}
    for name in tier.list_names():
        named_step = tier.naming.step_of(name)
        if named_step is None or named_step in exclude:
            continue
        age = idle_seconds(tier, named_step, now)
        if age is not None and age > older_than_seconds:
            found[named_step] = age
    return found


def idle_seconds(tier: DurableTier, step: int, now: float) -> float | None:
    """Seconds since the newest object of an uncommitted step prefix was written; None when it is
    committed, empty, or an object's time is unknown. DurableUnavailableError when it cannot be listed."""
    try:
        objects = store_call(f"cannot list {tier.describe(step)}", tier.fs.find, tier.location(step).path, detail=True)
    except FileNotFoundError:
        return None
    if any(str(path).rstrip("/").endswith("/" + MANIFEST_NAME) for path in objects):
        return None  # committed (or being deleted manifest-first by retention)
    times = [object_mtime(info) for info in objects.values()]
    if not times or any(t is None for t in times):
        return None
    return now - max(cast(list[float], times))


def remove_abandoned(tier: DurableTier, *, older_than_seconds: float,
                     exclude: set[int] | frozenset[int] = frozenset(), now: float | None = None) -> list[int]:
    """Delete the prefixes :func:`abandoned_uploads` returns (each listed again first, and kept if a
    manifest or a new object appeared); returns their steps, ascending. Arguments and errors as there."""
    removed = []
    for step in sorted(abandoned_uploads(tier, older_than_seconds=older_than_seconds, exclude=exclude, now=now)):
        tier.refresh()
        age = idle_seconds(tier, step, time.time() if now is None else now)
        if age is None or age <= older_than_seconds:
            continue
        if not tier.sweep([tier.naming.name(step)]):
            continue  # only objects committed steps reference (a deleted step's): kept
        removed.append(step)
        log.warning("durable tier %s: removed abandoned upload of step %d (no manifest, untouched for %.0f s)",
                    tier.url, step, age)
    tier.refresh()
    return removed


#: most transfers running at once, however small their files (the pool's threads)
MAX_TRANSFERS = 16


def _run_all(items: list[tuple[int, Callable[..., None], tuple[Any, ...]]], budget_bytes: int, prefix: str) -> None:
    """``work(*args)`` for every ``(weight, work, args)`` item, the heaviest first, as many at once as keep
    the sum of the running items' weights (the bytes each holds in memory) within ``budget_bytes``, one
    at a time when one alone is heavier, and at most :data:`MAX_TRANSFERS`. So the small files of a save
    (rank files, ``.metadata``) and a listing travel beside its large ones and a save costs about its
    largest transfer, not the sum of its requests' round trips. After a failure no further item starts
    (a failed upload or download is retried whole; the rest would be wasted transfers), the running
    ones finish, and the first failure in ``items`` order is raised."""
    failed = threading.Event()
    cond = threading.Condition()
    running = [0]  # bytes of the items now running

    def run(weight: int, work: Callable[..., None], args: tuple[Any, ...]) -> None:
        with cond:
            while running[0] and running[0] + weight > budget_bytes:
                cond.wait()
            running[0] += weight
        try:
            if not failed.is_set():
                work(*args)
        except BaseException:
            failed.set()
            raise
        finally:
            with cond:
                running[0] -= weight
                cond.notify_all()

    if not items:
        return
    order = sorted(range(len(items)), key=lambda i: -items[i][0])
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_TRANSFERS, len(items))), thread_name_prefix=prefix) as pool:
        futures = {i: pool.submit(run, *items[i]) for i in order}
    for i in range(len(items)):
        futures[i].result()


def _only(name: str, info: dict[str, int]) -> Manifest:
    """A manifest listing the one file ``name`` (``verify_files`` checks the listed files)."""
    return Manifest(step=0, world_size=1, files={name: info})


def _with_timeouts(url: str, storage_options: Mapping[str, Any] | None, timeout_seconds: float) -> dict[str, Any]:
    """``storage_options`` with botocore connect/read timeouts of ``timeout_seconds`` and 3 "standard"
    attempts on S3 stores unless set (botocore's 60 s and 5 attempts under s3fs's retries take minutes)."""
    options = dict(storage_options or {})
    if not url.startswith(("s3://", "s3a://")):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", timeout_seconds)
    config.setdefault("read_timeout", timeout_seconds)
    config.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
    options["config_kwargs"] = config
    return options
