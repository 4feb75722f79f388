"""Tests for the step-time estimator and the Cadence that feeds a save policy (torch_ckpt.policy._schedule).

Every test drives a fake monotonic clock (plain floats passed as ``now_s``): nothing here sleeps or
reads the real clock, so the results cannot depend on machine load.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.policy._schedule import (
    STEP_TIME_ALPHA,
    AnyOf,
    Cadence,
    EveryNSeconds,
    EveryNSteps,
    StepTimeEstimator,
    YoungDaly,
)

HOUR = 3600.0


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class RecordingPolicy:
    """A policy that records what the cadence tells it and never saves."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []
        self.saves: list[dict] = []

    def should_save(self, step, now_s):
        return False

    def record_step(self, step, now_s):
        self.steps.append((step, now_s))

    def record_save(self, step, *, blocking_s, durable_after_s, slowdown_s=0.0, now_s):
        self.saves.append({"step": step, "blocking_s": blocking_s, "durable_after_s": durable_after_s,
                           "slowdown_s": slowdown_s, "now_s": now_s})

    def describe(self):
        return {}


def pending_save(step: int, *, blocking_s: float) -> tuple[SaveHandle, Future]:
    """A save whose blocking part is over and whose commit the test resolves."""
    staged, committed = Future(), Future()
    staged.set_result(None)
    return SaveHandle(step, staged, committed, SaveStats(step=step, blocking_s=blocking_s)), committed


def commit(handle: SaveHandle, committed: Future, *, total_s: float) -> None:
    handle.stats.total_s = total_s
    committed.set_result("/ckpt/step")


# --- StepTimeEstimator -------------------------------------------------------------------------


def test_step_time_unknown_until_two_steps():
    """One recorded step gives no estimate; the second gives the first sample."""
    est = StepTimeEstimator()
    est.record_step(1, 10.0)
    assert est.seconds is None
    est.record_step(2, 12.5)
    assert est.seconds == pytest.approx(2.5)


def test_step_time_is_an_ewma_with_the_module_alpha():
    """After samples of 1 s then 2 s the estimate is 1 + STEP_TIME_ALPHA * (2 - 1)."""
    est = StepTimeEstimator()
    for step, now in ((1, 0.0), (2, 1.0), (3, 3.0)):
        est.record_step(step, now)
    assert est.seconds == pytest.approx(1.0 + STEP_TIME_ALPHA * 1.0)


def test_step_time_divides_by_steps_skipped():
    """Steps 10 -> 14 over 8 s measure 2 s per step."""
    est = StepTimeEstimator()
    est.record_step(10, 0.0)
    est.record_step(14, 8.0)
    assert est.seconds == pytest.approx(2.0)


def test_step_time_skip_next_leaves_out_the_stall():
    """The interval marked by skip_next() (it held a 50 s stall) is not averaged in."""
    est = StepTimeEstimator()
    est.record_step(1, 0.0)
    est.record_step(2, 1.0)
    est.skip_next()
    assert est.record_step(3, 52.0) == pytest.approx(51.0)
    est.record_step(4, 53.0)
    assert est.seconds == pytest.approx(1.0)


def test_step_time_excluded_sample_is_measured_but_not_averaged():
    """sample=False returns the interval without moving the estimate."""
    est = StepTimeEstimator(1.0)
    est.record_step(1, 0.0)
    assert est.record_step(2, 4.0, sample=False) == pytest.approx(4.0)
    assert est.seconds == 1.0


@pytest.mark.parametrize(("step", "now"), [(5, 20.0), (3, 20.0), (6, 5.0)])
def test_step_time_ignores_non_advancing_step_or_clock(step, now):
    """A repeated or earlier step (rollback) or a clock going back gives no sample."""
    est = StepTimeEstimator()
    est.record_step(4, 9.0)
    est.record_step(5, 10.0)
    assert est.record_step(step, now) is None
    assert est.seconds == pytest.approx(1.0)


# --- Cadence -----------------------------------------------------------------------------------


