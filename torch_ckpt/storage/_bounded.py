"""Bounded parsing of untrusted checkpoint content, and the errors it raises.

Every reader of a checkpoint treats its files as untrusted input: JSON is parsed with bounded
nesting and integer length (:func:`loads_bounded`), values are shown in messages shortened
(:func:`short_repr`), and anything malformed becomes a
:class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file (:func:`corrupt`).
"""

from __future__ import annotations

import json
from typing import Any

from torch_ckpt.errors import CheckpointCorruptError

__all__ = ["Malformed", "corrupt", "short_repr", "loads_bounded"]


class Malformed(ValueError):
    """One malformed piece of content (its message does not name the file; the caller adds it)."""


def corrupt(source: str, text: str) -> CheckpointCorruptError:
    """The error for malformed content ``text`` of the file ``source``."""
    return CheckpointCorruptError(f"{source}: {text}")


def short_repr(value: Any) -> str:
    """``repr(value)`` shortened to at most 120 characters (for messages about untrusted values)."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-57:]}"


def _max_depth(value: Any) -> int:
    """Nesting depth of containers in a parsed JSON value, computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def loads_bounded(raw: bytes, source: str, *, what: str, max_depth: int, max_int_digits: int) -> Any:
    """Parse JSON from untrusted bytes with bounded nesting and integer length.

    Args:
        raw: the file's bytes (already bounded in size by the caller).
        source: the file's path or URL, for messages.
        what: what the file is ("manifest", "per-rank state file"), for messages.
        max_depth: deepest nesting of objects and arrays accepted.
        max_int_digits: longest integer literal accepted (digits).

    Raises:
        CheckpointCorruptError: not UTF-8 JSON, nested deeper than ``max_depth`` (the parser's own
            recursion limit included) or holding a longer integer; the message names ``source``.
    """

    def parse_int(text: str) -> int:
        digits = len(text) - text.startswith("-")
        if digits > max_int_digits:
            raise Malformed(f"holds an integer of {digits} digits (at most {max_int_digits} are accepted)")
        return int(text)

    try:
        data = json.loads(raw, parse_int=parse_int)
    except Malformed as exc:
        raise corrupt(source, f"{what} {exc}") from None
    except RecursionError:
        raise corrupt(source, f"{what} is nested too deeply to parse (at most {max_depth} levels are "
                               "accepted)") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise corrupt(source, f"{what} is not valid JSON ({exc})") from None
    depth = _max_depth(data)
    if depth > max_depth:
        raise corrupt(source, f"{what} is nested {depth} levels deep (at most {max_depth} are accepted)")
    return data
