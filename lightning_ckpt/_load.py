"""Reading a torch-ckpt directory back as the dict Lightning expects (one process, pickle-free)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ckpt._values import RANK_LOCAL_KEYS, decode_values
from torch_ckpt import CheckpointNotFoundError, StateMismatchError, load_full_state
from torch_ckpt.codec import join_state
from torch_ckpt.layout import rank_file_name

__all__ = ["is_checkpoint_dir", "load_checkpoint_dir", "world", "check_against_live"]

log = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """``(rank, world size)`` of this process; ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_checkpoint_dir(path: Any) -> bool:
    """True if ``path`` is a committed torch-ckpt checkpoint directory."""
    p = Path(path)
    return p.is_dir() and (p / "manifest.json").is_file()


def load_checkpoint_dir(path: Path, *, verify: bool, allow_pickle: bool, map_location: Any = None) -> dict[str, Any]:
    """Load a committed checkpoint directory as Lightning's checkpoint dict.

    Tensors are full (unsharded) CPU tensors, moved to ``map_location`` when it is a device or
    device string. Rank-local entries (loop progress, callback states) are this rank's own when the
    world size is the one that saved, otherwise rank 0's (with a warning).

    Raises:
        CheckpointNotFoundError: ``path`` is a directory but not a committed checkpoint.
        CheckpointCorruptError: a file fails verification.
        UnsafeCheckpointError: pickled values and ``allow_pickle`` is False.
        TypeError: ``map_location`` is neither None, a device nor a device string.
    """
    if not is_checkpoint_dir(path):
        raise CheckpointNotFoundError(f"{path} is a directory but not a committed torch-ckpt checkpoint "
                                      "(no manifest.json); was it written by another CheckpointIO?")
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"map_location must be a device or device string for {path}, got {map_location!r}")
    state, manifest = load_full_state(path, verify=verify)
    state.pop("per_rank", None)
    rank, size = world()
    if manifest.world_size > 1 and rank > 0:
        if manifest.world_size == size:
            tree = json.loads((path / rank_file_name(rank)).read_bytes())["tree"]
            state.update({k: join_state(tree[k], {}) for k in RANK_LOCAL_KEYS if k in tree})
        else:
            rank_zero_warn(f"{path} was saved by {manifest.world_size} ranks and is loaded by {size}: every rank "
                           "restores rank 0's loop progress and callback states (RNG included)")
    state = decode_values(state, allow_pickle=allow_pickle)
    return state if map_location is None else _to_device(state, torch.device(map_location))


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def check_against_live(checkpoint: dict[str, Any], module: torch.nn.Module, optimizers: Sequence[Any], *,
                       strict: bool, allow_cast: bool, where: str) -> None:
    """Check that Lightning can load ``checkpoint`` into ``module`` and ``optimizers`` without a partial write or cast.

    ``nn.Module.load_state_dict`` copies every matching tensor before it reports a mismatch, and it
    and ``Optimizer.load_state_dict`` cast to the live dtype silently; this runs first.

    Args:
        checkpoint: the dict :func:`load_checkpoint_dir` returned.
        module: the live LightningModule.
        optimizers: the live (unwrapped) optimizers; empty when Lightning will not load them.
        strict: Lightning's ``strict_loading``: missing or unexpected keys are errors.
        allow_cast: accept dtype differences (each cast key is logged once).
        where: the checkpoint path, for messages.

    Raises:
        StateMismatchError: missing/unexpected keys (strict), shape differences, dtype differences
            (without ``allow_cast``), or optimizers that do not match their saved state.
    """
    from torch_ckpt.optim_state import check_plain_optimizer_state

    saved = checkpoint.get("state_dict", {})
    live = module.state_dict()
    missing = sorted(k for k in live if k not in saved) if strict else []
    unexpected = sorted(k for k in saved if k not in live) if strict else []
    if missing or unexpected:
        raise StateMismatchError(f"{where}: the model does not match the checkpoint. Missing from checkpoint: "
                                 f"{missing[:20]}; unexpected in checkpoint: {unexpected[:20]}",
                                 missing=missing, unexpected=unexpected)
    shapes, dtypes, casts = [], [], []
    for key, t in live.items():
        s = saved.get(key)
        if not isinstance(t, torch.Tensor) or not isinstance(s, torch.Tensor):
            continue
        if s.shape != t.shape:
            shapes.append(f"state_dict.{key}: checkpoint {tuple(s.shape)} vs live {tuple(t.shape)}")
        elif s.dtype != t.dtype:
            (casts if allow_cast else dtypes).append(f"state_dict.{key}: checkpoint {s.dtype}, live {t.dtype}")
    if shapes:
        raise StateMismatchError(f"{where}: tensor shapes differ: {shapes[:20]}")
    if dtypes:
        raise StateMismatchError(f"{where}: tensor dtypes differ (restore never casts silently): {dtypes[:20]}. "
                                 "Build the model with the saved dtypes, or use AsyncDCPCheckpointIO(allow_cast=True).")
    if optimizers:
        states = checkpoint.get("optimizer_states")
        if not isinstance(states, list) or len(states) != len(optimizers):
            raise StateMismatchError(f"{where}: checkpoint holds "
                                     f"{len(states) if isinstance(states, list) else 'no'} optimizer states, this run "
                                     f"has {len(optimizers)} optimizers")
        for i, (opt, osd) in enumerate(zip(optimizers, states)):
            casts += check_plain_optimizer_state(opt, osd, prefix=f"optimizer_states.{i}.", allow_cast=allow_cast)
    for line in casts:
        log.warning("%s: casting %s (allow_cast=True)", where, line)
