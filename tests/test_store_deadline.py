"""torch_ckpt.storage._locations: a durable call on the caller's thread waits only while the store answers."""

from __future__ import annotations

import threading
import time

import pytest

from torch_ckpt.storage._locations import DurableUnavailableError, bounded

TIMEOUT = 0.3


def test_a_call_that_keeps_answering_runs_past_the_timeout():
    """A call ticking more often than the timeout completes, however long it takes in all."""
    def work(watch):
        for _ in range(8):
            time.sleep(TIMEOUT / 3)
            watch.tick()
        return "done"

    assert bounded(work, timeout_seconds=TIMEOUT, what="listing x") == "done"


def test_a_silent_store_is_given_up_after_the_timeout():
    """No answer for the timeout: DurableUnavailableError naming the operation and the setting, promptly."""
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(DurableUnavailableError, match=r"listing s3://b/run: .*did not answer for 0.3 s "
                                                      r"\(durable_timeout_seconds\)"):
        bounded(lambda watch: release.wait(30), timeout_seconds=TIMEOUT, what="listing s3://b/run")
    assert time.monotonic() - t0 < 10 * TIMEOUT
    release.set()


def test_a_given_up_call_publishes_nothing():
    """After the caller gave up, the worker's commit is refused and its next tick stops it."""
    go, finished = threading.Event(), threading.Event()
    outcome = {}

    def work(watch):
        go.wait(30)
        try:
            watch.publish(lambda: outcome.setdefault("committed", True))
        except DurableUnavailableError as exc:
            outcome["refused"] = str(exc)
        try:
            watch.tick()
        except DurableUnavailableError:
            outcome["stopped"] = True
        finished.set()

    with pytest.raises(DurableUnavailableError):
        bounded(work, timeout_seconds=TIMEOUT, what="downloading x")
    go.set()
    assert finished.wait(10)
    assert "committed" not in outcome and "refused" in outcome and outcome["stopped"]


def test_local_work_does_not_count_as_silence():
    """Local work (a checksum, an fsync) longer than the timeout does not give the call up."""
    def work(watch):
        with watch.local_work():
            time.sleep(4 * TIMEOUT)
        return 7

    assert bounded(work, timeout_seconds=TIMEOUT, what="downloading x") == 7


def test_the_calls_own_error_reaches_the_caller():
    """An exception raised by the call is raised on the caller's thread as it is."""
    def work(watch):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        bounded(work, timeout_seconds=TIMEOUT, what="listing x")
