"""Duration strings: ``8h``, ``15m``, ``2s``, ``1.5d``, ``250ms``, ``1h30m`` or plain seconds.

Every option that takes a time (MTBF, save cost, intervals) accepts these forms, in Python and on
the command line. Parsing is unit-aware only: whether zero or a negative value makes sense is up to
the caller.

Example:
    >>> parse_duration("1.5d")
    129600.0
    >>> format_duration(339.41)
    '5.66 min'
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_duration", "format_duration", "DURATION_FORMS"]

#: Seconds per unit suffix (lower case). ``m`` is minutes; milliseconds are ``ms``.
_UNIT_SECONDS: dict[str, float] = {
    "ms": 1e-3, **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0), "w": 604800.0,
}

#: The accepted forms, for error messages and ``--help``.
DURATION_FORMS = ("a number of seconds (e.g. 90 or 2.5) or a number with a unit: ms, s, m/min, h, d, w "
                  "(e.g. 250ms, 2s, 15m, 8h, 1.5d), optionally combined (1h30m)")

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_PART = re.compile(rf"\s*({_NUMBER})\s*([a-z]+)\s*")


def parse_duration(value: str | float | int) -> float:
    """Convert a duration to seconds (may be zero or negative: callers reject what they cannot use).

    Args:
        value: An ``int`` or ``float`` (already seconds), or a string: a plain number of seconds
            (``"90"``, ``"1e3"``) or one or more ``<number><unit>`` parts (``"8h"``, ``"1h30m"``),
            units as in :data:`DURATION_FORMS`; case and surrounding spaces are ignored, a leading
            sign applies to the whole value.

    Raises:
        ValueError: The string is empty, not a duration, or not finite (``inf``, ``nan``); the
            message repeats it and lists the accepted forms.
        TypeError: ``value`` is not a ``str``, ``int`` or ``float`` (``bool`` is rejected).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"duration must be a str, int or float, got {type(value).__name__}: {value!r}")
    if not isinstance(value, str):
        if not math.isfinite(float(value)):
            raise ValueError(f"duration must be finite, got {value!r}")
        return float(value)
    text = value.strip().lower()
    sign, body = (text[0], text[1:]) if text[:1] in ("+", "-") else ("", text)
    if re.fullmatch(_NUMBER, body):
        total, pos = float(body), len(body)  # "1e309" overflows to inf: refused below
    else:
        total, pos = 0.0, 0
        for part in _PART.finditer(body):
            number, unit = part.groups()
            if part.start() != pos or unit not in _UNIT_SECONDS:
                break
            total, pos = total + float(number) * _UNIT_SECONDS[unit], part.end()
    if pos == 0 or pos != len(body) or not math.isfinite(total):
        raise ValueError(f"invalid duration {value!r}: expected {DURATION_FORMS}")
    return -total if sign == "-" else total


def format_duration(seconds: float) -> str:
    """Seconds for humans: three significant digits and the largest fitting unit (parses back, to the rounding).

    Returns:
        For example ``"250 ms"``, ``"2 s"``, ``"5.66 min"``, ``"1.95 h"``, ``"1.5 d"``, ``"-inf"``.

    Raises:
        ValueError: ``seconds`` is NaN.
    """
    seconds = float(seconds)
    if math.isnan(seconds):
        raise ValueError("cannot format a NaN duration")
    if math.isinf(seconds):
        return "inf" if seconds > 0 else "-inf"
    sign, magnitude = ("-" if seconds < 0 else ""), abs(seconds)
    if magnitude == 0:
        return "0 s"
    for limit, unit, scale in ((1.0, "ms", 1e-3), (60.0, "s", 1.0), (3600.0, "min", 60.0), (86400.0, "h", 3600.0)):
        if float(f"{magnitude / scale:.3g}") * scale < limit:  # after rounding: 59.999 s is "1 min", not "60 s"
            return f"{sign}{magnitude / scale:.3g} {unit}"
    return f"{sign}{magnitude / 86400.0:.3g} d"
