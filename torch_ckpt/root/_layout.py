"""The committed step directories of a checkpoint root (a local directory): list, commit, replace, remove;
the names of temporaries and their clean-up; and the root layout (:class:`SharedRoot`).

The manifest is defined in :mod:`torch_ckpt.format._files` (re-exported here), the lock in
:mod:`torch_ckpt.root._lock`::

    ROOT/
      step_000000100/            committed: .metadata (DCP, read with a restricted unpickler), __R_T.distcp
                                 shards, rank_NNNNN.json (non-tensor state, no pickle), manifest.json (last)
      step_000000110/            reserved when save() returned: a save in progress
        .torch-ckpt.partial.9f2c.../  its files until the commit; never listed, removed on the next start

A save reserves its final name ``NAME`` (created empty before ``save()`` returns, so a framework that
checks whether a name exists sees it taken), writes into the hidden partial inside it and commits by
renames (docs/format.md, "The commit protocol"): a final name holds a complete checkpoint or nothing
but partials (a *reservation*); ordering uses the manifest's integer step, never string order. No name
we add beside a checkpoint contains a copy of ``NAME``, so a framework's own scan of the folder
(Lightning's ``hpc_ckpt_<N>``, ``last`` names) never mistakes one for a checkpoint.

The incarnation is a random hex id drawn when the checkpointer is built: a restarted run never writes
into, and never commits, a temporary of a previous incarnation; :func:`clean_stale_temporaries` removes
those leftovers (and those of an interrupted delete or replace) when a run takes the root's lock.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
import time
import zlib
from contextlib import suppress
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
)
from torch_ckpt.format._files import (
    MANIFEST_NAME,
    Manifest,
    rank_file_name,
    read_manifest,
)
from torch_ckpt.policy._naming import Naming, StepNaming

__all__ = [
    "MANIFEST_NAME", "Manifest", "SharedRoot", "check_root", "commit_dir", "fsync_dir", "is_committed",
    "quarantine_step_dir", "rank_file_name", "read_manifest", "remove_step_dir", "discard_step_dir", "replace_dir",
    "retire_step_dir",
    "scan_committed", "scan_manifests", "update_manifest_tiers", "write_durable", "write_json_durable", "step_dir_name",
    "temporary_name", "new_incarnation", "is_temporary_name", "clean_stale_temporaries",
    "remove_failed_temporaries", "PARTIAL_PREFIX", "partial_path", "side_path", "is_reservation", "reserve", "unreserve"
]

log = get_logger("torch_ckpt.root._layout")

# a temporary checkpoint directory: ``.NAME.tmp`` (before incarnation ids), ``.NAME.tmp.<id>``, and the
# durable tier's ``.NAME.download.tmp`` in both forms; group 1 is NAME, group 3 the incarnation id
_TMP_RE = re.compile(r"^\.(.+?)(\.download)?\.tmp(?:\.([0-9a-f]+))?$")
# the previous checkpoint of a replaced directory, between the two renames of a non-atomic replace
_REPLACED_RE = re.compile(r"^\.(.+)\.replaced\.([0-9a-f]{1,64})$")
_INCARNATION_RE = re.compile(r"^[0-9a-f]{1,64}$")
_DEFAULT_NAMING = StepNaming()
#: a save in progress inside its reserved final directory: ``NAME/.torch-ckpt.partial.<incarnation>``
PARTIAL_PREFIX = ".torch-ckpt.partial."
#: the complete checkpoint between its two commit renames: ``.torch-ckpt.tmp.<incarnation>`` beside NAME
_SIDE = "torch-ckpt"


def step_dir_name(step: int) -> str:
    """Final directory name of ``step`` under the default :class:`~torch_ckpt.policy._naming.StepNaming`."""
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


def partial_path(final: Path, incarnation: str) -> Path:
    """Where ``final`` is written by checkpointer ``incarnation``: inside it, hidden.

    Raises:
        ValueError: ``incarnation`` is not 1 to 64 lowercase hex digits.
    """
    temporary_name(_SIDE, incarnation)  # validates the id
    return Path(final) / f"{PARTIAL_PREFIX}{incarnation}"


def side_path(final: Path, incarnation: str) -> Path:
    """The hidden sibling ``.torch-ckpt.tmp.<incarnation>`` a complete checkpoint passes through at commit."""
    return Path(final).with_name(temporary_name(_SIDE, incarnation))


def is_reservation(path: str | os.PathLike) -> bool:
    """True for a directory (not a symlink) holding nothing but partial saves (or nothing): a reserved,
    uncommitted name."""
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        return all(name.startswith(PARTIAL_PREFIX) for name in os.listdir(path))
    except OSError:
        return False


def reserve(final: Path) -> bool:
    """Create ``final`` empty (and its parents); True when this call created it, False when it existed.

    Raises:
        OSError: it cannot be created.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        final.mkdir()
    except FileExistsError:
        return False
    return True


