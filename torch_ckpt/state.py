"""``TrainState``: one ``Stateful`` bundle holding the complete state of a training run.

What it captures (the "what to save" table): model(s) and optimizer(s) through
``torch.distributed.checkpoint.state_dict.get_state_dict`` (so DDP, FSDP2 and compiled models
produce the same keys as a plain module), LR scheduler(s), a ``GradScaler``, the dataloader
position (anything with ``state_dict``/``load_state_dict``, e.g. torchdata's
``StatefulDataLoader``), the step and epoch counters, user extras (JSON values keep their type),
and the RNG of every kind on this rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from torch_ckpt.errors import CheckpointCorruptError, ConfigError, StateMismatchError
from torch_ckpt.rng import capture_rng_state, restore_rng_state

__all__ = ["TrainState"]


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _require_stateful(obj: Any, what: str) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise ConfigError(f"{what} ({type(obj).__name__}) has no state_dict()/load_state_dict(); it cannot be checkpointed")


def _warn_if_not_resumable(loader: Any) -> None:
    """Warn when a stateful loader's sampler cannot record its shuffle, which makes resume inexact."""
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", sampler)
    # torchdata's samplers keep their state in their iterators; torch's own RandomSampler keeps none
    if type(sampler) is torch.utils.data.RandomSampler:
        warnings.warn(
            "the dataloader shuffles with torch.utils.data.RandomSampler, whose shuffle order is not part of the "
            "loader's state_dict(): a resumed run will see different batches. "
            "Use torchdata.stateful_dataloader.sampler.RandomSampler(dataset, generator=...) (or "
            "StatefulDataLoader(shuffle=True)).", stacklevel=3)


