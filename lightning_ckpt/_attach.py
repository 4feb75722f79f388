"""Attaching :class:`~lightning_ckpt.AsyncDCPCheckpointIO` to a trainer: the per-strategy mechanism.

Lightning calls a ``CheckpointIO`` on rank 0 only, and its FSDP and ModelParallel strategies do not
call it at all (they write DCP themselves, synchronously). :func:`attach` therefore replaces, on
this trainer's strategy *instance* only (no class is patched), the methods that save, remove, load
and tear down, so that every rank takes part in every save through the core:

* single device and DDP (``ddp``, ``ddp_spawn``, ``ddp_fork``): ``save_checkpoint`` and
  ``remove_checkpoint`` call the plugin on every rank. Replicated tensors are written once (DCP
  deduplication); each rank's loop progress and callback states (RNG) are stored per rank. Loading
  one of our directories checks the model's and optimizers' keys, shapes and dtypes against the
  checkpoint before Lightning writes anything (no partial load, no silent cast).
* ModelParallel (FSDP2, tensor parallel) and FSDP (FSDP1, CUDA only; ``state_dict_type="sharded"``):
  additionally the model and optimizer state come from ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` as DTensor shards (no CPU-offload copy), every rank writes its own
  shards, and loading one of our directories while fitting is an in-place, resharding DCP load
  (full tensors then sharded, for validate/test). For ModelParallel the optimizer state comes from
  ``optimizer.state_dict()`` (no zero-gradient initialising step) and the load is the core's checked,
  staged restore (nothing is written unless every check and read succeeded; no silent casts).
  FSDP1 keeps DCP's optimizer functions, which initialise an optimizer that has no state yet.
  ``teardown`` also tears the plugin down (the ModelParallel strategy's own teardown skips it).

It also defers two things Lightning does right after a save returns, until the checkpoint is
committed: ``ModelCheckpoint(save_last="link")`` links, and loggers' ``after_save_checkpoint``
(checkpoint uploads), so neither ever sees a checkpoint that is still being written.
Plain ``.ckpt`` files and Lightning's own sharded directories still load through the strategy's
original method. These wrappers use Lightning 2.6 internals (``ModelCheckpoint._link_checkpoint``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from torch_ckpt import ConfigError
from torch_ckpt.layout import rank_file_name

__all__ = ["attach", "sharded_kind"]

log = logging.getLogger(__name__)
_MARK = "_lightning_ckpt_io"


def sharded_kind(strategy: Any) -> str | None:
    """``"fsdp"``, ``"model_parallel"`` or None (the strategy saves through ``CheckpointIO``).

    Raises:
        ConfigError: a sharded strategy configured to gather a full state dict on rank 0.
    """
    if isinstance(strategy, ModelParallelStrategy):
        if not strategy._save_distributed_checkpoint:
            raise ConfigError("AsyncDCPCheckpointIO writes sharded checkpoints (every rank its shards): use "
                              "ModelParallelStrategy(save_distributed_checkpoint=True)")
        return "model_parallel"
    if isinstance(strategy, FSDPStrategy):
        if strategy._state_dict_type != "sharded":
            raise ConfigError("AsyncDCPCheckpointIO writes sharded checkpoints (every rank its shards): use "
                              "FSDPStrategy(state_dict_type='sharded')")
        return "fsdp"
    return None


def attach(io: Any, trainer: Any) -> None:
    """Install the wrappers described in the module docstring on ``trainer`` (idempotent; every rank).

    Raises:
        ConfigError: ``io`` is not the trainer's checkpoint IO, or the strategy is misconfigured.
    """
    strategy = trainer.strategy
    if strategy.checkpoint_io is not io:
        raise ConfigError("this AsyncDCPCheckpointIO is not the trainer's checkpoint IO: pass it as "
                          "Trainer(plugins=[AsyncDCPCheckpointIO(...)])")
    if getattr(strategy, _MARK, None) is io:
        io._set_collective()  # a new fit on the same trainer
        return
    kind = sharded_kind(strategy)
    original_load, original_teardown = strategy.load_checkpoint, strategy.teardown

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        io.save_checkpoint(checkpoint, strategy.broadcast(filepath), storage_options)

    def remove_checkpoint(filepath: Any) -> None:
        io.remove_checkpoint(filepath)

    def teardown() -> None:
        try:
            original_teardown()
        finally:
            io.teardown()  # idempotent; the sharded strategies' teardown does not call it

    strategy.save_checkpoint = save_checkpoint
    strategy.remove_checkpoint = remove_checkpoint
    strategy.teardown = teardown
    if kind is not None:
        _attach_sharded(io, trainer, original_load)
    else:
        _attach_checked_load(io, trainer, original_load)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            _defer_links(io, callback)
    for logger in trainer.loggers:
        _defer_after_save(io, logger)
    io._set_collective()
    setattr(strategy, _MARK, io)


def _defer_links(io: Any, callback: ModelCheckpoint) -> None:
    if not hasattr(callback, "_link_checkpoint"):
        log.warning("ModelCheckpoint has no _link_checkpoint (Lightning changed): save_last='link' links are not "
                    "deferred until the checkpoint is committed")
        return

    def link(trainer: Any, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and Path(filepath).absolute() != Path(linkpath).absolute():
            io._link_when_committed(filepath, linkpath)
        trainer.strategy.barrier()

    callback._link_checkpoint = link  # instance attribute: replaces the staticmethod for this callback only


def _defer_after_save(io: Any, logger: Any) -> None:
    original = logger.after_save_checkpoint
    if getattr(original, _MARK, False):
        return

    def after_save_checkpoint(checkpoint_callback: Any) -> None:
        io._call_when_committed(lambda: original(checkpoint_callback))

    setattr(after_save_checkpoint, _MARK, True)
    logger.after_save_checkpoint = after_save_checkpoint


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)


def _attach_checked_load(io: Any, trainer: Any, original_load: Any) -> None:
    """Check a loaded directory against the live module and optimizers before Lightning writes into them."""
    from lightning_ckpt._load import check_against_live

    strategy = trainer.strategy

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = original_load(checkpoint_path, weights_only=weights_only)
        if io.is_checkpoint_dir(checkpoint_path):
            fitting = trainer.state.fn == TrainerFn.FITTING
            check_against_live(checkpoint, strategy.lightning_module,
                               [_unwrap(o) for o in strategy.optimizers] if fitting else [],
                               strict=strategy.lightning_module.strict_loading,
                               allow_cast=getattr(io, "allow_cast", False), where=str(checkpoint_path))
        return checkpoint

    strategy.load_checkpoint = load_checkpoint


def _attach_sharded(io: Any, trainer: Any, original_load: Any) -> None:
    """Sharded state for saving, and in-place resharding loads of our directories."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    from torch_ckpt.optim_state import optimizer_state as core_optimizer_state

    strategy = trainer.strategy
    kind = sharded_kind(strategy)

    def lightning_module_state_dict() -> dict[str, Any]:
        return get_model_state_dict(strategy.model)

    def optimizer_state(optimizer: Any) -> dict[str, Any]:
        if kind == "model_parallel":  # from optimizer.state_dict(): never steps an optimizer without state
            return core_optimizer_state(strategy.model, [_unwrap(optimizer)])
        return get_optimizer_state_dict(strategy.model, _unwrap(optimizer))  # FSDP1: flat state needs DCP

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(strategy.broadcast(checkpoint_path))
        if not io.is_checkpoint_dir(path):
            return original_load(checkpoint_path, weights_only=weights_only)
        strict = strategy.lightning_module.strict_loading
        optimizers = [_unwrap(o) for o in strategy.optimizers]
        if trainer.state.fn == TrainerFn.FITTING and optimizers:
            return _load_sharded_in_place(io, path, strategy.model, optimizers, strict=strict,
                                          weights_only=weights_only, fsdp1=kind == "fsdp")
        # evaluation: full tensors on every rank, then sharded into the model
        checkpoint = io.load_checkpoint(path, weights_only=weights_only)
        set_model_state_dict(strategy.model, checkpoint["state_dict"],
                             options=StateDictOptions(full_state_dict=True, strict=strict))
        return checkpoint

    strategy.lightning_module_state_dict = lightning_module_state_dict
    strategy.optimizer_state = optimizer_state
    strategy.load_checkpoint = load_checkpoint


