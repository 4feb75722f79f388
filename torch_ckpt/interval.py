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
"""

from __future__ import annotations

import math

__all__ = [
    "young_interval",
    "daly_interval",
    "expected_overhead",
    "expected_lost_work",
    "FORMULAS",
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
