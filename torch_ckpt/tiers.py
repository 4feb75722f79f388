"""The durable tier: a checkpoint root on any fsspec store (``s3://``, ``gs://``, ``file://``, ``memory://``).

Layout mirrors the local root (``URL/step_000000100/<files>``). Object stores have no atomic
rename, so a durable checkpoint is committed by writing its ``manifest.json`` *last*, after every
other file has been uploaded and verified (size, and CRC-32 read back from the store unless
``verify="size"``); a step directory without a manifest is invisible. Deleting removes the manifest
first. Locations stay URL strings end to end; no URL ever goes through ``pathlib``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from torch_ckpt._logging import get_logger
from torch_ckpt.crc import crc32
from torch_ckpt.errors import CheckpointCorruptError, ConfigError
from torch_ckpt.format import METADATA_NAME
from torch_ckpt.layout import commit_dir
from torch_ckpt.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, read_manifest
from torch_ckpt.naming import Naming, StepNaming
from torch_ckpt.storage import DurableUnavailableError, Location, object_mtime, url_to_fs

__all__ = ["DurableTier", "DurableUnavailableError", "object_mtime"]

log = get_logger(__name__)

_CHUNK_BYTES = 8 << 20


class DurableTier:
    """A checkpoint root on an fsspec store.

    Args:
        url: fsspec URL of the durable run root, e.g. ``s3://bucket/runs/exp1``.
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, ``client_kwargs``...).
        verify: "checksum" (read each uploaded file back and compare CRC-32) or "size".
        naming: directory names of steps (the local root's naming; default ``step_000000042``).
        part_bytes: multipart part size on S3-compatible stores (bytes); files of at least twice
            this size are uploaded in parts.
        upload_threads: files uploaded at once by this process (>= 1).

    With ``verify="checksum"`` on an S3-compatible store each upload is checked against the
    store's own MD5 (the object's ETag, single or multipart) computed from the local file: no byte
    is read back. Other stores, and S3 stores whose ETags are not MD5 digests (SSE-KMS), are
    checked by reading the object back (``bytes_read_back`` counts those bytes).

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed (the message
            names the package to install), or ``verify`` is invalid.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, verify: str = "checksum",
                 naming: Naming | None = None, part_bytes: int = 64 << 20, upload_threads: int = 1) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigError(f"durable_url must be a non-empty fsspec URL string, got {url!r}")
        if verify not in ("checksum", "size"):
            raise ConfigError(f"verify must be 'checksum' or 'size', got {verify!r}")
        self.fs, self.root = url_to_fs(url, storage_options)
        self.url = url.rstrip("/")
        self.root = self.root.rstrip("/")
        if not isinstance(part_bytes, int) or part_bytes < 5 << 20:
            raise ConfigError(f"part_bytes must be an int >= 5 MiB (S3's smallest part), got {part_bytes!r}")
        if not isinstance(upload_threads, int) or upload_threads < 1:
            raise ConfigError(f"upload_threads must be an int >= 1, got {upload_threads!r}")
        self.verify = verify
        self.naming = naming or StepNaming()
        self.part_bytes = part_bytes
        self.upload_threads = upload_threads
        self.bytes_read_back = 0  # bytes read back from the store to verify uploads (0 when it verifies itself)
        self._store_checked: bool | None = None  # None: not tried yet; False: ETags are not MD5s
        self.last_download: list[str] = []  # files fetched by the last download()

    def is_inside(self, local_root: Path) -> bool:
        """True when this tier is a local path equal to, inside or containing ``local_root``."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if protocol not in ("file", "local"):
            return False
        mine, theirs = Path(self.root).resolve(), Path(local_root).resolve()
        return mine == theirs or theirs in mine.parents or mine in theirs.parents

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def describe(self, step: int) -> str:
        """URL of a step directory (for messages)."""
        return f"{self.url}/{self.naming.name(step)}"

    def _refresh(self) -> None:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()

    # -- listing -------------------------------------------------------------------------------
    def _list_root(self) -> list[str]:
        """Entries directly under the durable root ([] when it does not exist yet).

        Raises:
            DurableUnavailableError: the store cannot be listed (distinct from an empty root).
        """
        self._refresh()
        try:
            return self.fs.ls(self.root, detail=False) if self.fs.exists(self.root) else []
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001 - any backend error here means "unreachable"
            raise DurableUnavailableError(f"cannot list durable tier {self.url}: {exc}") from exc

    def list_steps(self) -> dict[int, Manifest]:
        """``{step: manifest}`` of committed durable checkpoints.

        Raises:
            DurableUnavailableError: the store cannot be listed (distinct from an empty root).
        """
        entries = self._list_root()
        found: dict[int, Manifest] = {}
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            named_step = self.naming.step_of(name)
            if named_step is None:
                continue
            try:
                manifest = self.read_manifest(named_step)
            except FileNotFoundError:
                continue  # an upload in progress or abandoned: not committed
            except CheckpointCorruptError as exc:
                log.warning("durable tier: ignoring %s/%s: %s", self.url, name, exc)
                continue
            except Exception as exc:  # noqa: BLE001
                raise DurableUnavailableError(f"cannot read {self.url}/{name}: {exc}") from exc
            if manifest.step == named_step:
                found[manifest.step] = manifest
        return dict(sorted(found.items()))

    def read_manifest(self, step: int) -> Manifest:
        """Read and validate the durable manifest of ``step`` (:func:`torch_ckpt.manifest.read_manifest`).

        Raises:
            FileNotFoundError: there is none (the step is not committed in this tier).
            CheckpointCorruptError: it is too large or not a valid manifest (the URL is named).
            DurableUnavailableError: the store cannot be reached.
        """
        name = self.naming.name(step)
        return read_manifest(Location.on(self.fs, self._path(name), f"{self.url}/{name}"))

    # -- abandoned uploads ---------------------------------------------------------------------
    def abandoned_uploads(self, *, older_than_seconds: float, exclude: set[int] | frozenset[int] = frozenset(),
                          now: float | None = None) -> dict[int, float]:
        """``{step: age in seconds}`` of step prefixes without a manifest whose newest object is older
        than ``older_than_seconds``.

        A prefix whose objects carry no modification time, or any object younger than the limit, may
        still be uploading and is never returned; nor is any step in ``exclude``.

        Raises:
            DurableUnavailableError: the store cannot be listed.
        """
        now = time.time() if now is None else now
        entries = self._list_root()
        found: dict[int, float] = {}
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            named_step = self.naming.step_of(name)
            if named_step is None or named_step in exclude:
                continue
            age = self._idle_seconds(named_step, now)
            if age is not None and age > older_than_seconds:
                found[named_step] = age
        return found

    def _idle_seconds(self, step: int, now: float) -> float | None:
        """Seconds since the newest object of an uncommitted step prefix was written; None when the
        step is committed, empty, or an object's time is unknown (it may still be uploading)."""
        prefix = self._path(self.naming.name(step))
        try:
            objects = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise DurableUnavailableError(f"cannot list {self.describe(step)}: {exc}") from exc
        if any(str(path).rstrip("/").endswith("/" + MANIFEST_NAME) for path in objects):
            return None  # committed (or being deleted manifest-first by retention)
        times = [object_mtime(info) for info in objects.values()]
        if not times or any(t is None for t in times):
            return None
        return now - max(times)

    def remove_abandoned(self, *, older_than_seconds: float, exclude: set[int] | frozenset[int] = frozenset(),
                         now: float | None = None) -> list[int]:
        """Delete the step prefixes :meth:`abandoned_uploads` returns; returns their steps.

        Each prefix is listed again right before its deletion and kept if a manifest or a new
        object appeared meanwhile. ``now`` (Unix seconds) defaults to the current time.

        Raises:
            DurableUnavailableError: the store cannot be listed.
        """
        removed = []
        for step in sorted(self.abandoned_uploads(older_than_seconds=older_than_seconds, exclude=exclude, now=now)):
            self._refresh()
            age = self._idle_seconds(step, time.time() if now is None else now)
            if age is None or age <= older_than_seconds:
                continue
            self.fs.rm(self._path(self.naming.name(step)), recursive=True)
            removed.append(step)
            log.warning("durable tier %s: removed abandoned upload of step %d (no manifest, untouched for %.0f s)",
                        self.url, step, age)
        self._refresh()
        return removed

    # -- upload --------------------------------------------------------------------------------
    def _remote_crc(self, path: str) -> tuple[int, int]:
        crc, size = 0, 0
        with self.fs.open(path, "rb", block_size=_CHUNK_BYTES) as f:
            while chunk := f.read(_CHUNK_BYTES):
                crc = crc32(chunk, crc)
                size += len(chunk)
        self.bytes_read_back += size
        return size, crc

    @property
    def _is_s3(self) -> bool:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return protocol in ("s3", "s3a")

    def _expected_etag(self, local: Path, size: int) -> str:
        """The ETag an S3-compatible store computes for ``local`` as uploaded here: the MD5 of the
        object, or for a multipart upload the MD5 of the parts' MD5s followed by ``-<parts>``."""
        parts: list[bytes] = []
        whole = hashlib.md5(usedforsecurity=False)
        multipart = size >= min(5 << 30, 2 * self.part_bytes)
        with open(local, "rb") as f:
            while chunk := f.read(self.part_bytes if multipart else _CHUNK_BYTES):
                (parts.append(hashlib.md5(chunk, usedforsecurity=False).digest()) if multipart
                 else whole.update(chunk))
        if not multipart:
            return whole.hexdigest()
        return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"

    def _put_verified(self, local: Path, remote: str, name: str, step: int, info: dict[str, int]) -> None:
        """Upload one file and check it: by the store's own MD5/ETag on S3-compatible stores (no
        bytes read back), else by reading it back (``verify="checksum"``) or by size.

        Raises:
            CheckpointCorruptError: the stored object does not match the manifest.
        """
        if self._is_s3:
            self.fs.put_file(str(local), remote, chunksize=self.part_bytes)
        else:
            self.fs.put_file(str(local), remote)
        self._refresh()
        if self.verify == "checksum" and self._is_s3 and self._store_checked is not False:
            stored = self.fs.info(remote)
            etag = str(stored.get("ETag", stored.get("etag", ""))).strip('"')
            if int(stored.get("size", -1)) == info["bytes"] and etag == self._expected_etag(local, info["bytes"]):
                self._store_checked = True
                return
            if self._store_checked is None:  # an ETag that is not an MD5 (e.g. SSE-KMS): read back from now on
                log.warning("durable tier %s: object ETags are not MD5 digests; verifying uploads by reading them "
                            "back", self.url)
                self._store_checked = False
        if self.verify == "checksum":
            size, crc = self._remote_crc(remote)
        else:
            size, crc = int(self.fs.info(remote)["size"]), info["crc32"]
        if size != info["bytes"] or crc != info["crc32"]:
            raise CheckpointCorruptError(
                f"durable tier {self.url}: uploaded {name} of step {step} does not match the manifest "
                f"({size} bytes, crc32 {crc:#010x}; expected {info['bytes']} bytes, {info['crc32']:#010x})")

    def _put_all(self, local_dir: Path, step: int, files: dict[str, dict[str, int]]) -> None:
        step_dir = self._path(self.naming.name(step))
        items = sorted(files.items())
        if self.upload_threads <= 1 or len(items) <= 1:
            for name, info in items:
                self._put_verified(local_dir / name, f"{step_dir}/{name}", name, step, info)
            return
        with ThreadPoolExecutor(max_workers=self.upload_threads, thread_name_prefix="torch_ckpt_upload") as pool:
            for fut in [pool.submit(self._put_verified, local_dir / name, f"{step_dir}/{name}", name, step, info)
                        for name, info in items]:
                fut.result()

    def upload(self, local_dir: Path, manifest: Manifest) -> None:
        """Upload a committed local checkpoint, verify every file, then write the manifest (commit).

        Raises:
            CheckpointCorruptError: an uploaded file does not match the manifest (named, with the tier).
            Exception: backend errors propagate (the replicator retries them).
        """
        step_dir = self._path(self.naming.name(manifest.step))
        self.fs.makedirs(step_dir, exist_ok=True)
        self._put_all(local_dir, manifest.step, manifest.files)
        data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
        self.fs.pipe_file(f"{step_dir}/{MANIFEST_NAME}", data)
        self._refresh()

    def _marker(self, step: int, node: int) -> str:
        return self._path(self.naming.name(step), f"_uploaded_node_{node:05d}.json")

    def upload_node(self, local_dir: Path, manifest: Manifest, *, commit: bool,
                    wait_seconds: float = 600.0, poll_seconds: float = 0.2,
                    abandon: Callable[[], bool] = lambda: False) -> None:
        """Upload one node's copy of a node-local checkpoint; on the committing node, also commit it.

        Every node uploads and verifies the files it holds, then writes a marker object listing
        them. The committing node (node 0) then waits for every node's marker, checks each against
        the manifest, and writes the manifest last: a step whose uploader died midway never gets a
        manifest, so the durable tier never shows it (its prefix is removed as an abandoned upload).

        Args:
            local_dir: this node's committed copy.
            manifest: its manifest (``node`` set).
            commit: write the durable manifest once every node's marker is there.
            wait_seconds: how long the committing node waits for the other nodes' markers (seconds).
            poll_seconds: first delay between looks for markers (doubles up to 5 s).
            abandon: returns True when waiting is pointless (a newer step is queued).

        Raises:
            CheckpointCorruptError: an upload or a node's marker does not match the manifest.
            TimeoutError: a node's marker did not appear within ``wait_seconds`` (or ``abandon``).
        """
        if manifest.node is None:
            raise ValueError("upload_node() needs one node's copy (manifest.node is set)")
        from torch_ckpt.nodes import durable_manifest

        step, node = manifest.step, manifest.node
        self.fs.makedirs(self._path(self.naming.name(step)), exist_ok=True)
        durable = durable_manifest(manifest)  # without the nodes' extra copies: each tensor is uploaded once
        mine = {name: info for name, info in durable.files.items() if durable.nodes["file_node"][name] == node}
        self._put_all(local_dir, step, mine)
        self.fs.pipe_file(self._marker(step, node), json.dumps({"node": node, "files": mine}).encode())
        self._refresh()
        if not commit:
            return
        nodes = max(manifest.nodes["rank_node"]) + 1
        deadline, delay, missing = time.monotonic() + wait_seconds, poll_seconds, list(range(nodes))
        while True:
            self._refresh()
            missing = [n for n in missing if not self.fs.exists(self._marker(step, n))]
            if not missing:
                break
            if abandon() or time.monotonic() > deadline:
                raise TimeoutError(f"durable tier {self.url}: step {step} is not committed: node(s) {missing} have "
                                   f"not finished uploading their shards")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        file_node = durable.nodes["file_node"]
        for n in range(nodes):
            raw = self.fs.cat_file(self._marker(step, n))
            listed = json.loads(raw).get("files") if len(raw) < MAX_MANIFEST_BYTES else None
            expected = {k: v for k, v in durable.files.items() if file_node[k] == n}
            if listed != expected:
                raise CheckpointCorruptError(f"durable tier {self.url}: node {n}'s upload record of step {step} does "
                                             "not match the manifest")
        data = json.dumps(durable.to_json(), separators=(",", ":")).encode()
        self.fs.pipe_file(self._path(self.naming.name(step), MANIFEST_NAME), data)
        self._refresh()

    def delete(self, step: int) -> None:
        """Delete a durable checkpoint: manifest first (un-commit), then the files."""
        step_dir = self._path(self.naming.name(step))
        try:
            self.fs.rm_file(f"{step_dir}/{MANIFEST_NAME}")
        except FileNotFoundError:
            pass
        self.fs.rm(step_dir, recursive=True)
        self._refresh()

    # -- download ------------------------------------------------------------------------------
    def _fetch_file(self, step: int, name: str, info: dict[str, int], dst_path: Path, bar: Any) -> None:
        crc, size = 0, 0
        with self.fs.open(self._path(self.naming.name(step), name), "rb", block_size=_CHUNK_BYTES) as src, \
                open(dst_path, "wb") as dst:
            while chunk := src.read(_CHUNK_BYTES):
                dst.write(chunk)
                crc = crc32(chunk, crc)
                size += len(chunk)
                bar.update(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())
        if size != info["bytes"] or crc != info["crc32"]:
            raise CheckpointCorruptError(
                f"durable tier {self.url}: {name} of step {step} is corrupt ({size} bytes, crc32 {crc:#010x}; "
                f"manifest says {info['bytes']} bytes, {info['crc32']:#010x})")

    def download(self, step: int, local_root: Path, *, node: int | None = None) -> Path:
        """Download a durable checkpoint into ``local_root`` (verified, then committed atomically).

        Args:
            step: the step.
            local_root: the local run root.
            node: for a node-local checkpoint, fetch only what this node's ranks load at the same
                rank layout (their own files, the files holding replicated tensors, and the
                metadata) and commit it as that node's copy; None fetches every file.

        Returns:
            The local committed directory.

        Raises:
            CheckpointCorruptError: a downloaded file fails its size or CRC-32 check (file and tier named).
            ValueError: ``node`` is given but the checkpoint was not written to node-local roots.
        """
        import shutil

        from torch_ckpt.nodes import fetch_set

        manifest = self.read_manifest(step)
        if node is not None:
            if not manifest.nodes:
                raise ValueError(f"{self.describe(step)} was written to a shared root: it has no node copies")
            manifest = dataclasses.replace(manifest, node=node, nodes={
                **manifest.nodes, "held": fetch_set(manifest, node), "metadata": METADATA_NAME})
        files = manifest.local_files()
        final = local_root / self.naming.name(step)
        tmp = local_root / f".{final.name}.download.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        bar = tqdm(total=sum(i["bytes"] for i in files.values()), desc=f"download step {step}", unit="B",
                   unit_scale=True, unit_divisor=1024, leave=False, dynamic_ncols=True, disable=None)  # None: TTY only
        try:
            with ThreadPoolExecutor(max_workers=max(1, self.upload_threads),
                                    thread_name_prefix="torch_ckpt_download") as pool:
                for fut in [pool.submit(self._fetch_file, step, name, info, tmp / name, bar)
                            for name, info in sorted(files.items())]:
                    fut.result()
            data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
            with open(tmp / MANIFEST_NAME, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            commit_dir(tmp, final, replace=final.exists())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
        self.last_download = sorted(files)
        return final
