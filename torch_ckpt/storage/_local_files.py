"""Local checkpoint files, opened only as regular files and read within limits.

The local half of the storage seam (:mod:`torch_ckpt.storage._locations` re-exports these names; readers use
:class:`~torch_ckpt.storage._locations.Location`, which calls them for local paths). A file inside a
checkpoint is opened with ``O_NOFOLLOW`` (a symlink is refused unless explicitly allowed) and
``O_NONBLOCK`` (a FIFO never hangs the reader), and must be a regular file; an I/O error while
reading becomes a :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.storage._bounded import corrupt

__all__ = ["LocalFile", "open_range", "open_regular", "read_fd", "reading"]


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
