"""An optimizer kept by its own ``optimizer.state_dict()`` (integer parameter ids): :class:`OptimizerState`.

For optimizers that cannot be keyed by one model's parameter names (e.g. one spanning several
models). The state is saved as the optimizer gives it; on restore each state tensor is allocated
where ``Optimizer.load_state_dict`` would put it, and the groups and dtypes are checked before
anything is written. The name-keyed layout that :class:`~torch_ckpt.TrainState` uses for the other
optimizers, and the placement rules both share, are in :mod:`torch_ckpt.state._optim`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from torch_ckpt.errors import CheckpointCorruptError, StateMismatchError
from torch_ckpt.state._optim import group_of, keep_live_tensors, policy_key, step_on_param_device, tensors_in

__all__ = ["plain_state_target", "check_plain_optimizer_state", "OptimizerState"]

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


def _flat_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g[_PARAMS]]


def plain_state_target(opt: torch.optim.Optimizer, index: int, entry: str, shape: Sequence[int],
                       dtype: torch.dtype) -> torch.Tensor | None:
    """Like :func:`~torch_ckpt.state._optim.state_target`, for ``optimizer.state_dict()``'s integer parameter ids.

    None when ``index`` is out of range.
    """
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
    """Check that ``saved`` (an ``optimizer.state_dict()``; tensors may be meta) loads into ``opt`` without a cast.

    Returns:
        The keys that will be cast (only when ``allow_cast``).

    Raises:
        StateMismatchError: other parameter groups (count or sizes), state for ids the optimizer
            does not have, or dtypes that ``load_state_dict`` would cast (without ``allow_cast``).
        CheckpointCorruptError: ``saved`` is not an optimizer state dict.
    """
    if not isinstance(saved, Mapping) or not isinstance(saved.get(_GROUPS), list) \
            or not isinstance(saved.get(_STATE), Mapping):
        raise CheckpointCorruptError(f"{prefix.rstrip('.')}: not an optimizer state_dict in the checkpoint")
    sizes = [len(g.get(_PARAMS, [])) if isinstance(g, Mapping) else -1 for g in saved[_GROUPS]]
    live_sizes = [len(g[_PARAMS]) for g in opt.param_groups]
    if sizes != live_sizes:
        raise StateMismatchError(f"{prefix.rstrip('.')}: parameter groups of sizes {sizes} in the checkpoint, "
                                 f"{live_sizes} here; build the same optimizer as the saved run")
    params = _flat_params(opt)
    bad: list[str] = []
    to_cast: list[str] = []
    for index, entries in saved[_STATE].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entries, Mapping):
            raise StateMismatchError(f"{prefix}state.{index}: state for a parameter this optimizer does not have",
                                     unexpected=[f"{prefix}state.{index}"])
        param = params[index]
        for entry, value in tensors_in(dict(entries), ""):
            entry = entry[1:]
            if policy_key(entry) != "step" and param.is_floating_point() and value.dtype != param.dtype:
                (to_cast if allow_cast else bad).append(f"{prefix}state.{index}.{entry}: checkpoint {value.dtype}, "
                                                     f"parameter {param.dtype}")
    if bad:
        raise StateMismatchError(f"{prefix.rstrip('.')}: optimizer state dtypes differ from their parameters' "
                                 f"(loading would cast): {bad[:20]}. Restore with allow_cast=True to cast them.")
    return to_cast


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
