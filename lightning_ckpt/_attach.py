"""Attaching :class:`~lightning_ckpt.AsyncDCPCheckpointIO` so every rank takes part in every save.

Lightning calls a ``CheckpointIO`` on rank 0 only (FSDP/ModelParallel not at all): :func:`attach` replaces save,
remove, load and teardown on the trainer's strategy *instance*. Single device/DDP: a load is checked against the
live model first. ModelParallel and sharded FSDP: model and optimizer state go through
:class:`torch_ckpt.TrainState` (while fitting, a checked all-or-nothing load in place; evaluation: full tensors).
Before ``fit`` it registers a picklable callback attaching at ``setup`` in every worker (``ddp_spawn``); loggers'
``after_save_checkpoint`` waits for commits.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_ckpt import _compat
from lightning_ckpt._load import decode_values, is_url
from torch_ckpt import ConfigError, TrainState

_MARK = "_lightning_ckpt_io"


def sharded(strategy: Any) -> bool:
    """True for strategies whose state is sharded (ModelParallel, FSDP).

    Raises:
        ConfigError: a sharded strategy configured to gather a full state dict on rank 0.
    """
    distributed, dict_type = _compat.sharded_flags(strategy)
    fix = None
    if isinstance(strategy, ModelParallelStrategy) and not distributed:
        fix = "ModelParallelStrategy(save_distributed_checkpoint=True)"
    if isinstance(strategy, FSDPStrategy) and dict_type != "sharded":
        fix = "FSDPStrategy(state_dict_type='sharded')"
    if fix:
        raise ConfigError(f"AsyncDCPCheckpointIO writes sharded checkpoints (every rank its shards): use {fix}")
    return isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))


class _AttachAtSetup(Callback):
    """Installs the wrappers inside ``fit``/``validate``... on every rank (picklable for ``ddp_spawn``)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        attach(trainer.strategy.checkpoint_io, trainer)


def attach(io: Any, trainer: Any) -> None:
    """Install the wrappers described in the module docstring on ``trainer`` (idempotent; every rank).

    Raises:
        ConfigError: ``io`` is not the trainer's checkpoint IO, or the strategy is misconfigured.
    """
    strategy = trainer.strategy
    if strategy.checkpoint_io is not io:
        raise ConfigError("this AsyncDCPCheckpointIO is not the trainer's checkpoint IO: pass it as "
                          "Trainer(plugins=[AsyncDCPCheckpointIO(...)])")
    is_sharded = sharded(strategy)
    if trainer.state.status != TrainerStatus.RUNNING:  # before fit: install at setup, in every worker
        if not any(isinstance(cb, _AttachAtSetup) for cb in trainer.callbacks):
            trainer.callbacks.insert(0, _AttachAtSetup())
        return
    io.start_fit()
    if getattr(strategy, _MARK, None) is io:
        return
    if names := _compat.uploading_loggers(trainer):
        raise ConfigError(f"{', '.join(names)} with log_model uploads checkpoint files only (Path.is_file()), and "
                          "AsyncDCPCheckpointIO writes directories: no checkpoint would be uploaded. Pass "
                          "log_model=False and upload the checkpoint directories yourself (docs/lightning.md)")
    # module-level functions bound by functools.partial, never closures: an attached trainer still pickles
    original_load = partial(type(strategy).load_checkpoint, strategy)
    original_teardown = partial(type(strategy).teardown, strategy)
    strategy.save_checkpoint = partial(_save_checkpoint, io, strategy)
    strategy.remove_checkpoint = io.remove_checkpoint
    strategy.teardown = partial(_teardown, io, original_teardown)
    strategy.load_checkpoint = partial(_load_checkpoint, io, trainer, original_load, is_sharded)
    if is_sharded:
        strategy.lightning_module_state_dict = partial(_sharded_module_state, strategy)
        strategy.optimizer_state = partial(_sharded_optimizer_state, strategy)
    for logger in trainer.loggers:
        _defer_after_save(io, logger)
    setattr(strategy, _MARK, io)


def _save_checkpoint(io: Any, strategy: Any, checkpoint: dict[str, Any], filepath: Any,
                     storage_options: Any = None) -> None:
    io.save_checkpoint(checkpoint, strategy.broadcast(filepath), storage_options)


def _teardown(io: Any, original_teardown: Any) -> None:
    try:
        original_teardown()
    finally:
        io.teardown()  # idempotent; the sharded strategies' teardown does not call it


def _optimizers(strategy: Any) -> list:
    return [_compat.unwrap_optimizer(o) for o in strategy.optimizers]


