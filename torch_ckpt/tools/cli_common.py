"""Helpers shared by the ``torch-ckpt`` subcommands: the usage error, argument types and number formats."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from torch_ckpt._values import to_seconds
from torch_ckpt.durations import format_duration
from torch_ckpt.errors import ConfigError

__all__ = ["UsageError", "duration_type", "fmt_bytes", "fmt_time", "int_type", "interval_rows",
           "non_negative_duration", "positive_duration", "positive_float", "print_json", "print_result"]


class UsageError(ValueError):
    """A bad combination of arguments; ``main`` prints it and returns exit code 2."""


def print_json(payload: Any) -> None:
    """Print ``payload`` as indented JSON (the ``--json`` output)."""
    print(json.dumps(payload, indent=2))


def print_result(result: dict[str, Any], as_json: bool, to_text: Callable[[dict[str, Any]], str]) -> None:
    """Print a command's ``result``: as JSON with ``--json`` (``as_json``), else as ``to_text(result)``."""
    if as_json:
        print_json(result)
    else:
        print(to_text(result))


def duration_type(minimum: str) -> Callable[[str], float]:
    """An argparse type parsing a duration ("8h", "90s", "1.5") that must be ``minimum`` ("positive"/"non-negative")."""
    def parse(text: str) -> float:
        try:
            return to_seconds("duration", text, positive=minimum == "positive")
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "duration"  # argparse names the type in its messages
    return parse


def int_type(minimum: int) -> Callable[[str], int]:
    """An argparse type parsing a whole number ``>= minimum`` ("4", not "4.0")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


positive_duration = duration_type("positive")
"""An argparse type: a duration > 0 seconds."""
non_negative_duration = duration_type("non-negative")
"""An argparse type: a duration >= 0 seconds."""


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fmt_bytes(n: float | None) -> str:
    """``1.2 GB`` for 1.2e9 bytes (decimal units); "-" for None."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_time(seconds: float) -> str:
    """A duration for tables, with the seconds added from one minute up."""
    return f"{format_duration(seconds)} ({seconds:.1f} s)" if seconds >= 60 else format_duration(seconds)


def interval_rows(plans: list[dict[str, Any]]) -> str:
    """The table of interval plans printed by ``plan`` and ``bench``."""
    steps = "step_time_s" in plans[0]
    head = ["MTBF", "save cost", "lag", "Young", "Daly", "recommended", "lost work/failure", "overhead"]
    rows = [head + (["steps"] if steps else [])]
    for pl in plans:
        row = [format_duration(pl["mtbf_s"]), format_duration(pl["save_cost_s"]),
               format_duration(pl["durability_lag_s"]), fmt_time(pl["young_interval_s"]),
               fmt_time(pl["daly_interval_s"]),
               fmt_time(pl["recommended_interval_s"]) + (" *" if pl["limited_by"] == "durability" else ""),
               format_duration(pl["expected_lost_work_s"]), f"{100 * pl['expected_overhead']:.2f} %"]
        rows.append(row + ([str(pl["interval_steps"])] if steps else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) + steps)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("recommended = Daly's interval" + (" in whole steps" if steps else "")
                 + "; overhead = C/T + (T/2 + lag)/MTBF at it; "
                 "lost work/failure = T/2 + lag.")
    if any(pl["limited_by"] == "durability" for pl in plans):
        lines.append("* raised to the time a save needs to become durable (save cost + lag), so saves do not pile up.")
    return "\n".join(lines)
