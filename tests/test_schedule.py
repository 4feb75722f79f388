"""Tests for the interval formulas (torch_ckpt.policy._schedule) and save policies (torch_ckpt.policy._schedule)."""

from __future__ import annotations

import math
import time

import pytest

from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._schedule import (
    AnyOf,
    EveryNSeconds,
    EveryNSteps,
    SavePolicy,
    YoungDaly,
    daly_interval,
    expected_lost_work,
    expected_overhead,
    young_interval,
)

HOUR = 3600.0
MIN = 60.0


def run(policy, steps, *, step_time=1.0, blocking=2.0, durable_after=None, slowdown=0.0, start=1):
    """Drive ``policy`` like the manager does on a fake clock; return the steps it saved at."""
    now, saved = 1000.0, []
    for step in range(start, start + steps):
        now += step_time
        policy.record_step(step, now)
        if policy.should_save(step, now):
            saved.append(step)
            now += blocking
            policy.record_save(step, blocking_s=blocking, durable_after_s=durable_after, slowdown_s=slowdown, now_s=now)
    return saved


# --- formulas ------------------------------------------------------------------------------------


def test_young_is_sqrt_2cm():
    """Young's interval for M = 8 h, C = 2 s is sqrt(2 * 2 * 28800) = 339.41 s."""
    assert young_interval(8 * HOUR, 2.0) == pytest.approx(math.sqrt(115200.0))
    assert young_interval(8 * HOUR, 2.0) == pytest.approx(339.411, abs=1e-3)


@pytest.mark.parametrize(
    ("mtbf", "minutes", "tol"), [(24 * HOUR, 116.7, 0.05), (6 * HOUR, 56.7, 0.05), (15 * MIN, 9.14, 0.005)]
)
def test_daly_matches_published_examples(mtbf, minutes, tol):
    """Daly (2006), restart 10 min and C = 5 min: 24 h -> 116.7 min, 6 h -> 56.7 min, 15 min -> 9.14 min."""
    assert daly_interval(mtbf, 5 * MIN) / MIN == pytest.approx(minutes, abs=tol)


def test_daly_higher_order_terms_exact():
    """Daly's value equals sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C term by term."""
    c, m = 2.0, 900.0
    r = c / (2 * m)
    assert daly_interval(m, c) == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c, rel=1e-12)
    assert daly_interval(m, c) == pytest.approx(58.674, abs=1e-3)


@pytest.mark.parametrize("cost", [2 * 600.0, 5 * 600.0])
def test_daly_falls_back_to_mtbf_when_cost_at_least_2m(cost):
    """For C >= 2M Daly's documented fallback is T = M."""
    assert daly_interval(600.0, cost) == 600.0


def test_expected_overhead_formula():
    """Overhead is C/T + (T/2 + lag)/M: T=100, C=2, M=1000, lag=10 gives 0.08."""
    assert expected_overhead(100.0, 2.0, 1000.0, 10.0) == pytest.approx(0.02 + 60.0 / 1000.0)


def test_expected_overhead_adds_restart_over_mtbf():
    """A restart cost R adds R/M to the overhead."""
    base = expected_overhead(100.0, 2.0, 1000.0)
    assert expected_overhead(100.0, 2.0, 1000.0, restart_s=50.0) == pytest.approx(base + 0.05)


def test_expected_lost_work_is_half_interval_plus_lag():
    """A failure loses T/2 plus the durability lag on average."""
    assert expected_lost_work(300.0, 25.0) == 175.0