def unreserve(final: Path, partial: Path, created: bool) -> None:
    """After a failed save: remove its partial, and ``final`` too when the save created it and it is empty."""
    shutil.rmtree(partial, ignore_errors=True)
    if created:
        with suppress(OSError):  # not empty (another save's partial, or the user's files) or already gone
            os.rmdir(final)


def is_temporary_name(name: str, naming: Naming | None = None) -> bool:
    """True for the name of one of our temporary checkpoint directories.

    That is ``.NAME.tmp``, ``.NAME.tmp.<id>`` or their ``.download`` forms where NAME is a name of
    ``naming`` (default :class:`StepNaming`), or any ``.NAME.tmp.<16 hex digits>`` (an incarnation
    id: only torch-ckpt writes those, also for explicitly named checkpoints).
    """
    m = _TMP_RE.match(name)
    if m is None:
        return False
    if m.group(3) is not None and (len(m.group(3)) == 16 or m.group(1) == _SIDE):
        return True
    return (naming or _DEFAULT_NAMING).step_of(m.group(1)) is not None


def clean_stale_temporaries(root: str | os.PathLike, *, keep_incarnation: str | None = None,
                            naming: Naming | None = None) -> list[Path]:
    """Remove temporary checkpoint directories left by a crashed save or by a previous incarnation.

    Call it only while holding the root's lock: every temporary of another incarnation is then
    stale (a writer it left behind can no longer commit, see :mod:`torch_ckpt.save._writer_process`).
    Removed: temporaries (:func:`is_temporary_name`), ``.trash_NAME`` leftovers of an interrupted
    delete, and the old checkpoint of an interrupted non-atomic replace (``.NAME.replaced.<id>``),
    which is renamed back to NAME instead when NAME is missing.

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
        if replaced is not None and not os.path.lexists(root / replaced.group(1)):
            os.rename(entry, root / replaced.group(1))
            log.warning("restored %s from %s (a replace was interrupted)", root / replaced.group(1), entry)
            continue
        trash = entry.name.startswith(".trash_") and (
            naming.step_of(entry.name[len(".trash_"):]) is not None or entry.name.startswith(".trash_step_"))
        if replaced is not None or is_temporary_name(entry.name, naming) or trash:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif not entry.name.startswith(".") and entry.is_dir() and not entry.is_symlink():
            removed.extend(_clean_partials(entry, keep_incarnation, naming.step_of(entry.name) is not None))
    if removed:
        log.info("removed %d stale temporary checkpoint dir(s) under %s", len(removed), root)
    return removed


def _clean_partials(directory: Path, keep_incarnation: str | None, named: bool) -> list[Path]:
    """Remove the partial saves of other incarnations inside ``directory``, then the directory when that
    left it empty (the crashed save had reserved it). An empty directory with one of the naming's names
    is a reservation whose save died before it began writing: removed too."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    if not names and named:
        with suppress(OSError):
            os.rmdir(directory)
            removed.append(directory)
        return removed
    for name in names:
        if name.startswith(PARTIAL_PREFIX) and name[len(PARTIAL_PREFIX):] != keep_incarnation:
            shutil.rmtree(directory / name, ignore_errors=True)
            removed.append(directory / name)
    if removed:
        with suppress(OSError):  # only when empty: a committed checkpoint keeps its files
            os.rmdir(directory)
    return removed


