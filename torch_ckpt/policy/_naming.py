"""Naming of checkpoint directories under a run root: the seam adapters plug their conventions into."""

from __future__ import annotations

import re
import string
from typing import Any, Protocol, runtime_checkable

from torch_ckpt.errors import ConfigError

__all__ = ["Naming", "StepNaming", "PatternNaming", "MAX_STEP", "check_step"]

#: The largest step a checkpoint can hold (a manifest stores it as a signed 64-bit integer).
MAX_STEP = (1 << 63) - 1


def check_step(step: Any, what: str = "step") -> int:
    """``step`` if it is an ``int`` (not a bool) in ``[0, MAX_STEP]``.

    Raises:
        ConfigError: any other value, named with ``what`` (a reader would refuse such a manifest).
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"{what} must be an integer from 0 to {MAX_STEP} (2**63 - 1), got {step!r}")
    return step


@runtime_checkable
class Naming(Protocol):
    """How the checkpoint of a step is named under a run root (one path component).

    The manager, the durable tier and retention only list names the naming parses, so other tools'
    folders sharing the root (an older plain-Accelerate ``checkpoint_3``) are never listed, written
    into or deleted. Implementations must be pure (no I/O) and exact inverses on their own names:
    ``step_of(name(step)) == step`` for every step >= 0, and ``step_of`` returns None for any name
    that ``name`` cannot produce.
    """

    def name(self, step: int) -> str:
        """Directory name of ``step`` (one path component, not hidden)."""

    def step_of(self, name: str) -> int | None:
        """The step a directory name stands for, or None when it is not one of this naming's names."""


class PatternNaming:
    """Names from a pattern with exactly one ``{step}`` field, e.g. ``"checkpoint_{step}"``.

    Args:
        pattern: a :meth:`str.format` pattern with one ``{step}`` field, optionally with an integer
            format spec (``{step:06d}``); the rest is literal text. The result must be one path
            component that does not start with '.'.

    Raises:
        ConfigError: the pattern has no, or more than one, field, another field name, a non-integer
            format spec, a conversion, or produces an invalid name.
    """

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise ConfigError(f"naming pattern must be a str such as 'checkpoint_{{step}}', got {pattern!r}")
        try:
            parts = list(string.Formatter().parse(pattern))
        except ValueError as exc:
            raise ConfigError(f"naming pattern {pattern!r} is not a valid format string: {exc}") from exc
        fields = [(field, spec, conv) for _, field, spec, conv in parts if field is not None]
        if len(fields) != 1 or fields[0][0] != "step" or fields[0][2]:
            raise ConfigError(f"naming pattern {pattern!r} must contain exactly one '{{step}}' field "
                              "(optionally '{step:06d}'), e.g. 'checkpoint_{step}'")
        spec = fields[0][1] or ""
        if spec and not re.fullmatch(r"0?\d*d", spec):
            raise ConfigError(f"naming pattern {pattern!r}: the step's format spec must be an integer one "
                              f"such as '06d', got {spec!r}")
        regex = ""
        for literal, field, _, _ in parts:
            regex += re.escape(literal)
            if field is not None:
                regex += r"(\d+)"
        self.pattern = pattern
        self._re = re.compile(f"^{regex}$")
        name = self.name(0)
        if not name or name.startswith(".") or "/" in name or "\0" in name:
            raise ConfigError(f"naming pattern {pattern!r} produces {name!r}, which must be one non-empty path "
                              "component that does not start with '.'")

    def name(self, step: int) -> str:
        """The directory name of ``step``."""
        return self.pattern.format(step=step)

    def step_of(self, name: str) -> int | None:
        """The step ``name`` stands for, or None (also for a non-canonical form such as ``checkpoint_007``)."""
        m = self._re.match(name)
        if m is None:
            return None
        step = int(m.group(1))
        return step if self.name(step) == name else None

    def __repr__(self) -> str:
        return f"PatternNaming({self.pattern!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PatternNaming) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)


class StepNaming(PatternNaming):
    """``step_000000042``, the default: zero-padded to 9 digits (ordering uses the manifest's integer step)."""

    def __init__(self) -> None:
        super().__init__("step_{step:09d}")

    def __repr__(self) -> str:
        return "StepNaming()"