def test_young_minimises_first_order_overhead():
    """The first-order overhead is lower at Young's interval than 5 % either side of it."""
    t = young_interval(2 * HOUR, 3.0)
    at = expected_overhead(t, 3.0, 2 * HOUR)
    assert at < expected_overhead(t * 1.05, 3.0, 2 * HOUR)
    assert at < expected_overhead(t * 0.95, 3.0, 2 * HOUR)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: young_interval(0.0, 2.0), "mtbf_s"),
        (lambda: daly_interval(-1.0, 2.0), "mtbf_s"),
        (lambda: daly_interval(math.nan, 2.0), "mtbf_s"),
        (lambda: young_interval(HOUR, -2.0), "cost_s"),
        (lambda: expected_overhead(0.0, 2.0, HOUR), "interval_s"),
        (lambda: expected_lost_work(10.0, -1.0), "durability_lag_s"),
    ],
)
def test_formulas_reject_bad_input_naming_argument(call, field):
    """Zero/negative/NaN MTBF, negative cost or lag and a zero interval raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=field):
        call()


# --- fixed policies ------------------------------------------------------------------------------


def test_every_n_steps_saves_on_positive_multiples():
    """EveryNSteps(3) saves at 3, 6, 9 and never at step 0."""
    policy = EveryNSteps(3)
    assert [s for s in range(0, 10) if policy.should_save(s, 0.0)] == [3, 6, 9]


@pytest.mark.parametrize("n", [0, -1, 2.5, True, "3"])
def test_every_n_steps_rejects_bad_n(n):
    """n must be an integer >= 1; the error names the field and value."""
    with pytest.raises(ConfigError, match=r"n must be an integer >= 1"):
        EveryNSteps(n)


def test_every_n_seconds_saves_after_the_period_on_a_fake_clock():
    """With 1 s steps, a 10 s period and 2 s saves, saves come every 10 s of clock from the first step."""
    assert run(EveryNSeconds(10), 30, blocking=0.0) == [11, 21]


def test_every_n_seconds_accepts_duration_strings():
    """EveryNSeconds takes '2m' as 120 s."""
    assert EveryNSeconds("2m").seconds == 120.0


def test_every_n_seconds_clock_restarts_on_saves_from_elsewhere():
    """A save reported through record_save (another trigger) restarts the period from its start."""
    policy = EveryNSeconds(10)
    policy.record_step(1, 0.0)
    policy.record_save(1, blocking_s=1.0, durable_after_s=None, now_s=8.0)  # the save started at 7 s
    assert not policy.should_save(2, 16.9)
    assert policy.should_save(3, 17.0)


@pytest.mark.parametrize("seconds", [0, -5, "0s", "soon"])
def test_every_n_seconds_rejects_non_positive_or_unparseable(seconds):
    """The period must be a positive duration; the error names the field."""
    with pytest.raises(ValueError, match="seconds"):
        EveryNSeconds(seconds)


# --- YoungDaly ---------------------------------------------------------------------------------


def test_young_daly_saves_every_daly_interval_in_steps():
    """With 1 s steps and 2 s saves at MTBF 8 h, saves come every round(338.08) = 338 steps."""
    saved = run(YoungDaly("8h", initial_cost_seconds=2.0), 1400)
    assert saved == [339, 677, 1015, 1353]


def test_young_daly_young_formula_option():
    """formula='young' uses sqrt(2CM) = 339.4 s, so 339 steps."""
    assert run(YoungDaly(8 * HOUR, initial_cost_seconds=2.0, formula="young"), 700)[:2] == [340, 679]


def test_young_daly_job_mtbf_from_per_node_mtbf():
    """per-node MTBF 2048 h over 256 nodes is a job MTBF of 8 h."""
    assert YoungDaly(per_node_mtbf_seconds="2048h", nodes=256).mtbf_s == 8 * HOUR


def test_young_daly_cost_seeded_by_initial_guess():
    """Before any save is measured the cost is the initial guess."""
    policy = YoungDaly(HOUR, initial_cost_seconds=7.0)
    assert policy.describe()["cost_s"] == 7.0
    assert policy.describe()["optimal_interval_s"] == pytest.approx(daly_interval(HOUR, 7.0))


def test_young_daly_cost_is_ewma_of_blocking_plus_slowdown():
    """With alpha 0.5, saves costing 1 s + 3 s and then 2 s + 0 s give C = 4 s, then 3 s."""
    policy = YoungDaly(HOUR, initial_cost_seconds=10.0, ewma_alpha=0.5)
    policy.record_save(5, blocking_s=1.0, durable_after_s=None, slowdown_s=3.0, now_s=0.0)
    assert policy.describe()["cost_s"] == pytest.approx(4.0)
    policy.record_save(10, blocking_s=2.0, durable_after_s=None, slowdown_s=0.0, now_s=1.0)
    assert policy.describe()["cost_s"] == pytest.approx(3.0)


def test_young_daly_first_measured_cost_replaces_the_initial_guess():
    """A 5 s guess and a measured 0.005 s save: C is 0.005 s at once, not 30% of the way (issue 26 item 6)."""
    policy = YoungDaly(HOUR, initial_cost_seconds=5.0)
    policy.record_save(1, blocking_s=0.005, durable_after_s=None, now_s=0.0)
    assert policy.describe()["cost_s"] == pytest.approx(0.005)
    assert policy.describe()["optimal_interval_s"] == pytest.approx(daly_interval(HOUR, 0.005))


def test_young_daly_second_report_of_a_save_replaces_not_adds():
    """Reporting the same step again (when durable) replaces its sample instead of averaging twice."""
    policy = YoungDaly(HOUR, initial_cost_seconds=10.0, ewma_alpha=0.5)
    policy.record_save(4, blocking_s=10.0, durable_after_s=None, now_s=0.0)
    policy.record_save(5, blocking_s=2.0, durable_after_s=None, now_s=0.0)
    policy.record_save(5, blocking_s=2.0, durable_after_s=30.0, slowdown_s=2.0, now_s=30.0)
    assert policy.describe()["cost_s"] == pytest.approx(7.0)  # 10 + 0.5 * (4 - 10), not 6 + 0.5 * (4 - 6)
    assert policy.describe()["durability_lag_s"] == pytest.approx(28.0)


def test_young_daly_measured_cost_changes_the_interval():
    """After measuring an 8 s save (alpha 1) the interval is Daly's for C = 8 s."""
    policy = YoungDaly(8 * HOUR, initial_cost_seconds=2.0, ewma_alpha=1.0)
    run(policy, 400, blocking=8.0)
    plan = policy.describe()
    assert plan["cost_s"] == 8.0
    assert plan["interval_steps"] == round(daly_interval(8 * HOUR, 8.0))


