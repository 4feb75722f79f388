"""Tests of SaveReports: committed saves reported once, in order, and the lost-work figure paced by a clock."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from torch_ckpt import ConfigError, SaveHandle, SaveReports
from torch_ckpt.save import SaveStats


def handle(step: int, *, outcome: str | None = "ok") -> SaveHandle:
    """A SaveHandle whose commit is done ("ok" or "fail") or still running (None)."""
    committed: Future = Future()
    if outcome == "ok":
        committed.set_result(f"/ckpt/{step}")
    elif outcome == "fail":
        committed.set_exception(OSError("disk full"))
    staged: Future = Future()
    staged.set_result(None)
    return SaveHandle(step, staged, committed, SaveStats(step=step, bytes=2_000_000_000, total_s=2.0))


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def health(lost: float | None = 12.5):
    calls = []

    def report() -> dict:
        calls.append(1)
        return {"lost_work_if_failure_now_s": lost}
    return report, calls


def test_committed_returns_each_finished_save_once_at_its_training_step():
    """A committed save is handed back once, with the training step it was added with."""
    reports = SaveReports()
    h = handle(3)
    reports.add(h, step=600)
    assert reports.committed() == [(h, 600)]
    assert reports.committed() == []


def test_committed_without_a_training_step_gives_none():
    """Without a training step None comes back, never the checkpoint's number."""
    reports = SaveReports()
    h = handle(7)
    reports.add(h)
    assert reports.committed() == [(h, None)]


def test_failed_saves_are_dropped_and_running_ones_hold_back_later_ones():
    """A failed save is not reported; a running save keeps the ones after it for a later call."""
    reports = SaveReports()
    failed, running, later = handle(1, outcome="fail"), handle(2, outcome=None), handle(3)
    for h in (failed, running, later):
        reports.add(h)
    assert reports.committed() == []
    running.committed.set_result("/ckpt/2")
    assert [h.step for h, _ in reports.committed()] == [2, 3]


def test_lost_work_is_paced_by_the_clock():
    """The figure comes at the first call, then not again until health_every_seconds have passed."""
    clock = Clock()
    reports = SaveReports(health_every_seconds="1m", clock=clock)
    report, calls = health()
    assert reports.lost_work(report) == 12.5
    clock.now += 59.0
    assert reports.lost_work(report) is None and len(calls) == 1  # health() not even called
    clock.now += 1.0
    assert reports.lost_work(report) == 12.5


def test_lost_work_is_due_after_a_commit():
    """A save that committed since the last figure makes the next figure due at once."""
    clock = Clock()
    reports = SaveReports(clock=clock)
    report, _ = health()
    reports.lost_work(report)
    reports.add(handle(1))
    reports.committed()
    assert reports.lost_work(report) == 12.5


def test_lost_work_unknown_stays_due():
    """Before the first durable checkpoint (None) nothing is reported and the next call asks again."""
    clock = Clock()
    reports = SaveReports(clock=clock)
    unknown, calls = health(None)
    assert reports.lost_work(unknown) is None and reports.lost_work(unknown) is None
    assert len(calls) == 2


def test_metrics_prefix_the_stat_keys_as_floats():
    """metrics() gives every STAT_KEYS figure under the prefix, gb_per_s included."""
    m = SaveReports.metrics(handle(1), prefix="ckpt/", keys=("bytes", "gb_per_s"))
    assert m == {"ckpt/bytes": 2e9, "ckpt/gb_per_s": 1.0}


def test_bad_pace_is_a_config_error():
    """A negative health_every_seconds is refused naming the argument."""
    with pytest.raises(ConfigError, match="health_every_seconds"):
        SaveReports(health_every_seconds=-1)
