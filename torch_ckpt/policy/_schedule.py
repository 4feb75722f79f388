"""When to save: the optimal interval (Young 1974, Daly 2006), its online estimates, and the save policies.

Pure (no I/O; clocks are passed in as monotonic seconds). The model: a job computes for ``T``, stalls
``C`` to save (with asynchronous saves: the blocking part plus the slowdown while the save persists)
and repeats; failures arrive as a Poisson process with mean ``M`` and lose the work since the last
*durable* checkpoint, so the *durability lag* ``L`` adds to the loss but not, to first order, to the
optimum. :func:`checkpoint_interval` is the one rule that turns seconds into steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch_ckpt._logging import get_logger
from torch_ckpt._values import check_int, to_seconds
from torch_ckpt.errors import ConfigError

if TYPE_CHECKING:
    from torch_ckpt.handle import SaveHandle

__all__ = ["young_interval", "daly_interval", "expected_overhead", "expected_lost_work", "FORMULAS", "Interval",
           "checkpoint_interval", "STEP_TIME_ALPHA", "StepTimeEstimator", "SavePolicy",
           "EveryNSteps", "EveryNSeconds", "YoungDaly", "AnyOf", "Cadence"]

log = get_logger(__name__)


# -- the formulas ------------------------------------------------------------------------------------------------
def young_interval(mtbf_s: float, cost_s: float) -> float:
    """Young's (1974) first-order optimum compute time between checkpoints, ``sqrt(2 C M)``, in seconds.

    Young, "A first order approximation to the optimum checkpoint interval", Communications of the
    ACM 17(9):530-531, 1974. Args and Raises: as :func:`daly_interval`.
    """
    mtbf = to_seconds("mtbf_s", mtbf_s, positive=True)
    cost = to_seconds("cost_s", cost_s, positive=False)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(mtbf_s: float, cost_s: float) -> float:
    """Daly's (2006) higher-order optimum compute time between checkpoints.

    Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
    Generation Computer Systems 22(3):303-312, 2006, doi:10.1016/j.future.2004.11.016:
    ``T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``, else ``T = M``
    (the restart time does not enter the optimum). Daly's worked examples (restart 10 min, C = 5 min):
    116.7 min for M = 24 h, 56.7 min for 6 h, 9.14 min for 15 min.

    Args:
        mtbf_s: Mean time between failures of the whole job ``M``, in seconds (> 0).
        cost_s: Training stall per save ``C``, in seconds (>= 0).

    Returns:
        The interval ``T`` in seconds of compute between the end of one save and the next.

    Raises:
        ValueError: ``mtbf_s`` is not positive and finite, or ``cost_s`` is negative or not finite.
    """
    mtbf = to_seconds("mtbf_s", mtbf_s, positive=True)
    cost = to_seconds("cost_s", cost_s, positive=False)
    if cost >= 2.0 * mtbf:
        return mtbf
    ratio = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


#: Formula name -> function, as accepted by ``formula=``.
FORMULAS: dict[str, Callable[[float, float], float]] = {"young": young_interval, "daly": daly_interval}


def _check_formula(formula: str) -> str:
    if formula not in FORMULAS:
        raise ConfigError(f"formula must be one of {sorted(FORMULAS)}, got {formula!r}")
    return formula


def expected_lost_work(interval_s: float, durability_lag_s: float = 0.0) -> float:
    """Expected work lost per failure, ``T/2 + L``, in seconds.

    Half an interval on average, plus the durability lag of an asynchronous save. Valid for
    ``L <= T``, which the interval rule enforces.

    Args:
        interval_s: Compute time between checkpoints ``T``, in seconds (> 0).
        durability_lag_s: Seconds from the end of a save's stall until it is durable ``L`` (>= 0).

    Raises:
        ValueError: ``interval_s`` is not positive and finite or ``durability_lag_s`` is negative.
    """
    interval = to_seconds("interval_s", interval_s, positive=True)
    return interval / 2.0 + to_seconds("durability_lag_s", durability_lag_s, positive=False)


def expected_overhead(interval_s: float, cost_s: float, mtbf_s: float, durability_lag_s: float = 0.0, *,
                      restart_s: float = 0.0) -> float:
    """First-order expected overhead fraction, ``C/T + (T/2 + L + R)/M`` (0.01 = 1 %).

    ``C/T`` is the time spent saving per unit of work, ``(T/2 + L)/M`` the work redone, ``R/M`` the
    restarts. Accurate while the result is small; ``torch-ckpt simulate`` measures the exact value.

    Args:
        interval_s: Compute time between checkpoints ``T``, in seconds (> 0).
        cost_s: Training stall per save ``C``, in seconds (>= 0).
        mtbf_s: Mean time between failures ``M``, in seconds (> 0).
        durability_lag_s: Seconds from the end of a save's stall until it is durable ``L`` (>= 0).
        restart_s: Time to restart after a failure ``R``, in seconds (>= 0; default: left out).

    Raises:
        ValueError: An argument is out of range (the message names it).
    """
    interval = to_seconds("interval_s", interval_s, positive=True)
    cost = to_seconds("cost_s", cost_s, positive=False)
    mtbf = to_seconds("mtbf_s", mtbf_s, positive=True)
    restart = to_seconds("restart_s", restart_s, positive=False)
    return cost / interval + (expected_lost_work(interval, durability_lag_s) + restart) / mtbf


@dataclass(frozen=True)
class Interval:
    """The checkpoint interval for one set of inputs, from :func:`checkpoint_interval` (times in seconds).

    Attributes:
        formula: ``"daly"`` or ``"young"``.
        mtbf_s: Mean time between failures of the job ``M``.
        save_cost_s: Training stall per save ``C``.
        durability_lag_s: From the end of a save's stall until it is durable ``L``.
        step_time_s: Seconds per training step, or ``None`` if not known.
        optimal_interval_s: The formula's ``T``.
        durable_after_s: ``C + L``: the interval is never shorter, so saves do not pile up.
        interval_s: ``interval_steps * step_time_s`` with a step time, else ``max(T, C + L)``.
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


