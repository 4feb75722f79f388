"""The root's exclusive lock (:class:`RootLock`), so two runs never write or prune the same root."""

from __future__ import annotations

import atexit
import errno
import fcntl
import gc
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointWriteError

__all__ = ["RootLock", "LOCK_FILE_NAME"]

log = get_logger("torch_ckpt.root._layout")

#: The lock file, used only where the file system cannot lock a directory (NFS); removed at release.
LOCK_FILE_NAME = ".lock"
# flock() on a directory refused by the file system: lock a file in the root instead
_NO_DIRECTORY_LOCK = (errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK)
_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
# The RootLocks this process holds, by the real path of their root (RootLock: within one process)
_HELD: weakref.WeakValueDictionary[str, RootLock] = weakref.WeakValueDictionary()
_HELD_LOCK = threading.RLock()  # a finalizer run by a collection inside the guard releases a lock too


class RootLock:
    """An exclusive lock on a checkpoint root, so two runs never write (or prune) the same root.

    A kernel ``flock`` on the root directory itself: no file in the user's folder, and the kernel
    drops it when its process dies, so there is no staleness to guess. A run that finds the root
    locked names the holder's host and pid (``/proc/locks``: holders on this host). Where the file
    system cannot lock a directory (NFS emulates ``flock`` with POSIX locks, which need a file open
    for writing), ``ROOT/.lock`` is locked instead; it records the owner and is unlinked at release
    while still held (a contender that locked the unlinked file retries on the new one). Without
    lock support :meth:`acquire` fails saying so, never falling back to a pid file; NFS and Lustre
    mount options: docs/clusters.md.

    Within one process the kernel lock cannot tell owners apart, so the held locks are also
    registered by the root's real path: a previous holder in this process that is closed or no
    longer referenced is taken over (:meth:`_take_over`); one still open is refused naming this
    process, never as another run.

    Args:
        root: the checkpoint root.
        drain: called before a new lock of this process takes over from this one: finishes the
            holder's in-flight work; it must not reference the holder (which would keep it alive).
    """

    def __init__(self, root: Path, *, drain: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_FILE_NAME  # only where the directory cannot be locked
        self._fd: int | None = None
        self._file: bool = False  # the lock is on ``path`` (fallback), not on the directory
        self._drain = drain
        self._since: float | None = None
        self._key: str | None = None
        self._pid: int | None = None  # the process that took it (a forked child inherits the object, not the lock)

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def _held_by_this_process(self) -> bool:
        """True when this process holds the root's lock (through another object or path)."""
        pid = _flock_holder(self.root)
        if pid is not None:
            return pid == os.getpid()
        owner = self._recorded_owner()
        return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()

    def _recorded_owner(self) -> dict[str, Any]:
        """The lock-file fallback's owner record ({} when missing or unreadable)."""
        try:
            owner = json.loads(self.path.read_bytes() or b"{}")
        except (OSError, ValueError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def _take_over(self, key: str) -> None:
        """Within this process: wait out a previous holder of the same root that is closed or unreachable
        (its ``drain`` first, then a garbage collection so that its finalizer releases it), else
        CheckpointWriteError."""
        with _HELD_LOCK:
            holder = _HELD.get(key)
        if holder is None or holder is self:
            return
        drain, since = holder._drain, holder._since
        del holder
        if drain is not None:
            drain()  # its save in flight commits (or fails) first; the writer then lets go of its owner
        del drain
        gc.collect()  # an owner that only a reference cycle kept alive is finalized here
        with _HELD_LOCK:
            still = _HELD.get(key)
        if still is not None and still.held:
            when = time.strftime(" at %H:%M:%S", time.localtime(since)) if since is not None else ""
            raise CheckpointWriteError(
                errno.EBUSY, f"checkpoint root {self.root} is in use by another CheckpointManager of this "
                f"process (pid {os.getpid()}, opened{when}) that is still open and referenced: close() it (or leave "
                "its `with` block) before opening another one on the same root, or use a different directory")

    def _owner(self) -> str:
        pid = _flock_holder(self.root)
        owner = {"host": socket.gethostname(), "pid": pid} if pid is not None else self._recorded_owner()
        if "pid" not in owner:
            return "owner not recorded: another host, or not recorded yet"
        since = owner.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
            if isinstance(since, (int, float)) else ""
        return f"host {owner.get('host')!r}, pid {owner.get('pid')}{when}"

    def acquire(self) -> None:
        """Take the lock without waiting (directory, else lock file); record the owner in a lock file.

        Raises:
            CheckpointWriteError: another live process holds it (its host and pid are named), an
                open holder in this process holds it, the root cannot be opened, the lock file cannot
                be created or written, or the file system does not support locks.
        """
        if self._fd is not None:
            return
        key = os.path.realpath(self.root)
        self._take_over(key)
        try:
            fd = _lock_directory(self.root)
            file = False
            if fd is None:
                fd, file = _lock_file(self.path), True
            else:
                _remove_old_lock_files(self.root, fd)
        except BlockingIOError as exc:
            if self._held_by_this_process():  # e.g. the root reached through a bind mount
                raise CheckpointWriteError(
                    errno.EWOULDBLOCK, f"checkpoint root {self.root} is locked by this same process (pid "
                    f"{os.getpid()}) through another path or object; close the manager that owns it first") from exc
            raise CheckpointWriteError(
                errno.EWOULDBLOCK, f"checkpoint root {self.root} is in use by another run ({self._owner()}); "
                "use a different directory, or stop that run first") from exc
        except OSError as exc:
            code = exc.errno
            if code in _NO_LOCKS:
                raise CheckpointWriteError(
                    code, f"cannot lock {self.root}: the file system does not support file locks "
                    "(on Lustre mount with -o flock; on NFS enable the lock manager)") from exc
            hint = " (or open it with read_only=True to restore and list only)" \
                if code in (errno.EROFS, errno.EACCES, errno.EPERM) else ""
            raise CheckpointWriteError(code, f"cannot create the lock {self.path}: {exc.strerror or exc}; check that "
                                       f"the checkpoint root is writable and has free space{hint}") from exc
        if not file and not os.access(self.root, os.W_OK):  # the lock itself writes nothing: check now
            code = errno.EROFS if _read_only_mount(self.root) else errno.EACCES
            os.close(fd)
            raise CheckpointWriteError(code, f"cannot write into the checkpoint root {self.root}: "
                                       f"{os.strerror(code)}; check that it is writable (or open it with "
                                       "read_only=True to restore and list only)")
        if file:
            try:
                _write_owner(fd)
            except OSError as exc:
                _unlink_and_close(self.path, fd)
                raise CheckpointWriteError(exc.errno, f"cannot write the lock owner into {self.path}: "
                                           f"{exc.strerror}; check that the checkpoint root is writable and has "
                                           "free space") from exc
        self._fd, self._file, self._since, self._key, self._pid = fd, file, time.time(), key, os.getpid()
        with _HELD_LOCK:
            _HELD[key] = self

    def release(self) -> None:
        """Drop the lock if this object holds it; a lock file is removed first, while still held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with _HELD_LOCK:
            if self._key is not None and _HELD.get(self._key) is self:
                del _HELD[self._key]
        if self._file and self._pid == os.getpid():
            _unlink_and_close(self.path, fd)
        else:  # in a forked child only its copy of the descriptor: the parent still holds the lock and its file
            os.close(fd)

    def __del__(self) -> None:  # an unreachable lock (its manager's finalizer did not run): the file goes too
        with suppress(Exception):  # interpreter shutdown
            self.release()


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _flock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError when held


def _lock_directory(root: Path) -> int | None:
    """flock the directory itself; None when its file system cannot lock directories."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _flock(fd)
    except OSError as exc:
        os.close(fd)
        if exc.errno in _NO_DIRECTORY_LOCK and not isinstance(exc, BlockingIOError):
            log.debug("cannot flock the directory %s (%s): locking %s instead", root, exc, root / LOCK_FILE_NAME)
            return None
        raise
    return fd


def _lock_file(path: Path) -> int:
    """flock ``path`` (created if missing), retrying when the locked file was unlinked meanwhile."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _flock(fd)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # its holder removed it at release: lock the new file
    raise OSError(errno.EAGAIN, "the lock file keeps being replaced", str(path))


def _remove_old_lock_files(root: Path, held_fd: int) -> None:
    """Holding the directory lock: remove ``.lock``/``.lock.owner`` left by an earlier version, unless a
    live run of that version holds ``.lock`` (then the root is in use: BlockingIOError)."""
    path = root / LOCK_FILE_NAME
    if not os.path.lexists(path):
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        _flock(fd)
    except BlockingIOError:
        os.close(fd)
        os.close(held_fd)
        raise
    except OSError:
        os.close(fd)
        return
    for name in (LOCK_FILE_NAME + ".owner", LOCK_FILE_NAME + ".owner.tmp"):
        with suppress(OSError):
            os.unlink(root / name)
    _unlink_and_close(path, fd)


def _unlink_and_close(path: Path, fd: int) -> None:
    try:
        os.unlink(path)
    except OSError as exc:  # the root itself was removed or replaced
        log.debug("could not remove lock file %s: %s", path, exc)
    finally:
        os.close(fd)


def _write_owner(fd: int) -> None:
    """Write this process's host, pid and time into the held lock file."""
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, me, 0)
    os.fsync(fd)


def _flock_holder(root: Path) -> int | None:
    """The pid holding a flock on ``root`` on this host (``/proc/locks``), or None."""
    try:
        st = os.stat(root)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "WRITE" and parts[5] == device:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


@atexit.register
def _release_all() -> None:
    """At interpreter exit: remove the lock files still held (the kernel drops the locks themselves)."""
    with _HELD_LOCK:
        held = list(_HELD.values())  # in a forked child release() only closes its copy of the descriptor
    for lock in held:
        try:
            lock.release()
        except OSError as exc:
            log.debug("could not release %s at exit: %s", lock.root, exc)
