"""Optimizer state keyed by parameter name, read and written without side effects.

DCP's ``get_state_dict``/``set_state_dict`` initialise an optimizer that has no state yet by
running a zero-gradient ``optimizer.step()`` (which changes Adam's step count and, through weight
decay or momentum, the parameters), and their load path drops the state of frozen parameters and
refuses parameters without state. This module produces the same layout DCP uses (state keyed by
canonical parameter name, ``param_groups`` listing names) from ``optimizer.state_dict()`` alone, and
loads it back with ``optimizer.load_state_dict`` after checking it, so:

* capture never runs ``step()`` and never writes to the optimizer;
* any state the optimizer really had round-trips: parameters without state, frozen parameters with
  state, every ``param_groups`` entry (per-group hyper-parameters, ``initial_lr``, user keys);
* nothing is silently cast: torch's ``Optimizer.load_state_dict`` casts floating-point state to the
  parameter's dtype, so a dtype difference is reported before loading unless a cast was allowed.

Names are DCP's own (wrapper prefixes removed); FSDP1 flat parameters are refused. An optimizer
spanning several models is kept by its own integer-id ``state_dict()`` as :class:`OptimizerState`.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torch_ckpt.errors import CheckpointCorruptError, ConfigError, StateMismatchError
from torch_ckpt.restore._restore import copy_tensors, swap_in

__all__ = ["param_names", "module_walk", "optimizer_state", "check_optimizer_state", "apply_optimizer_state",
           "state_target", "TargetLookup", "split_state_key", "keep_live_tensors", "policy_key", "tensors_in",
           "group_of", "step_on_param_device", "plain_state_target", "check_plain_optimizer_state", "OptimizerState"]

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


def module_walk(model: nn.Module) -> tuple[tuple[tuple[str, nn.Parameter], ...], tuple[tuple[str, type], ...]]:
    """``(model.named_parameters(), ((name, type) of each of model.named_modules()))``: what :func:`param_names`
    depends on, walked once (a save reuses it for the structure check and the overlap-staged keys)."""
    return tuple(model.named_parameters()), tuple((n, type(m)) for n, m in model.named_modules())


def param_names(model: nn.Module, walk: tuple | None = None) -> dict[int, str]:
    """``{id(parameter): name}`` as DCP's ``get_model_state_dict`` names them; ConfigError for FSDP1.
    ``walk``: :func:`module_walk` of ``model`` taken just before, if the caller has it."""
    # DCP's names depend only on the parameter names and the module types along them: reuse the
    # last answer for this model while both are unchanged (a per-name _get_fqns costs ~15 us)
    params, modules = module_walk(model) if walk is None else walk
    signature = (tuple((n, id(p)) for n, p in params), modules)
    cached = _NAMES_CACHE.get(model)
    if cached is not None and cached[0] == signature:
        return dict(cached[1])
    out = _param_names_uncached(model)
    _NAMES_CACHE[model] = (signature, out)
    return dict(out)


#: ``{model: (signature, {id(parameter): name})}``; see param_names
_NAMES_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _param_names_uncached(model: nn.Module) -> dict[int, str]:
    from torch.distributed.checkpoint.state_dict import _get_fqns  # DCP's canonical naming
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError("the model is wrapped in FSDP1 (FullyShardedDataParallel), whose optimizer state is "
                          "flattened per rank; torch-ckpt checkpoints optimizers of plain, DDP, compiled and FSDP2 "
                          "(torch.distributed.fsdp.fully_shard) models. Use fully_shard.")
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:
            raise ConfigError(f"parameter {name!r} stands for {len(fqns)} parameters (an FSDP1 flat parameter); "
                              "torch-ckpt checkpoints optimizers of plain, DDP, compiled and FSDP2 (fully_shard) "
                              "models. Use FSDP2.")
        out.setdefault(id(p), next(iter(fqns)))
    return out


def _optimizer_names(opt: torch.optim.Optimizer, names: Mapping[int, str], where: str) -> list[list[str]]:
    groups = []
    for g in opt.param_groups:
        row = []
        for p in g[_PARAMS]:
            if id(p) not in names:
                raise ConfigError(f"{where}: the optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                                  "parameter of its model; give TrainState the model that owns every parameter")
            row.append(names[id(p)])
        groups.append(row)
    return groups


def optimizer_state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
                    where: str = "optimizer", names: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The state of ``optimizers`` (all of ``model``) in DCP's layout, without touching them: ``{"state":
    {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}``, the live tensors in new dicts."""
    names = param_names(model) if names is None else names
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for opt in optimizers:
        sd = opt.state_dict()  # ids are positions over the groups' params, in order
        flat = [n for row in _optimizer_names(opt, names, where) for n in row]
        for idx, entry in sd[_STATE].items():
            state[flat[idx]] = dict(entry)
        for g in sd[_GROUPS]:
            packed = {k: v for k, v in g.items() if k != _PARAMS}
            packed[_PARAMS] = [flat[i] for i in g[_PARAMS]]
            groups.append(packed)
    return {_STATE: state, _GROUPS: groups}