def checkpoint_interval(mtbf_seconds: float, save_cost_seconds: float, durability_lag_seconds: float = 0.0,
                        step_time_seconds: float | None = None, *, formula: str = "daly",
                        min_interval_steps: int = 1) -> Interval:
    """The interval between saves: the formula's optimum, never shorter than a save takes to be durable.

    ``T`` is Daly's optimum (default) or Young's. With a step time the interval in steps is the
    largest of ``T / step`` rounded to the nearest whole step (halves up), ``(C + L) / step``
    rounded **up** (a save is durable before the next one starts), and ``min_interval_steps``.
    Example: MTBF 8 h, ``C`` = 2 s, ``L`` = 400 s and 7 s steps give 58 steps (406 s >= 402 s).

    Args:
        mtbf_seconds: Mean time between failures of the job ``M``, in seconds (> 0).
        save_cost_seconds: Training stall per save ``C`` (blocking time plus the slowdown of training
            while the save persists), in seconds (>= 0).
        durability_lag_seconds: Seconds from the end of a save's stall until it is durable ``L``
            (>= 0; 0 for synchronous saves).
        step_time_seconds: Seconds per training step (> 0), or ``None`` for an interval in seconds only.
        formula: ``"daly"`` or ``"young"`` (keys of :data:`FORMULAS`).
        min_interval_steps: Smallest interval in steps (integer >= 1); applies with a step time.

    Raises:
        ValueError: An argument is out of range (the message names it), or ``formula`` is unknown.
    """
    _check_formula(formula)
    check_int("min_interval_steps", min_interval_steps, 1)
    mtbf = to_seconds("mtbf_seconds", mtbf_seconds, positive=True)
    cost = to_seconds("save_cost_seconds", save_cost_seconds, positive=False)
    lag = to_seconds("durability_lag_seconds", durability_lag_seconds, positive=False)
    optimal = FORMULAS[formula](mtbf, cost)
    durable = cost + lag
    steps: int | None = None
    step_time: float | None = None
    if step_time_seconds is None:
        interval, limited_by = (durable, "durability") if durable > optimal else (optimal, "formula")
    else:
        step_time = to_seconds("step_time_seconds", step_time_seconds, positive=True)
        by_formula = max(1, math.floor(optimal / step_time + 0.5))
        by_durability = math.ceil(durable / step_time - 1e-9)  # the tolerance absorbs float noise in C + L
        steps, limited_by = (by_durability, "durability") if by_durability > by_formula else (by_formula, "formula")
        if steps < min_interval_steps:
            steps, limited_by = min_interval_steps, "min_interval_steps"
        interval = steps * step_time
    return Interval(formula=formula, mtbf_s=mtbf, save_cost_s=cost, durability_lag_s=lag, step_time_s=step_time,
                    optimal_interval_s=optimal, durable_after_s=durable, interval_s=interval,
                    interval_steps=steps, limited_by=limited_by,
                    expected_overhead=expected_overhead(interval, cost, mtbf, lag) if interval > 0 else math.inf,
                    expected_lost_work_s=expected_lost_work(interval, lag) if interval > 0 else lag)