def test_cadence_measures_slowdown_while_a_save_persists():
    """Steps of 1.5 s against a 1 s baseline while persisting add 0.5 s each to the reported slowdown."""
    clock, policy = FakeClock(), RecordingPolicy()
    cadence = Cadence(policy)
    for step in range(1, 6):
        cadence.record_step(step, clock.advance(1.0))
    handle, committed = pending_save(5, blocking_s=2.0)
    cadence.record_save_started(handle, clock.now)
    cadence.record_step(6, clock.advance(3.0))  # holds the 2 s stall: neither a sample nor slowdown
    for step in (7, 8, 9):
        cadence.record_step(step, clock.advance(1.5))
    commit(handle, committed, total_s=8.0)
    cadence.record_step(10, clock.advance(1.0))
    durable = policy.saves[-1]
    assert durable["durable_after_s"] == 8.0 and durable["blocking_s"] == 2.0
    assert durable["slowdown_s"] == pytest.approx(1.5)
    assert cadence.step_time.seconds == pytest.approx(1.0)


def test_cadence_reports_each_save_twice_once_durable():
    """A save is reported when its stall ends (durable_after_s None) and again once committed."""
    clock, policy = FakeClock(), RecordingPolicy()
    cadence = Cadence(policy)
    cadence.record_step(1, clock.advance(1.0))
    handle, committed = pending_save(1, blocking_s=0.5)
    cadence.record_save_started(handle, clock.now)
    cadence.record_step(2, clock.advance(1.0))
    assert [s["durable_after_s"] for s in policy.saves] == [None]
    commit(handle, committed, total_s=4.0)
    cadence.record_step(3, clock.advance(1.0))
    assert [s["durable_after_s"] for s in policy.saves] == [None, 4.0]


def test_cadence_does_not_report_a_failed_save_as_durable():
    """A save whose commit failed is never reported as durable."""
    clock, policy = FakeClock(), RecordingPolicy()
    cadence = Cadence(policy)
    cadence.record_step(1, clock.advance(1.0))
    handle, committed = pending_save(1, blocking_s=0.5)
    cadence.record_save_started(handle, clock.now)
    committed.set_exception(OSError("disk full"))
    cadence.record_step(2, clock.advance(1.0))
    assert [s["durable_after_s"] for s in policy.saves] == [None]


def test_cadence_lends_its_estimator_to_young_daly():
    """The policy's step time is the cadence's (one estimator), which excludes steps slowed by persisting."""
    clock, policy = FakeClock(), YoungDaly(8 * HOUR, initial_cost_seconds=2.0)
    cadence = Cadence(policy)
    for step in range(1, 6):
        cadence.record_step(step, clock.advance(1.0))
    handle, _ = pending_save(5, blocking_s=2.0)
    cadence.record_save_started(handle, clock.now)
    for step in range(6, 10):
        cadence.record_step(step, clock.advance(4.0))  # slowed steps while the save persists
    assert cadence.step_time.seconds == pytest.approx(1.0)
    assert policy.describe()["step_time_s"] == pytest.approx(1.0)


def test_cadence_lends_its_estimator_through_any_of():
    """A YoungDaly inside AnyOf reads the cadence's estimator too."""
    clock, inner = FakeClock(), YoungDaly(8 * HOUR, initial_cost_seconds=2.0)
    cadence = Cadence(AnyOf(EveryNSteps(1000), inner))
    for step in range(1, 4):
        cadence.record_step(step, clock.advance(2.0))
    assert inner.describe()["step_time_s"] == pytest.approx(2.0)


def test_cadence_keeps_a_restored_policy_step_time():
    """A policy restored with a step time seeds the cadence's estimator instead of losing it."""
    policy = YoungDaly(8 * HOUR, initial_cost_seconds=2.0)
    policy.load_state_dict({"cost_s": 2.0, "step_time_s": 3.0})
    cadence = Cadence(policy)
    assert cadence.step_time.seconds == 3.0
    assert policy.describe()["interval_steps"] is not None