def remove_failed_temporaries(root: str | os.PathLike, current: str | os.PathLike,
                              failed_names: tuple[str, ...] | list[str]) -> list[Path]:
    """Remove the leftovers of earlier, failed saves of the incarnation that writes ``current`` now.

    Saves are sequential on every rank, so the partial ``NAME/.torch-ckpt.partial.<id>`` of a failed
    save of the same incarnation (and its commit side ``.torch-ckpt.tmp.<id>``) is a leftover, e.g. of a
    save whose collective timed out before rank 0 could remove it; its emptied reservation goes too.
    Only those saves' names are touched (a framework's files on their way into the next checkpoint
    are not).

    Args:
        root: the directory holding the failed saves' final names.
        current: the partial being written now (``FINAL/.torch-ckpt.partial.<id>``); it carries the id.
        failed_names: the final names of the failed saves (``NAME``).

    Returns:
        The removed paths.
    """
    current = Path(current)
    removed: list[Path] = []
    if not current.name.startswith(PARTIAL_PREFIX):
        return removed
    incarnation = current.name[len(PARTIAL_PREFIX):]
    root = Path(root)
    for name in dict.fromkeys(failed_names):
        final = root / name
        if final == current.parent:
            continue  # the save now writing this name removes its own leftover itself
        entry = partial_path(final, incarnation)
        if entry.is_dir() and not final.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            with suppress(OSError):  # only when empty: the failed save's reservation
                os.rmdir(final)
    side = side_path(current.parent, incarnation)
    if failed_names and side.is_dir() and not side.is_symlink():  # a failed commit's side (saves are sequential)
        shutil.rmtree(side, ignore_errors=True)
        removed.append(side)
    if removed:
        log.info("removed %d temporary dir(s) of failed saves under %s", len(removed), root)
    return removed


