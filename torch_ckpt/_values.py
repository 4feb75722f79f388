"""Value checks for :class:`~torch_ckpt.CheckpointConfig`: byte sizes, durations, bounded ints, "not given".

Each check raises :class:`~torch_ckpt.ConfigError` naming the setting, the value and what is accepted.
"""

from __future__ import annotations

import math
import re
from typing import Any

from torch_ckpt.durations import parse_duration
from torch_ckpt.errors import ConfigError

__all__ = ["DEFAULT", "DefaultType", "check_bool", "check_int", "parse_size", "to_bytes", "to_seconds"]


class DefaultType:
    """Type of :data:`DEFAULT`: "not given: use the configuration's value", for keyword arguments."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<default>"


#: Default of keyword arguments that mirror a config field (the manager's): ``config=`` is overridden only by
#: what was passed.
DEFAULT = DefaultType()

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*")


def parse_size(value: str | int) -> int:
    """Bytes (rounded down) from an int or a number with an optional, case-insensitive unit: B, KB, MB, GB,
    TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. ``"4GB"``, ``"512MiB"``, ``"1.5TB"``.

    Raises ValueError for a string that is not a size (the message lists the units), a negative or an
    infinite one; TypeError for a type other than ``str`` and ``int`` (``bool`` and ``float`` included).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"size must be an int of bytes or a string such as '4GB', got {type(value).__name__}: "
                        f"{value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value!r}")
        return value
    match = _SIZE.fullmatch(value.lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"invalid size {value!r}: expected bytes or a number with a unit "
                         "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. '4GB'")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if not math.isfinite(size):
        raise ValueError(f"size must be finite, got {value!r}")
    return int(size)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True``/``False`` (``1`` and ``"yes"`` are refused), else :class:`ConfigError`."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool, not ``2.0``) in ``[minimum, maximum]``, else :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def to_seconds(name: str, value: Any, *, positive: bool) -> float:
    """Seconds from a number or a duration such as ``"8h"``; ConfigError if negative (or 0 when ``positive``)."""
    try:
        seconds = float(parse_duration(value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if seconds < 0 or (positive and seconds == 0):
        raise ConfigError(f"{name} must be {'positive' if positive else 'non-negative'} (seconds or a duration such "
                          f"as '15m'), got {value!r}")
    return seconds


def to_bytes(name: str, value: Any) -> int:
    """Bytes (at least 1) from an int or a size such as ``"4GB"`` (:func:`parse_size`), else :class:`ConfigError`."""
    try:
        size = parse_size(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if size < 1:
        raise ConfigError(f"{name} must be at least 1 byte, got {value!r}")
    return size
