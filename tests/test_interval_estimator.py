"""YoungDaly's online estimates of the save cost, durability lag and step time, driven by an injected clock."""

from __future__ import annotations

import pytest

from torch_ckpt.policy._schedule import StepTimeEstimator, YoungDaly, checkpoint_interval

HOUR = 3600.0


def _estimator(**kwargs) -> YoungDaly:
    return YoungDaly(8 * HOUR, **{"initial_cost_seconds": 10.0, "ewma_alpha": 0.5, **kwargs})


def test_the_first_save_replaces_the_initial_cost_and_later_ones_move_it_by_the_ewma_weight():
    """The first save (2 s + 1 s) replaces the 10 s guess: 3 s; a 5 s save then moves it halfway (alpha 0.5): 4 s."""
    est = _estimator()
    assert est.state_dict()["cost_s"] is None and est.plan()["cost_s"] == 10.0
    est.record_save(1, blocking_s=2.0, durable_after_s=None, slowdown_s=1.0, now_s=0.0)
    assert est.state_dict()["cost_s"] == 3.0
    est.record_save(2, blocking_s=5.0, durable_after_s=None, slowdown_s=0.0, now_s=0.0)
    assert est.state_dict()["cost_s"] == 4.0


def test_a_repeated_step_replaces_its_earlier_sample():
    """Reporting step 2 again (once durable) replaces its cost sample instead of averaging it in twice."""
    est = _estimator()
    est.record_save(1, blocking_s=10.0, durable_after_s=None, slowdown_s=0.0, now_s=0.0)
    est.record_save(2, blocking_s=2.0, durable_after_s=None, slowdown_s=0.0, now_s=0.0)
    est.record_save(2, blocking_s=4.0, durable_after_s=None, slowdown_s=0.0, now_s=0.0)
    assert est.state_dict()["cost_s"] == 7.0  # 10 + 0.5 * (4 - 10), not 6 + 0.5 * (4 - 6)


def test_the_durability_lag_is_the_time_after_the_blocking_part():
    """A save durable 12 s after it started, 2 s of which blocked, gives a lag of 10 s."""
    est = _estimator()
    est.record_save(1, blocking_s=2.0, durable_after_s=12.0, slowdown_s=0.0, now_s=0.0)
    assert est.state_dict()["durability_lag_s"] == 10.0


def test_the_step_after_a_save_is_left_out_of_the_step_time():
    """The step interval holding a save's stall (10 s here) does not enter the 1 s/step estimate."""
    est = _estimator()
    est.record_step(0, 100.0)
    est.record_step(1, 101.0)
    est.record_save(1, blocking_s=9.0, durable_after_s=None, slowdown_s=0.0, now_s=0.0)
    est.record_step(2, 111.0)
    assert est.state_dict()["step_time_s"] == 1.0


def test_a_shared_step_time_estimator_is_read_not_fed():
    """After use_step_time, record_step no longer measures; the shared estimator's value is used."""
    est = _estimator()
    shared = StepTimeEstimator(3.0)
    est.use_step_time(shared)
    est.record_step(0, 0.0)
    est.record_step(1, 50.0)
    assert est.state_dict()["step_time_s"] == 3.0 and shared.seconds == 3.0


def test_the_interval_is_checkpoint_interval_of_the_estimates():
    """plan() is the one seconds-to-steps rule applied to the current estimates."""
    est = _estimator(formula="young", min_interval_steps=2)
    est.record_step(0, 0.0)
    est.record_step(1, 7.0)
    est.record_save(1, blocking_s=2.0, durable_after_s=402.0, slowdown_s=0.0, now_s=0.0)
    s = est.state_dict()
    expected = checkpoint_interval(8 * HOUR, s["cost_s"], s["durability_lag_s"], s["step_time_s"], formula="young",
                                   min_interval_steps=2).as_dict()
    expected["cost_s"] = expected.pop("save_cost_s")
    assert est.plan() == {"policy": "YoungDaly", **expected}


def test_state_dict_round_trips_into_a_fresh_estimator():
    """A fresh policy loaded with state_dict() plans exactly the same interval."""
    est = _estimator()
    est.record_step(0, 0.0)
    est.record_step(1, 5.0)
    est.record_save(1, blocking_s=3.0, durable_after_s=30.0, slowdown_s=0.5, now_s=0.0)
    fresh = _estimator()
    fresh.load_state_dict(est.state_dict())
    assert fresh.plan() == est.plan()


@pytest.mark.parametrize("kwargs", [{"ewma_alpha": 0.0}, {"formula": "weibull"}, {"min_interval_steps": 0},
                                    {"initial_cost_seconds": -1.0}])
def test_bad_arguments_are_value_errors(kwargs):
    """An out-of-range weight, unknown formula, interval below one step or negative seed cost is refused."""
    with pytest.raises(ValueError):
        _estimator(**kwargs)