class SharedRoot:
    """The root layout of one directory that every rank sees (the default).

    A *root layout* says how the ranks share the root; the manager chooses it once
    (:func:`torch_ckpt.root._nodes.choose_layout`) and the writer, the replicator and the restore ask
    it. The other layout is :class:`torch_ckpt.root._nodes.NodeLayout` (a private root per node).
    Every layout has: ``node_local``; ``acts`` (this rank creates, commits, prunes and
    replicates its root); ``commits`` (it commits the durable copy); ``agreed_name(final)`` (what the
    ranks compare when they agree on a save); ``check(root, ctx, ok=)`` (a collective check at start:
    an error message or None); ``uploader(tier, wait_seconds)`` (the replicator's upload; None:
    ``tier.upload``); ``persist`` (its commit protocol ``persist(req, ctx)``, given by the manager
    since it lives in a higher layer; None: the shared-root one).
    """

    node_local = False
    persist = None

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    @property
    def acts(self) -> bool:
        return self.rank == 0

    commits = acts

    def agreed_name(self, final: str | os.PathLike) -> str:
        return os.path.abspath(os.fspath(final))

    def check(self, root: Path, ctx: Any, *, ok: bool = True) -> str | None:
        return None

    def uploader(self, tier: Any, wait_seconds: float) -> None:
        return None


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike, data: bytes) -> tuple[int, int]:
    """Write ``data`` and fsync it. Returns ``(bytes, crc32)`` of what was written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), zlib.crc32(data)


def write_json_durable(path: str | os.PathLike, obj: Any) -> tuple[int, int]:
    """Write ``obj`` as JSON and fsync it. Returns ``(bytes, crc32)`` of what was written."""
    return write_durable(path, json.dumps(obj, separators=(",", ":"), allow_nan=True).encode())


def update_manifest_tiers(step_dir: Path, tiers: dict[str, Any]) -> None:
    """Atomically rewrite ``step_dir/manifest.json`` with ``tiers`` merged in."""
    manifest = read_manifest(step_dir)
    data = manifest.to_json()
    data["tiers"] = {**manifest.tiers, **tiers}
    tmp = Path(step_dir) / (MANIFEST_NAME + ".tmp")
    write_json_durable(tmp, data)
    os.rename(tmp, Path(step_dir) / MANIFEST_NAME)
    fsync_dir(step_dir)


def check_root(root: Path, *, create: bool, what: str = "checkpoint root") -> None:
    """Validate a checkpoint root; with ``create``, create it. ``what`` names it in messages (``memory_root``).

    Raises:
        CheckpointWriteError: the root exists but is not a directory, or cannot be created.
        CheckpointNotFoundError: ``create`` is False and the root does not exist.
        ConfigError: the root is itself a checkpoint (it holds ``manifest.json``): training there would
            start from scratch and write steps inside a checkpoint.
    """
    if root.exists() and not root.is_dir():
        raise CheckpointWriteError(f"{what} {root} exists but is not a directory; pass a directory path")
    if (root / MANIFEST_NAME).is_file():
        raise ConfigError(f"{root} is a checkpoint directory (it holds {MANIFEST_NAME}), not a run root: pass the "
                          f"run root that contains it ({root.parent}), or restore(path='{root}') to load this one")
    if not root.exists():
        if not create:
            raise CheckpointNotFoundError(f"{what} {root} does not exist")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot create {what} {root}: {exc.strerror}; "
                                       "choose a writable location") from exc


def scan_committed(root: str | os.PathLike, naming: Naming | None = None) -> dict[int, Path]:
    """``{step: directory}`` of the committed checkpoints under ``root``, ascending.

    Only names that ``naming`` (default :class:`StepNaming`) parses count, and the manifest's step
    must equal the name's. Such a directory without a readable manifest is skipped with a warning
    (silently when it was removed while listed, or is a reservation); temporaries never count.
    """
    return {step: path for step, (path, _) in scan_manifests(root, naming).items()}


#: ``{warning: monotonic time}`` of the scans' recent warnings (one open and restore scans a root several times)
_WARNED: dict[str, float] = {}
_REPEAT_AFTER_S = 60.0


def _warn_skipped(message: str) -> None:
    """Log a skipped entry as a warning, the same one again only after :data:`_REPEAT_AFTER_S` (else debug)."""
    now = time.monotonic()
    if now - _WARNED.get(message, -_REPEAT_AFTER_S) < _REPEAT_AFTER_S:
        log.debug("%s", message)
        return
    if len(_WARNED) > 1000:
        _WARNED.clear()
    _WARNED[message] = now
    log.warning("%s", message)


def scan_manifests(root: str | os.PathLike, naming: Naming | None = None) -> dict[int, tuple[Path, Manifest]]:
    """:func:`scan_committed` with each directory's manifest: ``{step: (directory, manifest)}``, ascending.
    A skipped directory is warned about once a minute at most (a restore scans the root more than once)."""
    root = Path(root)
    naming = naming or _DEFAULT_NAMING
    found: dict[int, tuple[Path, Manifest]] = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        named_step = naming.step_of(entry.name)
        if named_step is None or not entry.is_dir():
            continue
        try:
            manifest = read_manifest(entry)
        except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
            if not os.path.lexists(entry):  # removed since it was listed (the writer's retention): nothing to say
                log.debug("ignoring %s: removed while the root was listed", entry)
                continue
            if not is_reservation(entry):  # a reserved name (a save in flight, or crashed) is silently not one
                _warn_skipped(f"ignoring {entry}: {exc}")
            continue
        except OSError as exc:  # unreadable (permissions, I/O error): not a usable checkpoint either
            _warn_skipped(f"ignoring {entry}: cannot read its manifest ({exc})")
            continue
        if manifest.step != named_step:
            _warn_skipped(f"ignoring {entry}: manifest says step {manifest.step}")
            continue
        found[manifest.step] = (entry, manifest)
    return dict(sorted(found.items()))


def commit_dir(tmp: Path, final: Path, *, replace: bool = False) -> None:
    """Atomically publish ``tmp`` as ``final`` (fsync tmp, rename, fsync parent).

    A ``tmp`` inside ``final`` (its partial) is first moved out to its sibling ``.torch-ckpt.tmp.<id>``,
    then renamed over ``final``: missing, an empty reservation (rename(2) replaces an empty
    directory atomically), or, with ``replace``, a committed checkpoint (:func:`replace_dir`).

    Raises:
        CheckpointWriteError: ``final`` already exists (without ``replace``) or the rename fails.
    """
    fsync_dir(tmp)
    if tmp.parent == final:  # written inside its reserved (or replaced) directory: move it out first
        side = side_path(final, tmp.name[len(PARTIAL_PREFIX):])
        if os.path.lexists(side):  # a leftover of an earlier attempt (rare): the usual commit deletes nothing
            shutil.rmtree(side, ignore_errors=True)
        try:
            os.rename(tmp, side)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot commit {tmp} -> {side}: {exc.strerror}") from exc
        try:
            commit_dir(side, final, replace=replace)
        except BaseException:
            shutil.rmtree(side, ignore_errors=True)
            raise
        return
    reserved = is_reservation(final)
    if replace and final.exists() and not reserved:
        replace_dir(tmp, final)
        return
    if final.exists() and not reserved:
        raise CheckpointWriteError(f"{final} already exists; a checkpoint for this step is already committed")
    try:
        os.rename(tmp, final)  # a missing name, or the empty reservation (replaced atomically)
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

    On Linux the entries are swapped atomically (``renameat2(RENAME_EXCHANGE)``), then the old one is
    deleted (a crash leaves it as a stale temporary). Elsewhere the old one is renamed to
    ``.NAME.replaced.<id>`` first; a crash between the two renames leaves no ``final``, and the next
    start renames the old one back (:func:`~torch_ckpt.root._layout.clean_stale_temporaries`).

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
    """True when ``path`` is a committed checkpoint: a valid manifest, and every file it lists (that
    this node holds, for a node's copy) present as a regular file of the listed size (no checksums)."""
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


def quarantine_step_dir(path: Path, *, reason: str = "corrupt") -> Path:
    """Move a checkpoint directory aside (never listed, never auto-deleted) and return its new path:
    ``.<reason>_NAME.<time>`` (``corrupt``, or ``superseded`` for an abandoned run segment), with
    ``.1``, ``.2``... appended when taken.

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
    """Delete a committed checkpoint: renamed to a trash name first (:func:`retire_step_dir`), then removed.

    Raises:
        OSError: the rename failed (the checkpoint is still there, complete).
    """
    shutil.rmtree(retire_step_dir(path), ignore_errors=True)


def discard_step_dir(path: Path) -> None:
    """:func:`remove_step_dir`, or removed in place when the rename fails: for a directory that must go either
    way (a superseded memory step, a replica); never raises."""
    try:
        remove_step_dir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def retire_step_dir(path: Path) -> Path:
    """Rename a committed checkpoint to a hidden trash name (``.torch-ckpt.tmp.<random id>``, atomic); returns it.

    The name carries no copy of NAME (no framework's scan mistakes it for a checkpoint) and its
    ``manifest.json`` is deleted at once; the caller deletes the rest when convenient (about 0.15 s
    per GiB), a leftover is removed at the next start.

    Raises:
        OSError: the rename failed (the checkpoint is still there, complete).
    """
    trash = side_path(path, new_incarnation())  # a fresh random id: never taken
    os.rename(path, trash)
    with suppress(OSError):  # else the rmtree that follows (or the next start's cleanup) removes it
        (trash / MANIFEST_NAME).unlink()
    return trash

