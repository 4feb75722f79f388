"""When-to-save bookkeeping: the one step-time estimator and the ``Cadence`` that feeds a policy.

:class:`StepTimeEstimator` is the single measurement of "seconds per training step" used for
scheduling: an exponentially weighted moving average (EWMA, weight :data:`STEP_TIME_ALPHA` per
new sample) of the time between consecutive steps, leaving out the step that contained a save's
stall and the steps run while a save persisted in the background (those are slower because of the
save, and that slowdown is counted in the save's cost instead). The interval in steps then comes
from :func:`torch_ckpt.policy._interval.checkpoint_interval` (Young 1974, Daly 2006).

:class:`Cadence` is the small stateful adapter the manager (and the framework adapters) own, used
on the caller's thread only: it records every training step into the estimator, measures how much
slower steps run while a save is persisting (the background interference that, added to the
blocking time, makes up the cost ``C`` of a save), reports each save twice to the policy (when its
blocking part ends and once it is durable), and lends its estimator to the policy so the runtime
has exactly one step-time estimate. All times are passed in (monotonic seconds), so tests drive it
with a fake clock.
"""

from __future__ import annotations

from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.handle import SaveHandle

__all__ = ["STEP_TIME_ALPHA", "StepTimeEstimator", "Cadence"]

log = get_logger(__name__)

#: Weight of a new sample in the step-time EWMA (the only step-time average in the library).
STEP_TIME_ALPHA = 0.2


class StepTimeEstimator:
    """Seconds per training step from the times at which consecutive steps finish.

    Each call to :meth:`record_step` with a later step than the previous call measures
    ``(now_s - previous_now_s) / (step - previous_step)``; the sample updates an EWMA with weight
    :data:`STEP_TIME_ALPHA` unless it is excluded (``sample=False``, or the interval was marked by
    :meth:`skip_next` because it contained a save's stall). A step that does not advance (same or
    earlier step, e.g. after a rollback) or a clock that goes back restarts the measurement without
    a sample.

    Args:
        seconds: Initial estimate in seconds (``None``: unknown until two steps are recorded).
    """

    __slots__ = ("seconds", "_prev", "_skip_next")

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds: float | None = seconds
        self._prev: tuple[int, float] | None = None
        self._skip_next = False

    def record_step(self, step: int, now_s: float, *, sample: bool = True) -> float | None:
        """Note that ``step`` finished at monotonic time ``now_s`` (seconds).

        Args:
            step: The optimizer step that just finished.
            now_s: Monotonic time in seconds.
            sample: ``False`` to measure the interval without averaging it in (a step slowed by a
                save persisting in the background).

        Returns:
            The measured seconds per step since the previous call, or ``None`` when there is no
            previous call, the step did not advance, or the clock went back. Returned even when
            the sample is excluded, so callers can measure a slowdown against :attr:`seconds`.
        """
        prev, self._prev = self._prev, (step, now_s)
        skip, self._skip_next = self._skip_next, False
        if prev is None or step <= prev[0] or now_s < prev[1]:
            return None
        delta = (now_s - prev[1]) / (step - prev[0])
        if sample and not skip:
            self.seconds = delta if self.seconds is None else self.seconds + STEP_TIME_ALPHA * (delta - self.seconds)
        return delta

    def skip_next(self) -> None:
        """Exclude the next measured interval (it contains a save's blocking stall)."""
        self._skip_next = True


class Cadence:
    """Step/save bookkeeping around a save policy.

    If the policy has an ``use_step_time(estimator)`` method (``YoungDaly``, ``AnyOf``), the cadence
    lends it :attr:`step_time`, so the policy's interval in steps and the slowdown measured here use
    the same estimate.

    Args:
        policy: the save policy (``should_save``, ``record_step``, ``record_save``, ``describe``).
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.step_time = StepTimeEstimator()
        share = getattr(policy, "use_step_time", None)
        if callable(share):
            share(self.step_time)
        self._pending: SaveHandle | None = None
        self._slowdown_s = 0.0
        self._stall_next = False

    def record_step(self, step: int, now_s: float) -> None:
        """Record that ``step`` just finished at monotonic time ``now_s`` (seconds)."""
        baseline = self.step_time.seconds
        persisting = self._pending is not None and not self._pending.done()
        stall, self._stall_next = self._stall_next, False  # this step held a save's blocking part
        delta = self.step_time.record_step(step, now_s, sample=not persisting)
        if persisting and not stall and delta is not None and baseline is not None:
            self._slowdown_s += max(0.0, delta - baseline)
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
        self._stall_next = True
        self.step_time.skip_next()

    def decide(self, step: int, now_s: float) -> bool:
        """The policy's decision for ``step`` (call after :meth:`record_step`)."""
        decision = bool(self.policy.should_save(step, now_s))
        if decision:
            log.info("save policy: saving at step %d (%s)", step, self.policy.describe())
        return decision
