"""``SaveHandle``: what an asynchronous save returns (two futures and per-save statistics)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SaveHandle", "SaveStats"]


@dataclass(kw_only=True)
class SaveStats:
    """Per-save measurements (seconds and bytes). Filled in as the save progresses.

    Attributes:
        step: training step saved.
        bytes: tensor bytes this rank staged.
        blocking_s: time ``save()`` held the caller (includes ``wait_for_previous_s``).
        wait_for_previous_s: part of ``blocking_s`` spent waiting for the previous save.
        staging_s: device/host copy into the reusable host buffers.
        persist_s: background write + commit time (from staged to committed).
        total_s: from the ``save()`` call until committed.
        files_bytes: bytes of all files of the committed checkpoint (all ranks).
        mode: "async", "sync" or "sync-over-budget".
        wall_time: Unix time (seconds) of the ``save()`` call: when the saved state was captured.
    """

    step: int
    bytes: int = 0
    blocking_s: float = 0.0
    wait_for_previous_s: float = 0.0
    staging_s: float = 0.0
    persist_s: float = 0.0
    total_s: float = 0.0
    files_bytes: int = 0
    mode: str = "async"
    wall_time: float = field(default_factory=time.time)

    @property
    def gb_per_s(self) -> float:
        """Throughput of the whole save in GB/s (10^9 bytes), ``bytes / total_s``."""
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for loggers and trackers), including ``gb_per_s``."""
        d = asdict(self)
        d["gb_per_s"] = self.gb_per_s
        return d


class SaveHandle:
    """Handle of one save.

    Attributes:
        step: the step being saved.
        staged: future resolved (with None) once the state has been copied off the live tensors;
            training may then mutate them.
        committed: future resolved (with the committed directory path, a str) once the checkpoint is
            durable and listed; it raises the save's error if persisting failed.
        stats: :class:`SaveStats`, complete once ``committed`` is done.

    A save's error raised by :meth:`wait` counts as raised: the next ``save()``, ``wait()`` or ``close()`` of
    the manager does not raise it again (``on_raised``, from the engine, is told so).
    """

    def __init__(self, step: int, staged: Future[None], committed: Future[str], stats: SaveStats, *,
                 on_raised: Callable[[BaseException], None] | None = None) -> None:
        self.step = step
        self.staged = staged
        self.committed = committed
        self.stats = stats
        self._on_raised = on_raised

    def done(self) -> bool:
        """True once the save is committed or failed."""
        return self.committed.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; returns the checkpoint path or raises the save's error (then raised once).

        Raises:
            TimeoutError: not committed within ``timeout`` seconds (the save goes on).
            CheckpointError: the save failed (the class of its error; see ``docs/errors.md``).
        """
        try:
            return self.committed.result(timeout)
        except BaseException as exc:
            if self._on_raised is not None and self.committed.done() and self.committed.exception() is exc:
                self._on_raised(exc)
            raise

    def __repr__(self) -> str:
        state = "committed" if self.committed.done() and not self.committed.exception() else (
            "failed" if self.committed.done() else ("staged" if self.staged.done() else "staging"))
        return f"SaveHandle(step={self.step}, {state})"
