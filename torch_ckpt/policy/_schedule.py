"""When to save: pure save policies (no I/O, no process group; the clock is passed in).

Call contract (the manager's side), for every training step ``step`` (the optimizer step just
completed) at monotonic time ``now_s`` seconds:

1. ``policy.record_step(step, now_s)``: once per step, so policies can measure the step time.
2. ``policy.should_save(step, now_s)``: ``True`` means "save at this step", and the policy takes
   it as a save starting now. Asking again for the same step returns the same answer.
3. After each save, whatever triggered it: ``policy.record_save(step, blocking_s=...,
   durable_after_s=..., slowdown_s=..., now_s=...)``, once the blocking part has ended
   (``durable_after_s=None`` if durability is not known yet). It may be called a second time for
   the same step when the save becomes durable or its slowdown is measured; that call replaces
   the first one's measurements instead of counting the save twice.
4. ``policy.describe()``: the inputs and outputs of the last decision, for logging.

Policies are not thread-safe: calls must be serialised (for example under the manager's lock
when a background thread reports durability). Decisions depend only on the arguments received,
so every rank fed the same inputs decides the same; in practice rank 0 decides and broadcasts,
because ``now_s`` and measured costs differ between ranks.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch_ckpt._values import check_int, to_seconds
from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._cadence import StepTimeEstimator
from torch_ckpt.policy._estimator import IntervalEstimator
from torch_ckpt.policy._interval import FORMULAS

__all__ = ["SavePolicy", "EveryNSteps", "EveryNSeconds", "YoungDaly", "AnyOf"]


@runtime_checkable
class SavePolicy(Protocol):
    """Decides at which steps to save; see the module docstring for the call order."""

    def should_save(self, step: int, now_s: float) -> bool:
        """Whether to save after optimizer step ``step``, at monotonic time ``now_s`` seconds."""
        ...

    def record_step(self, step: int, now_s: float) -> None:
        """Note that optimizer step ``step`` completed at monotonic time ``now_s`` seconds."""
        ...

    def record_save(
        self,
        step: int,
        *,
        blocking_s: float,
        durable_after_s: float | None,
        slowdown_s: float = 0.0,
        now_s: float,
    ) -> None:
        """Note a save at ``step`` and its measured costs, in seconds."""
        ...

    def describe(self) -> dict[str, Any]:
        """The inputs and outputs of the last decision, as a JSON-serialisable dict."""
        ...


class _NoMeasurements:
    """Measurement hooks for policies whose decision needs no measurements."""

    def record_step(self, step: int, now_s: float) -> None:
        """No-op."""

    def record_save(
        self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0, now_s: float
    ) -> None:
        """No-op."""


class EveryNSteps(_NoMeasurements):
    """Save every ``n`` optimizer steps: at steps ``n, 2n, 3n, ...`` (never at step 0).

    Stateless, so it resumes correctly after a restart.

    Args:
        n: Steps between saves (integer >= 1).

    Raises:
        ConfigError: If ``n`` is not an integer >= 1 (a ``ValueError``).
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

    def describe(self) -> dict[str, Any]:
        """``policy``, ``n`` and the last ``step`` and ``decision``."""
        return {"policy": "EveryNSteps", "n": self._n, **self._last}

    def __repr__(self) -> str:
        return f"EveryNSteps(n={self._n})"


