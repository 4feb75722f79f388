"""On-disk layout and atomic commit of a checkpoint root (a local directory).

The manifest itself (:class:`Manifest`, :func:`read_manifest`) is defined in
:mod:`torch_ckpt.manifest` and re-exported here.

Layout of a run root::

    ROOT/
      step_000000100/            committed checkpoint (DCP files + per-rank JSON + manifest.json)
        .metadata                DCP global metadata (pickle, read with a restricted unpickler)
        __0_0.distcp ...         tensor shards, one file per rank and writer thread
        rank_00000.json ...      non-tensor state of each rank (types preserved, no pickle)
        manifest.json            written last: step, world size, files with sizes and CRC-32
      .step_000000110.tmp.9f2c.../  a save in progress; never listed, removed on the next start

Every temporary name carries the incarnation id of the checkpointer writing it (a random hex id
drawn when the checkpointer is built), so a restarted run never writes into, and never commits, a
temporary directory left or still being written by a previous incarnation of the same run.

Commit protocol (crash-safe at every instant): all files are written and fsynced inside the
temporary sibling, ``manifest.json`` is written and fsynced, the temporary directory is fsynced,
renamed to its final name (atomic on POSIX), and the root is fsynced. A directory with a final
name therefore always holds a complete checkpoint; ordering always uses the manifest's integer
step, never string order.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Any

import filelock

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from torch_ckpt.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest, rank_file_name, read_manifest
from torch_ckpt.naming import Naming, StepNaming

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Manifest",
    "step_dir_name",
    "tmp_dir_name",
    "temporary_name",
    "new_incarnation",
    "is_temporary_name",
    "scan_committed",
    "read_manifest",
    "write_json_durable",
    "fsync_dir",
    "commit_dir",
    "clean_stale_temporaries",
    "check_root",
    "update_manifest_tiers",
    "RootLock",
    "rank_file_name",
    "MANIFEST_NAME",
    "is_committed",
    "replace_dir",
]

log = get_logger(__name__)

# a temporary checkpoint directory: ``.NAME.tmp`` (before incarnation ids), ``.NAME.tmp.<id>``, and the
# durable tier's ``.NAME.download.tmp`` in both forms; group 1 is NAME, group 3 the incarnation id
_TMP_RE = re.compile(r"^\.(.+?)(\.download)?\.tmp(?:\.([0-9a-f]+))?$")
# the previous checkpoint of a replaced directory, between the two renames of a non-atomic replace
_REPLACED_RE = re.compile(r"^\.(.+)\.replaced\.([0-9a-f]{1,64})$")
_INCARNATION_RE = re.compile(r"^[0-9a-f]{1,64}$")
_DEFAULT_NAMING = StepNaming()


def step_dir_name(step: int) -> str:
    """Final directory name of ``step`` under the default :class:`~torch_ckpt.naming.StepNaming`."""
    return _DEFAULT_NAMING.name(step)


def new_incarnation() -> str:
    """A fresh incarnation id (16 hex digits, random) for one checkpointer instance."""
    return secrets.token_hex(8)


def temporary_name(final_name: str, incarnation: str) -> str:
    """Hidden sibling name under which ``final_name`` is written by checkpointer ``incarnation``.

    Raises:
        ValueError: ``incarnation`` is not 1 to 64 lowercase hex digits.
    """
    if not isinstance(incarnation, str) or not _INCARNATION_RE.match(incarnation):
        raise ValueError(f"incarnation id must be 1 to 64 lowercase hex digits, got {incarnation!r}")
    return f".{final_name}.tmp.{incarnation}"


def tmp_dir_name(step: int, incarnation: str) -> str:
    """Temporary sibling directory name used while ``step`` is being written by ``incarnation``."""
    return temporary_name(step_dir_name(step), incarnation)


def is_temporary_name(name: str, naming: Naming | None = None) -> bool:
    """True for the name of one of our temporary checkpoint directories.

    That is ``.NAME.tmp``, ``.NAME.tmp.<id>`` or their ``.download`` forms where NAME is a name of
    ``naming`` (default :class:`StepNaming`), or any ``.NAME.tmp.<16 hex digits>`` (an incarnation
    id: only torch-ckpt writes those, also for explicitly named checkpoints).
    """
    m = _TMP_RE.match(name)
    if m is None:
        return False
    if m.group(3) is not None and len(m.group(3)) == 16:
        return True
    return (naming or _DEFAULT_NAMING).step_of(m.group(1)) is not None


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: str | os.PathLike, obj: Any) -> tuple[int, int]:
    """Write ``obj`` as JSON and fsync it. Returns ``(bytes, crc32)`` of what was written."""
    import zlib

    data = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), zlib.crc32(data)


def update_manifest_tiers(step_dir: Path, tiers: dict[str, Any]) -> None:
    """Atomically rewrite ``step_dir/manifest.json`` with ``tiers`` merged in (write, fsync, rename)."""
    manifest = read_manifest(step_dir)
    data = manifest.to_json()
    data["tiers"] = {**manifest.tiers, **tiers}
    tmp = Path(step_dir) / (MANIFEST_NAME + ".tmp")
    write_json_durable(tmp, data)
    os.rename(tmp, Path(step_dir) / MANIFEST_NAME)
    fsync_dir(step_dir)


def check_root(root: Path, *, create: bool) -> None:
    """Validate a checkpoint root; optionally create it.

    Raises:
        CheckpointWriteError: the root exists but is not a directory, or cannot be created.
        CheckpointNotFoundError: ``create`` is False and the root does not exist.
    """
    if root.exists() and not root.is_dir():
        raise CheckpointWriteError(f"checkpoint root {root} exists but is not a directory; pass a directory path")
    if not root.exists():
        if not create:
            raise CheckpointNotFoundError(f"checkpoint root {root} does not exist")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot create checkpoint root {root}: {exc.strerror}; "
                                       "choose a writable location") from exc


def scan_committed(root: str | os.PathLike, naming: Naming | None = None) -> dict[int, Path]:
    """Return ``{step: directory}`` of committed checkpoints under ``root``, ascending.

    Only names that ``naming`` (default :class:`StepNaming`) parses are considered, and the
    manifest's step must equal the step of the name. Directories with such a name but no readable
    manifest (a folder of another tool, or damage) are skipped with a warning; temporary
    directories are never returned.
    """
    root = Path(root)
    naming = naming or _DEFAULT_NAMING
    found: dict[int, Path] = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        named_step = naming.step_of(entry.name)
        if named_step is None or not entry.is_dir():
            continue
        try:
            manifest = read_manifest(entry)
        except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
            log.warning("ignoring %s: %s", entry, exc)
            continue
        except OSError as exc:  # unreadable (permissions, I/O error): not a usable checkpoint either
            log.warning("ignoring %s: cannot read its manifest (%s)", entry, exc)
            continue
        if manifest.step != named_step:
            log.warning("ignoring %s: manifest says step %d", entry, manifest.step)
            continue
        found[manifest.step] = entry
    return dict(sorted(found.items()))


def commit_dir(tmp: Path, final: Path, *, replace: bool = False) -> None:
    """Atomically publish ``tmp`` as ``final`` (fsync tmp, rename, fsync parent).

    Args:
        tmp: the complete temporary directory.
        final: the final name.
        replace: ``final`` may already hold a committed checkpoint, which is replaced (see
            :func:`replace_dir`); otherwise an existing ``final`` is an error.

    Raises:
        CheckpointWriteError: ``final`` already exists (without ``replace``) or the rename fails.
    """
    fsync_dir(tmp)
    if replace and final.exists():
        replace_dir(tmp, final)
        return
    if final.exists():
        raise CheckpointWriteError(f"{final} already exists; a checkpoint for this step is already committed")
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise CheckpointWriteError(exc.errno, f"cannot commit {tmp} -> {final}: {exc.strerror}") from exc
    fsync_dir(final.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # kernel or file system without RENAME_EXCHANGE: fall back to two renames
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(tmp: Path, final: Path) -> None:
    """Replace the committed checkpoint ``final`` by the complete directory ``tmp``, crash-safely.

    On Linux the two entries are swapped atomically (``renameat2(RENAME_EXCHANGE)``): at every
    instant ``final`` is either the old or the new complete checkpoint. The old one then lies under
    the temporary name and is deleted (a crash leaves it as a stale temporary, removed on the next
    start). Where the exchange is not supported, the old directory is first renamed to
    ``.NAME.replaced.<id>`` and the new one renamed in; a crash between the two renames leaves no
    ``final``, and :func:`clean_stale_temporaries` renames the old one back on the next start.

    Raises:
        CheckpointWriteError: a rename fails (the old checkpoint is left in place or restorable).
    """
    try:
        if _exchange(tmp, final):
            fsync_dir(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        aside = final.with_name(f".{final.name}.replaced.{new_incarnation()}")
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(aside, final)  # put the old checkpoint back; a crash here is undone at the next start
            raise
        fsync_dir(final.parent)
        shutil.rmtree(aside, ignore_errors=True)
    except OSError as exc:
        raise CheckpointWriteError(exc.errno, f"cannot replace {final} by {tmp}: {exc.strerror}") from exc


def is_committed(path: str | os.PathLike) -> bool:
    """True when ``path`` is a committed torch-ckpt checkpoint: a valid manifest, and every file it
    lists present as a regular file of the listed size (cheap: no checksums are read). For one
    node's copy of a node-local checkpoint, the files that node holds."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
        for name, info in manifest.local_files().items():
            st = os.lstat(path / name)
            if not stat.S_ISREG(st.st_mode) or st.st_size != info["bytes"]:
                return False
    except (CheckpointNotFoundError, CheckpointCorruptError, OSError):
        return False
    return True


