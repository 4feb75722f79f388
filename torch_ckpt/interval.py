"""Optimal checkpoint intervals from the mean time between failures (MTBF) and the save cost.

Pure arithmetic, all times in seconds. The model: a job computes for ``T`` seconds, stalls for
``C`` seconds to save, and repeats; failures arrive as a Poisson process with mean ``M`` seconds
between them; a failure loses the work done since the last checkpoint that is *durable*.

* Young (1974), "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9):530-531: ``T = sqrt(2 C M)``.
* Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3):303-312, doi:10.1016/j.future.2004.11.016:
  ``T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``, else ``T = M``.

With asynchronous saves the stall ``C`` is only the blocking part (plus any slowdown of training
while the save persists), but a checkpoint protects nothing until it is durable: a failure within
the *durability lag* ``L`` after a save loses back to the save before it. Averaged over a uniform
failure time this adds ``L`` to the expected loss (for ``L <= T``), which is what
:func:`expected_lost_work` and :func:`expected_overhead` include. ``L`` does not move the optimum
to first order (it adds a constant per failure), so Young and Daly still give the interval.

:class:`IntervalEstimator` turns measurements (save stalls, step times, time to durability) into
an interval in steps; :class:`torch_ckpt.schedule.YoungDaly` decides with it.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "young_interval",
    "daly_interval",
    "expected_overhead",
    "expected_lost_work",
    "FORMULAS",
    "IntervalEstimator",
]


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return value


def _check_non_negative(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative, finite number of seconds, got {value!r}")
    return value


def young_interval(mtbf_s: float, cost_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints, ``sqrt(2 C M)``.

    Young, J. W. (1974). A first order approximation to the optimum checkpoint interval.
    Communications of the ACM, 17(9), 530-531.

    Args:
        mtbf_s: Mean time between failures of the whole job ``M``, in seconds (> 0).
        cost_s: Training stall per save ``C``, in seconds (>= 0).

    Returns:
        The interval ``T`` in seconds of compute between the end of one save and the next.

    Raises:
        ValueError: If ``mtbf_s`` is not positive and finite, or ``cost_s`` is negative or not finite.
    """
    mtbf = _check_positive("mtbf_s", mtbf_s)
    cost = _check_non_negative("cost_s", cost_s)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(mtbf_s: float, cost_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints.

    ``T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``; for
    ``C >= 2M`` (saving costs more than twice the MTBF) the documented fallback ``T = M``.
    The restart time does not enter the optimum. Daly's worked examples (restart 10 min, C = 5 min)
    give 116.7 min for M = 24 h, 56.7 min for 6 h and 9.14 min for 15 min.

    Daly, J. T. (2006). A higher order estimate of the optimum checkpoint interval for restart
    dumps. Future Generation Computer Systems, 22(3), 303-312. doi:10.1016/j.future.2004.11.016

    Args:
        mtbf_s: Mean time between failures of the whole job ``M``, in seconds (> 0).
        cost_s: Training stall per save ``C``, in seconds (>= 0).

    Returns:
        The interval ``T`` in seconds of compute between the end of one save and the next.

    Raises:
        ValueError: If ``mtbf_s`` is not positive and finite, or ``cost_s`` is negative or not finite.
    """
    mtbf = _check_positive("mtbf_s", mtbf_s)
    cost = _check_non_negative("cost_s", cost_s)
    if cost >= 2.0 * mtbf:
        return mtbf
    ratio = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


#: Formula name -> function, as accepted by ``YoungDaly(formula=...)``.
FORMULAS = {"young": young_interval, "daly": daly_interval}


def expected_lost_work(interval_s: float, durability_lag_s: float = 0.0) -> float:
    """Expected work lost per failure: ``T/2 + L``.

    A failure at a uniformly random time loses the work since the last *durable* checkpoint:
    half an interval on average, plus the durability lag ``L`` of an asynchronous save (a failure
    within ``L`` after a save loses back to the previous one). Valid for ``L <= T``, which the
    policies enforce (saves must not pile up).

    Args:
        interval_s: Compute time between checkpoints ``T``, in seconds (> 0).
        durability_lag_s: Seconds from the end of a save's stall until it is durable ``L`` (>= 0;
            0 for synchronous saves).

    Returns:
        Expected lost work in seconds.

    Raises:
        ValueError: If ``interval_s`` is not positive and finite or ``durability_lag_s`` is negative.
    """
    interval = _check_positive("interval_s", interval_s)
    lag = _check_non_negative("durability_lag_s", durability_lag_s)
    return interval / 2.0 + lag


def expected_overhead(
    interval_s: float,
    cost_s: float,
    mtbf_s: float,
    durability_lag_s: float = 0.0,
    *,
    restart_s: float = 0.0,
) -> float:
    """First-order expected overhead fraction: ``C/T + (T/2 + L + R)/M``.

    ``C/T`` is the time spent saving per unit of useful work, ``(T/2 + L)/M`` the work redone
    per unit of time (one failure per ``M`` seconds), ``R/M`` the restarts. Minimising it over
    ``T`` gives Young's interval; it is accurate while the result is small (``T`` and ``C`` well
    below ``M``). ``torch-ckpt simulate`` measures the exact value.

    Args:
        interval_s: Compute time between checkpoints ``T``, in seconds (> 0).
        cost_s: Training stall per save ``C``, in seconds (>= 0).
        mtbf_s: Mean time between failures ``M``, in seconds (> 0).
        durability_lag_s: Seconds from the end of a save's stall until it is durable ``L`` (>= 0).
        restart_s: Time to restart after a failure ``R``, in seconds (>= 0; default 0 leaves it out,
            as in the formula used for logging decisions).

    Returns:
        The overhead as a fraction (0.01 = 1 %).

    Raises:
        ValueError: If an argument is out of range (see each argument).
    """
    interval = _check_positive("interval_s", interval_s)
    cost = _check_non_negative("cost_s", cost_s)
    mtbf = _check_positive("mtbf_s", mtbf_s)
    restart = _check_non_negative("restart_s", restart_s)
    return cost / interval + (expected_lost_work(interval, durability_lag_s) + restart) / mtbf


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
    """Online estimates of the save cost, step time and durability, and the interval they give.

    Each estimate is an exponentially weighted moving average (EWMA). The cost ``C`` of a save is
    its ``blocking_s + slowdown_s``, seeded by ``initial_cost_s``. The step time averages the time
    between :meth:`record_step` calls, leaving out the step that contained a save's stall. The
    interval is the formula's ``T`` raised to the measured time until a save is durable (so saves
    never pile up), converted to whole steps (nearest; up when set by the durability floor) and
    raised to ``min_interval_steps``.

    Args:
        mtbf_s: Mean time between failures of the job, in seconds (> 0).
        initial_cost_s: ``C`` before the first save is measured, in seconds (>= 0).
        formula: ``"daly"`` or ``"young"`` (keys of :data:`FORMULAS`).
        min_interval_steps: Smallest interval in steps (>= 1).
        ewma_alpha: Weight of a new sample, in ``(0, 1]``.

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
        self.mtbf_s = _check_positive("mtbf_s", mtbf_s)
        self.initial_cost_s = _check_non_negative("initial_cost_s", initial_cost_s)
        self.formula = formula
        self.min_interval_steps = min_interval_steps
        self._alpha = float(ewma_alpha)
        self.load_state_dict({})

    def record_step(self, step: int, now_s: float) -> None:
        """Measure the step time from consecutive calls (step, monotonic seconds)."""
        prev = self._prev_step
        if prev is not None and step > prev[0] and not self._skip_next_delta:
            delta = (now_s - prev[1]) / (step - prev[0])
            if delta >= 0:
                self._step_time.update(delta)
        self._skip_next_delta = False
        self._prev_step = (step, now_s)

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float) -> None:
        """Add one save's measurements, in seconds; a repeated ``step`` replaces its earlier sample.

        Raises:
            ValueError: If a duration is negative or not finite.
        """
        cost = _check_non_negative("blocking_s", blocking_s) + _check_non_negative("slowdown_s", slowdown_s)
        if step == self._cost_step:
            self._cost.replace_last(cost)
        else:
            self._cost.update(cost)
            self._cost_step = step
            if self._prev_step is None or step >= self._prev_step[0]:
                self._skip_next_delta = True  # the next step's duration includes this stall
        if durable_after_s is not None:
            durable = _check_non_negative("durable_after_s", durable_after_s)
            lag = max(0.0, durable - blocking_s)
            if step == self._durable_step:
                self._durable.replace_last(durable)
                self._lag.replace_last(lag)
            else:
                self._durable.update(durable)
                self._lag.update(lag)
                self._durable_step = step

    def plan(self) -> dict[str, Any]:
        """The interval the current estimates give.

        Returns:
            ``formula``, ``mtbf_s``, ``cost_s``, ``step_time_s`` (``None`` until measured),
            ``durable_after_s``, ``durability_lag_s``, ``optimal_interval_s`` (the formula's ``T``),
            ``interval_s`` (after the durability floor), ``interval_steps`` (``None`` without a step
            time), ``limited_by`` (``"formula"``, ``"durability"`` or ``"min_interval_steps"``),
            ``expected_overhead`` and ``expected_lost_work_s`` (at the interval in whole steps).
        """
        cost = float(self._cost.value)  # type: ignore[arg-type]  # seeded, never None
        optimal = FORMULAS[self.formula](self.mtbf_s, cost)
        durable = self._durable.value or 0.0
        lag = self._lag.value or 0.0
        interval_s, limited_by = (durable, "durability") if durable > optimal else (optimal, "formula")
        step_time = self._step_time.value
        steps: int | None = None
        effective_s = interval_s
        if step_time is not None:
            if step_time <= 0:
                steps = 1
            elif limited_by == "durability":
                steps = max(1, math.ceil(durable / step_time - 1e-9))
            else:
                steps = max(1, math.floor(optimal / step_time + 0.5))
            if steps < self.min_interval_steps:
                steps, limited_by = self.min_interval_steps, "min_interval_steps"
            effective_s = steps * step_time
        if effective_s > 0:
            overhead = expected_overhead(effective_s, cost, self.mtbf_s, lag)
            lost = expected_lost_work(effective_s, lag)
        else:
            overhead, lost = math.inf, lag
        return {
            "formula": self.formula,
            "mtbf_s": self.mtbf_s,
            "cost_s": cost,
            "step_time_s": step_time,
            "durable_after_s": durable,
            "durability_lag_s": lag,
            "optimal_interval_s": optimal,
            "interval_s": interval_s,
            "interval_steps": steps,
            "limited_by": limited_by,
            "expected_overhead": overhead,
            "expected_lost_work_s": lost,
        }

    def state_dict(self) -> dict[str, Any]:
        """The estimates (``cost_s``, ``step_time_s``, ``durable_after_s``, ``durability_lag_s``)."""
        return {
            "cost_s": self._cost.value,
            "step_time_s": self._step_time.value,
            "durable_after_s": self._durable.value,
            "durability_lag_s": self._lag.value,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (missing keys start fresh; clock state is reset)."""
        cost = state.get("cost_s")
        self._cost = _Ewma(self._alpha, self.initial_cost_s if cost is None else float(cost))
        self._step_time = _Ewma(self._alpha, state.get("step_time_s"))
        self._durable = _Ewma(self._alpha, state.get("durable_after_s"))
        self._lag = _Ewma(self._alpha, state.get("durability_lag_s"))
        self._cost_step: int | None = None
        self._durable_step: int | None = None
        self._prev_step: tuple[int, float] | None = None
        self._skip_next_delta = False
