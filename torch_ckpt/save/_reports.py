"""``SaveReports``: each committed save's statistics once, and the lost-work health figure at a steady pace.

For integrations that forward checkpoint figures to a metrics logger from the training thread
(Accelerate's trackers, Lightning's loggers): they :meth:`~SaveReports.add` each save's handle,
and at their next convenient point take :meth:`~SaveReports.committed` and
:meth:`~SaveReports.lost_work`. Nothing here blocks or logs by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from torch_ckpt._values import to_seconds
from torch_ckpt.handle import SaveHandle

__all__ = ["STAT_KEYS", "SaveReports"]

#: The per-save figures :meth:`SaveReports.metrics` reports (see :class:`~torch_ckpt.save.SaveStats`).
STAT_KEYS = ("blocking_s", "wait_for_previous_s", "staging_s", "persist_s", "total_s", "bytes", "files_bytes",
             "gb_per_s")


class SaveReports:
    """Hands back every tracked save once it committed, and paces the lost-work health figure.

    Not thread-safe: use it from the training thread.

    Args:
        health_every_seconds: Least time between two lost-work figures (seconds or a duration
            such as ``"1m"``, >= 0), unless a save committed in between.
        clock: Monotonic clock in seconds (injected by tests).

    Raises:
        ConfigError: ``health_every_seconds`` is not a non-negative duration.
    """

    def __init__(self, *, health_every_seconds: float | str = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._every = to_seconds("health_every_seconds", health_every_seconds, positive=False)
        self._clock = clock
        self._pending: list[tuple[SaveHandle, int | None]] = []
        self._last_health: float | None = None
        self._committed_since = False

    def add(self, handle: SaveHandle, step: int | None = None) -> None:
        """Track ``handle``, to be reported at training step ``step`` (None: unknown; a checkpoint's
        number, ``handle.step``, need not be a training step)."""
        self._pending.append((handle, None if step is None else int(step)))

    def committed(self) -> list[tuple[SaveHandle, int | None]]:
        """The tracked saves that finished since the last call, in save order, without failed ones.

        Returns:
            ``(handle, training step given to add)`` pairs; a save still running holds back the
            ones after it.
        """
        done: list[tuple[SaveHandle, int | None]] = []
        while self._pending and self._pending[0][0].done():
            handle, step = self._pending.pop(0)
            if handle.committed.exception() is None:
                done.append((handle, step))
        self._committed_since = self._committed_since or bool(done)
        return done

    def lost_work(self, health: Callable[[], Mapping[str, Any]]) -> float | None:
        """The training time a failure now would lose (seconds), when a figure is due; else None.

        Due after a save committed (seen by :meth:`committed`) or ``health_every_seconds`` after the
        last figure. ``health`` (e.g. ``CheckpointManager.health``) is called only when due.

        Returns:
            ``health()["lost_work_if_failure_now_s"]``, or None when not due or not known yet.
        """
        now = self._clock()
        if not self._committed_since and self._last_health is not None and now - self._last_health < self._every:
            return None
        lost = health().get("lost_work_if_failure_now_s")
        if lost is not None:
            self._last_health, self._committed_since = now, False
        return lost

    @staticmethod
    def metrics(handle: SaveHandle, prefix: str = "checkpoint/", keys: tuple[str, ...] = STAT_KEYS) -> dict[str, float]:
        """``{prefix + key: value}`` of the save's :class:`~torch_ckpt.save.SaveStats` for ``keys``, as floats."""
        stats = handle.stats.as_dict()
        return {prefix + key: float(stats[key]) for key in keys}
