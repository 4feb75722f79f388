"""The load side of :class:`~torch_ckpt.TrainState`: the protocol :func:`torch_ckpt.restore._restore.load_into` calls.

A mixin of ``TrainState`` (it uses the state's models, optimizers and other components): which
flat keys may be missing on one side (optimizer state of a parameter that has none yet), where a
loaded optimizer-state tensor is allocated, :meth:`check_load` before anything is written, and
:meth:`load_state_dict`, which loads the components one by one, puts back those already loaded
should one fail, and writes parameters and buffers last, in place. :mod:`torch_ckpt.state._train_state` builds
the state and captures it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointCorruptError, StateMismatchError
from torch_ckpt.restore._restore import copy_into_live
from torch_ckpt.state._optim import (
    TargetLookup,
    apply_optimizer_state,
    check_optimizer_state,
    keep_live_tensors,
    param_names,
    split_state_key,
    state_target,
)
from torch_ckpt.state._rng import capture_rng_state, check_rng_state, restore_rng_state

__all__ = ["TrainStateLoadMixin", "iteration_in_progress"]

log = get_logger("torch_ckpt.state._train_state")


def _need(mapping: Any, key: str, prefix: str = "") -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise StateMismatchError(f"checkpoint has no {prefix + key!r} entry but this TrainState needs one",
                                 missing=[prefix + key])
    return mapping[key]


def _optimizer_undo(opt: torch.optim.Optimizer) -> Any:
    """Put back an optimizer's state and groups (``load_state_dict`` replaces both objects, never edits them)."""
    state, groups = opt.state, opt.param_groups

    def undo() -> None:
        opt.state, opt.param_groups = state, groups
    return undo


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


class TrainStateLoadMixin:
    """:meth:`check_load`, :meth:`load_state_dict` and the load-target hooks of :class:`~torch_ckpt.TrainState`."""

    _session_names: dict[str, dict[int, str]] | None = None

    @contextmanager
    def load_session(self) -> Iterator[None]:
        """One restore: within the block, each model's parameter names are computed once.

        :func:`~torch_ckpt.restore._restore.load_into` holds it from :meth:`state_dict` to the end of
        :meth:`load_state_dict` (nothing else runs meanwhile, so the models cannot change); every
        hook then shares one :func:`~torch_ckpt.state._optim.param_names` answer per model instead of
        computing it 6 times. Outside a session each call computes the names itself. Re-entrant.
        """
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
            return param_names(self._models[name])
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

    def load_in_place(self, key: str) -> bool:
        """True for keys whose live tensor (from :meth:`state_dict`) :meth:`load_state_dict` writes in place.

        That is parameters and buffers (copied into, unless DCP options make the live values copies)
        and optimizer state the optimizer already has (kept, holding the loaded values); not the
        scheduler, scaler, RNG, dataloader or extras, whose values are replaced.
        """
        if self._optim_key(key) is not None:
            return True
        return key.startswith("model.") and not (self._options.full_state_dict or self._options.cpu_offload)

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
        return state_target(self._models[name], self._optims[name], param, entry, shape, dtype, lookup=lookup)

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
        """The body of :meth:`load_state_dict`, inside a :meth:`load_session`."""
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
                    undo.append(_optimizer_undo(opt))
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
