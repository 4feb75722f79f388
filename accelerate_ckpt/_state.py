"""``AcceleratorTrainState``: everything ``Accelerator.save_state`` covers, as one torch-ckpt ``Stateful``.

Built fresh for every save and load from the objects the ``Accelerator`` holds:

==============================  ============================================================
key                             contents
==============================  ============================================================
``model.<i>``                   model ``i`` (``accelerator._models``) through DCP's
                                ``get_model_state_dict``: plain, DDP and FSDP2 models give
                                the same, reshardable keys (FSDP1 is refused)
``optimizer.<i>``               the optimizers whose parameters all belong to model ``i``
                                (DCP's layout, keyed by parameter name; read from
                                ``optimizer.state_dict()``, never by a zero-gradient step)
``optimizers_plain.<j>``        any other optimizer ``j`` (its own ``state_dict()``)
``scheduler``                   every prepared LR scheduler
``scaler``                      the ``GradScaler`` (when enabled)
``dataloader`` (per rank)       per prepared dataloader: its epoch (``iteration``) and, for
                                stateful loaders, their ``state_dict()``
``rng`` (per rank)              Python, NumPy, torch CPU and every CUDA/XPU/MPS generator
``custom.<k>``                  objects given to ``register_for_checkpointing``
``step`` / ``accelerate``       the training step, ``accelerator.step`` and the save iteration
==============================  ============================================================
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from accelerate_ckpt import _compat as compat
from torch_ckpt import OptimizerState, StateMismatchError, TrainState

__all__ = ["AcceleratorTrainState"]


def _inner_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or ``opt`` itself)."""
    return getattr(opt, "optimizer", opt)


class _DataLoaders:
    """The position of every prepared dataloader: epoch and, for stateful loaders, the loader state."""

    def __init__(self, loaders: Sequence[Any]) -> None:
        self.loaders = list(loaders)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, dl in enumerate(self.loaders):
            entry: dict[str, Any] = {}
            if compat.loader_epoch(dl) is not None:
                entry["epoch"] = compat.loader_epoch(dl)
            if getattr(dl, "use_stateful_dataloader", False):
                entry["state"] = dl.state_dict()
            out[str(i)] = entry
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for i, dl in enumerate(self.loaders):
            entry = state[str(i)]
            if "epoch" in entry:
                compat.set_loader_epoch(dl, int(entry["epoch"]))
            if "state" in entry:
                compat.set_loader_state(dl, entry["state"])


