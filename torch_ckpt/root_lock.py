"""The root's exclusive lock (:class:`RootLock`), so two runs never write or prune the same root."""

from __future__ import annotations

import errno
import gc
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import filelock

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointWriteError

__all__ = ["RootLock"]

log = get_logger("torch_ckpt.layout")

# The RootLocks this process holds, by the real path of their lock file. The kernel lock excludes
# other processes; within this process a second owner of the same root is told apart from another
# run, and takes over from a previous owner that is closed or no longer reachable.
_HELD: weakref.WeakValueDictionary[str, RootLock] = weakref.WeakValueDictionary()
_HELD_GUARD = threading.RLock()  # a finalizer run by a collection inside the guard releases a lock too


class RootLock:
    """An exclusive lock on a checkpoint root, so two runs never write (or prune) the same root.

    The lock is :class:`filelock.UnixFileLock` (a kernel ``flock``) on ``ROOT/.lock``: the kernel
    drops it when the owning process exits or dies, so there is no staleness to guess and a lock
    left by a dead run is simply taken. The lock file stays in place after release (as filelock
    keeps it, so that every contender locks the same inode). The holder's host, pid and start time
    are kept in the sidecar ``ROOT/.lock.owner``, only for the message of a run that finds the root
    locked (filelock's own lock file may be truncated by any contender that opens it).

    Local file systems are exact. On NFS, ``flock`` relies on the server's lock manager (NLM /
    NFSv4 locks); a client mounted with ``local_lock=flock`` (or ``local_lock=all``) keeps flock
    locks local to one node. On Lustre the clients must be mounted with ``-o flock``
    (``localflock`` only excludes processes of the same node). A file system without lock support
    makes :meth:`acquire` fail with a message saying so (never a silent fallback to a pid file).

    Within one process the kernel lock cannot tell owners apart (a second open of the file
    conflicts like another process), so the held locks are also registered by path: a new lock on
    a root whose previous holder in this process is closed or no longer referenced (its ``drain``,
    e.g. the in-flight save, is finished first, then garbage is collected so that its finalizer
    releases it) takes over; one whose holder is still open and referenced is refused naming this
    process, never as another run.

    Args:
        root: the checkpoint root.
        drain: called before a new lock of this process takes over from this one: finishes the
            holder's in-flight work; it must not reference the holder (which would keep it alive).
    """

    def __init__(self, root: Path, *, drain: Callable[[], None] | None = None) -> None:
        self.path = Path(root) / ".lock"
        self.owner_path = Path(root) / ".lock.owner"
        self._lock: filelock.UnixFileLock | None = None
        self._drain = drain
        self._since: float | None = None
        self._key: str | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._lock is not None

    def _owner_record(self) -> dict:
        try:
            owner = json.loads(self.owner_path.read_bytes() or b"{}")
        except (OSError, ValueError):
            owner = {}
        return owner if isinstance(owner, dict) else {}

    def _held_by_this_process(self) -> bool:
        owner = self._owner_record()
        return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()

    def _owner(self) -> str:
        owner = self._owner_record()
        if not isinstance(owner, dict) or "pid" not in owner:
            return "owner not recorded yet"
        since = owner.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
            if isinstance(since, (int, float)) else ""
        return f"host {owner.get('host')!r}, pid {owner.get('pid')}{when}"

    def _take_over(self, key: str) -> None:
        """Within this process: wait out a previous holder of the same root that is closed or unreachable.

        The previous holder's in-flight work is finished first (its ``drain``), then garbage is
        collected, so an owner nobody references any more is finalized and releases the lock.

        Raises:
            CheckpointWriteError: the previous holder is still open and reachable.
        """
        with _HELD_GUARD:
            holder = _HELD.get(key)
        if holder is None or holder is self:
            return
        drain, since = holder._drain, holder._since
        del holder
        if drain is not None:
            drain()  # its save in flight commits (or fails) first; the writer then lets go of its owner
        del drain
        gc.collect()  # an owner that only a reference cycle kept alive is finalized here
        with _HELD_GUARD:
            still = _HELD.get(key)
        if still is not None and still.held:
            when = time.strftime(" at %H:%M:%S", time.localtime(since)) if since is not None else ""
            raise CheckpointWriteError(
                errno.EBUSY, f"checkpoint root {self.path.parent} is in use by another CheckpointManager of this "
                f"process (pid {os.getpid()}, opened{when}) that is still open and referenced: close() it (or leave "
                "its `with` block) before opening another one on the same root, or use a different directory")

    def acquire(self) -> None:
        """Take the lock without waiting, then record this process as its owner.

        A previous holder in this same process that is closed, or that nothing references any
        more, is waited for (its in-flight save finishes) and its lock taken over.

        Raises:
            CheckpointWriteError: another live process holds it (its host and pid are named), an
                open holder in this process holds it, the lock or owner file cannot be created or
                written, or the file system does not support locks.
        """
        if self._lock is not None:
            return
        key = os.path.realpath(self.path)
        self._take_over(key)
        lock = _unix_file_lock(self.path)
        try:
            lock.acquire()
        except filelock.Timeout as exc:
            if self._held_by_this_process():  # e.g. a lock file reached through another hard link
                raise CheckpointWriteError(
                    errno.EWOULDBLOCK, f"checkpoint root {self.path.parent} is locked by this same process (pid "
                    f"{os.getpid()}) through another path or object; close the manager that owns it first") from exc
            raise CheckpointWriteError(
                errno.EWOULDBLOCK, f"checkpoint root {self.path.parent} is in use by another run ({self._owner()}); "
                "use a different directory, or stop that run first") from exc
        except (NotImplementedError, OSError) as exc:  # filelock < 4 raises NotImplementedError without flock
            code = getattr(exc, "errno", None)
            if isinstance(exc, NotImplementedError) or code in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise CheckpointWriteError(
                    code or errno.ENOSYS, f"cannot lock {self.path}: the file system does not support file locks "
                    "(on Lustre mount with -o flock; on NFS enable the lock manager)") from exc
            hint = " (or open it with read_only=True to restore and list only)" \
                if code in (errno.EROFS, errno.EACCES, errno.EPERM) else ""
            raise CheckpointWriteError(code, f"cannot create the lock {self.path}: {exc.strerror or exc}; check that "
                                       f"the checkpoint root is writable and has free space{hint}") from exc
        try:
            _write_owner(self.owner_path)
        except OSError as exc:
            lock.release()
            raise CheckpointWriteError(exc.errno, f"cannot write the lock owner {self.owner_path}: {exc.strerror}; "
                                       "check that the checkpoint root is writable and has free space") from exc
        self._lock, self._since, self._key = lock, time.time(), key
        with _HELD_GUARD:
            _HELD[key] = self

    def release(self) -> None:
        """Drop the lock if this object holds it (the owner file is removed first, while still held)."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        with _HELD_GUARD:
            if _HELD.get(self._key) is self:
                del _HELD[self._key]
        try:
            self.owner_path.unlink(missing_ok=True)
        except OSError as exc:  # the root itself was removed or replaced
            log.debug("could not remove lock owner %s: %s", self.owner_path, exc)
        finally:
            lock.release()


def _unix_file_lock(path: Path) -> filelock.UnixFileLock:
    """A non-blocking, thread-independent ``UnixFileLock`` that never falls back to a soft lock."""
    try:
        return filelock.UnixFileLock(path, timeout=0, thread_local=False, fallback_to_soft=False)
    except TypeError:  # filelock < 4: no `fallback_to_soft` (it has no soft fallback either)
        return filelock.UnixFileLock(path, timeout=0, thread_local=False)


def _write_owner(path: Path) -> None:
    """Write this process's host, pid and time to ``path`` atomically (temporary file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, json.dumps(me).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
