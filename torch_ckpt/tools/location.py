"""Where checkpoints live for the read-only tools: a local directory or an fsspec URL.

:class:`Location` gives ``ls``/``inspect``/``verify`` one interface over both, plus a progress bar
that stays silent off a terminal.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from torch_ckpt.format import (
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    MAX_RANK_JSON_BYTES,
    _open_regular,
    _read_fd,
    open_range,
    parse_manifest,
    parse_rank_doc,
    unpickle_metadata,
)
from torch_ckpt.layout import MANIFEST_NAME, Manifest, rank_file_name

__all__ = ["Location", "PathNotFoundError", "is_url", "COMMITTED", "PARTIAL", "CORRUPT"]

COMMITTED, PARTIAL, CORRUPT = "committed", "partial", "corrupt"

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_(\d+)(\.download)?\.tmp(\.[0-9a-f]+)?$")  # old and incarnation-id forms
_METADATA = ".metadata"
_CHUNK_BYTES = 8 << 20


class PathNotFoundError(CheckpointNotFoundError):
    """The path or URL given does not exist (a bad argument rather than a damaged checkpoint)."""


# ---------------------------------------------------------------------------------------------
# progress


# ---------------------------------------------------------------------------------------------
# locations


def is_url(text: str | os.PathLike) -> bool:
    """True for an fsspec URL (``s3://...``, ``memory://...``); ``file://`` counts as a local path."""
    text = os.fspath(text)
    return "://" in text and not text.startswith("file://")


def _mtime(info: dict[str, Any]) -> float | None:
    from torch_ckpt.tiers import object_mtime

    return object_mtime(info)


class Location:
    """A directory on the local file system or on an fsspec store; files are addressed by name.

    Local files are read as regular files only: a symlink is reported as such by :meth:`entries`
    and refused by every read, unless ``allow_symlinks`` (object stores have no symlinks).

    Args:
        text: a local path (``file://`` allowed) or an fsspec URL.
        storage_options: fsspec options for URLs (credentials, ``client_kwargs``...).
        allow_symlinks: follow symlinks inside checkpoints (local paths only).

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed.
    """

    def __init__(self, text: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 allow_symlinks: bool = False) -> None:
        text = os.fspath(text)
        self.allow_symlinks = bool(allow_symlinks)
        self.storage_options = dict(storage_options or {})
        if is_url(text):
            from torch_ckpt.tiers import DurableTier

            tier = DurableTier(text, storage_options=self.storage_options)
            self.fs, self.path, self.url, self.remote = tier.fs, tier.root, tier.url, True
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache()
        else:
            import fsspec

            local = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
            self.fs, self.path, self.url, self.remote = fsspec.filesystem("file"), local, local, False

    def child(self, name: str) -> Location:
        """The location of the entry ``name`` of this directory."""
        new = object.__new__(Location)
        new.storage_options, new.fs, new.remote = self.storage_options, self.fs, self.remote
        new.allow_symlinks = self.allow_symlinks
        new.path = f"{self.path.rstrip('/')}/{name}"
        new.url = f"{self.url.rstrip('/')}/{name}" if self.remote else os.path.join(self.url, name)
        return new

    @property
    def name(self) -> str:
        """Last component of the path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def describe(self, name: str | None = None) -> str:
        """The URL or path of this directory, or of its file ``name`` (for messages)."""
        if name is None:
            return self.url
        return f"{self.url.rstrip('/')}/{name}" if self.remote else os.path.join(self.url, name)

    def _p(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a file-system call; on a remote store, backend errors become DurableUnavailableError."""
        if not self.remote:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001 - any backend error (botocore, aiohttp...) means unreachable
            from torch_ckpt.tiers import DurableUnavailableError

            raise DurableUnavailableError(f"cannot read {self.describe()}: {exc}") from exc

    def exists(self, name: str | None = None) -> bool:
        """Whether the directory (on object stores, the prefix), or its entry ``name``, exists."""
        return bool(self._call(self.fs.exists, self.path if name is None else self._p(name)))

    def is_dir(self) -> bool:
        """Whether this is a directory (a prefix with entries, on object stores)."""
        return bool(self._call(self.fs.isdir, self.path))

    def entries(self) -> dict[str, dict[str, Any]]:
        """``{name: {"type", "size": int, "mtime": float|None}}`` of the directory.

        ``type`` is "file" or "directory"; locally also "symlink" (a link to anything but a
        directory, not followed unless ``allow_symlinks``) and "other" (FIFO, socket, device).
        A link to a directory is listed as the directory (restore follows step-directory links).
        """
        if not self.remote:
            return self._local_entries()
        out: dict[str, dict[str, Any]] = {}
        for info in self._call(self.fs.ls, self.path, detail=True):
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if not name or self._p(name).rstrip("/") == self.path.rstrip("/"):
                continue
            kind = "directory" if info.get("type") == "directory" else "file"
            out[name] = {"type": kind, "size": int(info.get("size") or 0), "mtime": _mtime(info)}
        return out

    def _local_entries(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with os.scandir(self.path) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=self.allow_symlinks)
                except OSError:  # a dangling symlink, or removed while listing
                    st = entry.stat(follow_symlinks=False) if entry.is_symlink() else None
                if st is None:
                    continue
                if stat.S_ISLNK(st.st_mode) and entry.is_dir():  # a linked step directory: listed as restore lists it
                    st = entry.stat()
                kind = "symlink" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else \
                    "file" if stat.S_ISREG(st.st_mode) else "other"
                out[entry.name] = {"type": kind, "size": int(st.st_size) if kind == "file" else 0,
                                   "mtime": float(st.st_mtime)}
        return out

    def read_bytes(self, name: str, max_bytes: int | None = None) -> bytes:
        """Contents of the file ``name`` (a regular file; at most ``max_bytes``).

        Raises:
            FileNotFoundError: it does not exist.
            CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``), not a regular file,
                or larger than ``max_bytes``.
        """
        if not self.remote:
            fd = _open_regular(Path(self._p(name)), allow_symlinks=self.allow_symlinks, what="file")
            if max_bytes is not None:
                return _read_fd(fd, max_bytes, self.describe(name))
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        else:
            if max_bytes is not None:
                size = int(self._call(self.fs.info, self._p(name)).get("size") or 0)
                if size > max_bytes:
                    raise CheckpointCorruptError(f"{self.describe(name)}: {size} bytes, more than the {max_bytes} "
                                                 "accepted")
            data = self._call(self.fs.cat_file, self._p(name))
        if max_bytes is not None and len(data) > max_bytes:
            raise CheckpointCorruptError(f"{self.describe(name)}: more than the {max_bytes} bytes accepted")
        return data

    def checksum(self, name: str, bar: Any = None) -> tuple[int, int]:
        """``(bytes, crc32)`` of the file ``name`` (a regular file), read in chunks (advancing ``bar``)."""

        def read() -> tuple[int, int]:
            crc, size = 0, 0
            if self.remote:
                f = self.fs.open(self._p(name), "rb", block_size=_CHUNK_BYTES)
            else:
                f = os.fdopen(_open_regular(Path(self._p(name)), allow_symlinks=self.allow_symlinks, what="file"),
                              "rb")
            with f:
                while chunk := f.read(_CHUNK_BYTES):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            return size, crc

        return self._call(read)

    @contextmanager
    def open_range(self, name: str) -> Iterator[Any]:
        """The file ``name`` (a regular file) open for range reads (a :class:`~torch_ckpt.records.RangeReader`).

        Raises:
            FileNotFoundError: it does not exist.
            CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``) or not a regular file.
        """
        if not self.remote:
            with open_range(Path(self._p(name)), allow_symlinks=self.allow_symlinks) as f:
                yield f
            return
        f = self._call(self.fs.open, self._p(name), "rb", block_size=1 << 20)
        try:
            yield _RemoteRange(self, f)
        finally:
            f.close()

    def read_metadata(self, name: str = _METADATA) -> Any:
        """DCP metadata read with the restricted unpickler (never executes code from the file).

        The result's fields are not checked here: see :func:`torch_ckpt.format.metadata_problems`.

        Raises:
            UnsafeCheckpointError: the pickle references anything but DCP's metadata classes.
            CheckpointCorruptError: the file is truncated, not DCP metadata, or not a regular file.
        """
        return unpickle_metadata(self.read_bytes(name, MAX_METADATA_BYTES), self.describe(name))

    def read_manifest(self) -> Manifest:
        """The validated manifest of this checkpoint directory (bounded; see :mod:`torch_ckpt.format`).

        Raises:
            CheckpointNotFoundError: there is no ``manifest.json`` (not a committed checkpoint).
            CheckpointCorruptError: it is not a regular file, too large, or not a valid manifest.
        """
        source = self.describe(MANIFEST_NAME)
        try:
            raw = self.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{source} does not exist: {self.describe()} is not a committed "
                                          "torch-ckpt checkpoint") from exc
        return parse_manifest(raw, source)

    def read_rank_doc(self, rank: int, manifest: Manifest) -> dict[str, Any]:
        """The validated per-rank JSON document (``{"step", "rank", "world_size", "tree"}``) of ``rank``.

        Raises:
            CheckpointCorruptError: the file is missing, not a regular file, too large, or malformed
                (see :func:`torch_ckpt.format.parse_rank_doc`).
        """
        name = rank_file_name(rank)
        try:
            raw = self.read_bytes(name, MAX_RANK_JSON_BYTES)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{self.describe(name)}: per-rank state file is missing") from exc
        return parse_rank_doc(raw, self.describe(name), manifest, rank)


class _RemoteRange:
    """A :class:`~torch_ckpt.records.RangeReader` over an open fsspec file (backend errors: unreachable)."""

    def __init__(self, loc: Location, f: Any) -> None:
        self._loc, self._f = loc, f
        self.size = int(getattr(f, "size", 0) or 0)

    def read_at(self, offset: int, length: int) -> bytes:
        def read() -> bytes:
            self._f.seek(offset)
            return self._f.read(length)

        return self._loc._call(read)


def _as_location(where: str | os.PathLike | Location, storage_options: dict[str, Any] | None) -> Location:
    return where if isinstance(where, Location) else Location(where, storage_options=storage_options)


def _require_dir(loc: Location) -> None:
    if not loc.exists():
        raise PathNotFoundError(f"{loc.describe()} does not exist")
    if not loc.is_dir():
        raise PathNotFoundError(f"{loc.describe()} is not a directory")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def _step_of(name: str) -> tuple[int | None, bool]:
    """``(step, temporary)`` parsed from a directory name; step None for other names."""
    m = _STEP_RE.match(name)
    if m:
        return int(m.group(1)), False
    t = _TMP_RE.match(name)
    if t:
        return int(t.group(1)), True
    return None, False