def clean_stale_temporaries(root: str | os.PathLike, *, keep_incarnation: str | None = None,
                            naming: Naming | None = None) -> list[Path]:
    """Remove temporary checkpoint directories left by a crashed save or by a previous incarnation.

    Call it only while holding the root's lock: every temporary of another incarnation is then
    stale (its owner is gone; a writer it left behind can no longer commit, see
    :mod:`torch_ckpt.writer_process`). Temporaries are recognised by :func:`is_temporary_name`
    (``.NAME.tmp``, ``.NAME.tmp.<id>``, ``.download`` forms); ``.trash_NAME`` leftovers of an
    interrupted delete are removed; the old checkpoint of an interrupted non-atomic replace
    (``.NAME.replaced.<id>``) is renamed back to NAME when NAME is missing, and removed otherwise.

    Args:
        root: the checkpoint root.
        keep_incarnation: the caller's own incarnation id; its temporaries (a save in flight) are kept.
        naming: the root's naming (default :class:`StepNaming`).

    Returns:
        The removed paths.
    """
    removed: list[Path] = []
    root = Path(root)
    naming = naming or _DEFAULT_NAMING
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        m = _TMP_RE.match(entry.name)
        if m and keep_incarnation is not None and m.group(3) == keep_incarnation:
            continue
        replaced = _REPLACED_RE.match(entry.name)
        if replaced is not None:
            final = root / replaced.group(1)
            if not os.path.lexists(final):
                os.rename(entry, final)
                log.warning("restored %s from %s (a replace was interrupted)", final, entry)
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        trash = entry.name.startswith(".trash_") and (
            naming.step_of(entry.name[len(".trash_"):]) is not None or entry.name.startswith(".trash_step_"))
        if is_temporary_name(entry.name, naming) or trash:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("removed %d stale temporary checkpoint dir(s) under %s", len(removed), root)
    return removed


