"""The storage seam: bytes of checkpoints on the local file system or on an fsspec store.

Every reader of a checkpoint reaches its bytes through this module and treats them as untrusted:

- :class:`Location` is one interface over a local directory (``file://`` allowed) and an fsspec URL
  (``s3://``, ``gs://``, ``memory://``...): listing, bounded reads, range reads, CRC-32 and, on stores
  that compute one (S3's ETag), the object's digest (:meth:`Location.stat`). A backend error on a
  store is a :class:`DurableUnavailableError` (an outage, not a damaged checkpoint).
- Local files are opened with ``O_NOFOLLOW`` (no symlink unless allowed) and ``O_NONBLOCK`` (a FIFO
  never hangs the reader) and must be regular files (:func:`open_regular`); an I/O error while
  reading becomes a :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file (:func:`reading`).
- JSON is parsed with bounded nesting and integer length (:func:`loads_bounded`); malformed content is
  reported by :func:`corrupt`, values in messages shortened by :func:`short_repr`.
- A call to a store from the caller's thread (``durable_timeout_seconds``) is bounded by the store's
  silence, not by its duration (:func:`bounded`): the operation ticks a :class:`Watch` after every
  answer; when none came for ``timeout_seconds`` the caller gets a :class:`DurableUnavailableError`.
  The abandoned worker stops at its next answer, and whatever it would publish goes through
  :meth:`Watch.publish`, which refuses once the caller gave up (a late download never appears).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointTimeoutError,
    ConfigError,
    DurableUnavailableError,
    PathNotFoundError,
)
from torch_ckpt.storage._crc import crc32

__all__ = [
    "CHUNK_BYTES", "DurableUnavailableError", "LocalFile", "Location", "Malformed", "PathNotFoundError", "Watch",
    "as_location", "bounded", "corrupt", "is_url", "loads_bounded", "object_mtime", "open_range", "open_regular",
    "read_fd", "reading", "short_repr", "store_call", "url_to_fs", "waiting_for_coordinator",
]

T = TypeVar("T")
CHUNK_BYTES = 8 << 20


# -- bounded parsing of untrusted content -------------------------------------------------------------
class Malformed(ValueError):
    """One malformed piece of content (its message does not name the file; the caller adds it)."""


def corrupt(source: str, text: str) -> CheckpointCorruptError:
    """The error for malformed content ``text`` of the file ``source``."""
    return CheckpointCorruptError(f"{source}: {text}")


def short_repr(value: Any) -> str:
    """``repr(value)`` shortened to at most 120 characters (for messages about untrusted values)."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-57:]}"


