"""``AcceleratorTrainState``: everything ``Accelerator.save_state`` covers, as one torch-ckpt state."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, cast

import torch

from accelerate_ckpt import _compat as compat
from torch_ckpt import OptimizerState, StateMismatchError, TrainState, TypedValues

_VALUES = TypedValues("error", plain_dicts=False)  # custom objects' paths, enums, dataclasses... stored pickle-free


class _DataLoaders:
    """Every prepared dataloader's epoch and, for stateful loaders, its ``state_dict()``."""

    def __init__(self, loaders: Sequence[Any]) -> None:
        self.loaders = list(loaders)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): compat.loader_state(dl) for i, dl in enumerate(self.loaders)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for i, dl in enumerate(self.loaders):
            compat.load_loader_state(dl, state[str(i)])


class AcceleratorTrainState:
    """The complete state of an ``Accelerator`` run (keys in ``docs/accelerate.md``, "What a checkpoint holds").

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved or loaded.
        step: the training step to record (None: unknown; kept apart from the save iteration).
        save_iteration: the value ``accelerator.save_iteration`` should have after restoring.
        skip_models: indices of the prepared models that a user save/load hook handles itself.

    Raises:
        ConfigError: an object cannot be checkpointed (no ``state_dict``) or is of an unsupported kind.
    """

    rank_local_keys: tuple[str, ...] = ("rng", "dataloader")
    # models and optimizers: one tensor for the job (DCP); the rest (custom objects...) per rank
    replicated_keys: tuple[str, ...] = ("model", "optimizer", "optimizers_plain")

    def __init__(self, accelerator: Any, *, step: int | None = None, save_iteration: int = 0,
                 skip_models: Sequence[int] = ()) -> None:
        self._acc = accelerator
        models = {str(i): m for i, m in enumerate(compat.prepared(accelerator, "models")) if i not in set(skip_models)}
        owner_of = {id(p): name for name, m in models.items() for p in m.parameters()}
        by_model: dict[str, list[torch.optim.Optimizer]] = {name: [] for name in models}
        plain: list[torch.optim.Optimizer] = []
        for opt in compat.prepared(accelerator, "optimizers"):
            inner = getattr(opt, "optimizer", opt)  # the torch optimizer inside Accelerate's AcceleratedOptimizer
            owners = {owner_of.get(id(p)) for g in inner.param_groups for p in g["params"]}
            if len(owners) == 1 and None not in owners:
                by_model[cast(str, owners.pop())].append(inner)
            else:  # spans several models, or a model a user hook saves: keep its own state_dict()
                plain.append(inner)
        self._plain = [OptimizerState(opt, name=f"optimizers_plain.{j}") for j, opt in enumerate(plain)]
        self._loaders = compat.prepared(accelerator, "dataloaders")
        self._custom = compat.prepared(accelerator, "custom_objects")
        scaler = accelerator.scaler
        self._train = TrainState(
            model=models or None, optimizer=by_model if models else None,
            scheduler=compat.prepared(accelerator, "schedulers"),
            scaler=scaler if scaler is not None and scaler.is_enabled() else None,
            dataloader=_DataLoaders(self._loaders), step=0 if step is None else step)
        self._allow_cast = False
        self.training_step = step
        self._save_iteration = int(save_iteration)

    def state_dict(self) -> dict[str, Any]:
        """The nested state (live tensors, not copies)."""
        sd = self._train.state_dict()
        sd["optimizers_plain"] = {str(j): opt.state_dict() for j, opt in enumerate(self._plain)}
        sd["custom"] = {str(k): _VALUES.encode(obj.state_dict(), f"custom.{k}") for k, obj in enumerate(self._custom)}
        sd["accelerate"] = {"step": int(self._acc.step), "save_iteration": self._save_iteration,
                            "training_step": self.training_step}
        return sd

    def _route(self, method: str, key: str, *args: Any) -> Any:  # optimizers_plain.<j>.<rest> to optimizer j
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[0] == "optimizers_plain" and parts[1].isdigit() and int(parts[1]) < len(
                self._plain):
            return getattr(self._plain[int(parts[1])], method)(parts[2], *args)
        return getattr(self._train, method)(key, *args)

    def load_optional_key(self, key: str) -> bool:
        """True for optimizer-state tensors (a fresh optimizer has none yet)."""
        return self._route("load_optional_key", key)

    def load_target(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new tensor, placed where its optimizer keeps it, for an optimizer-state key; None otherwise."""
        return self._route("load_target", key, shape, dtype)

    def check_load(self, state: Mapping[str, Any], *, allow_cast: bool = False) -> list[str]:
        """Check everything :meth:`load_state_dict` will load (tensors may be meta tensors); change nothing; return
        the optimizer-state keys that will be cast. StateMismatchError: other objects, groups or dtypes than saved."""
        for key, what, live in (("optimizers_plain", "optimizers outside the models' DCP state, this run has",
                                 self._plain),
                                ("custom", "objects registered with register_for_checkpointing, this run registered",
                                 self._custom),
                                ("dataloader", "dataloader positions, this run prepared", self._loaders)):
            if len(state.get(key, {})) != len(live):
                raise StateMismatchError(f"checkpoint holds {len(state.get(key, {}))} {what} {len(live)}; "
                                         "prepare and register the same objects as the saved run")
        self._allow_cast = bool(allow_cast)  # the load_state_dict() that follows applies these casts
        casts = self._train.check_load(state, allow_cast=allow_cast)
        for j, opt in enumerate(self._plain):
            casts += opt.check_load(state["optimizers_plain"][str(j)], allow_cast=allow_cast)
        return casts

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load in place, all or nothing; set ``accelerator.step`` and the save iteration (raises as check_load)."""
        self.check_load(state, allow_cast=self._allow_cast)  # cheap; load_into checked with meta tensors
        undo: list = []
        try:
            for j, opt in enumerate(self._plain):
                opt.load_state_dict(state["optimizers_plain"][str(j)])
                undo.append(opt.undo)
            for k, obj in enumerate(self._custom):
                undo.append(partial(obj.load_state_dict, copy.deepcopy(obj.state_dict())))
                obj.load_state_dict(_VALUES.decode(state["custom"][str(k)]))
            self._train.load_state_dict(state)  # undoes its own components when one of them fails
        except BaseException:
            for fn in reversed(undo):
                fn()
            raise
        for opt in self._plain:
            opt.keep_live()
        saved = state.get("accelerate", {})
        self._save_iteration = int(saved.get("save_iteration", 0))
        self.training_step = saved.get("training_step", self._train.step)
        self._acc.step = int(saved.get("step", 0))
        compat.set_save_iteration(self._acc, self._save_iteration)

    def optimizer_owned_keys(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """Keys only ``optimizer.step()`` mutates (parameters and optimizer state); see ``overlap_staging``."""
        return self._train.optimizer_owned_keys(tensors) | {k for k in tensors if k.startswith("optimizers_plain.")}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer of the state (the checkpointer waits for staging before their next step)."""
        return self._train.optimizers() + [opt.optimizer for opt in self._plain]