def split_state_key(key: str, prefix: str, names: Collection[str]) -> tuple[str, str] | None:
    """``(parameter name, state path)`` of a flat key ``<prefix>state.<parameter name>.<state path>``, or None
    (the state path may be dotted, e.g. LBFGS's ``old_dirs.0``)."""
    head = f"{prefix}state."
    if not key.startswith(head):
        return None
    rest = key[len(head):]
    pos = len(rest)
    while (pos := rest.rfind(".", 0, pos)) > 0:
        if rest[:pos] in names:
            return rest[:pos], rest[pos + 1:]
    return None


def policy_key(path: str) -> str:
    """The key ``Optimizer.load_state_dict`` decides a value's placement by (innermost non-index name)."""
    parts = [p for p in path.split(".") if not p.isdigit()]
    return parts[-1] if parts else path


def tensors_in(value: Any, path: str):
    """Yield ``(path.key.index..., tensor)`` for every tensor nested in ``value`` (mappings, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from tensors_in(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensors_in(v, f"{path}.{i}")


def _params_by_name(model: nn.Module, names: Mapping[int, str] | None = None) -> dict[str, torch.Tensor]:
    names = param_names(model) if names is None else names
    return {names[id(p)]: p for p in model.parameters() if id(p) in names}


def group_of(optimizers: Sequence[torch.optim.Optimizer], param: torch.Tensor) -> dict[str, Any]:
    """The first parameter group of ``optimizers`` holding ``param`` ({} when none does)."""
    for opt in optimizers:
        for g in opt.param_groups:
            if any(p is param for p in g[_PARAMS]):
                return g
    return {}


def step_on_param_device(group: Mapping[str, Any]) -> bool:
    """Whether ``Optimizer.load_state_dict`` keeps a ``step`` of ``group`` on the parameter's device."""
    return bool(group.get("capturable", False) or group.get("fused", False))