# -- online estimates ----------------------------------------------------------------------------------------------
#: Weight of a new sample in the step-time EWMA (the only step-time average in the library).
STEP_TIME_ALPHA = 0.2


class StepTimeEstimator:
    """Seconds per training step (``seconds``; None until measured): an EWMA (weight :data:`STEP_TIME_ALPHA`).

    A sample is ``(now_s - previous now_s) / (step - previous step)``, left out with ``sample=False``
    or after :meth:`skip_next` (the interval held a save's stall, counted in the save's cost). A step
    that does not advance (a rollback) or a clock that goes back restarts the measurement.
    """

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds: float | None = seconds
        self._prev: tuple[int, float] | None = None
        self._skip_next = False

    def record_step(self, step: int, now_s: float, *, sample: bool = True) -> float | None:
        """Note ``step`` finished at monotonic ``now_s``; returns the seconds per step since the previous call
        (also when not averaged in), or None when there is no measurement (see the class)."""
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


class _Ewma:
    """Exponentially weighted moving average of one sample per step: a repeated step replaces its sample."""

    def __init__(self, alpha: float, value: float | None) -> None:
        self.alpha, self.value = alpha, value
        self._step: int | None = None
        self._before = value

    def add(self, step: int, sample: float) -> bool:
        """Average ``sample`` in; True when ``step`` is new (not a replacement)."""
        new = step != self._step
        if new:
            self._step, self._before = step, self.value
        self.value = sample if self._before is None else self._before + self.alpha * (sample - self._before)
        return new


# -- policies ------------------------------------------------------------------------------------------------------
@runtime_checkable
class SavePolicy(Protocol):
    """Decides at which steps to save.

    Driven per training step (through :class:`Cadence`) by ``record_step(step, now_s)``, then
    ``should_save(step, now_s)`` (``True`` counts as a save starting now; the same step gets the same
    answer), then after each save of any trigger ``record_save(step, blocking_s=, durable_after_s=,
    slowdown_s=, now_s=)`` (``durable_after_s=None`` until known; a second call for the step once durable
    replaces the first's measurements); ``describe()`` gives the last decision's inputs and outputs.
    Policies are not thread-safe. Every rank fed the same inputs decides the same; rank 0 decides and
    broadcasts, as clocks differ per rank.
    """

    def should_save(self, step: int, now_s: float) -> bool:
        """Whether to save after optimizer step ``step``, at monotonic time ``now_s`` seconds."""

    def record_step(self, step: int, now_s: float) -> None:
        """Note that optimizer step ``step`` completed at monotonic time ``now_s`` seconds."""

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0,
                    now_s: float) -> None:
        """Note a save at ``step`` and its measured costs, in seconds."""

    def describe(self) -> dict[str, Any]:
        """The inputs and outputs of the last decision, as a JSON-serialisable dict."""


class EveryNSteps:
    """Save every ``n`` optimizer steps: at steps ``n, 2n, 3n, ...`` (never at step 0); stateless, so resumable.

    Args:
        n: Steps between saves (integer >= 1).

    Raises:
        ConfigError: ``n`` is not an integer >= 1 (a ``ValueError``).
    """

    def __init__(self, n: int) -> None:
        self._n = check_int("n", n, 1)
        self._last: dict[str, Any] = {}

    @property
    def n(self) -> int:
        """Steps between saves."""
        return self._n

    def should_save(self, step: int, now_s: float) -> bool:
        """``True`` when ``step`` is a positive multiple of ``n``."""
        decision = step > 0 and step % self._n == 0
        self._last = {"step": step, "decision": decision}
        return decision

    def record_step(self, step: int, now_s: float) -> None:
        """No-op: the decision needs no measurement."""

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0,
                    now_s: float) -> None:
        """No-op: the decision needs no measurement."""

    def describe(self) -> dict[str, Any]:
        """``policy``, ``n`` and the last ``step`` and ``decision``."""
        return {"policy": "EveryNSteps", "n": self._n, **self._last}

    def __repr__(self) -> str:
        return f"EveryNSteps(n={self._n})"


