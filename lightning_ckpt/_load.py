"""Reading torch-ckpt directories back as the dict Lightning expects, and building a module from one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ckpt import _compat
from lightning_ckpt._values import RANK_LOCAL_KEYS, decode_values
from torch_ckpt import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StateMismatchError,
    is_committed,
    load_full_state,
    read_manifest,
)

__all__ = ["check_against_live", "load_checkpoint_dir", "load_from_checkpoint", "world"]

log = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """``(rank, world size)`` of this process; ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllValues:
    """A load target that takes every value of a checkpoint: full tensors, this rank's rank-local values."""

    def __init__(self, rank_local: tuple[str, ...]) -> None:
        self.rank_local_keys, self.loaded = rank_local, {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_optional_key(self, key: str) -> bool:
        return True

    def load_target(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def check_load(self, state: Any, *, allow_cast: bool = False) -> list[str]:
        return []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


def _rank_local(path: Path) -> tuple[str, ...]:
    saved = read_manifest(path).world_size
    if saved != world()[1]:
        rank_zero_warn(f"{path} was saved by {saved} ranks and is loaded by {world()[1]}: every rank restores rank "
                       "0's loop progress and callback states (RNG included)")
        return ()
    return RANK_LOCAL_KEYS


def load_checkpoint_dir(candidates: Sequence[Path], *, manager: Any, verify: bool, allow_pickle: bool,
                        map_location: Any = None) -> dict[str, Any]:
    """Load the first intact checkpoint of ``candidates`` (newest first) as Lightning's checkpoint dict.

    A candidate that fails verification is skipped with a warning naming it when another follows.
    With ``manager`` (attached: every rank calls this) each rank gets its own loop progress and
    callback states; without, rank 0's.

    Raises:
        CheckpointNotFoundError: the last candidate is not a committed checkpoint.
        CheckpointCorruptError: the last candidate fails verification.
        UnsafeCheckpointError: pickled values and ``allow_pickle`` is False.
        TypeError: ``map_location`` is neither None, a device nor a device string.
    """
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"map_location must be a device or device string for {candidates[0]}, got {map_location!r}")
    for path in candidates[:-1]:
        if not is_committed(path):
            log.warning("checkpoint %s is not intact; falling back to an older one", path)
    candidates = [p for p in candidates[:-1] if is_committed(p)] + [Path(candidates[-1])]
    if not is_committed(candidates[0]) and not (Path(candidates[0]) / "manifest.json").is_file():
        raise CheckpointNotFoundError(f"{candidates[0]} is a directory but not a committed torch-ckpt checkpoint (no "
                                      "manifest.json); was it written by another CheckpointIO?")
    if manager is not None:
        target = _AllValues(_rank_local(Path(candidates[0])))
        manager.restore(target, path=list(candidates))
        state = target.loaded
    else:
        for i, path in enumerate(candidates):
            try:
                state, _ = load_full_state(path, verify=verify)
                break
            except CheckpointCorruptError as exc:
                if i == len(candidates) - 1:
                    raise
                log.warning("checkpoint %s is not usable (%s); falling back to %s", path, exc, candidates[i + 1])
        state.pop("per_rank", None)
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


def load_from_checkpoint(cls: type, checkpoint_path: str | Path, *, map_location: Any = None,
                         strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path)`` for torch-ckpt directories (and plain ``.ckpt`` files).

    Builds ``cls`` from the saved hyper-parameters (``kwargs`` override them), runs its
    ``on_load_checkpoint`` and loads the weights, as Lightning's own method does for a file.

    Args:
        cls: the ``LightningModule`` class.
        checkpoint_path: a torch-ckpt checkpoint directory or a plain ``.ckpt`` file.
        map_location: device (or device string) for the tensors; default CPU.
        strict: as in ``load_state_dict``; default the module's ``strict_loading``.
        weights_only: False allows values stored pickled (``unsafe_values="pickle"``).
        kwargs: hyper-parameters overriding the saved ones.

    Raises:
        CheckpointNotFoundError: ``checkpoint_path`` is neither a file nor a committed checkpoint.
        CheckpointCorruptError: a file fails verification.
        UnsafeCheckpointError: pickled values and ``weights_only`` is not False.
    """
    path = Path(checkpoint_path)
    if path.is_file():
        return cls.load_from_checkpoint(path, map_location=map_location, strict=strict, weights_only=weights_only,
                                        **kwargs)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} does not exist")
    checkpoint = load_checkpoint_dir([path], manager=None, verify=True, allow_pickle=weights_only is False,
                                     map_location=map_location)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
    return _compat.load_module_state(cls, checkpoint, strict=strict, **kwargs)


def _check_optimizer(index: int, optimizer: Any, saved: Any, *, allow_cast: bool, where: str) -> list[str]:
    """Groups, parameter counts and state tensors (shape, dtype) of one plain optimizer state."""
    live = optimizer.state_dict()
    sizes = [len(g.get("params", ())) for g in saved.get("param_groups", ())] if isinstance(saved, dict) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or [len(g["params"]) for g in live["param_groups"]] != sizes:
        raise StateMismatchError(f"{where}: optimizer {index}'s parameter groups do not match the checkpoint's")
    casts = []
    for pid, entries in saved.get("state", {}).items():
        for name, value in entries.items():
            now = live["state"].get(pid, {}).get(name)
            if not isinstance(value, torch.Tensor) or not isinstance(now, torch.Tensor):
                continue
            key = f"optimizer_states.{index}.state.{pid}.{name}"
            if value.shape != now.shape:
                raise StateMismatchError(f"{where}: {key}: checkpoint {tuple(value.shape)} vs live {tuple(now.shape)}")
            if value.dtype != now.dtype:
                if not allow_cast:
                    raise StateMismatchError(f"{where}: {key}: checkpoint {value.dtype}, live {now.dtype} (restore "
                                             "never casts silently; AsyncDCPCheckpointIO(allow_cast=True) casts)")
                casts.append(f"{key}: checkpoint {value.dtype}, live {now.dtype}")
    return casts


def check_against_live(checkpoint: dict[str, Any], module: torch.nn.Module, optimizers: Sequence[Any], *,
                       strict: bool, allow_cast: bool, where: str) -> None:
    """Check that Lightning can load ``checkpoint`` into ``module`` and ``optimizers`` without a partial write or cast.

    ``nn.Module.load_state_dict`` copies every matching tensor before it reports a mismatch, and it
    and ``Optimizer.load_state_dict`` cast to the live dtype silently; this runs first.

    Raises:
        StateMismatchError: missing/unexpected keys (strict), shape differences, dtype differences
            (without ``allow_cast``), or optimizers that do not match their saved state.
    """
    saved, live = checkpoint.get("state_dict", {}), module.state_dict()
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
            raise StateMismatchError(f"{where}: checkpoint holds {len(states) if isinstance(states, list) else 'no'} "
                                     f"optimizer states, this run has {len(optimizers)} optimizers")
        for i, (opt, osd) in enumerate(zip(optimizers, states)):
            casts += _check_optimizer(i, opt, osd, allow_cast=allow_cast, where=where)
    for line in casts:
        log.warning("%s: casting %s (allow_cast=True)", where, line)
