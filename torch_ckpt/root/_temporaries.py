"""Names of temporary checkpoint directories, incarnation ids, reservations, and the clean-up of stale temporaries.

A save first *reserves* its final name: the directory ``NAME`` is created empty when the save is
accepted (before ``save()`` returns), so every framework that checks whether a name exists sees it
taken, as with a synchronous save. The checkpoint is written inside it, under the hidden
``NAME/.torch-ckpt.partial.<incarnation>``; the commit moves that out to the hidden sibling
``.torch-ckpt.tmp.<incarnation>`` and renames it over the reserved directory (rename(2) replaces an
empty directory atomically) or exchanges it with the committed checkpoint it replaces. A
directory that holds nothing but partials (or nothing) is a *reservation*: never committed for any
reader. No name we add beside a checkpoint contains a copy of ``NAME``, so a framework's own scan
of the folder (Lightning's ``hpc_ckpt_<N>``, ``last`` names) never mistakes one for a checkpoint.
The incarnation is a random hex id drawn when the checkpointer is built; a restarted run
therefore never writes into, and never commits, a temporary left or still being written by a
previous incarnation. :func:`clean_stale_temporaries` removes those leftovers (and the other
hidden directories of an interrupted delete or replace) when a run takes the root's lock. The
final names, listing and commit are in :mod:`torch_ckpt.root._layout`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.policy._naming import Naming, StepNaming

__all__ = ["step_dir_name", "tmp_dir_name", "temporary_name", "replaced_name", "new_incarnation", "is_temporary_name",
           "clean_stale_temporaries", "remove_failed_temporaries", "PARTIAL_PREFIX", "partial_path", "side_path",
           "is_reservation", "reserve", "unreserve"]

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
        try:
            os.rmdir(final)
        except OSError:
            pass  # not empty (another save's partial, or the user's files) or already gone


def tmp_dir_name(step: int, incarnation: str) -> str:
    """Temporary sibling directory name used while ``step`` is being written by ``incarnation``."""
    return temporary_name(step_dir_name(step), incarnation)


def replaced_name(final_name: str) -> str:
    """Hidden name of the old checkpoint ``final_name`` between the two renames of a non-atomic replace."""
    return f".{final_name}.replaced.{new_incarnation()}"


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
    stale (its owner is gone; a writer it left behind can no longer commit, see
    :mod:`torch_ckpt.save._writer_process`). Temporaries are recognised by :func:`is_temporary_name`
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
        elif not entry.name.startswith(".") and entry.is_dir() and not entry.is_symlink():
            removed.extend(_clean_partials(entry, keep_incarnation, naming.step_of(entry.name) is not None))
    if removed:
        log.info("removed %d stale temporary checkpoint dir(s) under %s", len(removed), root)
    return removed


def _clean_partials(directory: Path, keep_incarnation: str | None, named: bool) -> list[Path]:
    """Remove the partial saves of other incarnations inside ``directory``; then the reservation itself
    when nothing else is left in it (it was reserved by the crashed save). An empty directory with
    one of the naming's names is a reservation whose save died before it began writing: removed too."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    if not names and named:
        try:
            os.rmdir(directory)
            removed.append(directory)
        except OSError:
            pass
        return removed
    for name in names:
        if name.startswith(PARTIAL_PREFIX) and name[len(PARTIAL_PREFIX):] != keep_incarnation:
            shutil.rmtree(directory / name, ignore_errors=True)
            removed.append(directory / name)
    if removed:
        try:
            os.rmdir(directory)  # only when empty: a committed checkpoint keeps its files
        except OSError:
            pass
    return removed



def remove_failed_temporaries(root: str | os.PathLike, current: str | os.PathLike,
                              failed_names: tuple[str, ...] | list[str]) -> list[Path]:
    """Remove the leftovers of earlier, failed saves of the incarnation that writes ``current`` now.

    A save runs only once the previous one finished on every rank (the ranks' agreement), so the
    partial ``NAME/.torch-ckpt.partial.<id>`` of a failed save of the same incarnation id (and its
    commit side ``.torch-ckpt.tmp.<id>``) is a leftover, for example of a save whose collective timed
    out before rank 0 could remove it. The reservation ``NAME`` goes too once nothing is left in it.
    Only the names of those saves are given: other directories of the root (a framework's files on
    their way into the next checkpoint) are never touched.

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
            try:
                os.rmdir(final)  # only when empty: the failed save's reservation
            except OSError:
                pass
    side = side_path(current.parent, incarnation)
    if failed_names and side.is_dir() and not side.is_symlink():  # a failed commit's side (saves are sequential)
        shutil.rmtree(side, ignore_errors=True)
        removed.append(side)
    if removed:
        log.info("removed %d temporary dir(s) of failed saves under %s", len(removed), root)
    return removed