class EveryNSeconds:
    """Save when at least ``seconds`` have passed since the last save.

    The clock starts at the first step observed (no save then); saves of other triggers, reported
    through :meth:`record_save`, restart it too.

    Args:
        seconds: Minimum time between saves, in seconds or as a duration string (``"30m"``).

    Raises:
        ConfigError: ``seconds`` is not a positive duration (a ``ValueError``).
    """

    def __init__(self, seconds: float | str) -> None:
        self._seconds = to_seconds("seconds", seconds, positive=True)
        self._last_save_s: float | None = None
        self._last_save_step: int | None = None
        self._decided: tuple[int, bool] | None = None
        self._last: dict[str, Any] = {}

    @property
    def seconds(self) -> float:
        """Minimum time between saves, in seconds."""
        return self._seconds

    def should_save(self, step: int, now_s: float) -> bool:
        """``True`` once ``seconds`` have elapsed since the last save (or the first step)."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        if self._last_save_s is None:
            self._last_save_s = now_s
        elapsed = now_s - self._last_save_s
        decision = elapsed >= self._seconds
        if decision:
            self._last_save_s, self._last_save_step = now_s, step
        self._decided = (step, decision)
        self._last = {"step": step, "elapsed_s": elapsed, "decision": decision}
        return decision

    def record_step(self, step: int, now_s: float) -> None:
        """Start the clock at the first step observed."""
        if self._last_save_s is None:
            self._last_save_s = now_s

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0,
                    now_s: float) -> None:
        """Restart the clock at the start of a save (``now_s - blocking_s``) of a new step."""
        self.restart(step, now_s - blocking_s)

    def restart(self, step: int, now_s: float) -> None:
        """Restart the clock at monotonic ``now_s`` seconds, for a checkpoint of a new ``step`` made elsewhere."""
        if self._last_save_step is None or step > self._last_save_step:
            self._last_save_step, self._last_save_s = step, now_s

    def describe(self) -> dict[str, Any]:
        """``policy``, ``seconds`` and the last ``step``, ``elapsed_s`` and ``decision``."""
        return {"policy": "EveryNSeconds", "seconds": self._seconds, **self._last}

    def __repr__(self) -> str:
        return f"EveryNSeconds(seconds={self._seconds!r})"


class YoungDaly:
    """Save at the interval that minimises expected overhead, from the MTBF and the measured cost.

    ``T`` is Daly's (2006, default) or Young's (1974) optimum; seconds become steps by
    :func:`checkpoint_interval`. Measured online: ``C``, an EWMA (weight ``ewma_alpha``) of each
    save's ``blocking_s + slowdown_s``, where ``initial_cost_seconds`` stands only until the first
    save is measured (a 5 s prior against a real 5 ms would keep saves 20-30x too rare); ``L``, an
    EWMA of ``durable_after_s - blocking_s``; the step time, from its own :class:`StepTimeEstimator`
    or the one a :class:`Cadence` lends (:meth:`use_step_time`). No save before a positive step time
    is measured; steps are counted from the first step observed (or the last save).

    Args:
        mtbf_seconds: Mean time between failures of the whole job, in seconds or a duration string.
        per_node_mtbf_seconds: Instead of ``mtbf_seconds``: the MTBF of one node (or GPU); the job's
            MTBF is this divided by ``nodes``.
        nodes: Number of nodes (or GPUs) the job runs on, with ``per_node_mtbf_seconds``.
        initial_cost_seconds: ``C`` before the first save is measured, in seconds (>= 0).
        formula: ``"daly"`` (default) or ``"young"``.
        min_interval_steps: Never save more often than every this many steps.
        ewma_alpha: Weight of a new save measurement in the averages of ``C`` and ``L``, in ``(0, 1]``
            (the step time uses :data:`STEP_TIME_ALPHA`).

    Raises:
        ConfigError: A ``ValueError``: the MTBF is not given exactly one way, or an argument is out
            of range; the message names the field and the value.
    """

    def __init__(self, mtbf_seconds: float | str | None = None, *, per_node_mtbf_seconds: float | str | None = None,
                 nodes: int | None = None, initial_cost_seconds: float | str = 5.0, formula: str = "daly",
                 min_interval_steps: int = 1, ewma_alpha: float = 0.3) -> None:
        if mtbf_seconds is not None and (per_node_mtbf_seconds is not None or nodes is not None):
            raise ConfigError("give either mtbf_seconds or per_node_mtbf_seconds with nodes, not both (got "
                              f"mtbf_seconds={mtbf_seconds!r}, per_node_mtbf_seconds={per_node_mtbf_seconds!r}, "
                              f"nodes={nodes!r})")
        if mtbf_seconds is not None:
            self.mtbf_s = to_seconds("mtbf_seconds", mtbf_seconds, positive=True)
        elif per_node_mtbf_seconds is not None and nodes is not None:
            self.mtbf_s = to_seconds("per_node_mtbf_seconds", per_node_mtbf_seconds, positive=True) / check_int(
                "nodes", nodes, 1)
        else:
            raise ConfigError("YoungDaly needs mtbf_seconds, or per_node_mtbf_seconds together with nodes "
                              f"(got per_node_mtbf_seconds={per_node_mtbf_seconds!r}, nodes={nodes!r})")
        if isinstance(ewma_alpha, bool) or not isinstance(ewma_alpha, (int, float)) or not 0.0 < ewma_alpha <= 1.0:
            raise ConfigError(f"ewma_alpha must be a number in (0, 1], got {ewma_alpha!r}")
        self.initial_cost_s = to_seconds("initial_cost_seconds", initial_cost_seconds, positive=False)
        self.formula = _check_formula(formula)
        self.min_interval_steps = check_int("min_interval_steps", min_interval_steps, 1)
        self._alpha = float(ewma_alpha)
        self._step_time = StepTimeEstimator()
        self._owns_step_time = True
        self._last_save_step: int | None = None
        self._decided: tuple[int, bool] | None = None  # the answer for the step last asked
        self._last: dict[str, Any] | None = None
        self.load_state_dict({})

    def plan(self) -> dict[str, Any]:
        """The interval the current estimates give, deciding nothing: ``policy`` and the fields of
        :class:`Interval` (``save_cost_s`` named ``cost_s``; ``interval_steps`` None before a step time)."""
        cost = self.initial_cost_s if self._cost.value is None else self._cost.value
        plan = checkpoint_interval(self.mtbf_s, cost, self._lag.value or 0.0, self._step_time.seconds or None,
                                   formula=self.formula, min_interval_steps=self.min_interval_steps).as_dict()
        plan["cost_s"] = plan.pop("save_cost_s")
        return {"policy": "YoungDaly", **plan}

    def use_step_time(self, estimator: StepTimeEstimator) -> None:
        """Read the step time from ``estimator`` (fed by its owner); an estimate of ours seeds an empty one."""
        if estimator.seconds is None:
            estimator.seconds = self._step_time.seconds
        self._step_time, self._owns_step_time = estimator, False

    def should_save(self, step: int, now_s: float) -> bool:
        """``True`` when ``interval_steps`` steps have passed since the last save."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        if self._last_save_step is None:
            self._last_save_step = step
        plan = self.plan()
        since = step - self._last_save_step
        decision = plan["interval_steps"] is not None and since >= plan["interval_steps"]
        if decision:
            self._last_save_step = step
        self._decided = (step, decision)
        self._last = {**plan, "step": step, "now_s": now_s, "steps_since_save": since, "decision": decision}
        return decision

    def record_step(self, step: int, now_s: float) -> None:
        """Measure the step time (unless lent one); the first step observed starts the step count."""
        if self._last_save_step is None:
            self._last_save_step = step
        if self._owns_step_time:
            self._step_time.record_step(step, now_s)

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0,
                    now_s: float) -> None:
        """Update ``C`` (``blocking_s + slowdown_s``) and ``L`` (``durable_after_s - blocking_s``; None: not
        known yet) from one save, in seconds; a repeated ``step`` replaces its samples, a save of any trigger
        restarts the step count (``now_s`` is unused).

        Raises:
            ValueError: A duration is negative or not finite.
        """
        cost = to_seconds("blocking_s", blocking_s, positive=False) + to_seconds("slowdown_s", slowdown_s,
                                                                                 positive=False)
        if self._cost.add(step, cost) and self._owns_step_time:
            self._step_time.skip_next()  # the next step's duration includes this stall
        if durable_after_s is not None:
            self._lag.add(step, max(0.0, to_seconds("durable_after_s", durable_after_s, positive=False) - blocking_s))
        self.restart(step, now_s)

    def restart(self, step: int, now_s: float) -> None:
        """Restart the step count at ``step`` (a checkpoint of a new step made elsewhere), measuring nothing."""
        if self._last_save_step is None or step > self._last_save_step:
            self._last_save_step = step

    def describe(self) -> dict[str, Any]:
        """The last decision (:meth:`plan`'s keys plus ``step``, ``now_s``, ``steps_since_save``,
        ``decision``), or the current :meth:`plan` before any."""
        return dict(self._last) if self._last is not None else self.plan()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run keeps: ``cost_s``, ``step_time_s``, ``durability_lag_s`` (None: not measured
        yet) and ``last_save_step``."""
        return {"cost_s": self._cost.value, "step_time_s": self._step_time.seconds,
                "durability_lag_s": self._lag.value, "last_save_step": self._last_save_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (missing keys start fresh; monotonic-clock state is reset)."""
        cost = state.get("cost_s")
        self._cost = _Ewma(self._alpha, None if cost is None else float(cost))
        self._lag = _Ewma(self._alpha, state.get("durability_lag_s"))
        step_time = state.get("step_time_s")
        if self._owns_step_time:
            self._step_time = StepTimeEstimator(step_time)
        elif step_time is not None:
            self._step_time.seconds = float(step_time)
        self._last_save_step = state.get("last_save_step")
        self._decided = None

    def __repr__(self) -> str:
        return (f"YoungDaly(mtbf_seconds={self.mtbf_s!r}, formula={self.formula!r}, "
                f"initial_cost_seconds={self.initial_cost_s!r}, min_interval_steps={self.min_interval_steps})")


