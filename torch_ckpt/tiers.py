"""The durable tier: a checkpoint root on any fsspec store (``s3://``, ``gs://``, ``file://``, ``memory://``).

Layout mirrors the local root (``URL/step_000000100/<files>``). Object stores have no atomic
rename, so a durable checkpoint is committed by writing its ``manifest.json`` *last*, after every
other file has been uploaded and verified (size, and CRC-32 read back from the store unless
``verify="size"``); a step directory without a manifest is invisible. Deleting removes the manifest
first. Locations stay URL strings end to end; no URL ever goes through ``pathlib``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointCorruptError, ConfigError
from torch_ckpt.crc import crc32
from torch_ckpt.layout import commit_dir
from torch_ckpt.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from torch_ckpt.naming import Naming, StepNaming
from torch_ckpt.storage import DurableUnavailableError, object_mtime, url_to_fs

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

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed (the message
            names the package to install), or ``verify`` is invalid.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, verify: str = "checksum",
                 naming: Naming | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigError(f"durable_url must be a non-empty fsspec URL string, got {url!r}")
        if verify not in ("checksum", "size"):
            raise ConfigError(f"verify must be 'checksum' or 'size', got {verify!r}")
        self.fs, self.root = url_to_fs(url, storage_options)
        self.url = url.rstrip("/")
        self.verify = verify
        self.naming = naming or StepNaming()

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
        """Read and validate the durable manifest of ``step`` (bounded; see :mod:`torch_ckpt.format`).

        Raises:
            FileNotFoundError: there is none (the step is not committed in this tier).
            CheckpointCorruptError: it is too large or not a valid manifest (the URL is named).
        """
        path = self._path(self.naming.name(step), MANIFEST_NAME)
        source = f"{self.url}/{self.naming.name(step)}/{MANIFEST_NAME}"
        with self.fs.open(path, "rb") as f:
            size = getattr(f, "size", None)
            if isinstance(size, int) and size > MAX_MANIFEST_BYTES:
                raise CheckpointCorruptError(f"{source}: manifest is {size} bytes, more than the "
                                             f"{MAX_MANIFEST_BYTES} accepted")
            raw = f.read(MAX_MANIFEST_BYTES + 1 if not isinstance(size, int) else size + 1)
        return parse_manifest(raw, source)

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
        return size, crc

    def upload(self, local_dir: Path, manifest: Manifest) -> None:
        """Upload a committed local checkpoint, verify every file, then write the manifest (commit).

        Raises:
            CheckpointCorruptError: an uploaded file does not match the manifest (named, with the tier).
            Exception: backend errors propagate (the replicator retries them).
        """
        step_dir = self._path(self.naming.name(manifest.step))
        self.fs.makedirs(step_dir, exist_ok=True)
        for name, info in sorted(manifest.files.items()):
            remote = f"{step_dir}/{name}"
            self.fs.put_file(str(local_dir / name), remote)
            if self.verify == "checksum":
                size, crc = self._remote_crc(remote)
            else:
                size, crc = int(self.fs.info(remote)["size"]), info["crc32"]
            if size != info["bytes"] or crc != info["crc32"]:
                raise CheckpointCorruptError(
                    f"durable tier {self.url}: uploaded {name} of step {manifest.step} does not match the manifest "
                    f"({size} bytes, crc32 {crc:#010x}; expected {info['bytes']} bytes, {info['crc32']:#010x})")
        data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
        self.fs.pipe_file(f"{step_dir}/{MANIFEST_NAME}", data)
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
    def download(self, step: int, local_root: Path) -> Path:
        """Download a durable checkpoint into ``local_root`` (verified, then committed atomically).

        Returns:
            The local committed directory.

        Raises:
            CheckpointCorruptError: a downloaded file fails its size or CRC-32 check (file and tier named).
        """
        manifest = self.read_manifest(step)
        final = local_root / self.naming.name(step)
        tmp = local_root / f".{final.name}.download.tmp"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        bar = tqdm(total=sum(i["bytes"] for i in manifest.files.values()), desc=f"download step {step}", unit="B",
                   unit_scale=True, unit_divisor=1024, leave=False, dynamic_ncols=True, disable=None)  # None: TTY only
        try:
            for name, info in sorted(manifest.files.items()):
                crc, size = 0, 0
                with self.fs.open(self._path(self.naming.name(step), name), "rb", block_size=_CHUNK_BYTES) as src, \
                        open(tmp / name, "wb") as dst:
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
            data = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
            with open(tmp / MANIFEST_NAME, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            commit_dir(tmp, final)
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
        return final
