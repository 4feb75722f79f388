"""Checkpoint lineage: which committed steps belong to the live history after rollbacks.

A rollback (``restore()`` of a step older than the newest live one, then a save) starts a new *run
segment*, abandoning the old segment's steps beyond the restored one. Manifests of every segment but
the base one record it (``"lineage"`` in ``manifest.json``)::

    {"run": "3f9c...", "since": 1764626400.25, "parents": [["", 200], ["a81e...", 350]]}

The fields are :class:`Lineage`'s. Manifests without a record belong to the *base* segment ``""``.

The rule, asked by every tier (listing and resume, node-local resume, the durable tier's uploads and
retention, ``torch-ckpt ls``): of the segments any tier holds a checkpoint of, the one that began last
is the *head*; a checkpoint is *live* when its segment is the head, or one of the head's parents and
its step is at most the step at which that parent was left; every other checkpoint is *superseded*:
never resumed, listed as latest, kept by retention instead of a live one, or uploaded over. A new
segment begins later than every segment its restore saw (:func:`new_segment`), so clock skew between
restarts cannot order a fork before its parent.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["BASE", "Lineage", "MalformedLineage", "head_of", "lineage_from_doc", "new_segment", "successor"]

_MAX_RUN_CHARS = 64


@dataclass(frozen=True)
class Lineage:
    """The run segment a checkpoint belongs to: ``run``, its id (lowercase hex; ``""`` for the base segment),
    ``since``, the Unix time (seconds) it began (0.0 for the base), and ``parents``, ``((run, step), ...)``
    oldest first: the segments it descends from, each with the step at which it was left (restored)."""

    run: str = ""
    since: float = 0.0
    parents: tuple[tuple[str, int], ...] = ()

    @property
    def is_base(self) -> bool:
        """True for the base segment (manifests without a lineage record)."""
        return self.run == "" and not self.parents

    def to_json(self) -> dict[str, Any] | None:
        """The manifest's ``lineage`` object, or None for the base segment (no record is written)."""
        if self.is_base:
            return None
        return {"run": self.run, "since": self.since, "parents": [[r, s] for r, s in self.parents]}

    def holds(self, step: int, other: Lineage) -> bool:
        """True when checkpoint ``step`` of segment ``other`` is live in the history whose head is ``self``."""
        left_at = self.left_at(other)
        return other.run == self.run or (left_at is not None and step <= left_at)

    def fork(self, step: int, run: str, since: float) -> Lineage:
        """The new segment ``run`` (begun at ``since``) that continues from checkpoint ``step`` of this one."""
        return Lineage(run=run, since=since, parents=(*self.parents, (self.run, step)))

    def left_at(self, other: Lineage) -> int | None:
        """The step at which ``other``'s segment was left in this history (None: not one of its parents)."""
        return next((s for r, s in self.parents if r == other.run), None)

    def describe(self) -> str:
        """A short name for messages: ``base`` or ``run 3f9c0a1b``."""
        return "base" if self.run == "" else f"run {self.run[:8]}"


BASE = Lineage()
"""The base segment: every checkpoint whose manifest has no lineage record."""


def head_of(lineages: Iterable[Lineage]) -> Lineage:
    """Of the segments of every checkpoint of every tier seen, the one that began last (ties: the larger id)."""
    return max(lineages, key=lambda lin: (lin.since, lin.run), default=BASE)


def new_segment(seen: Iterable[Lineage], now: float | None = None) -> tuple[str, float]:
    """``(run, since)``: 16 random hex digits, and ``max(now, newest since in seen + 1 ms)`` (seconds)."""
    since = time.time() if now is None else now
    latest = max((lin.since for lin in seen), default=0.0)
    return secrets.token_hex(8), max(since, latest + 1e-3)


def successor(restored: Lineage, step: int, *, newest: bool, fork: tuple[str, float]) -> Lineage:
    """The segment of the saves after restoring checkpoint ``step`` of ``restored``: the same one only when
    ``newest`` (the newest live step, every tier seen: a plain resume), else ``fork`` (:func:`new_segment`)."""
    return restored if newest else restored.fork(step, *fork)


class MalformedLineage(ValueError):
    """A manifest's ``lineage`` object is not valid (the message says which part)."""


def lineage_from_doc(doc: Any) -> Lineage:
    """Validate a manifest's ``lineage`` object (None: the base segment); raises :class:`MalformedLineage`."""
    if doc is None:
        return BASE
    if not isinstance(doc, dict) or set(doc) != {"run", "since", "parents"}:
        raise MalformedLineage("lineage must be an object with exactly run, since and parents")
    run, since, parents = doc["run"], doc["since"], doc["parents"]
    if not _is_run(run) or run == "":
        raise MalformedLineage(f"lineage.run must be 1 to {_MAX_RUN_CHARS} lowercase hex digits")
    if type(since) not in (int, float) or not math.isfinite(since) or since < 0:
        raise MalformedLineage("lineage.since must be a finite number of seconds >= 0")
    if not isinstance(parents, list):
        raise MalformedLineage("lineage.parents must be a list of [run, step] pairs")
    chain: list[tuple[str, int]] = []
    for entry in parents:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_run(entry[0]) and type(entry[1]) is int
                and 0 <= entry[1] < (1 << 63)):
            raise MalformedLineage("lineage.parents must be a list of [run, step] pairs (run: hex or '', step >= 0)")
        chain.append((entry[0], entry[1]))
    runs = [r for r, _ in chain] + [run]
    if len(set(runs)) != len(runs):
        raise MalformedLineage("lineage.parents names a segment twice")
    return Lineage(run=run, since=float(since), parents=tuple(chain))


def _is_run(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= _MAX_RUN_CHARS and all(c in "0123456789abcdef" for c in value)