class TrainState:
    """The complete, exactly-resumable state of a training run (implements DCP's ``Stateful``).

    Args:
        model: the model, or a mapping ``name -> module`` for several models.
        optimizer: optimizer(s) of ``model``: one optimizer or a sequence of them (single model), or a
            mapping ``name -> optimizer`` whose names are keys of ``model`` (several models).
        scheduler: LR scheduler(s): one or a sequence.
        scaler: a ``torch.amp.GradScaler`` (optional).
        dataloader: anything with ``state_dict``/``load_state_dict`` (e.g. ``StatefulDataLoader``); its
            position is stored per rank.
        step: optimizer steps completed so far (int); update ``state.step`` in the loop.
        epoch: epochs started so far (int).
        extras: user values (JSON types, tensors, numpy arrays); restored with their Python type.
        rng: capture and restore every RNG of this rank (default True).
        options: ``StateDictOptions`` passed to ``get_state_dict``/``set_state_dict`` (default: sharded,
            no CPU offload).

    Raises:
        ConfigError: an object cannot be checkpointed, or optimizer names do not match model names.

    Attributes:
        rank_local_keys: top-level keys whose values differ per rank (stored once per rank).
    """

    rank_local_keys: tuple[str, ...] = ("rng", "dataloader")

    def __init__(
        self,
        *,
        model: nn.Module | Mapping[str, nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, Any] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        dataloader: Any = None,
        step: int = 0,
        epoch: int = 0,
        extras: dict[str, Any] | None = None,
        rng: bool = True,
        options: StateDictOptions | None = None,
    ) -> None:
        if model is None and optimizer is not None:
            raise ConfigError("TrainState: an optimizer was given without its model; pass model=... too")
        if isinstance(model, nn.Module) or model is None:
            self._models = {} if model is None else {"": model}
            if isinstance(optimizer, Mapping):
                raise ConfigError("TrainState: optimizer mapping needs model to be a mapping with the same names")
            self._optims = {"": _as_list(optimizer)} if model is not None else {}
        elif isinstance(model, Mapping):
            self._models = dict(model)
            opt_map = optimizer if isinstance(optimizer, Mapping) else ({} if optimizer is None else None)
            if opt_map is None:
                raise ConfigError("TrainState: with several models, pass optimizer as a mapping model-name -> optimizer(s)")
            unknown = sorted(set(opt_map) - set(self._models))
            if unknown:
                raise ConfigError(f"TrainState: optimizer names {unknown} are not model names {sorted(self._models)}")
            self._optims = {name: _as_list(opt_map.get(name)) for name in self._models}
        else:
            raise ConfigError(f"TrainState: model must be an nn.Module or a mapping of them, got {type(model).__name__}")
        self._schedulers = _as_list(scheduler)
        for i, s in enumerate(self._schedulers):
            _require_stateful(s, f"scheduler[{i}]")
        if scaler is not None:
            _require_stateful(scaler, "scaler")
        if dataloader is not None:
            if not callable(getattr(dataloader, "state_dict", None)):
                raise ConfigError(
                    f"dataloader ({type(dataloader).__name__}) has no state_dict(), so its position cannot be "
                    "checkpointed: use torchdata's StatefulDataLoader (torchdata.stateful_dataloader), or leave "
                    "dataloader= out and restore the position yourself")
            _require_stateful(dataloader, "dataloader")
            _warn_if_not_resumable(dataloader)
        self._scaler = scaler
        self._dataloader = dataloader
        self._rng = rng
        self._options = options or StateDictOptions()
        self.step = int(step)
        self.epoch = int(epoch)
        self.extras: dict[str, Any] = dict(extras or {})

    # -- model/optimizer -------------------------------------------------------------------------
    def _model_optim_state(self) -> tuple[dict, dict]:
        models: dict[str, Any] = {}
        optims: dict[str, Any] = {}
        for name, module in self._models.items():
            opts = self._optims.get(name, [])
            if opts:
                msd, osd = get_state_dict(module, opts, options=self._options)
                optims[name] = osd
            else:
                msd = get_model_state_dict(module, options=self._options)
            models[name] = msd
        if set(models) == {""}:
            return models[""], optims.get("", {})
        return models, optims

    def state_dict(self) -> dict[str, Any]:
        """Return the nested state (live tensors, not copies); keys are stable across runs."""
        model_sd, optim_sd = self._model_optim_state()
        sd: dict[str, Any] = {"step": self.step, "epoch": self.epoch, "extras": dict(self.extras)}
        if self._models:
            sd["model"] = model_sd
        if any(self._optims.values()):
            sd["optimizer"] = optim_sd
        if self._schedulers:
            sd["scheduler"] = [s.state_dict() for s in self._schedulers]
        if self._scaler is not None:
            sd["scaler"] = self._scaler.state_dict()
        if self._dataloader is not None:
            sd["dataloader"] = self._dataloader.state_dict()
        if self._rng:
            sd["rng"] = capture_rng_state()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state produced by :meth:`state_dict` (in place).

        Raises:
            CheckpointCorruptError: a component this state needs is absent from ``state_dict``.
        """
        def need(key: str) -> Any:
            if key not in state_dict:
                raise StateMismatchError(f"checkpoint has no {key!r} entry but this TrainState needs one",
                                         missing=[key])
            return state_dict[key]

        single = set(self._models) == {""}
        for name, module in self._models.items():
            msd = need("model") if single else need("model")[name]
            opts = self._optims.get(name, [])
            if opts:
                osd = need("optimizer") if single else need("optimizer")[name]
                set_state_dict(module, opts, model_state_dict=msd, optim_state_dict=osd, options=self._options)
            else:
                set_model_state_dict(module, msd, options=self._options)
        if self._schedulers:
            scheds = need("scheduler")
            if len(scheds) != len(self._schedulers):
                raise CheckpointCorruptError(
                    f"checkpoint holds {len(scheds)} scheduler states but this TrainState has {len(self._schedulers)}")
            for s, ssd in zip(self._schedulers, scheds):
                s.load_state_dict(ssd)
        if self._scaler is not None:
            self._scaler.load_state_dict(need("scaler"))
        if self._dataloader is not None:
            self._dataloader.load_state_dict(need("dataloader"))
        if self._rng:
            restore_rng_state(need("rng"))
        self.step = int(state_dict.get("step", self.step))
        self.epoch = int(state_dict.get("epoch", self.epoch))
        self.extras = dict(state_dict.get("extras", {}))

    def optimizer_owned_keys(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """Keys of ``tensors`` (flat, from this state's :meth:`state_dict`) that only ``optimizer.step()`` mutates.

        These are the parameters and the optimizer state; buffers (e.g. BatchNorm running stats),
        RNG and dataloader state also change in forward passes and are not included.
        """
        param_ptrs = {p.data_ptr() for m in self._models.values() for p in m.parameters()}
        owned = set()
        for key, t in tensors.items():
            if key.startswith("optimizer."):
                owned.add(key)
            elif key.startswith("model."):
                local = getattr(t, "_local_tensor", t)
                if local.data_ptr() in param_ptrs:
                    owned.add(key)
        return owned

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """All optimizers of this state (used to wait for staging before their next ``step()``)."""
        return [o for opts in self._optims.values() for o in opts]
