"""The read side of :class:`~torch_ckpt.CheckpointManager` that is not a restore: listing and removal.

A restore goes straight to :func:`torch_ckpt.restore._resume.restore_checkpoint`; the manager's
:meth:`~torch_ckpt.CheckpointManager.checkpoints` and :meth:`~torch_ckpt.CheckpointManager.remove`
call the functions here with what they need.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointWriteError, ConfigError
from torch_ckpt.policy._lineage import head_of
from torch_ckpt.policy._naming import Naming
from torch_ckpt.root._layout import is_reservation, read_manifest, remove_step_dir, scan_manifests

log = get_logger("torch_ckpt.manager._manager")

__all__ = ["agreed_checkpoints", "live_checkpoints", "remove_checkpoint"]


def live_checkpoints(root: Path, naming: Naming) -> dict[int, Path]:
    """This rank's live committed checkpoints under ``root`` (superseded ones left out), ``{step: directory}``."""
    found = scan_manifests(root, naming)
    head = head_of(m.lineage for _, m in found.values())
    return {s: p for s, (p, m) in found.items() if head.holds(s, m.lineage)}


def agreed_checkpoints(root: Path, naming: Naming, ctx: DistContext) -> dict[int, Path]:
    """:func:`live_checkpoints` of the coordinator, agreed by every rank (collective)."""
    found = {s: str(p) for s, p in live_checkpoints(root, naming).items()} if ctx.is_coordinator else None
    return {s: Path(p) for s, p in ctx.broadcast(found, what="list checkpoints").items()}


def remove_checkpoint(path: Path) -> None:
    """Delete the committed checkpoint ``path`` crash-safely (renamed aside, then deleted); missing: a no-op.

    Raises:
        ConfigError: ``path`` exists but is not a torch-ckpt checkpoint (never deleted).
        CheckpointWriteError: the directory could not be removed.
    """
    if not os.path.lexists(path):
        return
    if is_reservation(path) and os.listdir(path):  # only partials of saves that never committed: ours
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        read_manifest(path)
    except CheckpointNotFoundError:
        raise ConfigError(f"{path} is not a torch-ckpt checkpoint (no manifest.json); not deleting it") from None
    except CheckpointCorruptError:
        pass  # ours but damaged: still ours to delete
    try:
        remove_step_dir(path)
    except OSError as exc:
        raise CheckpointWriteError(exc.errno, f"cannot remove checkpoint {path}: {exc.strerror}") from exc
    log.info("removed checkpoint %s", path)
