"""The storage seam: checkpoint directories on the local file system or on an fsspec store.

Every reader of a checkpoint reaches its bytes through this module. :class:`Location` gives one
interface over a local directory (``file://`` allowed) and an fsspec URL (``s3://``, ``gs://``,
``memory://``...): listing, bounded reads of whole files, range reads and CRC-32 (:mod:`torch_ckpt.storage._crc`).
Local files are opened only as regular files (:mod:`torch_ckpt.storage._local_files`, whose names this
module re-exports: ``O_NOFOLLOW``, no FIFO, no directory) unless symlinks are explicitly allowed; a
backend error on a store is a :class:`DurableUnavailableError` (an outage, not a damaged
checkpoint). On stores that compute a digest of each object (the ETag of S3-compatible stores),
:meth:`Location.stat` reports it, so an upload can be verified without reading it back
(:func:`torch_ckpt.format._read.verify_files`).
"""

from __future__ import annotations

import datetime as _dt
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError
from torch_ckpt.storage._bounded import corrupt
from torch_ckpt.storage._crc import crc32
from torch_ckpt.storage._local_files import LocalFile, open_range, open_regular, read_fd, reading

__all__ = [
    "DurableUnavailableError",
    "Location",
    "LocalFile",
    "PathNotFoundError",
    "as_location",
    "is_url",
    "object_mtime",
    "open_range",
    "open_regular",
    "read_fd",
    "reading",
    "url_to_fs",
]

_CHUNK_BYTES = 8 << 20


class PathNotFoundError(CheckpointNotFoundError):
    """The path or URL given does not exist (a bad argument rather than a damaged checkpoint)."""


class DurableUnavailableError(CheckpointError, ConnectionError):
    """The durable store could not be reached (an outage, not an empty store)."""


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None, *, what: str = "durable_url") -> tuple[Any, str]:
    """``(fsspec file system, root path without a trailing slash)`` of an fsspec URL.

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed (the message
            names the package to install).
    """
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot use {what} {url!r}: {exc}") from exc
    return fs, root.rstrip("/")


def is_url(text: str | os.PathLike) -> bool:
    """True for an fsspec URL (``s3://...``, ``memory://...``); ``file://`` counts as a local path."""
    text = os.fspath(text)
    return "://" in text and not text.startswith("file://")


def object_mtime(info: dict[str, Any]) -> float | None:
    """Modification time (Unix seconds) of an fsspec ``info``/``ls`` entry, whatever the backend names it."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
        if isinstance(value, _dt.datetime):
            return value.timestamp() if value.tzinfo else value.replace(tzinfo=_dt.timezone.utc).timestamp()
        if isinstance(value, str) and value:
            try:
                return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None



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
            self.fs, self.path = url_to_fs(text, self.storage_options, what="URL")
            self.url, self.remote = text.rstrip("/"), True
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache()
        else:
            local = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
            self.fs, self.path, self.url, self.remote = fsspec.filesystem("file"), local, local, False

    @classmethod
    def on(cls, fs: Any, path: str, url: str) -> Location:
        """A directory of an already open fsspec file system (``path`` in its terms, ``url`` for messages).

        On a local file system (``file://``) the result reads regular files only, like a local path.
        """
        new = object.__new__(cls)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        new.storage_options, new.allow_symlinks, new.fs = {}, False, fs
        new.remote = protocol not in ("file", "local")
        new.path = path.rstrip("/") if new.remote else os.path.abspath(path)
        new.url = url.rstrip("/") if new.remote else new.path
        return new

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
            out[name] = {"type": kind, "size": int(info.get("size") or 0), "mtime": object_mtime(info)}
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

    def size(self, name: str) -> int:
        """Size in bytes of the file ``name`` (a regular file); raises as :meth:`stat`."""
        return self.stat(name)[0]

    def stat(self, name: str) -> tuple[int, str | None]:
        """``(size in bytes, store digest)`` of the file ``name`` (a regular file).

        The digest is what the store computed over the object's bytes and reports with it: the
        ETag of S3-compatible stores, without quotes (the MD5 of the object, or of its parts' MD5s
        followed by ``-<parts>``; other values with server-side KMS encryption). None for local
        files and stores that report none.

        Raises:
            FileNotFoundError: it does not exist.
            CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``) or not a regular file.
            DurableUnavailableError: the store cannot be reached.
        """
        if not self.remote:
            fd = open_regular(Path(self._p(name)), allow_symlinks=self.allow_symlinks,
                              what="file listed in the manifest")
            try:
                return os.fstat(fd).st_size, None
            finally:
                os.close(fd)
        info = self._call(self.fs.info, self._p(name))
        if info.get("type") == "directory":
            raise corrupt(self.describe(name), "file listed in the manifest is a directory, not a regular file")
        digest = info.get("ETag", info.get("etag"))
        return int(info.get("size") or 0), str(digest).strip('"') if digest else None

    def read_bytes(self, name: str, max_bytes: int | None = None, *,
                   what: str = "file listed in the manifest") -> bytes:
        """Contents of the file ``name`` (a regular file; at most ``max_bytes``; ``what`` it is, for messages).

        Raises:
            FileNotFoundError: it does not exist.
            CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``), not a regular file,
                or larger than ``max_bytes``.
        """
        if not self.remote:
            fd = open_regular(Path(self._p(name)), allow_symlinks=self.allow_symlinks, what=what)
            if max_bytes is not None:
                return read_fd(fd, max_bytes, self.describe(name))
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
        """``(bytes, crc32)`` of the file ``name`` (a regular file), read in chunks (advancing ``bar``).

        Raises:
            FileNotFoundError: it does not exist.
            CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``) or not a regular file.
            DurableUnavailableError: the store cannot be reached.
        """

        def read() -> tuple[int, int]:
            crc, size = 0, 0
            if self.remote:
                f = self.fs.open(self._p(name), "rb", block_size=_CHUNK_BYTES)
            else:
                f = os.fdopen(open_regular(Path(self._p(name)), allow_symlinks=self.allow_symlinks,
                                           what="file listed in the manifest"), "rb")
            with f:
                while chunk := f.read(_CHUNK_BYTES):
                    crc = crc32(chunk, crc)
                    size += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            return size, crc

        return self._call(read)

    @contextmanager
    def open_range(self, name: str) -> Iterator[Any]:
        """The file ``name`` (a regular file) open for range reads (a :class:`~torch_ckpt.format._records.RangeReader`).

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


class _RemoteRange:
    """A :class:`~torch_ckpt.format._records.RangeReader` over an open fsspec file (backend errors: unreachable)."""

    def __init__(self, loc: Location, f: Any) -> None:
        self._loc, self._f = loc, f
        self.size = int(getattr(f, "size", 0) or 0)

    def read_at(self, offset: int, length: int) -> bytes:
        def read() -> bytes:
            self._f.seek(offset)
            return self._f.read(length)

        return self._loc._call(read)


def as_location(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                allow_symlinks: bool = False) -> Location:
    """``where`` as a :class:`Location` (returned as is when it already is one)."""
    if isinstance(where, Location):
        return where
    return Location(where, storage_options=storage_options, allow_symlinks=allow_symlinks)
