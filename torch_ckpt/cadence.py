"""``Cadence``: feeds a :class:`~torch_ckpt.schedule.SavePolicy` with what the manager measures.

The policy itself is pure; this small stateful adapter (owned by the manager, used on the
caller's thread only) records every training step, measures how much slower steps run while a save
is persisting (the background interference that, added to the blocking time, makes up the cost
``C`` of a save), and reports each save twice: when its blocking part ends and once it is durable.
"""

from __future__ import annotations

from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.handle import SaveHandle

__all__ = ["Cadence"]

log = get_logger(__name__)


class Cadence:
    """Step/save bookkeeping around a save policy.

    Args:
        policy: the save policy (``should_save``, ``record_step``, ``record_save``, ``describe``).
        ewma_alpha: weight of a new sample in the baseline step-time average.
    """

    def __init__(self, policy: Any, *, ewma_alpha: float = 0.2) -> None:
        self.policy = policy
        self._alpha = ewma_alpha
        self._last_step_time: float | None = None
        self._baseline_step_s: float | None = None
        self._pending: SaveHandle | None = None
        self._slowdown_s = 0.0
        self._skip_next = False

    def record_step(self, step: int, now_s: float) -> None:
        """Record that ``step`` just finished at monotonic time ``now_s`` (seconds)."""
        if self._last_step_time is not None:
            dt = now_s - self._last_step_time
            if self._skip_next:  # this step contained a save's blocking part: not a training sample
                self._skip_next = False
            elif self._pending is not None and not self._pending.done():
                if self._baseline_step_s is not None:
                    self._slowdown_s += max(0.0, dt - self._baseline_step_s)
            else:
                b = self._baseline_step_s
                self._baseline_step_s = dt if b is None else (1 - self._alpha) * b + self._alpha * dt
        self._last_step_time = now_s
        self._report_durable(now_s)
        self.policy.record_step(step, now_s)

    def _report_durable(self, now_s: float) -> None:
        handle = self._pending
        if handle is None or not handle.done():
            return
        self._pending = None
        if handle.committed.exception() is None:
            s = handle.stats
            self.policy.record_save(handle.step, blocking_s=s.blocking_s, durable_after_s=s.total_s,
                                    slowdown_s=self._slowdown_s, now_s=now_s)
        self._slowdown_s = 0.0

    def record_save_started(self, handle: SaveHandle, now_s: float) -> None:
        """Report a save whose blocking part just ended (its durability is reported later)."""
        self._report_durable(now_s)
        self.policy.record_save(handle.step, blocking_s=handle.stats.blocking_s, durable_after_s=None,
                                slowdown_s=0.0, now_s=now_s)
        self._pending = handle
        self._slowdown_s = 0.0
        self._skip_next = True

    def decide(self, step: int, now_s: float) -> bool:
        """The policy's decision for ``step`` (call after :meth:`record_step`)."""
        decision = bool(self.policy.should_save(step, now_s))
        if decision:
            log.info("save policy: saving at step %d (%s)", step, self.policy.describe())
        return decision