class _ShardedTarget:
    """The live sharded model/optimizers as the core's load target (DCP loads into them in place)."""

    rank_local_keys: tuple[str, ...] = ()  # a different world size loads rank 0's loop/callback states

    def __init__(self, model: Any, optimizers: list, top_keys: list[str], *, strict: bool) -> None:
        self._model, self._optimizers, self._top_keys, self._strict = model, optimizers, top_keys, strict
        self.loaded: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {k: None for k in self._top_keys}
        state["state_dict"] = get_model_state_dict(self._model)
        state["optimizer_states"] = [get_optimizer_state_dict(self._model, o) for o in self._optimizers]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(self._model, state["state_dict"], options=StateDictOptions(strict=self._strict))
        for optimizer, optim_state in zip(self._optimizers, state["optimizer_states"], strict=True):
            set_optimizer_state_dict(self._model, optimizer, optim_state)
        self.loaded = dict(state)


class _Fsdp2Target(_ShardedTarget):
    """The ModelParallel (FSDP2/TP) load target: the core's checked, staged restore (see ``load_into``).

    Optimizer state is read from ``optimizer.state_dict()`` (never a zero-gradient step) and may be
    absent on either side; nothing is written before every check and every read succeeded, and a
    dtype difference is refused unless the plugin allows casts.
    """

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from torch_ckpt.optim_state import optimizer_state

        state: dict[str, Any] = {k: None for k in self._top_keys}
        state["state_dict"] = get_model_state_dict(self._model)
        state["optimizer_states"] = [optimizer_state(self._model, [o]) for o in self._optimizers]
        return state

    def _optim_key(self, key: str) -> tuple[int, str, str] | None:
        from torch_ckpt.optim_state import param_names, split_state_key

        if not key.startswith("optimizer_states."):
            return None
        if getattr(self, "_names", None) is None:
            self._names = set(param_names(self._model).values())
        for i in range(len(self._optimizers)):
            parts = split_state_key(key, f"optimizer_states.{i}.", self._names)
            if parts is not None:
                return i, *parts
        return None

    def load_optional_key(self, key: str) -> bool:
        """Optimizer-state tensors may exist on one side only (a fresh optimizer has none)."""
        return self._optim_key(key) is not None

    def load_target(self, key: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new tensor, sharded and placed like the optimizer keeps it, for an optimizer-state key."""
        from torch_ckpt.optim_state import state_target

        parts = self._optim_key(key)
        if parts is None:
            return None
        i, name, entry = parts
        return state_target(self._model, [self._optimizers[i]], name, entry, shape, dtype)

    def check_load(self, state: dict[str, Any], *, allow_cast: bool = False) -> list[str]:
        """Check the optimizer parameter groups, state and dtypes against the live optimizers; change nothing."""
        from torch_ckpt import StateMismatchError
        from torch_ckpt.optim_state import check_optimizer_state

        saved = state.get("optimizer_states")
        if not isinstance(saved, list) or len(saved) != len(self._optimizers):
            raise StateMismatchError(f"checkpoint holds {len(saved) if isinstance(saved, list) else 'no'} optimizer "
                                     f"states, this run has {len(self._optimizers)} optimizers")
        casts: list[str] = []
        for i, (optimizer, osd) in enumerate(zip(self._optimizers, saved)):
            casts += check_optimizer_state(self._model, [optimizer], osd, prefix=f"optimizer_states.{i}.",
                                           allow_cast=allow_cast)
        self._allow_cast = allow_cast
        return casts

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install the optimizer states, then copy the (checked, fully read) parameters in place."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from torch_ckpt.optim_state import apply_optimizer_state, keep_live_tensors
        from torch_ckpt.restore import copy_into_live

        self.check_load(state, allow_cast=getattr(self, "_allow_cast", False))
        undo = []
        try:
            for optimizer, osd in zip(self._optimizers, state["optimizer_states"]):
                undo.append((optimizer, optimizer.state, optimizer.param_groups))
                apply_optimizer_state(self._model, [optimizer], osd)
        except BaseException:
            for optimizer, old_state, old_groups in reversed(undo):
                optimizer.state, optimizer.param_groups = old_state, old_groups
            raise
        for optimizer, old_state, _groups in undo:
            keep_live_tensors(optimizer, old_state)
        copy_into_live(get_model_state_dict(self._model), state["state_dict"])
        self.loaded = dict(state)


def _load_sharded_in_place(io: Any, path: Path, model: Any, optimizers: list, *, strict: bool,
                           weights_only: bool | None, fsdp1: bool = False) -> dict[str, Any]:
    from torch.distributed import get_rank

    from lightning_ckpt._values import decode_values

    tree = json.loads((path / rank_file_name(0)).read_bytes())["tree"]
    target = (_ShardedTarget if fsdp1 else _Fsdp2Target)(model, optimizers, list(tree), strict=strict)
    io.checkpointer().load(path, target, verify=io.verify_on_load, allow_cast=getattr(io, "allow_cast", False))
    log.info("[rank %d] loaded %s in place (sharded)", get_rank(), path)
    return decode_values(target.loaded, allow_pickle=weights_only is False)