class TargetLookup:
    """Parameters by name and their optimizer groups, computed once for the :func:`state_target` calls of
    one restore."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 names: Mapping[int, str] | None = None) -> None:
        self.params = _params_by_name(model, names)
        self.groups: dict[int, dict[str, Any]] = {}
        for opt in reversed(list(optimizers)):  # the first group holding a parameter wins, as in group_of
            for g in reversed(opt.param_groups):
                for p in g[_PARAMS]:
                    self.groups[id(p)] = g


def state_target(lookup: TargetLookup, param_name: str, entry: str, shape: Sequence[int],
                 dtype: torch.dtype) -> torch.Tensor | None:
    """A new, uninitialised tensor to load optimizer state ``entry`` of ``param_name`` into.

    It is placed where ``Optimizer.load_state_dict`` would put the value (the parameter's device,
    except a ``step`` of a non-capturable, non-fused group, which stays on the CPU) and, for a
    DTensor parameter whose global shape it shares, sharded like the parameter. None when
    ``param_name`` is not a parameter of ``lookup``'s optimizers.
    """
    param = lookup.params.get(param_name)
    if param is None:
        return None
    group = lookup.groups.get(id(param))
    if not group:
        return None
    step = policy_key(entry) == "step"
    device = torch.device("cpu") if step and not step_on_param_device(group) else param.device
    if isinstance(param, DTensor) and tuple(shape) == tuple(param.shape) and not step:
        local = torch.empty(param._local_tensor.shape, dtype=dtype, device=param._local_tensor.device)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    if isinstance(device, torch.device) and device.type == "meta":
        device = torch.device("cpu")
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def check_optimizer_state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], saved: Mapping[str, Any],
                          *, prefix: str, allow_cast: bool = False,
                          names: Mapping[int, str] | None = None) -> list[str]:
    """Check that ``saved`` (layout of :func:`optimizer_state`) can be loaded into ``optimizers``; write nothing.

    Tensors in ``saved`` may be meta tensors. ``prefix``: of the flat keys in messages. ``names``:
    :func:`param_names` of ``model`` if known. Returns the keys that will be cast (with ``allow_cast``).

    Raises:
        StateMismatchError: the parameter groups differ (count or parameter names, i.e. another
            model or optimizer setup), state is stored for a parameter the optimizers do not
            have, or a state tensor's dtype differs from its parameter's (without ``allow_cast``).
        CheckpointCorruptError: ``saved`` does not have the layout.
    """
    if not isinstance(saved, Mapping) or not isinstance(saved.get(_GROUPS), list) \
            or not isinstance(saved.get(_STATE, {}), Mapping):
        raise CheckpointCorruptError(f"{prefix.rstrip('.')}: the checkpoint's optimizer state is not a "
                                     "{'state': ..., 'param_groups': [...]} mapping")
    names = param_names(model) if names is None else names
    live_groups = [row for opt in optimizers for row in _optimizer_names(opt, names, prefix.rstrip("."))]
    saved_groups = saved[_GROUPS]
    saved_rows = [list(g.get(_PARAMS, [])) if isinstance(g, Mapping) else None for g in saved_groups]
    if saved_rows != live_groups:
        diff = []
        if len(saved_rows) != len(live_groups):
            diff.append(f"{len(saved_rows)} param_groups in the checkpoint, {len(live_groups)} here")
        for i, (s, live) in enumerate(zip(saved_rows, live_groups)):
            if s != live:
                s_set, l_set = set(s or []), set(live)
                diff.append(f"param_groups[{i}]: missing from checkpoint {sorted(l_set - s_set)[:10]}, unexpected "
                            f"{sorted(s_set - l_set)[:10]}" if s_set != l_set else
                            f"param_groups[{i}]: same parameters in another order")
        missing = sorted({n for row in live_groups for n in row} - {n for row in saved_rows if row for n in row})
        unexpected = sorted({n for row in saved_rows if row for n in row} - {n for row in live_groups for n in row})
        raise StateMismatchError(
            f"{prefix.rstrip('.')}: the optimizer parameter groups differ from the checkpoint's: {'; '.join(diff)}. "
            "Build the same model and optimizer(s), with the same parameter groups, as the saved run.",
            missing=[f"{prefix}param_groups.{n}" for n in missing],
            unexpected=[f"{prefix}param_groups.{n}" for n in unexpected])
    params = _params_by_name(model, names)
    known = {n for row in live_groups for n in row}
    unexpected = sorted(f"{prefix}state.{n}" for n in saved.get(_STATE, {}) if n not in known)
    if unexpected:
        raise StateMismatchError(f"{prefix.rstrip('.')}: unexpected in checkpoint: {unexpected[:20]} (state for "
                                 "parameters these optimizers do not hold)", unexpected=unexpected)
    casts: list[str] = []
    for name, entries in saved.get(_STATE, {}).items():
        if not isinstance(entries, Mapping):
            raise CheckpointCorruptError(f"{prefix}state.{name}: not a mapping in the checkpoint")
        casts += _casts(f"{prefix}state.{name}", params[name], entries)
    if casts and not allow_cast:
        raise StateMismatchError(
            f"{prefix.rstrip('.')}: optimizer state dtypes differ from their parameters' (loading would cast): "
            f"{casts[:20]}. Build the model with the saved dtypes, or restore with allow_cast=True.",
            missing=[], unexpected=[])
    return casts


def _casts(key: str, param: torch.Tensor, entries: Mapping[str, Any]) -> list[str]:
    """The state tensors of ``param`` that ``Optimizer.load_state_dict`` would cast to its dtype."""
    if not param.is_floating_point():
        return []
    return [f"{key}{entry}: checkpoint {value.dtype}, parameter {param.dtype}"
            for entry, value in tensors_in(dict(entries), "")
            if policy_key(entry[1:]) != "step" and value.dtype != param.dtype]


def apply_optimizer_state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                          saved: Mapping[str, Any], *, names: Mapping[int, str] | None = None) -> None:
    """Load ``saved`` (checked by :func:`check_optimizer_state`) into ``optimizers``: groups and state are
    replaced whole, so afterwards ``optimizer.state_dict()`` equals the saved one."""
    names = param_names(model) if names is None else names
    groups = list(saved[_GROUPS])
    state = saved.get(_STATE, {})
    for opt in optimizers:
        rows = _optimizer_names(opt, names, "optimizer")
        mine, groups = groups[:len(rows)], groups[len(rows):]
        flat = [n for row in rows for n in row]
        index = {n: i for i, n in enumerate(flat)}
        packed_groups = []
        for g, row in zip(mine, rows):
            packed = {k: v for k, v in g.items() if k != _PARAMS}
            packed[_PARAMS] = [index[n] for n in row]
            packed_groups.append(packed)
        packed_state = {index[n]: dict(entries) for n, entries in state.items() if n in index}
        opt.load_state_dict({_STATE: packed_state, _GROUPS: packed_groups})


@torch.no_grad()
def keep_live_tensors(opt: torch.optim.Optimizer, old_state: Mapping[Any, Any]) -> None:
    """After a successful load, put back each matching tensor of ``old_state`` holding the loaded value, so
    references to optimizer state taken before a restore stay valid (in place, as for parameters)."""
    pairs, shards = [], []
    for param, entries in opt.state.items():
        before = old_state.get(param) if isinstance(old_state, Mapping) else None
        if not isinstance(before, Mapping):
            continue
        for key, new in list(entries.items()):
            old = before.get(key)
            if (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and type(old) is type(new)
                    and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
                    and old is not new):
                if isinstance(old, DTensor):
                    assert isinstance(new, DTensor)  # the same type as old
                    if old.placements != new.placements:
                        continue
                    shards.append((old._local_tensor, new._local_tensor))  # copied: never swapped
                else:
                    pairs.append((old, new))
                entries[key] = old
    copy_tensors(shards)
    swap_in(pairs)  # the loaded tensors are dropped: only the kept ones are used after this


def _flat_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g[_PARAMS]]


def plain_state_target(opt: torch.optim.Optimizer, index: int, entry: str, shape: Sequence[int],
                       dtype: torch.dtype) -> torch.Tensor | None:
    """Like :func:`state_target`, for ``optimizer.state_dict()``'s integer parameter ids (None: out of range)."""
    params = _flat_params(opt)
    if not 0 <= index < len(params):
        return None
    param = params[index]
    group = group_of([opt], param)
    step = policy_key(entry) == "step"
    device = torch.device("cpu") if step and not step_on_param_device(group) else param.device
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def check_plain_optimizer_state(opt: torch.optim.Optimizer, saved: Any, *, prefix: str,
                                allow_cast: bool = False) -> list[str]:
    """Check that ``saved`` (an ``optimizer.state_dict()``; tensors may be meta) loads into ``opt``; returns the
    keys that will be cast (with ``allow_cast``), else StateMismatchError as :func:`check_optimizer_state`."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get(_GROUPS), list) \
            or not isinstance(saved.get(_STATE), Mapping):
        raise CheckpointCorruptError(f"{prefix.rstrip('.')}: not an optimizer state_dict in the checkpoint")
    sizes = [len(g.get(_PARAMS, [])) if isinstance(g, Mapping) else -1 for g in saved[_GROUPS]]
    live_sizes = [len(g[_PARAMS]) for g in opt.param_groups]
    if sizes != live_sizes:
        raise StateMismatchError(f"{prefix.rstrip('.')}: parameter groups of sizes {sizes} in the checkpoint, "
                                 f"{live_sizes} here; build the same optimizer as the saved run")
    params = _flat_params(opt)
    casts: list[str] = []
    for index, entries in saved[_STATE].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entries, Mapping):
            raise StateMismatchError(f"{prefix}state.{index}: state for a parameter this optimizer does not have",
                                     unexpected=[f"{prefix}state.{index}"])
        casts += _casts(f"{prefix}state.{index}", params[index], entries)
    if casts and not allow_cast:
        raise StateMismatchError(f"{prefix.rstrip('.')}: optimizer state dtypes differ from their parameters' "
                                 f"(loading would cast): {casts[:20]}. Restore with allow_cast=True to cast them.")
    return casts


class OptimizerState:
    """One optimizer kept by its own ``optimizer.state_dict()`` (integer parameter ids), as a restorable ``Stateful``.

    For optimizers that cannot be keyed by one model's parameter names (e.g. one spanning several
    models); :class:`~torch_ckpt.TrainState` keys the others by name. Implements the load protocol
    of :func:`torch_ckpt.restore._restore.load_into` (keys relative to this object): state tensors a fresh
    optimizer does not have yet are allocated where the optimizer keeps them, everything is checked
    before anything is written, a load can be undone (:meth:`undo`) until the whole restore has
    succeeded, and then (:meth:`keep_live`) the optimizer keeps its live state tensors, the loaded
    values copied into them.

    Args:
        optimizer: the torch optimizer.
        name: the key prefix used in error messages (e.g. ``"optimizers_plain.0"``).

    Attributes:
        replicated_keys: its state tensors are the same on every rank (stored once, as by DCP),
            when it is saved as a state of its own.
    """

    replicated_keys: tuple[str, ...] = ("state",)

    def __init__(self, optimizer: torch.optim.Optimizer, *, name: str = "optimizer") -> None:
        self.optimizer = optimizer
        self.name = name
        self._before: tuple[Any, Any] = (optimizer.state, optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` (live tensors)."""
        return self.optimizer.state_dict()

    def _state_key(self, key: str) -> tuple[int, str] | None:
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != _STATE or not parts[1].isdigit():
            return None
        return int(parts[1]), parts[2]

    def load_optional_key(self, key: str) -> bool:
        """True for ``state.<id>.<entry>`` tensors (a parameter may have state on one side only)."""
        return self._state_key(key) is not None

    def load_target(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A new tensor on the device where the optimizer keeps ``key``; None for other keys."""
        parts = self._state_key(key)
        return None if parts is None else plain_state_target(self.optimizer, parts[0], parts[1], shape, dtype)

    def check_load(self, state: Any, *, allow_cast: bool = False) -> list[str]:
        """See :func:`check_plain_optimizer_state`; returns the keys that will be cast."""
        return check_plain_optimizer_state(self.optimizer, state, prefix=f"{self.name}.", allow_cast=allow_cast)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """``optimizer.load_state_dict(state)``; then :meth:`undo` (a later component failed) or :meth:`keep_live`."""
        self._before = (self.optimizer.state, self.optimizer.param_groups)
        self.optimizer.load_state_dict(cast(dict[str, Any], state))

    def undo(self) -> None:
        """Put back the state and parameter groups the last :meth:`load_state_dict` replaced."""
        self.optimizer.state, self.optimizer.param_groups = self._before

    def keep_live(self) -> None:
        """After the whole restore succeeded: copy the loaded values into the tensors they replaced and keep those."""
        keep_live_tensors(self.optimizer, self._before[0])
