"""The root's exclusive lock (:class:`RootLock`), so two runs never write or prune the same root."""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import threading
import time
import weakref
from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointWriteError

__all__ = ["RootLock", "LOCK_FILE_NAME"]

log = get_logger("torch_ckpt.layout")

#: The lock file, used only where the file system cannot lock a directory (NFS); removed at release.
LOCK_FILE_NAME = ".lock"
# flock() on a directory refused by the file system (NFS emulates flock with POSIX locks, which need a
# file opened for writing): lock a file in the root instead
_NO_DIRECTORY_LOCK = (errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK)
_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
_HELD: weakref.WeakSet[RootLock] = weakref.WeakSet()  # released at interpreter exit (the lock file, if any)
_HELD_LOCK = threading.Lock()


class RootLock:
    """An exclusive lock on a checkpoint root, so two runs never write (or prune) the same root.

    The lock is a kernel ``flock`` on the root directory itself, so it puts no file into the
    user's folder; the kernel drops it when the owning process exits or dies, so there is no
    staleness to guess and a lock left by a dead run is simply taken. A run that finds the root
    locked names the holder's host and pid, read from ``/proc/locks`` (Linux; holders on this host).

    Where the file system refuses to lock a directory (NFS, which emulates ``flock`` with POSIX
    locks needing a file opened for writing), the lock is a ``flock`` on the file ``ROOT/.lock``
    instead, which holds the owner's host, pid and start time while it runs and is removed at
    release and at interpreter exit (unlinked while still held; a contender that locked an unlinked
    file retries on the new one). Only a run killed with SIGKILL leaves that empty-or-stale file
    behind, and the next run takes it over.

    Local file systems are exact. On NFS, ``flock`` relies on the server's lock manager (NLM /
    NFSv4 locks); a client mounted with ``local_lock=flock`` (or ``local_lock=all``) keeps flock
    locks local to one node. On Lustre the clients must be mounted with ``-o flock``
    (``localflock`` only excludes processes of the same node). A file system without lock support
    makes :meth:`acquire` fail with a message saying so (never a silent fallback to a pid file).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_FILE_NAME  # only where the directory cannot be locked
        self._fd: int | None = None
        self._file: bool = False  # the lock is on ``path`` (fallback), not on the directory

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def _owner(self) -> str:
        pid = _flock_holder(self.root)
        owner: object = {"host": socket.gethostname(), "pid": pid}
        if pid is None:
            try:
                owner = json.loads(self.path.read_bytes() or b"{}")
            except (OSError, ValueError):
                owner = {}
        if not isinstance(owner, dict) or "pid" not in owner:
            return "owner not recorded: another host, or not recorded yet"
        since = owner.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
            if isinstance(since, (int, float)) else ""
        return f"host {owner.get('host')!r}, pid {owner.get('pid')}{when}"

    def acquire(self) -> None:
        """Take the lock without waiting (directory, else lock file); record the owner in a lock file.

        Raises:
            CheckpointWriteError: another live process holds it (its host and pid are named), the
                root cannot be opened, the lock file cannot be created or written, or the file
                system does not support locks.
        """
        if self._fd is not None:
            return
        try:
            fd = _lock_directory(self.root)
            file = False
            if fd is None:
                fd, file = _lock_file(self.path), True
            else:
                _remove_old_lock_files(self.root, fd)
        except BlockingIOError as exc:
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
        self._fd, self._file = fd, file
        with _HELD_LOCK:
            _HELD.add(self)

    def release(self) -> None:
        """Drop the lock if this object holds it; a lock file is removed first, while still held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with _HELD_LOCK:
            _HELD.discard(self)
        if self._file:
            _unlink_and_close(self.path, fd)
        else:
            os.close(fd)

    def __del__(self) -> None:  # an unreachable manager's lock: the file goes, the kernel lock with the fd
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


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
        try:
            os.unlink(root / name)
        except OSError:
            pass
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
        held = list(_HELD)
    for lock in held:
        try:
            lock.release()
        except OSError as exc:
            log.debug("could not release %s at exit: %s", lock.root, exc)