def _max_depth(value: Any) -> int:
    """Nesting depth of containers in a parsed JSON value, computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def loads_bounded(raw: bytes, source: str, *, what: str, max_depth: int, max_int_digits: int) -> Any:
    """Parse JSON from untrusted bytes ``raw`` (bounded in size by the caller) of ``source`` (``what``
    it is, for messages), with at most ``max_depth`` levels and ``max_int_digits``-digit integers.

    Raises:
        CheckpointCorruptError: not UTF-8 JSON, nested deeper than ``max_depth`` (the parser's own
            recursion limit included) or holding a longer integer; the message names ``source``.
    """

    def parse_int(text: str) -> int:
        digits = len(text) - text.startswith("-")
        if digits > max_int_digits:
            raise Malformed(f"holds an integer of {digits} digits (at most {max_int_digits} are accepted)")
        return int(text)

    try:
        data = json.loads(raw, parse_int=parse_int)
    except Malformed as exc:
        raise corrupt(source, f"{what} {exc}") from None
    except RecursionError:
        raise corrupt(source, f"{what} is nested too deeply to parse (at most {max_depth} levels are "
                               "accepted)") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise corrupt(source, f"{what} is not valid JSON ({exc})") from None
    depth = _max_depth(data)
    if depth > max_depth:
        raise corrupt(source, f"{what} is nested {depth} levels deep (at most {max_depth} are accepted)")
    return data


# -- local files: regular files only, read within limits -----------------------------------------
def open_regular(path: Path, *, allow_symlinks: bool, what: str) -> int:
    """Open ``path`` read-only as a regular file (no symlink unless allowed); returns the descriptor.

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointCorruptError: it is a symlink (and symlinks are not allowed), a directory, a FIFO
            or anything else but a regular file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # NONBLOCK: a FIFO must not hang us
    if not allow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise corrupt(str(path), f"{what} is a symbolic link; torch-ckpt reads only regular files inside the "
                                      "checkpoint (copy the file in, or follow links explicitly: allow_symlinks=True, "
                                      "torch-ckpt --follow-symlinks)") from None
        if exc.errno in (errno.EISDIR,):
            raise corrupt(str(path), f"{what} is a directory, not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise corrupt(str(path), f"{what} is not a regular file")
    os.set_blocking(fd, True)
    return fd


@contextmanager
def reading(source: str, what: str) -> Iterator[None]:
    """Turn an I/O error while reading a checkpoint file into CheckpointCorruptError naming it."""
    try:
        yield
    except CheckpointCorruptError:
        raise
    except OSError as exc:
        raise corrupt(source, f"{what} cannot be read ({exc.strerror or exc})") from exc


def read_fd(fd: int, limit: int, source: str) -> bytes:
    """All bytes of an open regular file, refusing more than ``limit`` (never allocates beyond its size)."""
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise corrupt(source, f"is {size} bytes, more than the {limit} accepted")
        data = f.read(size + 1)
    if len(data) > limit:
        raise corrupt(source, f"grew past the {limit} bytes accepted while being read")
    return data


class LocalFile:
    """A :class:`~torch_ckpt.format._records.RangeReader` over an open descriptor (``pread``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def read_at(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)


@contextmanager
def open_range(path: Path, *, allow_symlinks: bool = False) -> Iterator[LocalFile]:
    """The local regular file ``path`` open for range reads (I/O errors become corruption naming it).

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``), not a regular file, or
            unreadable.
    """
    fd = open_regular(path, allow_symlinks=allow_symlinks, what="file listed in the manifest")
    try:
        with reading(str(path), "file listed in the manifest"):
            yield LocalFile(fd)
    finally:
        os.close(fd)


# -- locations ------------------------------------------------------------------------------------
def url_to_fs(url: str, storage_options: dict[str, Any] | None = None, *, what: str = "durable_url") -> tuple[Any, str]:
    """``(fsspec file system, root path without a trailing slash)`` of an fsspec URL.

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed (the message
            names the package to install).
        DurableUnavailableError: the backend connects when created (FTP, SFTP) and the store cannot be reached.
    """
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot use {what} {url!r}: {exc}") from exc
    except FileNotFoundError:
        raise
    except (OSError, EOFError) as exc:  # a refused or dropped connection of a backend that connects at once
        raise outage(f"cannot reach {what} {url}", exc) from exc
    return fs, root.rstrip("/")


def outage(what: str, exc: BaseException) -> DurableUnavailableError:
    """DurableUnavailableError ``what: <type>: <message>`` for a backend error; a missing or refused credential
    also says where credentials go (the store's own environment, or ``storage_options``)."""
    text = f"{what}: {type(exc).__name__}: {exc}"
    if "credential" in text.lower() or type(exc).__name__ in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
        text += ("; give the store's credentials in its usual environment (for S3: AWS_ACCESS_KEY_ID and "
                 "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or in storage_options (the command line's "
                 "--storage-options '{\"key\": ..., \"secret\": ...}')")
    return DurableUnavailableError(text)


def store_call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a call to the store: any backend error (botocore, aiohttp, EIO on NFS...) but a
    missing object or our own is an outage, DurableUnavailableError ``what: <type>: <message>`` (the type
    says what an empty or terse message does not)."""
    try:
        return fn(*args, **kwargs)
    except (FileNotFoundError, CheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise outage(what, exc) from exc


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
    and refused by every read, unless ``allow_symlinks`` (object stores have no symlinks). Every
    method reading a file ``name`` raises ``FileNotFoundError`` when it does not exist,
    ``CheckpointCorruptError`` when it is a refused symlink or not a regular file, and
    :class:`DurableUnavailableError` when the store cannot be reached.

    Args:
        text: a local path (``file://`` allowed) or an fsspec URL.
        storage_options: fsspec options for URLs (credentials, ``client_kwargs``...).
        allow_symlinks: follow symlinks inside checkpoints (local paths only).

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed.
    """

    _stored: dict[str, str] = {}  # noqa: RUF012 - never mutated: resolving() gives a copy its own

    def __init__(self, text: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 allow_symlinks: bool = False) -> None:
        text = os.fspath(text)
        self.allow_symlinks = bool(allow_symlinks)
        self.storage_options = dict(storage_options or {})
        if is_url(text):
            self.fs, self.path = url_to_fs(text, self.storage_options, what="URL")
            self.url, self.remote = text.rstrip("/"), True
            self.fs.invalidate_cache()
        else:
            local = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
            self.fs, self.path, self.url, self.remote = fsspec.filesystem("file"), local, local, False

    @classmethod
    def on(cls, fs: Any, path: str, url: str) -> Location:
        """A directory of an open fsspec file system (``path`` in its terms, ``url`` for messages); on a
        local file system it reads regular files only, like a local path."""
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        remote = protocol not in ("file", "local")
        path = path.rstrip("/") if remote else os.path.abspath(path)
        return cls._made(fs, path, url.rstrip("/") if remote else path, remote, {}, False)

    @classmethod
    def _made(cls, fs: Any, path: str, url: str, remote: bool, options: dict[str, Any], symlinks: bool) -> Location:
        new = object.__new__(cls)
        new.fs, new.path, new.url, new.remote, new.storage_options, new.allow_symlinks = \
            fs, path, url, remote, options, symlinks
        return new

    def resolving(self, stored: Mapping[str, str]) -> Location:
        """This directory, where each file ``name`` of ``stored`` (``{name: directory}``, a manifest's
        :attr:`~torch_ckpt.format._files.Manifest.stored`) is read from that sibling directory instead."""
        if not stored:
            return self
        new = self._made(self.fs, self.path, self.url, self.remote, self.storage_options, self.allow_symlinks)
        new._stored = dict(stored)
        return new

    def _where(self, name: str) -> tuple[str, str]:
        """``(path, url)`` of the directory that holds the file ``name``."""
        other = self._stored.get(name)
        if other is None:
            return self.path, self.url
        if self.remote:
            parent_path, parent_url = self.path.rstrip("/").rsplit("/", 1)[0], self.url.rstrip("/").rsplit("/", 1)[0]
            return f"{parent_path}/{other}", f"{parent_url}/{other}"
        return os.path.join(os.path.dirname(self.path), other), os.path.join(os.path.dirname(self.url), other)

    def child(self, name: str) -> Location:
        """The location of the entry ``name`` of this directory."""
        return self._made(self.fs, self._p(name), self.describe(name), self.remote, self.storage_options,
                          self.allow_symlinks)

    @property
    def name(self) -> str:
        """Last component of the path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def describe(self, name: str | None = None) -> str:
        """The URL or path of this directory, or of its file ``name`` (for messages)."""
        if name is None:
            return self.url
        url = self._where(name)[1]
        return f"{url.rstrip('/')}/{name}" if self.remote else os.path.join(url, name)

    def path_of(self, name: str) -> str:
        """The path, in the terms of :attr:`fs`, of the file ``name`` (in another directory for a
        :meth:`resolving` one)."""
        return f"{self._where(name)[0].rstrip('/')}/{name}"

    _p = path_of

    def _open_local(self, name: str, what: str = "file listed in the manifest") -> int:
        return open_regular(Path(self._p(name)), allow_symlinks=self.allow_symlinks, what=what)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a file-system call; on a remote store, backend errors become DurableUnavailableError."""
        if not self.remote:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError as exc:
            cause = exc.__cause__  # fsspec's HTTP file system reports any failure as not found, caused by it
            while isinstance(cause, FileNotFoundError):
                cause = cause.__cause__
            aiohttp = sys.modules.get("aiohttp")  # loaded whenever one of its errors is the cause
            dropped = aiohttp is not None and isinstance(cause, aiohttp.ClientConnectionError)  # e.g. disconnected
            if cause is None or not (dropped or isinstance(cause, OSError)
                                     or (getattr(cause, "status", None) or 0) >= 500):
                raise  # not found indeed (a 404, S3's NoSuchKey/NoSuchBucket); not a refused connection or timeout
            raise outage(f"cannot read {self.describe()}", cause) from cause
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend error (botocore, aiohttp...) means unreachable
            raise outage(f"cannot read {self.describe()}", exc) from exc

    def exists(self, name: str | None = None) -> bool:
        """Whether the directory (on object stores, the prefix), or its entry ``name``, exists.

        Raises:
            DurableUnavailableError: a remote store did not answer (fsspec's own ``exists`` reports that as
                False: an unreachable server would read as a path that does not exist).
        """
        path = self.path if name is None else self._p(name)
        if not self.remote:
            return bool(self.fs.exists(path))
        return self._info(path) is not None

    def is_dir(self) -> bool:
        """Whether this is a directory (a prefix with entries, on object stores); raises as :meth:`exists`."""
        if not self.remote:
            return bool(self.fs.isdir(self.path))
        info = self._info(self.path)  # raises when the store does not answer, which isdir would call False
        if info is None or info.get("type") == "directory":
            return info is not None
        return bool(self._call(self.fs.isdir, self.path))  # HTTP's info says "file" of a page listing files

    def _info(self, path: str) -> dict[str, Any] | None:
        try:
            return self._call(self.fs.info, path)
        except FileNotFoundError:
            return None

    def entries(self) -> dict[str, dict[str, Any]]:
        """``{name: {"type", "size": int, "mtime": float|None}}`` of the directory. ``type`` is "file" or
        "directory"; locally also "symlink" (a link to anything but a directory, not followed unless
        ``allow_symlinks``; a link to a directory is listed as the directory) and "other" (FIFO...)."""
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
                st: os.stat_result | None
                try:
                    st = entry.stat(follow_symlinks=self.allow_symlinks)
                except OSError:  # a dangling symlink, or removed while listing
                    st = entry.stat(follow_symlinks=False) if entry.is_symlink() else None
                if st is None:
                    continue
                if stat.S_ISLNK(st.st_mode):  # a linked step directory: listed as restore lists it
                    try:
                        if entry.is_dir():
                            st = entry.stat()
                    except OSError:  # a link loop (ELOOP) or removed meanwhile: listed as the link it is
                        pass
                kind = "symlink" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else \
                    "file" if stat.S_ISREG(st.st_mode) else "other"
                out[entry.name] = {"type": kind, "size": int(st.st_size) if kind == "file" else 0,
                                   "mtime": float(st.st_mtime)}
        return out

    def stat(self, name: str) -> tuple[int, str | None]:
        """``(size in bytes, store digest)`` of the file ``name``: the digest the store reports for the
        object (S3's ETag without quotes: the MD5 of the object, or of its parts' MD5s followed by
        ``-<parts>``; other values with SSE-KMS); None for local files and stores that report none."""
        if not self.remote:
            fd = self._open_local(name)
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
        """Contents of the file ``name`` (``what`` it is, for messages); CheckpointCorruptError when it
        holds more than ``max_bytes``."""
        if not self.remote:
            fd = self._open_local(name, what)
            if max_bytes is not None:
                return read_fd(fd, max_bytes, self.describe(name))
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        else:
            def read() -> bytes:
                with self.fs.open(self._p(name), "rb") as f:  # one HEAD (the size) and one GET
                    size = getattr(f, "size", None)
                    if max_bytes is None:
                        return f.read()
                    if size is not None and int(size) > max_bytes:
                        raise CheckpointCorruptError(f"{self.describe(name)}: {size} bytes, more than the "
                                                     f"{max_bytes} accepted")
                    return f.read(max_bytes + 1)

            data = self._call(read)
        if max_bytes is not None and len(data) > max_bytes:
            raise CheckpointCorruptError(f"{self.describe(name)}: more than the {max_bytes} bytes accepted")
        return data

    def checksum(self, name: str, bar: Any = None) -> tuple[int, int]:
        """``(bytes, crc32)`` of the file ``name``, read in chunks (advancing ``bar``)."""

        def read() -> tuple[int, int]:
            crc, size = 0, 0
            if self.remote:
                f = self.fs.open(self._p(name), "rb", block_size=CHUNK_BYTES, cache_type="none")  # one chunk a read
            else:
                f = os.fdopen(self._open_local(name), "rb")
            with f:
                while chunk := f.read(CHUNK_BYTES):
                    crc = crc32(chunk, crc)
                    size += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            return size, crc

        return self._call(read)

    @contextmanager
    def open_range(self, name: str) -> Iterator[Any]:
        """The file ``name`` open for range reads (a :class:`~torch_ckpt.format._records.RangeReader`)."""
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


# -- bounded calls to a store from the caller's thread ---------------------------------------------
class Watch:
    """Progress of one bounded call, shared by the caller and the worker doing it."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._abandoned = False
        self._published = False
        self._local = 0  # workers now busy with local work (writing, fsync, checksums): not waiting on the store

    def tick(self) -> None:
        """Record an answer from the store; DurableUnavailableError once the caller gave up (stops the worker)."""
        self._last = time.monotonic()
        if self._abandoned:
            raise DurableUnavailableError("abandoned: the caller stopped waiting for the store")

    def idle_seconds(self) -> float:
        """Seconds since the last answer (or since the call started); 0 during local work."""
        return 0.0 if self._local else time.monotonic() - self._last

    @contextmanager
    def local_work(self) -> Iterator[None]:
        """Mark local work (a disk write, an fsync, a checksum of a fetched file): the store's
        silence is not counted while it runs, however long it takes."""
        with self._lock:
            self._local += 1
        try:
            yield
        finally:
            with self._lock:
                self._local -= 1
            self.tick()

    def publish(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a local commit) unless the caller gave up (DurableUnavailableError); the caller
        then takes the result."""
        with self._lock:
            if self._abandoned:
                raise DurableUnavailableError("abandoned: the caller stopped waiting for the store")
            result = fn()
            self._published = True
            return result

    def _abandon(self) -> bool:
        """Give up unless the worker already published; True when given up."""
        with self._lock:
            if self._published:
                return False
            self._abandoned = True
            return True


def bounded(fn: Callable[[Watch], T], *, timeout_seconds: float, what: str) -> T:
    """Run ``fn(watch)`` on a worker thread and return its result, waiting while the store answers at
    least every ``timeout_seconds`` (> 0). ``fn`` calls ``watch.tick()`` after each answer and commits
    anything local through ``watch.publish``; ``what`` names the operation and store in the message.

    Raises:
        DurableUnavailableError: the store did not answer for ``timeout_seconds``.
        Exception: whatever ``fn`` raised.
    """
    done = threading.Event()
    box: dict[str, Any] = {}
    watch = Watch()

    def run() -> None:
        try:
            box["value"] = fn(watch)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="torch_ckpt_durable_call", daemon=True).start()
    try:
        while not done.wait(max(0.0, timeout_seconds - watch.idle_seconds())):
            if watch.idle_seconds() >= timeout_seconds and watch._abandon():
                raise DurableUnavailableError(
                    f"{what}: the store did not answer for {timeout_seconds:g} s (durable_timeout_seconds); "
                    "it accepts connections but does not respond, or is very slow")
            if watch._published:
                done.wait()
    except BaseException:
        watch._abandon()  # an interrupt of the caller: the worker publishes nothing after it
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def waiting_for_coordinator(ctx: Any, tier: Any, doing: str, collective: Callable[[], T], *,
                            whom: str | None = None) -> T:
    """Run ``collective`` (a broadcast of rank 0's answer); a CheckpointTimeoutError on another rank
    says what rank 0 was ``doing`` (not that the ranks called different methods). ``whom``: who is
    waited for when not rank 0 ("the node leaders"); then every rank's timeout says so."""
    try:
        return collective()
    except CheckpointTimeoutError as exc:
        if whom is None and ctx.is_coordinator:
            raise
        bound = "" if tier is None else (
            f"; each call to the store gives up after durable_timeout_seconds={tier.timeout_seconds:g} s "
            "without an answer, but a download that keeps receiving bytes may take longer: raise timeout_seconds "
            "above the time it needs")
        raise CheckpointTimeoutError(
            f"rank {ctx.rank} waited {ctx.timeout_seconds:g} s (timeout_seconds) for {whom or 'rank 0'}, which "
            f"{'were' if whom else 'was'} {doing}"
            f"{bound}") from exc