def quarantine_step_dir(path: Path, *, reason: str = "corrupt") -> Path:
    """Move a checkpoint directory aside (never listed, never auto-deleted) and return its new path.

    ``reason`` names the hidden directory: ``.corrupt_step_N.<time>`` for a damaged checkpoint,
    ``.superseded_step_N.<time>`` for one from a run segment abandoned by restoring an older step.
    When that name is taken (twice within one second), ``.1``, ``.2``... is appended.

    Raises:
        CheckpointWriteError: the directory cannot be moved (the message names both paths).
    """
    base = f".{reason}_{path.name}.{int(time.time())}"
    for n in range(1000):
        target = path.with_name(base if n == 0 else f"{base}.{n}")
        if os.path.lexists(target):
            continue
        try:
            os.rename(path, target)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # created meanwhile: try the next name
                continue
            raise CheckpointWriteError(exc.errno, f"cannot move {reason} checkpoint {path} aside to {target}: "
                                       f"{exc.strerror}; check the permissions of {path.parent}") from exc
        try:
            fsync_dir(path.parent)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"moved {path} aside to {target}, but cannot sync "
                                       f"{path.parent}: {exc.strerror}") from exc
        log.warning("moved %s checkpoint %s aside to %s", reason, path, target)
        return target
    raise CheckpointWriteError(f"cannot move {reason} checkpoint {path} aside: names {base}.* are all taken; "
                               f"remove old ones from {path.parent}")


def remove_step_dir(path: Path) -> None:
    """Delete a committed checkpoint so that no partial one is ever visible under a final name.

    The directory is first renamed to a hidden trash name (atomic), then removed.
    """
    trash = path.with_name(f".trash_{path.name}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


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
    """

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / ".lock"
        self.owner_path = Path(root) / ".lock.owner"
        self._lock: filelock.UnixFileLock | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._lock is not None

    def _owner(self) -> str:
        try:
            owner = json.loads(self.owner_path.read_bytes() or b"{}")
        except (OSError, ValueError):
            owner = {}
        if not isinstance(owner, dict) or "pid" not in owner:
            return "owner not recorded yet"
        since = owner.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
            if isinstance(since, (int, float)) else ""
        return f"host {owner.get('host')!r}, pid {owner.get('pid')}{when}"

    def acquire(self) -> None:
        """Take the lock without waiting, then record this process as its owner.

        Raises:
            CheckpointWriteError: another live process holds it (its host and pid are named), the
                lock or owner file cannot be created or written, or the file system does not
                support locks.
        """
        if self._lock is not None:
            return
        lock = _unix_file_lock(self.path)
        try:
            lock.acquire()
        except filelock.Timeout as exc:
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
        self._lock = lock

    def release(self) -> None:
        """Drop the lock if this object holds it (the owner file is removed first, while still held)."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
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
