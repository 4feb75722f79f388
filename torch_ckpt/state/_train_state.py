"""``TrainState``: one ``Stateful`` bundle holding the complete state of a training run, saved and loaded.

Optimizers are keyed by DCP's parameter names (so DDP, FSDP2 and compiled models give a plain
module's keys), the RNG is plain data the codec stores without pickling, and capturing changes
nothing. The load side is the protocol of :func:`torch_ckpt.restore._restore.load_into`: check
everything first, load component by component, put back what was loaded should one fail.
"""

from __future__ import annotations

import copy
import random
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointCorruptError, ConfigError, StateMismatchError
from torch_ckpt.restore._restore import copy_into_live
from torch_ckpt.state._optim import (
    OptimizerState,
    TargetLookup,
    apply_optimizer_state,
    check_optimizer_state,
    keep_live_tensors,
    module_walk,
    optimizer_state,
    param_names,
    split_state_key,
    state_target,
)

__all__ = ["TrainState", "capture_rng_state", "check_rng_state", "iteration_in_progress", "restore_rng_state"]

log = get_logger(__name__)


# -- the RNG of this process -----------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """``{"python", "numpy", "torch_cpu"[, "cuda", "xpu", "mps"]}``: every RNG this process uses (an
    accelerator's entry only when that backend is initialised)."""
    version, mt, gauss = random.getstate()
    np_state = cast(tuple[Any, ...], np.random.get_state())  # legacy=True: the tuple form
    state: dict[str, Any] = {
        "python": {"version": version, "mt": np.asarray(mt, dtype=np.uint32), "gauss": gauss},  # 625 words
        "numpy": {
            "kind": np_state[0],
            "keys": np.asarray(np_state[1], dtype=np.uint32),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        state["xpu"] = list(torch.xpu.get_rng_state_all())
    if hasattr(torch, "mps") and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def _host_states(state: Any) -> tuple[tuple, tuple, torch.Tensor]:
    py = state["python"]
    npst = state["numpy"]
    py_state = (int(py["version"]), tuple(map(int, py["mt"])), py["gauss"])
    np_state = (npst["kind"], np.asarray(npst["keys"], dtype=np.uint32), int(npst["pos"]), int(npst["has_gauss"]),
                float(npst["cached_gaussian"]))
    cpu = state["torch_cpu"]
    if not isinstance(cpu, torch.Tensor):
        raise TypeError(f"torch_cpu is a {type(cpu).__name__}, not a tensor")
    return py_state, np_state, cpu.to(torch.uint8).cpu()


def check_rng_state(state: Any) -> None:
    """Raise ``CheckpointCorruptError`` unless scratch generators accept ``state`` (nothing live changes)."""
    try:
        py_state, np_state, cpu = _host_states(state)
        random.Random().setstate(py_state)
        np.random.RandomState().set_state(np_state)
        torch.Generator().set_state(cpu)
        for kind in ("cuda", "xpu"):
            devices = state.get(kind)
            if devices is not None and not all(isinstance(s, torch.Tensor) for s in devices):
                raise TypeError(f"{kind} generator states are not tensors")
    except (KeyError, IndexError, OverflowError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"RNG state in checkpoint is malformed ({exc!r})") from exc


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng_state`'s states (``CheckpointCorruptError`` if malformed); accelerators for
    the devices both sides have (a CPU-only checkpoint leaves them untouched)."""
    check_rng_state(state)  # nothing is set unless every host generator accepts its state
    py_state, np_state, cpu = _host_states(state)
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), device)
    xpu = state.get("xpu")
    if xpu and hasattr(torch, "xpu") and torch.xpu.is_available():
        for device, s in enumerate(xpu[: torch.xpu.device_count()]):
            torch.xpu.set_rng_state(s.cpu(), device)
    mps = state.get("mps")
    if mps is not None and hasattr(torch, "mps") and torch.backends.mps.is_available():
        torch.mps.set_rng_state(mps.cpu())


# -- loading helpers ----------------------------------------------------------------------------------
def _need(mapping: Any, key: str, prefix: str = "") -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise StateMismatchError(f"checkpoint has no {prefix + key!r} entry but this TrainState needs one",
                                 missing=[prefix + key])
    return mapping[key]


def iteration_in_progress(loader: Any) -> bool:
    """True when an unfinished iterator of ``loader`` (torchdata's ``StatefulDataLoader``) is still held elsewhere.

    ``StatefulDataLoader.load_state_dict`` sets the position of the *next* ``iter(loader)`` and forgets
    the current iterator, which keeps yielding from its old position to whoever holds it: a ``for``
    loop still running over the loader, or a variable. An iterator only the loader refers to (the
    loop was left) is harmless. The attributes are torchdata's own (0.11); a loader without them
    (another stateful loader, an adapter's wrapper) gives False.
    """
    it = getattr(loader, "_iterator", None)
    if it is None or getattr(it, "_finished", True) is not False \
            or getattr(loader, "_initial_iter_for_state_dict", True) is not False:  # True: made by state_dict()
        return False
    if not hasattr(sys, "getrefcount"):
        return True
    del it
    holder = _Holder()
    holder._iterator = object()  # referred to by one attribute only: the count of an iterator nobody else holds
    return _references(loader) > _references(holder)


class _Holder:
    _iterator: object


def _references(owner: Any) -> int:
    """``sys.getrefcount`` of ``owner._iterator``, measured the same way for every owner (so interpreters that
    borrow references on the stack shift both counts alike)."""
    it = owner._iterator
    return sys.getrefcount(it)


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
    _session_names: dict[str, dict[int, str]] | None = None

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
        self._walks: dict[str, tuple] = {}  # module_walk of each model, inside state_dict()
        self._param_ptrs: set[int] | None = None  # data pointers of the parameters at the last state_dict()
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
        """DCP's ``get_model_state_dict`` of ``module``, or the module's own when that is known to be equal
        (DCP's renaming costs about 30 us per tensor: 0.6 s for 20,000 tensors)."""
        if self._options != StateDictOptions():
            return get_model_state_dict(module, options=self._options)
        structure = self._walks[name][1] if name in self._walks else tuple((n, type(m)) for n, m in
                                                                             module.named_modules())
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
        self._walks = {name: module_walk(module) for name, module in self._models.items()}
        try:
            model_sd, optim_sd = self._model_optim_state()
        finally:
            walks, self._walks = self._walks, {}
        self._param_ptrs = {p.data_ptr() for walk in walks.values() for _, p in walk[0]}
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
        RNG and dataloader state also change in forward passes and are not included (the parameters are
        those of the last :meth:`state_dict`, which gave ``tensors``).
        """
        param_ptrs = self._param_ptrs if self._param_ptrs is not None else \
            {p.data_ptr() for m in self._models.values() for p in m.parameters()}
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

    # -- the load side (called by torch_ckpt.restore._restore.load_into) --------------------------------
    @contextmanager
    def load_session(self) -> Iterator[None]:
        """One restore (``load_into`` holds it throughout): each model's parameter names are computed once,
        not by each of the 6 hooks. Re-entrant."""
        if self._session_names is not None:
            yield
            return
        self._session_names = {}
        try:
            yield
        finally:
            self._session_names = None

    def _param_names(self, name: str) -> dict[int, str]:
        """:func:`~torch_ckpt.state._optim.param_names` of model ``name``, once per :meth:`load_session`."""
        memo = self._session_names
        if memo is None:
            return param_names(self._models[name], self._walks.get(name))
        names = memo.get(name)
        if names is None:
            names = memo[name] = param_names(self._models[name])
        return names

    def _optim_prefix(self, name: str) -> str:
        """Flat-key prefix of the optimizer state of model ``name``."""
        single = set(self._models) == {""}
        return "optimizer." if single else f"optimizer.{name}."

    def _optim_key(self, key: str) -> tuple[str, str, str] | None:
        """``(model name, parameter name, state name)`` for a flat optimizer-state key, else None."""
        for name, opts in self._optims.items():
            if opts and key.startswith(self._optim_prefix(name) + "state."):
                names = self._name_cache.get(name)
                if names is None:
                    names = self._name_cache[name] = set(self._param_names(name).values())
                parts = split_state_key(key, self._optim_prefix(name), names)
                if parts is not None:
                    return (name, *parts)
        return None

    def load_optional_key(self, key: str) -> bool:
        """True for optimizer-state tensors: a parameter may have state on one side only (no step yet)."""
        return self._optim_key(key) is not None

    def load_target(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new tensor, placed where the optimizer keeps it, for optimizer-state ``key``; None for other keys."""
        parts = self._optim_key(key)
        if parts is None:
            return None
        name, param, entry = parts
        lookup = self._lookups.get(name)
        if lookup is None:
            lookup = self._lookups[name] = TargetLookup(self._models[name], self._optims[name],
                                                        self._param_names(name))
        return state_target(lookup, param, entry, shape, dtype)

    def _sections(self, state_dict: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """``(model name, model state, optimizer state or None)`` for every model; raises if absent."""
        single = set(self._models) == {""}
        out = []
        for name in self._models:
            msd = _need(state_dict, "model") if single else _need(_need(state_dict, "model"), name, "model.")
            osd = None
            if self._optims.get(name):
                osd = _need(state_dict, "optimizer") if single else _need(_need(state_dict, "optimizer"), name,
                                                                           "optimizer.")
            out.append((name, msd, osd))
        return out

    def check_load(self, state_dict: Mapping[str, Any], *, allow_cast: bool = False) -> list[str]:
        """Check that ``state_dict`` (tensors may be meta tensors) can be loaded; change nothing.

        Returns:
            Descriptions of the optimizer-state tensors that will be cast (only with ``allow_cast``).

        Raises:
            StateMismatchError: a component is absent, or the optimizer parameter groups, state or
                dtypes do not match this state's optimizers.
            CheckpointCorruptError: a component has the wrong structure.
        """
        self._allow_cast = bool(allow_cast)  # the load_state_dict() that follows applies these casts
        casts: list[str] = []
        for name, _msd, osd in self._sections(state_dict):
            if osd is not None:
                casts += check_optimizer_state(self._models[name], self._optims[name], osd,
                                               prefix=self._optim_prefix(name), allow_cast=allow_cast,
                                               names=self._param_names(name))
        if self._schedulers:
            scheds = _need(state_dict, "scheduler")
            if not isinstance(scheds, list) or len(scheds) != len(self._schedulers) \
                    or not all(isinstance(x, Mapping) for x in scheds):
                count = len(scheds) if isinstance(scheds, list) else "malformed"
                raise StateMismatchError(f"checkpoint holds {count} scheduler states but this TrainState has "
                                         f"{len(self._schedulers)}; build the same schedulers as the saved run")
        if self._scaler is not None and not isinstance(_need(state_dict, "scaler"), Mapping):
            raise CheckpointCorruptError("checkpoint's 'scaler' entry is not a mapping")
        if self._dataloader is not None:
            _need(state_dict, "dataloader")
        if self._rng:
            check_rng_state(_need(state_dict, "rng"))
        for key in ("step", "epoch"):
            if key in state_dict and (isinstance(state_dict[key], bool) or not isinstance(state_dict[key], int)):
                raise CheckpointCorruptError(f"checkpoint's {key!r} is not an int: {state_dict[key]!r}")
        if "extras" in state_dict and not isinstance(state_dict["extras"], Mapping):
            raise CheckpointCorruptError(f"checkpoint's 'extras' is not a mapping: "
                                         f"{type(state_dict['extras']).__name__}")
        return casts

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state produced by :meth:`state_dict` (in place).

        The components are checked first (:meth:`check_load`); they are then loaded one by one and,
        should one fail, the ones already loaded are put back, so a failed load changes nothing.
        Parameters, buffers and the optimizer-state tensors the optimizer already had are written
        last, in place, by copying; optimizer-state tensors it did not have yet are the loaded ones.

        Raises:
            StateMismatchError: see :meth:`check_load` (also casting, which needs
                ``load_into(..., allow_cast=True)``).
            CheckpointCorruptError: see :meth:`check_load`.
        """
        with self.load_session():  # the check and the load share one parameter-name answer per model
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        sections = self._sections(state_dict)
        self.check_load(state_dict, allow_cast=self._allow_cast)  # cheap; load_into checked with meta tensors
        self._allow_cast = False
        undo: list = []
        live_optim_state = []
        try:
            for name, _msd, osd in sections:
                if osd is None:
                    continue
                for opt in self._optims[name]:
                    undo.append(OptimizerState(opt).undo)  # puts back the state and groups load_state_dict replaces
                    live_optim_state.append((opt, opt.state))
                apply_optimizer_state(self._models[name], self._optims[name], osd, names=self._param_names(name))
            if self._schedulers:
                for s, ssd in zip(self._schedulers, state_dict["scheduler"]):
                    undo.append(partial(s.load_state_dict, copy.deepcopy(s.state_dict())))
                    s.load_state_dict(ssd)
            if self._scaler is not None:
                undo.append(partial(self._scaler.load_state_dict, copy.deepcopy(self._scaler.state_dict())))
                self._scaler.load_state_dict(state_dict["scaler"])
            if self._rng:
                undo.append(partial(restore_rng_state, capture_rng_state()))
                restore_rng_state(state_dict["rng"])
            if self._dataloader is not None:
                running = iteration_in_progress(self._dataloader)  # before state_dict(), which may create one
                undo.append(partial(self._dataloader.load_state_dict, copy.deepcopy(self._dataloader.state_dict())))
                self._dataloader.load_state_dict(state_dict["dataloader"])
                if running:
                    log.warning("restore: the dataloader was being iterated; its restored position applies to the "
                                "next iter(loader), but the iterator already running keeps yielding from where it "
                                "was, and the loader's state_dict() (so the next save) no longer follows it. Leave "
                                "that loop and start a new `for batch in loader` before training on")
        except BaseException:
            for fn in reversed(undo):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - keep undoing; the original error propagates
                    log.exception("could not undo part of a failed restore")
            raise
        # from here on nothing can fail: same keys, shapes (and dtypes unless a cast was allowed)
        for opt, old_state in live_optim_state:
            keep_live_tensors(opt, old_state)
        for name, msd, _osd in sections:
            self._write_model(name, msd)
        self.step = int(state_dict.get("step", self.step))
        self.epoch = int(state_dict.get("epoch", self.epoch))
        self.extras = dict(state_dict.get("extras", {}))

    def _write_model(self, name: str, msd: Mapping[str, Any]) -> None:
        module = self._models[name]
        if self._options.full_state_dict or self._options.cpu_offload:  # live values are copies: let DCP place them
            set_model_state_dict(module, dict(msd), options=self._options)
            return
        live = self._model_state_dict(name, module)
        copy_into_live(live, {k: v for k, v in msd.items() if isinstance(v, torch.Tensor)}, module=module)
