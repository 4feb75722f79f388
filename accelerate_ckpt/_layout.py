"""Accelerate's checkpoint directories, with torch-ckpt's atomic payload inside each one.

Layout (``ProjectConfiguration(automatic_checkpoint_naming=True)``)::

    PROJECT_DIR/checkpoints/
      checkpoint_9/                Accelerate's folder; files of user save hooks go here
        torch_ckpt/                the committed payload (DCP shards, per-rank JSON, manifest.json)
      checkpoint_10/
        .torch_ckpt.tmp.<id>/      a save in flight: not a checkpoint yet

A folder is a checkpoint if and only if ``torch_ckpt/manifest.json`` exists (the core renames the
payload into place only when every rank's files are written and fsynced). Folders are ordered by
the integer in their name, never by string order, and pruned only after a newer one is committed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from torch_ckpt import CheckpointError
from torch_ckpt.layout import read_manifest

__all__ = ["PAYLOAD", "checkpoint_dir", "checkpoint_root", "committed_checkpoints", "is_committed", "prune"]

log = logging.getLogger(__name__)

#: Name of the torch-ckpt payload directory inside an Accelerate checkpoint folder.
PAYLOAD = "torch_ckpt"
_NAME_RE = re.compile(r"^checkpoint_(\d+)$")


def checkpoint_root(project_dir: str | os.PathLike) -> Path:
    """Where Accelerate's automatic naming puts checkpoints: ``project_dir/checkpoints``."""
    return Path(project_dir).expanduser() / "checkpoints"


def checkpoint_dir(root: Path, number: int) -> Path:
    """The folder of checkpoint ``number`` under ``root`` (Accelerate's ``checkpoint_<n>``)."""
    return root / f"checkpoint_{number}"


def is_committed(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a committed torch-ckpt payload."""
    try:
        read_manifest(Path(folder) / PAYLOAD)
    except CheckpointError:
        return False
    return True


def _numbered(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        m = _NAME_RE.match(entry.name)
        if m and entry.is_dir():
            found[int(m.group(1))] = entry
    return dict(sorted(found.items()))


def committed_checkpoints(root: str | os.PathLike) -> dict[int, Path]:
    """``{number: folder}`` of the committed checkpoints under ``root``, in ascending numeric order."""
    return {n: p for n, p in _numbered(Path(root)).items() if is_committed(p)}


def _remove(folder: Path) -> None:
    """Rename to a hidden trash name first (atomic), so a half-deleted folder never looks like a checkpoint."""
    trash = folder.with_name(f".trash_{folder.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: str | os.PathLike, keep: int, *, newest: int, protect: set[int] | frozenset[int] = frozenset()
          ) -> list[int]:
    """Keep the ``keep`` numerically newest committed checkpoints; call right after ``newest`` committed.

    Also removes uncommitted folders numbered below ``newest`` (left by crashed saves; only one
    save is ever in flight, and it is ``newest``). ``newest`` and the numbers in ``protect``
    (e.g. still being replicated) are never removed.

    Returns:
        The numbers removed (ascending). Removal errors are logged, not raised.
    """
    folders = _numbered(Path(root))
    committed = [n for n, p in folders.items() if is_committed(p)]
    kept = set(committed[-keep:]) | {newest} | set(protect)
    doomed = [n for n in committed if n not in kept]
    doomed += [n for n in folders if n < newest and n not in committed]
    removed = []
    for n in sorted(doomed):
        try:
            _remove(folders[n])
            removed.append(n)
        except OSError as exc:
            log.warning("total_limit: could not remove %s: %s", folders[n], exc)
    if removed:
        log.info("total_limit=%d: removed checkpoint(s) %s under %s", keep, removed, root)
    return removed