class EveryNSeconds:
    """Save when at least ``seconds`` have passed since the last save.

    The clock starts at the first step observed (no save then). Saves triggered by other
    policies, reported through :meth:`record_save`, restart the clock too.

    Args:
        seconds: Minimum time between saves, in seconds or as a duration string (``"30m"``).

    Raises:
        ConfigError: If ``seconds`` is not a positive duration (a ``ValueError``).
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

    def record_save(
        self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0, now_s: float
    ) -> None:
        """Restart the clock at the start of a save (``now_s - blocking_s``) of a new step."""
        if self._last_save_step is not None and step <= self._last_save_step:
            return
        self._last_save_step = step
        self._last_save_s = now_s - blocking_s

    def describe(self) -> dict[str, Any]:
        """``policy``, ``seconds`` and the last ``step``, ``elapsed_s`` and ``decision``."""
        return {"policy": "EveryNSeconds", "seconds": self._seconds, **self._last}

    def __repr__(self) -> str:
        return f"EveryNSeconds(seconds={self._seconds!r})"


class YoungDaly:
    """Save at the interval that minimises expected overhead, from the MTBF and the measured cost.

    The interval ``T`` comes from Daly (2006, the default) or Young (1974); see
    :mod:`torch_ckpt.policy._interval`. ``C`` is measured online: an exponentially weighted moving
    average (EWMA) of each save's ``blocking_s + slowdown_s``; ``initial_cost_seconds`` is used
    until the first save is measured, whose cost replaces it; the durability lag ``L`` likewise. The step time is the
    :class:`~torch_ckpt.policy._cadence.StepTimeEstimator`'s (the time between :meth:`record_step` calls,
    leaving out the step that contained a save's stall); driven by a
    :class:`~torch_ckpt.policy._cadence.Cadence` (as the manager does), the policy reads the cadence's
    estimator through :meth:`use_step_time`. Seconds become steps by
    :func:`torch_ckpt.policy._interval.checkpoint_interval`, the same rule ``torch-ckpt plan`` uses: the
    nearest whole step of ``T``, raised to the steps a save needs to become durable (``C + L``,
    rounded up) and to ``min_interval_steps``. Until a (positive) step time has been measured
    the policy does not save. Steps are counted from the first step observed (or the last save).

    Args:
        mtbf_seconds: Mean time between failures of the whole job, in seconds or a duration string.
        per_node_mtbf_seconds: Instead of ``mtbf_seconds``: the MTBF of one node (or GPU); the
            job's MTBF is this divided by ``nodes``.
        nodes: Number of nodes (or GPUs) the job runs on, with ``per_node_mtbf_seconds``.
        initial_cost_seconds: Guess for ``C`` before the first save is measured, in seconds.
        formula: ``"daly"`` (default) or ``"young"``.
        min_interval_steps: Never save more often than every this many steps.
        ewma_alpha: Weight of a new save measurement in the averages of ``C`` and ``L``, in
            ``(0, 1]`` (the step time uses :data:`torch_ckpt.policy._cadence.STEP_TIME_ALPHA`).

    Raises:
        ConfigError: A ``ValueError``: the MTBF is not given exactly one way, or an argument is
            out of range (zero or negative MTBF, unparseable duration...); the message names the
            field and the value.
    """

    def __init__(
        self,
        mtbf_seconds: float | str | None = None,
        *,
        per_node_mtbf_seconds: float | str | None = None,
        nodes: int | None = None,
        initial_cost_seconds: float | str = 5.0,
        formula: str = "daly",
        min_interval_steps: int = 1,
        ewma_alpha: float = 0.3,
    ) -> None:
        if mtbf_seconds is not None and (per_node_mtbf_seconds is not None or nodes is not None):
            raise ConfigError(
                "give either mtbf_seconds or per_node_mtbf_seconds with nodes, not both (got "
                f"mtbf_seconds={mtbf_seconds!r}, per_node_mtbf_seconds={per_node_mtbf_seconds!r}, nodes={nodes!r})"
            )
        if mtbf_seconds is not None:
            mtbf = to_seconds("mtbf_seconds", mtbf_seconds, positive=True)
        elif per_node_mtbf_seconds is not None and nodes is not None:
            per_node = to_seconds("per_node_mtbf_seconds", per_node_mtbf_seconds, positive=True)
            mtbf = per_node / check_int("nodes", nodes, 1)
        else:
            raise ConfigError(
                "YoungDaly needs mtbf_seconds, or per_node_mtbf_seconds together with nodes "
                f"(got per_node_mtbf_seconds={per_node_mtbf_seconds!r}, nodes={nodes!r})"
            )
        if formula not in FORMULAS:
            raise ConfigError(f"formula must be one of {sorted(FORMULAS)}, got {formula!r}")
        alpha = ewma_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
            raise ConfigError(f"ewma_alpha must be a number in (0, 1], got {ewma_alpha!r}")
        self._estimator = IntervalEstimator(
            mtbf,
            initial_cost_s=to_seconds("initial_cost_seconds", initial_cost_seconds, positive=False),
            formula=formula,
            min_interval_steps=check_int("min_interval_steps", min_interval_steps, 1),
            ewma_alpha=float(alpha),
        )
        self._last_save_step: int | None = None
        self._decided: tuple[int, bool] | None = None
        self._last: dict[str, Any] | None = None

    @property
    def mtbf_s(self) -> float:
        """Mean time between failures of the job, in seconds."""
        return self._estimator.mtbf_s

    def plan(self) -> dict[str, Any]:
        """The interval the current estimates give, deciding nothing (see ``IntervalEstimator.plan``)."""
        return {"policy": "YoungDaly", **self._estimator.plan()}

    def use_step_time(self, estimator: StepTimeEstimator) -> None:
        """Read the step time from ``estimator`` (a :class:`~torch_ckpt.policy._cadence.Cadence` lends its own)."""
        self._estimator.use_step_time(estimator)

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
        """Measure the step time; the first step observed starts the step count."""
        if self._last_save_step is None:
            self._last_save_step = step
        self._estimator.record_step(step, now_s)

    def record_save(
        self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0, now_s: float
    ) -> None:
        """Update ``C`` (blocking + slowdown) and the durability estimates from one save.

        Args:
            step: The step saved (a save of any trigger restarts the step count).
            blocking_s: Seconds the training loop was blocked by the save.
            durable_after_s: Seconds from the start of the save until it was durable (committed),
                or ``None`` if not known yet.
            slowdown_s: Extra training time lost while the save persisted in the background.
            now_s: Monotonic time of this call, in seconds (unused: the step count decides).

        Raises:
            ValueError: If a duration is negative or not finite.
        """
        self._estimator.record_save(
            step, blocking_s=blocking_s, durable_after_s=durable_after_s, slowdown_s=slowdown_s
        )
        if self._last_save_step is None or step > self._last_save_step:
            self._last_save_step = step

    def describe(self) -> dict[str, Any]:
        """The last decision: :meth:`plan`'s keys plus ``step``, ``now_s``, ``steps_since_save``
        and ``decision``; before any decision, the current :meth:`plan`."""
        return dict(self._last) if self._last is not None else self.plan()

    def state_dict(self) -> dict[str, Any]:
        """The measured estimates and last save step, so a resumed run keeps what it learned."""
        return {**self._estimator.state_dict(), "last_save_step": self._last_save_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (monotonic-clock state is not restored)."""
        self._estimator.load_state_dict(state)
        self._last_save_step = state.get("last_save_step")
        self._decided = None

    def __repr__(self) -> str:
        e = self._estimator
        return (
            f"YoungDaly(mtbf_seconds={e.mtbf_s!r}, formula={e.formula!r}, "
            f"initial_cost_seconds={e.initial_cost_s!r}, min_interval_steps={e.min_interval_steps})"
        )


class AnyOf:
    """Save when any of the given policies says so; every policy sees every call.

    Args:
        *policies: One or more objects implementing :class:`SavePolicy`.

    Raises:
        ConfigError: If no policy is given (a ``ValueError``).
        TypeError: If an argument does not implement :class:`SavePolicy`.
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
            share = getattr(policy, "use_step_time", None)
            if callable(share):
                share(estimator)

    def record_save(
        self, step: int, *, blocking_s: float, durable_after_s: float | None, slowdown_s: float = 0.0, now_s: float
    ) -> None:
        """Forward to every policy."""
        for policy in self._policies:
            policy.record_save(
                step, blocking_s=blocking_s, durable_after_s=durable_after_s, slowdown_s=slowdown_s, now_s=now_s
            )

    def describe(self) -> dict[str, Any]:
        """``policy``, the last ``step``/``decision``/``triggered_by`` and each policy's ``describe()``."""
        return {"policy": "AnyOf", **self._last, "policies": [p.describe() for p in self._policies]}

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(repr(p) for p in self._policies)})"
