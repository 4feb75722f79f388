"""Retention policies: which committed checkpoints to keep. Pure objects (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch_ckpt._values import check_int

__all__ = ["RetentionPolicy", "KeepLatest", "KeepEveryNSteps", "KeepAny", "apply_retention"]


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed steps survive. Implementations must not do I/O.

    The manager applies it only *after* a new checkpoint is committed, and always keeps the newest
    committed step whatever the policy says, so retention can never delete the last good checkpoint.
    """

    def keep(self, steps: Sequence[int]) -> set[int]:
        """Return the subset of ``steps`` (ascending, committed) to keep."""


@dataclass(frozen=True, kw_only=True)
class KeepLatest:
    """Keep the ``count`` numerically newest steps.

    Raises:
        ConfigError: ``count`` < 1.
    """

    count: int

    def __post_init__(self) -> None:
        check_int("KeepLatest.count", self.count, 1)

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.count:])


@dataclass(frozen=True, kw_only=True)
class KeepEveryNSteps:
    """Keep every step that is a multiple of ``every_steps`` (long-term history).

    Raises:
        ConfigError: ``every_steps`` < 1.
    """

    every_steps: int

    def __post_init__(self) -> None:
        check_int("KeepEveryNSteps.every_steps", self.every_steps, 1)

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.every_steps == 0}


@dataclass(frozen=True)
class KeepAny:
    """Keep a step if any of the given policies keeps it."""

    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set().union(*(p.keep(steps) for p in self.policies))


def apply_retention(policy: RetentionPolicy | None, steps: Sequence[int], *,
                    protected: Sequence[int] = ()) -> list[int]:
    """The steps to delete (ascending): never the newest one, nor any of ``protected`` (being restored, replicated)."""
    if policy is None or not steps:
        return []
    ordered = sorted(steps)
    keep = set(policy.keep(ordered)) | {ordered[-1]} | set(protected)
    return [s for s in ordered if s not in keep]
