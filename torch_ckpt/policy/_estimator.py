"""Online estimates of a save's cost and durability lag, and the interval they give: :class:`IntervalEstimator`.

The runtime :class:`~torch_ckpt.policy._schedule.YoungDaly` policy owns one. It averages what each save
measured (its blocking time plus the training slowdown while it persisted, and the time until it
was durable), takes the step time from the :class:`~torch_ckpt.policy._cadence.StepTimeEstimator` it is
handed, and turns these into an interval with :func:`torch_ckpt.policy._interval.checkpoint_interval`,
the same pure rule ``torch-ckpt plan`` and ``torch-ckpt simulate`` use. Times in seconds.
"""

from __future__ import annotations

from typing import Any

from torch_ckpt._values import to_seconds
from torch_ckpt.policy._cadence import StepTimeEstimator
from torch_ckpt.policy._interval import FORMULAS, Interval, checkpoint_interval

__all__ = ["IntervalEstimator"]


class _Ewma:
    """Exponentially weighted moving average whose last sample can be replaced."""

    __slots__ = ("alpha", "value", "_before_last")

    def __init__(self, alpha: float, value: float | None = None) -> None:
        self.alpha = alpha
        self.value = value
        self._before_last = value

    def update(self, sample: float) -> None:
        self._before_last = self.value
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)

    def replace_last(self, sample: float) -> None:
        self.value = self._before_last
        self.update(sample)


class IntervalEstimator:
    """Online estimates of the save cost and durability lag, and the interval they give.

    The cost ``C`` of a save is an exponentially weighted moving average (EWMA, weight
    ``ewma_alpha``) of its ``blocking_s + slowdown_s``; ``initial_cost_s`` stands for it only until
    the first save is measured, whose cost then replaces it (a prior of 5 s against a real 0.005 s
    would otherwise keep saves 20-30x too rare for the first several saves); the durability
    lag ``L`` an EWMA of ``durable_after_s - blocking_s``. The step time comes from a
    :class:`~torch_ckpt.policy._cadence.StepTimeEstimator`: its own, fed by :meth:`record_step`, until
    :meth:`use_step_time` hands it the one a :class:`~torch_ckpt.policy._cadence.Cadence` feeds. The
    interval is :func:`checkpoint_interval` of these estimates.

    Args:
        mtbf_s: Mean time between failures of the job, in seconds (> 0).
        initial_cost_s: ``C`` before the first save is measured, in seconds (>= 0).
        formula: ``"daly"`` or ``"young"`` (keys of :data:`FORMULAS`).
        min_interval_steps: Smallest interval in steps (>= 1).
        ewma_alpha: Weight of a new save measurement, in ``(0, 1]``.

    Raises:
        ValueError: If an argument is out of range.
    """

    def __init__(
        self,
        mtbf_s: float,
        *,
        initial_cost_s: float,
        formula: str = "daly",
        min_interval_steps: int = 1,
        ewma_alpha: float = 0.3,
    ) -> None:
        if formula not in FORMULAS:
            raise ValueError(f"formula must be one of {sorted(FORMULAS)}, got {formula!r}")
        if not 0.0 < float(ewma_alpha) <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        if isinstance(min_interval_steps, bool) or not isinstance(min_interval_steps, int) or min_interval_steps < 1:
            raise ValueError(f"min_interval_steps must be an integer >= 1, got {min_interval_steps!r}")
        self.mtbf_s = to_seconds("mtbf_s", mtbf_s, positive=True)
        self.initial_cost_s = to_seconds("initial_cost_s", initial_cost_s, positive=False)
        self.formula = formula
        self.min_interval_steps = min_interval_steps
        self._alpha = float(ewma_alpha)
        self._step_time = StepTimeEstimator()
        self._owns_step_time = True
        self.load_state_dict({})

    def use_step_time(self, estimator: StepTimeEstimator) -> None:
        """Read the step time from ``estimator`` (fed by its owner) instead of :meth:`record_step`.

        An estimate this object already has seeds ``estimator`` if that one has none yet.
        """
        if estimator.seconds is None:
            estimator.seconds = self._step_time.seconds
        self._step_time, self._owns_step_time = estimator, False

    def record_step(self, step: int, now_s: float) -> None:
        """Measure the step time from consecutive calls (step, monotonic seconds), unless shared."""
        if self._owns_step_time:
            self._step_time.record_step(step, now_s)

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float) -> None:
        """Add one save's measurements, in seconds; a repeated ``step`` replaces its earlier sample.

        Raises:
            ValueError: If a duration is negative or not finite.
        """
        cost = to_seconds("blocking_s", blocking_s, positive=False)
        cost += to_seconds("slowdown_s", slowdown_s, positive=False)
        if step == self._cost_step:
            self._cost.replace_last(cost)
        else:
            self._cost.update(cost)
            self._cost_step = step
            if self._owns_step_time:
                self._step_time.skip_next()  # the next step's duration includes this stall
        if durable_after_s is not None:
            lag = max(0.0, to_seconds("durable_after_s", durable_after_s, positive=False) - blocking_s)
            if step == self._lag_step:
                self._lag.replace_last(lag)
            else:
                self._lag.update(lag)
                self._lag_step = step

    def interval(self) -> Interval:
        """:func:`checkpoint_interval` of the current estimates (``interval_steps`` is ``None``
        until a step time has been measured)."""
        return checkpoint_interval(
            self.mtbf_s,
            self.initial_cost_s if self._cost.value is None else float(self._cost.value),
            self._lag.value or 0.0,
            self._step_time.seconds or None,
            formula=self.formula,
            min_interval_steps=self.min_interval_steps,
        )

    def plan(self) -> dict[str, Any]:
        """The interval the current estimates give, as a dict.

        Returns:
            ``formula``, ``mtbf_s``, ``cost_s``, ``step_time_s`` (``None`` until measured),
            ``durable_after_s`` (``C + L``), ``durability_lag_s``, ``optimal_interval_s`` (the
            formula's ``T``), ``interval_s``, ``interval_steps`` (``None`` without a step time),
            ``limited_by`` (``"formula"``, ``"durability"`` or ``"min_interval_steps"``),
            ``expected_overhead`` and ``expected_lost_work_s`` (at ``interval_s``).
        """
        d = self.interval().as_dict()
        d["cost_s"] = d.pop("save_cost_s")
        return d

    def state_dict(self) -> dict[str, Any]:
        """The estimates (``cost_s``, ``step_time_s``, ``durability_lag_s``; None: not measured yet)."""
        return {
            "cost_s": self._cost.value,
            "step_time_s": self._step_time.seconds,
            "durability_lag_s": self._lag.value,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (missing keys start fresh; clock state is reset)."""
        cost = state.get("cost_s")
        self._cost = _Ewma(self._alpha, None if cost is None else float(cost))  # None: initial_cost_s until measured
        self._lag = _Ewma(self._alpha, state.get("durability_lag_s"))
        step_time = state.get("step_time_s")
        if self._owns_step_time:
            self._step_time = StepTimeEstimator(step_time)
        elif step_time is not None:
            self._step_time.seconds = float(step_time)
        self._cost_step: int | None = None
        self._lag_step: int | None = None