def test_young_daly_step_time_excludes_the_save_stall():
    """A 50 s save stall does not inflate the measured step time of 1 s."""
    policy = YoungDaly(HOUR, initial_cost_seconds=2.0)
    for step in range(1, 11):
        policy.record_step(step, float(step))
    policy.record_save(10, blocking_s=50.0, durable_after_s=None, now_s=60.0)
    policy.record_step(11, 61.0)  # 51 s after step 10, 50 of them the save's stall
    policy.record_step(12, 62.0)
    assert policy.describe()["step_time_s"] == pytest.approx(1.0)


def test_young_daly_interval_never_below_durability_time():
    """Saves that take 600 s to become durable are never closer than 600 steps of 1 s."""
    policy = YoungDaly(8 * HOUR, initial_cost_seconds=2.0, ewma_alpha=1.0)
    saved = run(policy, 2000, durable_after=600.0)
    assert all(b - a >= 600 for a, b in zip(saved, saved[1:]))
    assert policy.describe()["limited_by"] == "durability"
    assert policy.describe()["interval_steps"] == 600


def test_young_daly_respects_min_interval_steps():
    """A tiny optimal interval is raised to min_interval_steps."""
    policy = YoungDaly(60.0, initial_cost_seconds=0.01, min_interval_steps=50)
    saved = run(policy, 200, blocking=0.0)
    assert saved == [51, 101, 151]
    assert policy.describe()["limited_by"] == "min_interval_steps"


def test_young_daly_does_not_save_before_step_time_is_known():
    """Without a measured step time there is no interval in steps, so no save."""
    policy = YoungDaly(60.0, initial_cost_seconds=0.0)
    assert policy.should_save(1, 0.0) is False
    assert policy.describe()["interval_steps"] is None


def test_young_daly_describe_reports_decision_inputs_and_outputs():
    """describe() carries C, step time, MTBF, interval, overhead and lost work consistent with the formulas."""
    policy = YoungDaly(8 * HOUR, initial_cost_seconds=2.0, ewma_alpha=1.0)
    run(policy, 400, durable_after=32.0)
    d = policy.describe()
    for key in ("cost_s", "step_time_s", "mtbf_s", "interval_s", "interval_steps", "expected_overhead",
                "expected_lost_work_s", "durability_lag_s", "formula", "decision", "step"):
        assert key in d
    t = d["interval_steps"] * d["step_time_s"]
    assert d["durability_lag_s"] == pytest.approx(30.0)
    assert d["expected_overhead"] == pytest.approx(2.0 / t + (t / 2 + 30.0) / (8 * HOUR))
    assert d["expected_lost_work_s"] == pytest.approx(t / 2 + 30.0)


def test_young_daly_saves_triggered_elsewhere_restart_the_count():
    """A save at step 200 reported via record_save delays the next YoungDaly save to 200 + 338."""
    policy = YoungDaly(8 * HOUR, initial_cost_seconds=2.0)
    now = 0.0
    saved = []
    for step in range(1, 700):
        now += 1.0
        policy.record_step(step, now)
        if step == 200:
            policy.record_save(200, blocking_s=2.0, durable_after_s=None, now_s=now)
        elif policy.should_save(step, now):
            saved.append(step)
    assert saved == [538]


