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

The one rule that turns these seconds into a number of steps is :func:`checkpoint_interval`;
``torch-ckpt plan``, ``torch-ckpt simulate`` and the runtime policy
(:class:`torch_ckpt.policy._schedule.YoungDaly`, through :class:`torch_ckpt.policy._estimator.IntervalEstimator`)
all use it, so they agree on every input. The online estimates of ``C`` and ``L`` that feed it at run
time are in :mod:`torch_ckpt.policy._estimator`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from torch_ckpt._values import to_seconds

__all__ = [
    "young_interval",
    "daly_interval",
    "expected_overhead",
    "expected_lost_work",
    "FORMULAS",
    "Interval",
    "checkpoint_interval",
]


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
    mtbf = to_seconds("mtbf_s", mtbf_s, positive=True)
    cost = to_seconds("cost_s", cost_s, positive=False)
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
    mtbf = to_seconds("mtbf_s", mtbf_s, positive=True)
    cost = to_seconds("cost_s", cost_s, positive=False)
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
    interval = to_seconds("interval_s", interval_s, positive=True)
    lag = to_seconds("durability_lag_s", durability_lag_s, positive=False)
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
    interval = to_seconds("interval_s", interval_s, positive=True)
    cost = to_seconds("cost_s", cost_s, positive=False)
    mtbf = to_seconds("mtbf_s", mtbf_s, positive=True)
    restart = to_seconds("restart_s", restart_s, positive=False)
    return cost / interval + (expected_lost_work(interval, durability_lag_s) + restart) / mtbf


@dataclass(frozen=True)
class Interval:
    """The checkpoint interval for one set of inputs, from :func:`checkpoint_interval`.

    All times in seconds.

    Attributes:
        formula: ``"daly"`` or ``"young"``.
        mtbf_s: Mean time between failures of the job ``M``.
        save_cost_s: Training stall per save ``C``.
        durability_lag_s: From the end of a save's stall until it is durable ``L``.
        step_time_s: Seconds per training step, or ``None`` if not known.
        optimal_interval_s: The formula's ``T``.
        durable_after_s: ``C + L``: the time a save needs to become durable; the interval is never
            shorter, so saves do not pile up.
        interval_s: The interval used: ``interval_steps * step_time_s`` with a step time, else
            ``max(optimal_interval_s, durable_after_s)``.
        interval_steps: Whole steps between saves, or ``None`` without a step time.
        limited_by: ``"formula"``, ``"durability"`` or ``"min_interval_steps"``: what set the interval.
        expected_overhead: :func:`expected_overhead` at ``interval_s`` (a fraction).
        expected_lost_work_s: :func:`expected_lost_work` at ``interval_s``.
    """

    formula: str
    mtbf_s: float
    save_cost_s: float
    durability_lag_s: float
    step_time_s: float | None
    optimal_interval_s: float
    durable_after_s: float
    interval_s: float
    interval_steps: int | None
    limited_by: str
    expected_overhead: float
    expected_lost_work_s: float

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return asdict(self)


def checkpoint_interval(
    mtbf_seconds: float,
    save_cost_seconds: float,
    durability_lag_seconds: float = 0.0,
    step_time_seconds: float | None = None,
    *,
    formula: str = "daly",
    min_interval_steps: int = 1,
) -> Interval:
    """The interval between saves: the formula's optimum, never shorter than a save takes to be durable.

    ``T`` is Daly's (2006) higher-order optimum (default) or Young's (1974) ``sqrt(2 C M)``; see
    :func:`daly_interval` and :func:`young_interval` for the references. With a step time the
    interval in steps is the largest of

    * ``T / step`` rounded to the nearest whole step (halves round up),
    * ``(C + L) / step`` rounded **up**, so that a save is durable before the next one starts
      (an interval never shorter than what a save needs to become durable), and
    * ``min_interval_steps``.

    This is the only place where seconds become steps: ``torch-ckpt plan``, ``torch-ckpt simulate``
    and the runtime :class:`~torch_ckpt.policy._schedule.YoungDaly` policy call it. Example: MTBF 8 h,
    ``C`` = 2 s, ``L`` = 400 s and 7 s steps give 58 steps (406 s >= the 402 s to durability).

    Args:
        mtbf_seconds: Mean time between failures of the job ``M``, in seconds (> 0).
        save_cost_seconds: Training stall per save ``C`` (blocking time plus any slowdown of
            training while the save persists), in seconds (>= 0).
        durability_lag_seconds: Seconds from the end of a save's stall until it is durable ``L``
            (>= 0; 0 for synchronous saves).
        step_time_seconds: Seconds per training step (> 0), or ``None`` for an interval in
            seconds only.
        formula: ``"daly"`` or ``"young"`` (keys of :data:`FORMULAS`).
        min_interval_steps: Smallest interval in steps (integer >= 1); applies with a step time.

    Returns:
        An :class:`Interval`.

    Raises:
        ValueError: If an argument is out of range (the message names it), or ``formula`` is unknown.
    """
    if formula not in FORMULAS:
        raise ValueError(f"formula must be one of {sorted(FORMULAS)}, got {formula!r}")
    if isinstance(min_interval_steps, bool) or not isinstance(min_interval_steps, int) or min_interval_steps < 1:
        raise ValueError(f"min_interval_steps must be an integer >= 1, got {min_interval_steps!r}")
    mtbf = to_seconds("mtbf_seconds", mtbf_seconds, positive=True)
    cost = to_seconds("save_cost_seconds", save_cost_seconds, positive=False)
    lag = to_seconds("durability_lag_seconds", durability_lag_seconds, positive=False)
    optimal = FORMULAS[formula](mtbf, cost)
    durable = cost + lag
    steps: int | None = None
    if step_time_seconds is None:
        step_time = None
        interval, limited_by = (durable, "durability") if durable > optimal else (optimal, "formula")
    else:
        step_time = to_seconds("step_time_seconds", step_time_seconds, positive=True)
        by_formula = max(1, math.floor(optimal / step_time + 0.5))
        by_durability = math.ceil(durable / step_time - 1e-9)  # the tolerance absorbs float noise in C + L
        steps, limited_by = (by_durability, "durability") if by_durability > by_formula else (by_formula, "formula")
        if steps < min_interval_steps:
            steps, limited_by = min_interval_steps, "min_interval_steps"
        interval = steps * step_time
    return Interval(
        formula=formula,
        mtbf_s=mtbf,
        save_cost_s=cost,
        durability_lag_s=lag,
        step_time_s=step_time,
        optimal_interval_s=optimal,
        durable_after_s=durable,
        interval_s=interval,
        interval_steps=steps,
        limited_by=limited_by,
        expected_overhead=expected_overhead(interval, cost, mtbf, lag) if interval > 0 else math.inf,
        expected_lost_work_s=expected_lost_work(interval, lag) if interval > 0 else lag,
    )
