"""Reading torch-ckpt directories back as the dict Lightning expects (plugin, ``pl_load``, ``load_from_checkpoint``)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ckpt._values import RANK_LOCAL_KEYS, decode_values
from torch_ckpt import CheckpointNotFoundError, is_committed, load_full_state, rank_and_world, read_manifest

__all__ = ["is_remote_checkpoint", "load_checkpoint_dir", "load_from_checkpoint", "read_for_lightning"]

log = logging.getLogger(__name__)


class _AllValues:
    """A load target reading every value (this rank's rank-local ones) into new tensors, after the core
    checked the checkpoint against ``live`` (the live model: keys when ``strict``, shapes, dtypes)."""

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


def load_checkpoint_dir(candidates: Sequence[Path], *, manager: Any, verify: bool, allow_pickle: bool,
                        map_location: Any = None, live: dict[str, Any] | None = None, strict: bool = True,
                        allow_cast: bool = False) -> dict[str, Any]:
    """Load the first intact checkpoint of ``candidates`` (newest first) as Lightning's checkpoint dict.

    With ``manager`` (attached: every rank calls this), a candidate that fails verification is skipped
    with a warning when another follows, the checkpoint is checked against ``live`` first (see
    ``_AllValues``), and each rank gets its own loop progress and callback states; without, rank 0's.

    Raises:
        CheckpointNotFoundError: the last candidate is not a committed checkpoint.
        CheckpointCorruptError: the last candidate fails verification.
        UnsafeCheckpointError: pickled values and ``allow_pickle`` is False.
        TypeError: ``map_location`` names no device.
    """
    if skipped := [str(p) for p in candidates[:-1] if not is_committed(p)]:
        log.warning("checkpoints %s are not intact; falling back to older ones", skipped)
    candidates = [p for p in candidates[:-1] if is_committed(p)] + [Path(candidates[-1])]
    if not is_committed(candidates[0]) and not (Path(candidates[0]) / "manifest.json").is_file():
        raise CheckpointNotFoundError(f"{candidates[0]} is a directory but not a committed torch-ckpt checkpoint (no "
                                      "manifest.json); was it written by another CheckpointIO?")
    if manager is not None:
        saved, world = read_manifest(candidates[0]).world_size, rank_and_world()[1]
        if saved != world:
            rank_zero_warn(f"{candidates[0]} was saved by {saved} ranks and is loaded by {world}: every rank "
                           "restores rank 0's loop progress and callback states (RNG included)")
        target = _AllValues(RANK_LOCAL_KEYS if saved == world else (), live, strict=strict)
        manager.restore(target, path=list(candidates), allow_cast=allow_cast)
        state = target.loaded
    else:  # one process reading alone (not attached: no fallback candidates); rank 0's rank-local values
        state, _ = load_full_state(candidates[0], verify=verify)
        state.pop("per_rank", None)
    state = decode_values(state, allow_pickle=allow_pickle)
    device = _device(map_location, candidates[0])
    return state if device is None else move_data_to_device(state, device)


def _device(map_location: Any, path: Path) -> torch.device | None:
    """The device ``torch.load``'s ``map_location`` (device, string, dict or callable) gives tensors saved on
    the CPU (location ``"cpu"``: every tensor is read into CPU memory first); None: leave them there."""
    if callable(map_location):
        mapped = map_location(torch.empty(0).untyped_storage(), "cpu")
        map_location = None if mapped is None else mapped.device
    elif isinstance(map_location, dict):
        map_location = map_location.get("cpu")
    if map_location is None:
        return None
    try:
        device = torch.device(map_location)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"map_location for {path} names no device: {map_location!r}") from exc
    return None if device.type == "cpu" else device


def read_for_lightning(path: str, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    """Lightning's own loader (``pl_load``) on a torch-ckpt directory or URL: the dict the plugin's
    ``load_checkpoint`` returns (verified, nothing unpickled unless ``weights_only=False``; a URL is
    downloaded into a temporary directory first)."""
    from lightning_ckpt._remote import RemoteCheckpoints, is_url

    if not is_url(path):
        return load_checkpoint_dir([Path(path)], manager=None, verify=True, allow_pickle=weights_only is False,
                                   map_location=map_location)
    local = RemoteCheckpoints().download(path)
    try:
        return load_checkpoint_dir([local], manager=None, verify=True, allow_pickle=weights_only is False,
                                   map_location=map_location)
    finally:
        shutil.rmtree(local.parent, ignore_errors=True)


def is_remote_checkpoint(url: str) -> bool:
    """True when the fsspec URL ``url`` holds a torch-ckpt checkpoint (its ``manifest.json``); False for an
    unknown protocol or an unreachable store (Lightning's loader then reports the error)."""
    from lightning_ckpt._remote import RemoteCheckpoints, is_url

    try:
        return is_url(url) and RemoteCheckpoints().is_checkpoint(url)
    except Exception:  # noqa: BLE001 - not ours to report: Lightning's own loader tries the URL next
        return False


def load_from_checkpoint(cls: type, checkpoint_path: str | Path, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for a torch-ckpt directory or a ``.ckpt`` file.

    Importing :mod:`lightning_ckpt` already lets Lightning's own method read our directories (see
    ``docs/lightning.md``); this function adds a clear error for a missing path. ``kwargs`` are those of
    Lightning's method (``map_location``, ``strict``, ``weights_only``: False allows values stored
    pickled, hyper-parameters overriding the saved ones).

    Raises:
        CheckpointNotFoundError: ``checkpoint_path`` does not exist.
        CheckpointCorruptError: a file fails verification.
        UnsafeCheckpointError: pickled values and ``weights_only`` is not False.
    """
    from lightning_ckpt._remote import is_url

    if not is_url(str(checkpoint_path)) and not Path(checkpoint_path).exists():
        raise CheckpointNotFoundError(f"{checkpoint_path} does not exist")
    return cls.load_from_checkpoint(checkpoint_path, **kwargs)