def test_cadence_never_reads_the_real_clock(monkeypatch):
    """Step and save bookkeeping uses only the times passed in."""
    clock = FakeClock()
    cadence = Cadence(YoungDaly(8 * HOUR, initial_cost_seconds=2.0))

    def boom():
        raise AssertionError("cadence read the real clock")

    for name in ("monotonic", "time", "perf_counter"):
        monkeypatch.setattr(time, name, boom)
    for step in range(1, 400):
        cadence.record_step(step, clock.advance(1.0))
        cadence.decide(step, clock.now)
    assert cadence.step_time.seconds == pytest.approx(1.0)


# --- two tiers: the other tier's saves never enter this cadence's costs ----------------------------------------


def test_cadence_leaves_a_wait_for_another_tiers_save_out_of_the_cost():
    """A save that waited for a save this cadence did not make reports its blocking time less that wait."""
    clock, policy = FakeClock(), RecordingPolicy()
    cadence = Cadence(policy)
    cadence.record_step(1, clock.advance(1.0))
    handle, committed = pending_save(1, blocking_s=2.5)
    handle.stats.wait_for_previous_s = 2.0  # the other tier's save was still being written
    cadence.record_save_started(handle, clock.now)
    commit(handle, committed, total_s=4.0)
    cadence.record_step(2, clock.advance(1.0))
    assert [(s["blocking_s"], s["durable_after_s"]) for s in policy.saves] == [(0.5, None), (0.5, 2.0)]


def test_cadence_counts_a_wait_for_its_own_previous_save():
    """A wait for this cadence's own save, still persisting at the last step, stays in the cost."""
    clock, policy = FakeClock(), RecordingPolicy()
    cadence = Cadence(policy)
    cadence.record_step(1, clock.advance(1.0))
    first, first_committed = pending_save(1, blocking_s=0.5)
    cadence.record_save_started(first, clock.now)
    cadence.record_step(2, clock.advance(1.0))  # the first save still persists
    commit(first, first_committed, total_s=3.0)
    second, _ = pending_save(2, blocking_s=2.5)
    second.stats.wait_for_previous_s = 2.0
    cadence.record_save_started(second, clock.now)
    assert policy.saves[-1]["step"] == 2 and policy.saves[-1]["blocking_s"] == 2.5


def test_cadence_busy_step_is_no_step_time_sample():
    """A step recorded while another tier's save persists (busy) leaves the step-time estimate as it was."""
    clock, cadence = FakeClock(), Cadence(RecordingPolicy())
    for step in range(1, 4):
        cadence.record_step(step, clock.advance(1.0))
    cadence.record_step(4, clock.advance(5.0), busy=True)
    assert cadence.step_time.seconds == pytest.approx(1.0)


def test_other_saved_restarts_young_daly_without_a_cost_sample():
    """Another tier's save restarts the step count, keeps the measured cost and leaves out its stall's step."""
    clock, policy = FakeClock(), YoungDaly(HOUR, initial_cost_seconds=0.0)
    cadence = Cadence(policy)
    for step in range(1, 4):
        cadence.record_step(step, clock.advance(1.0))
    handle, committed = pending_save(3, blocking_s=0.5)
    cadence.record_save_started(handle, clock.now)
    commit(handle, committed, total_s=1.0)
    for step in range(4, 8):
        cadence.record_step(step, clock.advance(1.0))
    cadence.other_saved(7, clock.now)
    cadence.record_step(8, clock.advance(30.0))  # holds the other tier's stall
    cadence.decide(8, clock.now)
    info = policy.describe()
    assert info["cost_s"] == 0.5 and info["steps_since_save"] == 1
    assert cadence.step_time.seconds == pytest.approx(1.0)


def test_other_saved_restarts_an_every_n_seconds_clock_inside_any_of():
    """Through AnyOf, another tier's save restarts an EveryNSeconds clock (no save 10 s after it)."""
    clock = FakeClock()
    cadence = Cadence(AnyOf(EveryNSteps(1000), EveryNSeconds(10)))
    cadence.record_step(1, clock.now)
    cadence.record_step(2, clock.advance(9.0))
    cadence.other_saved(2, clock.now)
    cadence.record_step(3, clock.advance(9.0))
    assert not cadence.decide(3, clock.now)
    cadence.record_step(4, clock.advance(1.0))
    assert cadence.decide(4, clock.now)