def test_young_daly_answer_is_stable_for_a_repeated_step():
    """Asking twice about the same step gives the same answer (the decision is not consumed)."""
    policy = YoungDaly(60.0, initial_cost_seconds=0.0)
    policy.record_step(1, 0.0)
    policy.record_step(2, 1.0)
    assert policy.should_save(2, 1.0) is True
    assert policy.should_save(2, 1.0) is True


def test_young_daly_never_reads_the_real_clock(monkeypatch):
    """Decisions come only from the arguments: the real clocks are never consulted."""
    def boom():
        raise AssertionError("policy read the real clock")

    for name in ("monotonic", "time", "perf_counter"):
        monkeypatch.setattr(time, name, boom)
    assert run(YoungDaly("8h", initial_cost_seconds=2.0), 700) == [339, 677]


def test_young_daly_state_dict_round_trip_keeps_estimates():
    """A resumed policy restores the measured cost instead of the initial guess."""
    policy = YoungDaly(HOUR, initial_cost_seconds=10.0, ewma_alpha=1.0)
    assert run(policy, 400, blocking=3.0)
    fresh = YoungDaly(HOUR, initial_cost_seconds=10.0)
    fresh.load_state_dict(policy.state_dict())
    assert fresh.describe()["cost_s"] == 3.0
    assert fresh.describe()["interval_steps"] == policy.describe()["interval_steps"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mtbf_seconds": 0}, "mtbf_seconds must be positive"),
        ({"mtbf_seconds": -HOUR}, "mtbf_seconds must be positive"),
        ({"mtbf_seconds": "eight hours"}, "mtbf_seconds: invalid duration"),
        ({}, "needs mtbf_seconds"),
        ({"per_node_mtbf_seconds": "100h"}, "needs mtbf_seconds"),
        ({"mtbf_seconds": HOUR, "nodes": 4}, "not both"),
        ({"per_node_mtbf_seconds": "100h", "nodes": 0}, "nodes must be an integer >= 1"),
        ({"mtbf_seconds": HOUR, "formula": "optimal"}, "formula must be one of"),
        ({"mtbf_seconds": HOUR, "ewma_alpha": 0.0}, "ewma_alpha"),
        ({"mtbf_seconds": HOUR, "min_interval_steps": 0}, "min_interval_steps"),
        ({"mtbf_seconds": HOUR, "initial_cost_seconds": -1}, "initial_cost_seconds"),
    ],
)
def test_young_daly_rejects_bad_configuration(kwargs, match):
    """Bad or missing configuration raises ConfigError (a ValueError) naming the field."""
    with pytest.raises(ConfigError, match=match):
        YoungDaly(**kwargs)


def test_young_daly_rejects_negative_measurements():
    """A negative blocking time is a caller bug and raises ValueError."""
    with pytest.raises(ValueError, match="blocking_s"):
        YoungDaly(HOUR).record_save(1, blocking_s=-1.0, durable_after_s=None, now_s=0.0)


# --- AnyOf and the protocol ----------------------------------------------------------------------


def test_any_of_saves_when_any_policy_does():
    """AnyOf(EveryNSteps(3), EveryNSteps(5)) saves at the union of their steps."""
    policy = AnyOf(EveryNSteps(3), EveryNSteps(5))
    assert [s for s in range(1, 11) if policy.should_save(s, 0.0)] == [3, 5, 6, 9, 10]


def test_any_of_forwards_measurements_to_every_policy():
    """A YoungDaly inside AnyOf sees the saves and step times the manager reports."""
    inner = YoungDaly(8 * HOUR, initial_cost_seconds=2.0, ewma_alpha=1.0)
    run(AnyOf(EveryNSteps(100), inner), 250, blocking=5.0)
    assert inner.describe()["cost_s"] == 5.0
    assert inner.describe()["step_time_s"] == pytest.approx(1.0)


def test_any_of_asks_every_policy_without_short_circuit():
    """Every policy is asked each step, so each one's describe() reflects the last step."""
    first, second = EveryNSteps(1), EveryNSteps(7)
    AnyOf(first, second).should_save(4, 0.0)
    assert second.describe()["step"] == 4


def test_any_of_rejects_empty_and_non_policies():
    """AnyOf needs at least one policy, and every argument must implement SavePolicy."""
    with pytest.raises(ConfigError):
        AnyOf()
    with pytest.raises(TypeError, match="argument 1"):
        AnyOf(EveryNSteps(2), object())


@pytest.mark.parametrize("policy", [EveryNSteps(2), EveryNSeconds(5), YoungDaly(HOUR), AnyOf(EveryNSteps(2))])
def test_policies_implement_the_protocol(policy):
    """Every policy is a runtime-checkable SavePolicy."""
    assert isinstance(policy, SavePolicy)