def _lend_step_time(policy: object, estimator: StepTimeEstimator) -> None:
    share = getattr(policy, "use_step_time", None)
    if callable(share):
        share(estimator)


def _restart(policy: object, step: int, now_s: float) -> None:
    restart = getattr(policy, "restart", None)
    if callable(restart):
        restart(step, now_s)


class AnyOf:
    """Save when any of the given policies says so; every policy sees every call.

    Args:
        *policies: One or more objects implementing :class:`SavePolicy`.

    Raises:
        ConfigError: No policy is given (a ``ValueError``).
        TypeError: An argument does not implement :class:`SavePolicy`.
    """

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ConfigError("AnyOf needs at least one policy")
        for index, policy in enumerate(policies):
            if not isinstance(policy, SavePolicy):
                raise TypeError(f"AnyOf argument {index} is not a SavePolicy: {policy!r}")
        self._policies = tuple(policies)
        self._last: dict[str, Any] = {}

    @property
    def policies(self) -> tuple[SavePolicy, ...]:
        """The combined policies, in order."""
        return self._policies

    def should_save(self, step: int, now_s: float) -> bool:
        """Ask every policy (no short-circuit, so each keeps its state) and return any ``True``."""
        answers = [policy.should_save(step, now_s) for policy in self._policies]
        triggered = [repr(p) for p, answer in zip(self._policies, answers) if answer]
        self._last = {"step": step, "decision": any(answers), "triggered_by": triggered}
        return any(answers)

    def record_step(self, step: int, now_s: float) -> None:
        """Forward to every policy."""
        for policy in self._policies:
            policy.record_step(step, now_s)

    def use_step_time(self, estimator: StepTimeEstimator) -> None:
        """Lend ``estimator`` to every policy that reads a step time (see :class:`YoungDaly`)."""
        for policy in self._policies:
            _lend_step_time(policy, estimator)

    def record_save(self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0,
                    now_s: float) -> None:
        """Forward to every policy."""
        for policy in self._policies:
            policy.record_save(step, blocking_s=blocking_s, durable_after_s=durable_after_s, slowdown_s=slowdown_s,
                               now_s=now_s)

    def restart(self, step: int, now_s: float) -> None:
        """Forward to every policy that has a count or clock to restart (see :meth:`Cadence.other_saved`)."""
        for policy in self._policies:
            _restart(policy, step, now_s)

    def describe(self) -> dict[str, Any]:
        """``policy``, the last ``step``/``decision``/``triggered_by`` and each policy's ``describe()``."""
        return {"policy": "AnyOf", **self._last, "policies": [p.describe() for p in self._policies]}

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(repr(p) for p in self._policies)})"


