"""The state protocol: what :meth:`~torch_ckpt.CheckpointManager.save` and ``restore`` accept."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

__all__ = ["HasStateDict", "Checkpointable", "StateToSave", "StateToRestore"]


@runtime_checkable
class HasStateDict(Protocol):
    """What a save needs of a state object: ``state_dict()`` (see :class:`Checkpointable` for the hooks)."""

    def state_dict(self) -> Mapping[str, Any]:
        """The state to save: a nested mapping of tensors and plain values (nothing is mutated)."""


@runtime_checkable
class Checkpointable(HasStateDict, Protocol):
    """A training state that save and restore take whole: ``state_dict()`` and ``load_state_dict()``.

    Structurally DCP's ``Stateful``, so every ``Stateful`` (a :class:`~torch_ckpt.TrainState`, an
    ``nn.Module``, an optimizer...) is one. A save needs only ``state_dict()`` (:class:`HasStateDict`),
    and plain mappings are accepted too (:data:`StateToSave`, :data:`StateToRestore`): their tensors and
    values are saved as they are and restored into them.

    Besides the two methods, the engine looks up these optional hooks with ``getattr``; a state
    without one gets the default in brackets. Keys are the flat, dot-joined keys of ``state_dict()``.

    * ``rank_local_keys: tuple[str, ...]`` [``()``]: top-level keys whose values differ per rank
      (RNG, dataloader position), stored once per rank; on another world size they follow
      ``on_world_size_change``.
    * ``replicated_keys: tuple[str, ...]`` [``()``]: key prefixes whose plain tensors are equal on
      every rank (a DDP model and optimizer), stored once.
    * ``optimizer_owned_keys(tensors: Mapping[str, Tensor]) -> set[str]`` [none]: with
      ``overlap_staging``, the keys only ``optimizer.step()`` mutates, copied in the background.
    * ``optimizers() -> list[torch.optim.Optimizer]`` [``[]``]: with ``overlap_staging``, the
      optimizers whose next ``step()`` waits for that copy.
    * ``load_optional_key(key: str) -> bool`` [``False``]: a key that may be missing on either side
      (optimizer state of a parameter that has not stepped yet).
    * ``check_load(state_dict: Mapping[str, Any], *, allow_cast: bool) -> list[str]`` [no check]:
      the state's own check of the checkpoint's tree (tensors as ``meta`` tensors) before anything
      is read; raises :class:`~torch_ckpt.StateMismatchError`, returns casts to log.
    * ``load_target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None``
      [a buffer like the live tensor]: the tensor to read ``key`` into (e.g. placed where the
      optimizer keeps it); needed for optional keys the live state lacks.
    * ``load_session() -> ContextManager[None]`` [none]: held around one restore, from
      ``state_dict()`` to the end of ``load_state_dict()``, for work its hooks share.
    """

    def load_state_dict(self, state_dict: dict[str, Any], /) -> object:
        """Take the checked, restored values (the same structure as :meth:`state_dict`); the result is ignored."""


#: What a save accepts: an object with ``state_dict()`` (any :class:`Checkpointable`) or a plain mapping.
StateToSave: TypeAlias = HasStateDict | Mapping[str, Any]
#: What a restore accepts: a :class:`Checkpointable` (any DCP ``Stateful``) or a plain mutable mapping.
StateToRestore: TypeAlias = Checkpointable | MutableMapping[str, Any]
