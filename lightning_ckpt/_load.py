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
    is_committed,
    load_full_state,
    read_manifest,
)

__all__ = ["load_checkpoint_dir", "load_from_checkpoint", "world"]

log = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """``(rank, world size)`` of this process; ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllValues:
    """A load target reading every value of a checkpoint (this rank's rank-local ones) into new tensors.

    The core's restore first checks the checkpoint against ``live`` (``{"state_dict": ...}``, the
    live model): keys when ``strict``, shapes and dtypes; nothing is loaded on a mismatch.
    """

    def __init__(self, rank_local: tuple[str, ...], live: dict[str, Any] | None = None, *, strict: bool = True) -> None:
        self.rank_local_keys, self.loaded = rank_local, {}
        self._live, self._strict = live or {}, strict

    def state_dict(self) -> dict[str, Any]:
        return self._live

    def load_optional_key(self, key: str) -> bool:
        return not (self._strict and self._live and key.split(".", 1)[0] == "state_dict")

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
                        map_location: Any = None, live: dict[str, Any] | None = None, strict: bool = True,
                        allow_cast: bool = False) -> dict[str, Any]:
    """Load the first intact checkpoint of ``candidates`` (newest first) as Lightning's checkpoint dict.

    A candidate that fails verification is skipped with a warning naming it when another follows.
    With ``manager`` (attached: every rank calls this) each rank gets its own loop progress and
    callback states, after the checkpoint was checked against ``live`` (see ``_AllValues``); without,
    rank 0's.

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
        target = _AllValues(_rank_local(Path(candidates[0])), live, strict=strict)
        manager.restore(target, path=list(candidates), allow_cast=allow_cast)
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
