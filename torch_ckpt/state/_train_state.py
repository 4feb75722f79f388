"""``TrainState``: one ``Stateful`` bundle holding the complete state of a training run.

What it captures (the "what to save" table): model(s) through DCP's ``get_model_state_dict`` and
optimizer(s) from ``optimizer.state_dict()`` keyed by the same parameter names (so DDP, FSDP2 and
compiled models produce the same keys as a plain module, in DCP's own layout), LR scheduler(s), a
``GradScaler``, the dataloader position (anything with ``state_dict``/``load_state_dict``, e.g.
torchdata's ``StatefulDataLoader``), the step and epoch counters, user extras (JSON values keep
their type), and the RNG of every kind on this rank. Capturing changes none of them. This module
builds the state and captures it; loading it back is :mod:`torch_ckpt.state._load`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torch_ckpt.errors import ConfigError
from torch_ckpt.state._load import TrainStateLoadMixin
from torch_ckpt.state._optim import TargetLookup, optimizer_state
from torch_ckpt.state._rng import capture_rng_state

__all__ = ["TrainState"]



def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _require_stateful(obj: Any, what: str) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise ConfigError(f"{what} ({type(obj).__name__}) has no state_dict()/load_state_dict(); "
                          "it cannot be checkpointed")


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
    if getattr(loader, "generator", False) is None:
        # without its own generator, every new iterator draws its base seed from the global torch RNG: a
        # resumed run restores the RNG after that draw and then draws again, shifting dropout and every
        # other global-RNG consumer by one draw
        warnings.warn(
            "the dataloader has no generator=: each new iterator draws a seed from the global torch RNG, so after "
            "a resume the RNG stream (dropout, random augmentation) departs from the uninterrupted run by one "
            "draw. Give the loader its own generator, e.g. StatefulDataLoader(..., "
            "generator=torch.Generator().manual_seed(1)), and shuffle with "
            "torchdata.stateful_dataloader.sampler.RandomSampler(dataset, generator=...).", stacklevel=3)


class TrainState(TrainStateLoadMixin):
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
        options: ``StateDictOptions`` for the models' ``get_model_state_dict`` (default: sharded, no
            CPU offload). Optimizer state is always sharded like the parameters; with optimizers,
            ``full_state_dict``, ``cpu_offload`` and ``flatten_optimizer_state_dict`` are refused.

    Raises:
        ConfigError: an object cannot be checkpointed, optimizer names do not match model names, or
            ``options`` asks for full/offloaded optimizer state.

    Attributes:
        rank_local_keys: top-level keys whose values differ per rank (stored once per rank).
        replicated_keys: key prefixes whose plain tensors are the same on every rank (DCP stores
            them once; sharded tensors always are): the models and optimizers. Every other tensor
            (extras, scheduler, scaler) is stored per rank and comes back per rank. A subclass or
            instance may add prefixes (``"extras.ema"``) for large extras that every rank holds
            alike; ranks must then agree on their shapes and dtypes (``save()`` checks).
    """

    rank_local_keys: tuple[str, ...] = ("rng", "dataloader")
    replicated_keys: tuple[str, ...] = ("model", "optimizer")

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
                raise ConfigError("TrainState: with several models, pass optimizer as a mapping "
                                  "model-name -> optimizer(s)")
            unknown = sorted(set(opt_map) - set(self._models))
            if unknown:
                raise ConfigError(f"TrainState: optimizer names {unknown} are not model names {sorted(self._models)}")
            self._optims = {name: _as_list(opt_map.get(name)) for name in self._models}
        else:
            raise ConfigError(f"TrainState: model must be an nn.Module or a mapping of them, "
                              f"got {type(model).__name__}")
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
        if any(self._optims.values()) and (self._options.full_state_dict or self._options.cpu_offload
                                           or self._options.flatten_optimizer_state_dict):
            raise ConfigError("TrainState: options with full_state_dict, cpu_offload or flatten_optimizer_state_dict "
                              "are supported for models without optimizers only; leave options out (sharded "
                              "state, resharded on load)")
        self._allow_cast = False
        self._name_cache: dict[str, set[str]] = {}
        self._plain_models: dict[str, tuple[tuple, tuple[str, ...]]] = {}
        self._lookups: dict[str, TargetLookup] = {}
        self.step = int(step)
        self.epoch = int(epoch)
        self.extras: dict[str, Any] = dict(extras or {})

    def _model_optim_state(self) -> tuple[dict, dict]:
        models: dict[str, Any] = {}
        optims: dict[str, Any] = {}
        for name, module in self._models.items():
            models[name] = self._model_state_dict(name, module)
            opts = self._optims.get(name, [])
            if opts:  # from optimizer.state_dict(): never initialises (steps) an optimizer without state
                optims[name] = optimizer_state(module, opts, where=f"optimizer {name!r}" if name else "optimizer",
                                               names=self._param_names(name))
        if set(models) == {""}:
            return models[""], optims.get("", {})
        return models, optims

    def _model_state_dict(self, name: str, module: nn.Module) -> dict[str, Any]:
        """DCP's ``get_model_state_dict`` of ``module``, or the module's own when that is known to be equal.

        DCP's function renames every key through its wrapper-aware naming (about 30 us per tensor:
        0.6 s for 20,000 tensors). For a module whose ``state_dict()`` DCP returned unchanged (same
        keys in the same order, the same tensors), the module's own ``state_dict()`` is used again
        while its keys and the types of its submodules stay the same.
        """
        if self._options != StateDictOptions():
            return get_model_state_dict(module, options=self._options)
        structure = tuple((n, type(m)) for n, m in module.named_modules())
        known = self._plain_models.get(name)
        if known is not None and known[0] == structure:
            own = module.state_dict()
            if tuple(own) == known[1]:
                return own
        sd = get_model_state_dict(module, options=self._options)
        own = module.state_dict()
        same = list(own) == list(sd) and all(
            type(a) is type(b) and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
            and a.stride() == b.stride() and a.device == b.device
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a is b
            for a, b in zip(own.values(), sd.values()))
        if same:
            self._plain_models[name] = (structure, tuple(own))
        else:
            self._plain_models.pop(name, None)
        return sd

    def state_dict(self) -> dict[str, Any]:
        """Return the nested state (live tensors, not copies); keys are stable across runs.

        Reading it changes nothing: no optimizer step, no RNG draw, no dataloader advance.
        """
        self._name_cache = {}  # parameter names, for load_into's calls that follow (a module may have changed)
        self._lookups = {}
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