def _sharded_module_state(strategy: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(strategy.model)


def _sharded_optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    return TrainState(model=strategy.model, optimizer=[_compat.unwrap_optimizer(optimizer)],
                      rng=False).state_dict()["optimizer"]


def _load_checkpoint(io: Any, trainer: Any, original_load: Any, is_sharded: bool, checkpoint_path: Any,
                     weights_only: bool | None = None) -> dict[str, Any]:
    strategy = trainer.strategy
    checkpoint_path = strategy.broadcast(checkpoint_path)
    if is_url(os.fspath(checkpoint_path)):  # fsspec URL: downloaded and read by every rank (never a Path)
        return io.load_checkpoint(checkpoint_path, weights_only=weights_only)
    path = Path(checkpoint_path)
    io.wait_for_path(path)
    if not path.is_dir():  # a committed checkpoint is a directory
        return original_load(checkpoint_path, weights_only=weights_only)
    fitting = trainer.state.fn == TrainerFn.FITTING
    module = strategy.lightning_module
    if is_sharded and fitting and _optimizers(strategy):
        candidates = io.fallbacks.pop(str(path.absolute()), [path])
        target = _ShardedTarget(strategy.model, _optimizers(strategy))
        io.manager(path.parent).restore(target, path=candidates, allow_cast=io.allow_cast)
        return decode_values(target.loaded, allow_pickle=weights_only is False)
    # DDP/single device restore before the optimizers exist: only the model is checked (by the core)
    live = None if is_sharded else {"state_dict": module.state_dict()}
    checkpoint = io.load_checkpoint(path, weights_only=weights_only, live=live, strict=module.strict_loading)
    if is_sharded:  # evaluation: full tensors on every rank, then sharded into the model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(strategy.model, checkpoint["state_dict"],
                             options=StateDictOptions(full_state_dict=True, strict=module.strict_loading))
    return checkpoint


def _defer_after_save(io: Any, logger: Any) -> None:
    if not getattr(logger.after_save_checkpoint, _MARK, False):
        logger.after_save_checkpoint = partial(_after_save_checkpoint, io, logger.after_save_checkpoint)
        setattr(logger.after_save_checkpoint, _MARK, True)


def _after_save_checkpoint(io: Any, original: Any, checkpoint_callback: Any) -> None:
    io.call_when_committed(partial(original, checkpoint_callback))


class _ShardedTarget:
    """The live sharded model and optimizers as the core's load target (one :class:`torch_ckpt.TrainState`
    per optimizer; nothing is written before every check and read succeeded); other values are read as is."""

    rank_local_keys: tuple[str, ...] = ()  # loops and callbacks of rank 0 (the same on every rank here)

    def __init__(self, model: Any, optimizers: list) -> None:
        self._states = [TrainState(model=model, optimizer=[o], rng=False) for o in optimizers]
        self.loaded: dict[str, Any] = {}

    def _route(self, key: str) -> tuple[TrainState, str] | None:
        if key.startswith("optimizer_states."):
            index, _, rest = key.removeprefix("optimizer_states.").partition(".")
            return self._states[int(index)], f"optimizer.{rest}"
        return None

    def state_dict(self) -> dict[str, Any]:
        sections = [s.state_dict() for s in self._states]
        return {"state_dict": sections[0]["model"], "optimizer_states": [s["optimizer"] for s in sections]}

    def load_optional_key(self, key: str) -> bool:
        route = self._route(key)
        return route[0].load_optional_key(route[1]) if route else not key.startswith("state_dict.")

    def load_target(self, key: str, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        route = self._route(key)
        if route is not None:
            return route[0].load_target(route[1], shape, dtype)
        return None if key.startswith("state_dict.") else torch.empty(shape, dtype=dtype)

    def _sections(self, state: dict[str, Any], i: int) -> dict[str, Any]:
        saved = state.get("optimizer_states")
        if not isinstance(saved, list) or len(saved) != len(self._states):
            raise ConfigError(f"checkpoint holds {len(saved) if isinstance(saved, list) else 'no'} optimizer states, "
                              f"this run has {len(self._states)} optimizers")
        return {"model": state["state_dict"], "optimizer": saved[i]}

    def check_load(self, state: dict[str, Any], *, allow_cast: bool = False) -> list[str]:
        """Check every optimizer's groups, state and dtypes against the live ones; change nothing."""
        return [c for i, s in enumerate(self._states) for c in s.check_load(self._sections(state, i),
                                                                              allow_cast=allow_cast)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install every optimizer's state and the (checked, fully read) parameters, in place."""
        for i, s in enumerate(self._states):
            s.load_state_dict(self._sections(state, i))
        self.loaded = dict(state)
