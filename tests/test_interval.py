"""Tests for the one seconds-to-steps rule, torch_ckpt.policy._schedule.checkpoint_interval, and its users.

``torch-ckpt plan`` (sizing.interval_plan), ``torch-ckpt simulate`` (simulate.sweep) and the runtime
``YoungDaly`` policy must all give the same interval for the same inputs.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.policy._schedule import Cadence, YoungDaly, checkpoint_interval, daly_interval, young_interval
from torch_ckpt.tools.simulate import sweep
from torch_ckpt.tools.sizing import interval_plan

HOUR = 3600.0
# The case in issue 15: plan said 57 steps (399 s < the 402 s to durability), the runtime 58.
ISSUE = {"mtbf": 8 * HOUR, "cost": 2.0, "lag": 400.0, "step": 7.0}


def test_issue_input_gives_58_steps_limited_by_durability():
    """MTBF 8 h, C 2 s, L 400 s, 7 s steps: 58 steps (406 s), not 57 (399 s < 402 s)."""
    got = checkpoint_interval(ISSUE["mtbf"], ISSUE["cost"], ISSUE["lag"], ISSUE["step"])
    assert got.interval_steps == 58
    assert got.interval_s == pytest.approx(406.0)
    assert got.limited_by == "durability"


def test_formula_interval_rounds_to_the_nearest_step():
    """Daly's 338.1 s at 1.5 s steps is 225.4 steps, so 225."""
    got = checkpoint_interval(8 * HOUR, 2.0, 0.0, 1.5)
    assert got.interval_steps == 225
    assert got.limited_by == "formula"


def test_durability_floor_wins_when_rounding_the_formula_falls_short():
    """T = 338.1 s > C + L = 338 s, but 48 steps of 7 s (336 s) are too short: 49 steps."""
    got = checkpoint_interval(8 * HOUR, 2.0, 336.0, 7.0)
    assert got.optimal_interval_s > got.durable_after_s
    assert got.interval_steps == 49
    assert got.limited_by == "durability"


@pytest.mark.parametrize("mtbf", [600.0, HOUR, 8 * HOUR, 100 * HOUR])
@pytest.mark.parametrize("cost", [0.0, 0.3, 2.0, 45.0])
@pytest.mark.parametrize("lag", [0.0, 7.0, 400.0, 1999.0])
@pytest.mark.parametrize("step", [0.05, 1.0, 7.0, 33.3])
def test_interval_never_shorter_than_durability(mtbf, cost, lag, step):
    """For every input the interval in whole steps covers the time a save needs to be durable."""
    got = checkpoint_interval(mtbf, cost, lag, step)
    assert got.interval_steps >= 1
    assert got.interval_steps * step >= (cost + lag) * (1 - 1e-12)
    assert got.interval_s == pytest.approx(got.interval_steps * step)


def test_min_interval_steps_raises_a_short_interval():
    """A 1-step optimum is raised to min_interval_steps and says so."""
    got = checkpoint_interval(60.0, 0.01, 0.0, 1.0, min_interval_steps=50)
    assert (got.interval_steps, got.limited_by) == (50, "min_interval_steps")


def test_without_step_time_the_interval_is_in_seconds():
    """No step time: interval_steps is None and interval_s is max(T, C + L)."""
    got = checkpoint_interval(8 * HOUR, 2.0, 400.0)
    assert got.interval_steps is None
    assert got.interval_s == 402.0


def test_young_formula_is_selectable():
    """formula='young' uses sqrt(2 C M) for T."""
    got = checkpoint_interval(8 * HOUR, 2.0, formula="young")
    assert got.optimal_interval_s == pytest.approx(young_interval(8 * HOUR, 2.0))


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0.0, 2.0), {}, "mtbf_seconds"),
        ((HOUR, -1.0), {}, "save_cost_seconds"),
        ((HOUR, 1.0, -5.0), {}, "durability_lag_seconds"),
        ((HOUR, 1.0, 0.0, 0.0), {}, "step_time_seconds"),
        ((HOUR, 1.0, 0.0, float("nan")), {}, "step_time_seconds"),
        ((HOUR, 1.0), {"formula": "optimal"}, "formula"),
        ((HOUR, 1.0), {"min_interval_steps": 0}, "min_interval_steps"),
    ],
)
def test_checkpoint_interval_rejects_bad_input(args, kwargs, match):
    """Out-of-range input raises ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        checkpoint_interval(*args, **kwargs)


def test_plan_and_runtime_agree_on_the_issue_input():
    """`torch-ckpt plan` and a YoungDaly fed through a Cadence both choose 58 steps for the issue's input."""
    plan = interval_plan(ISSUE["mtbf"], ISSUE["cost"], durability_lag_s=ISSUE["lag"], step_time_s=ISSUE["step"])
    policy = YoungDaly(ISSUE["mtbf"], initial_cost_seconds=ISSUE["cost"], ewma_alpha=1.0)
    cadence = Cadence(policy)
    now = 0.0
    for step in range(1, 11):
        now += ISSUE["step"]
        cadence.record_step(step, now)
    staged, committed = Future(), Future()
    staged.set_result(None)
    handle = SaveHandle(10, staged, committed, SaveStats(step=10, blocking_s=ISSUE["cost"]))
    cadence.record_save_started(handle, now)
    handle.stats.total_s = ISSUE["cost"] + ISSUE["lag"]
    committed.set_result("/ckpt/step_10")
    for step in range(11, 14):
        now += ISSUE["step"] + (ISSUE["cost"] if step == 11 else 0.0)
        cadence.record_step(step, now)
    runtime = policy.describe()
    assert plan["interval_steps"] == runtime["interval_steps"] == 58
    assert plan["recommended_interval_s"] == pytest.approx(runtime["interval_s"])


def test_plan_reports_the_interval_it_recommends_in_whole_steps():
    """With a step time, plan's recommended seconds are interval_steps x step time."""
    plan = interval_plan(8 * HOUR, 2.0, durability_lag_s=400.0, step_time_s=7.0)
    assert plan["recommended_interval_s"] == pytest.approx(plan["interval_steps"] * 7.0)
    assert plan["daly_interval_s"] == pytest.approx(daly_interval(8 * HOUR, 2.0))


def test_simulate_marks_the_recommended_interval():
    """simulate's recommended interval is checkpoint_interval's (Daly raised to C + L) and is simulated."""
    result = sweep(mtbf_s=8 * HOUR, cost_s=2.0, durability_lag_s=400.0, points=5, failures=2_000)
    assert result.recommended_interval_s == checkpoint_interval(8 * HOUR, 2.0, 400.0).interval_s == 402.0
    assert 0 < result.recommended_overhead < 1