class AcceleratorTrainState:
    """The complete state of an ``Accelerator`` run (a DCP ``Stateful``; see the module docstring).

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved or loaded.
        step: the training step to record (None: not known; kept apart from the save iteration).
        save_iteration: the value ``accelerator.save_iteration`` should have after restoring.
        skip_models: indices of ``accelerator._models`` a user save/load hook handles itself.

    Raises:
        ConfigError: an object cannot be checkpointed (no ``state_dict``), or a prepared object is
            of a kind this adapter does not support.
    """

    rank_local_keys: tuple[str, ...] = ("rng", "dataloader")

    def __init__(self, accelerator: Any, *, step: int | None = None, save_iteration: int = 0,
                 skip_models: Sequence[int] = ()) -> None:
        self._acc = accelerator
        models = {str(i): m for i, m in enumerate(compat.prepared(accelerator, "models")) if i not in set(skip_models)}
        owner_of = {id(p): name for name, m in models.items() for p in m.parameters()}
        by_model: dict[str, list[torch.optim.Optimizer]] = {name: [] for name in models}
        plain: list[torch.optim.Optimizer] = []
        for opt in compat.prepared(accelerator, "optimizers"):
            inner = _inner_optimizer(opt)
            owners = {owner_of.get(id(p)) for g in inner.param_groups for p in g["params"]}
            if len(owners) == 1 and None not in owners:
                by_model[owners.pop()].append(inner)
            else:  # spans several models, or a model a user hook saves: keep its own state_dict()
                plain.append(inner)
        self._plain = [OptimizerState(opt, name=f"optimizers_plain.{j}") for j, opt in enumerate(plain)]
        self._loaders = compat.prepared(accelerator, "dataloaders")
        self._allow_cast = False
        scaler = accelerator.scaler
        self._train = TrainState(
            model=models or None,
            optimizer=by_model if models else None,
            scheduler=compat.prepared(accelerator, "schedulers"),
            scaler=scaler if scaler is not None and scaler.is_enabled() else None,
            dataloader=_DataLoaders(self._loaders),
            step=0 if step is None else step,
        )
        self._custom = compat.prepared(accelerator, "custom_objects")
        self.training_step = step
        self._save_iteration = int(save_iteration)
        self.accelerate_step = int(accelerator.step)

    @property
    def save_iteration(self) -> int:
        """The save iteration recorded (or restored)."""
        return self._save_iteration

    def state_dict(self) -> dict[str, Any]:
        """The nested state (live tensors, not copies)."""
        sd = self._train.state_dict()
        sd["optimizers_plain"] = {str(j): opt.state_dict() for j, opt in enumerate(self._plain)}
        sd["custom"] = {str(k): obj.state_dict() for k, obj in enumerate(self._custom)}
        sd["accelerate"] = {"step": int(self._acc.step), "save_iteration": self._save_iteration,
                            "training_step": self.training_step}
        return sd

    # -- loading (the protocol of torch_ckpt.restore.load_into) -------------------------------------
    def _plain_key(self, key: str) -> tuple[OptimizerState, str] | None:
        """``(optimizer j, rest of the key)`` for ``optimizers_plain.<j>.<rest>``."""
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "optimizers_plain" or not parts[1].isdigit() or int(parts[1]) >= len(
                self._plain):
            return None
        return self._plain[int(parts[1])], parts[2]

    def load_optional_key(self, key: str) -> bool:
        """True for optimizer-state tensors, which a fresh optimizer does not have yet."""
        plain = self._plain_key(key)
        return plain[0].load_optional_key(plain[1]) if plain else self._train.load_optional_key(key)

    def load_target(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new tensor, placed where its optimizer keeps it, for an optimizer-state key; None otherwise."""
        plain = self._plain_key(key)
        return plain[0].load_target(plain[1], shape, dtype) if plain else self._train.load_target(key, shape, dtype)

    def check_load(self, state: Mapping[str, Any], *, allow_cast: bool = False) -> list[str]:
        """Check everything :meth:`load_state_dict` will load (tensors may be meta tensors); change nothing.

        Returns:
            The optimizer-state keys that will be cast (only with ``allow_cast``).

        Raises:
            StateMismatchError: other optimizers, registered objects, dataloaders, parameter groups or
                dtypes than the checkpoint's.
        """
        plain, custom = state.get("optimizers_plain", {}), state.get("custom", {})
        if len(plain) != len(self._plain):
            raise StateMismatchError(f"checkpoint holds {len(plain)} optimizers outside the models' DCP state, this "
                                     f"run has {len(self._plain)}; prepare the same optimizers as the saved run")
        if len(custom) != len(self._custom):
            raise StateMismatchError(f"checkpoint holds {len(custom)} objects registered with "
                                     f"register_for_checkpointing, this run registered {len(self._custom)}")
        loaders = state.get("dataloader", {})
        if len(loaders) != len(self._loaders):
            raise StateMismatchError(f"checkpoint holds {len(loaders)} dataloader positions, this run prepared "
                                     f"{len(self._loaders)} dataloaders")
        self._allow_cast = bool(allow_cast)  # the load_state_dict() that follows applies these casts
        casts = self._train.check_load(state, allow_cast=allow_cast)
        for j, opt in enumerate(self._plain):
            casts += opt.check_load(plain[str(j)], allow_cast=allow_cast)
        return casts

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load in place and set ``accelerator.step`` and ``accelerator.project_configuration.iteration``.

        Everything is checked first; should a component fail to load, the ones already loaded are
        put back, so a failed load leaves the run as it was.

        Raises:
            StateMismatchError: the checkpoint has a different number of optimizers, registered
                objects or dataloaders.
        """
        self.check_load(state, allow_cast=self._allow_cast)  # cheap; load_into checked with meta tensors
        plain, custom = state["optimizers_plain"], state["custom"]
        undo: list = []
        try:
            for j, opt in enumerate(self._plain):
                opt.load_state_dict(plain[str(j)])
                undo.append(opt.undo)
            for k, obj in enumerate(self._custom):
                undo.append(partial(obj.load_state_dict, copy.deepcopy(obj.state_dict())))
                obj.load_state_dict(custom[str(k)])
            self._train.load_state_dict(state)  # undoes its own components when one of them fails
        except BaseException:
            for fn in reversed(undo):
                fn()
            raise
        for opt in self._plain:
            opt.keep_live()
        acc_state = state.get("accelerate", {})
        self.accelerate_step = int(acc_state.get("step", 0))
        self._save_iteration = int(acc_state.get("save_iteration", 0))
        self.training_step = acc_state.get("training_step", self._train.step)
        self._acc.step = self.accelerate_step
        compat.set_save_iteration(self._acc, self._save_iteration)

    def optimizer_owned_keys(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """Keys only ``optimizer.step()`` mutates (parameters and optimizer state); see ``overlap_staging``."""
        return self._train.optimizer_owned_keys(tensors) | {k for k in tensors if k.startswith("optimizers_plain.")}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer of the state (the checkpointer waits for staging before their next step)."""
        return self._train.optimizers() + [opt.optimizer for opt in self._plain]