class Cadence:
    """The step/save bookkeeping around a save policy, on the caller's thread (the manager and adapters own one).

    It records every step into its :class:`StepTimeEstimator` (lent to the policy when it has
    ``use_step_time``, so the runtime has one step-time estimate), measures how much slower steps
    run while a save persists (that slowdown plus the blocking time is the save's cost ``C``), and
    reports each save twice to the policy: when its blocking part ends and once it is durable.
    With two save tiers (the manager's disk and memory tiers, each its own cadence) the costs never
    mix: a step while the other tier's save persists is no step-time sample, the other tier's
    saves only restart the count (:meth:`other_saved`), and a wait for the other tier's save is
    left out of this tier's cost.

    Args:
        policy: The save policy.
    """

    def __init__(self, policy: SavePolicy) -> None:
        self.policy = policy
        self.step_time = StepTimeEstimator()
        _lend_step_time(policy, self.step_time)
        self._pending: SaveHandle | None = None
        self._slowdown_s = 0.0
        self._stall_next = False
        self._other_wait_s = 0.0  # the pending save's wait for another tier's save, left out of its cost

    def record_step(self, step: int, now_s: float, *, busy: bool = False) -> None:
        """Record that ``step`` just finished at monotonic time ``now_s`` (seconds); ``busy``: a save (of any
        tier) is still persisting, so the step is no step-time sample."""
        baseline = self.step_time.seconds
        persisting = self._pending is not None and not self._pending.done()
        stall, self._stall_next = self._stall_next, False  # this step held a save's blocking part
        delta = self.step_time.record_step(step, now_s, sample=not persisting and not stall and not busy)
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
            s, other = handle.stats, self._other_wait_s
            self.policy.record_save(handle.step, blocking_s=max(0.0, s.blocking_s - other),
                                    durable_after_s=max(0.0, s.total_s - other), slowdown_s=self._slowdown_s,
                                    now_s=now_s)
        self._slowdown_s = 0.0

    def record_save_started(self, handle: SaveHandle, now_s: float) -> None:
        """Report a save whose blocking part just ended (its durability is reported later). Its wait for the
        previous save counts in its cost only when that was this cadence's own save, still persisting at the
        last :meth:`record_step`; a wait for another tier's save is that tier's cost."""
        own = self._pending is not None
        self._report_durable(now_s)
        self._other_wait_s = 0.0 if own else handle.stats.wait_for_previous_s
        self.policy.record_save(handle.step, blocking_s=max(0.0, handle.stats.blocking_s - self._other_wait_s),
                                durable_after_s=None, slowdown_s=0.0, now_s=now_s)
        self._pending = handle
        self._slowdown_s = 0.0
        self._stall_next = True

    def other_saved(self, step: int, now_s: float) -> None:
        """Another tier's save of ``step`` starts now (after :meth:`record_step` of ``step``): the policy's step
        count or clock restarts (a newer checkpoint exists; its ``restart(step, now_s)``, where it has one), with
        no cost sample; the next step interval holds that save's stall, so it is no step time."""
        _restart(self.policy, step, now_s)
        self._stall_next = True

    def decide(self, step: int, now_s: float) -> bool:
        """The policy's decision for ``step`` (call after :meth:`record_step`)."""
        decision = bool(self.policy.should_save(step, now_s))
        if decision:
            log.info("save policy: saving at step %d (%s)", step, self.policy.describe())
        return decision
