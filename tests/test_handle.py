"""torch_ckpt.handle: SaveHandle's two futures and SaveStats' figures.

The futures are resolved by hand (or by a thread the test joins), standing in for the background writer.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

import pytest

from torch_ckpt.errors import CheckpointWriteError
from torch_ckpt.handle import SaveHandle, SaveStats


def make_handle(step: int = 7) -> SaveHandle:
    return SaveHandle(step, Future(), Future(), SaveStats(step=step, wall_time=0.0))


def test_fresh_handle_is_staging_and_not_done():
    """Before anything resolves, the handle is not done and reads as staging."""
    h = make_handle()
    assert not h.done()
    assert repr(h) == "SaveHandle(step=7, staging)"


def test_staged_is_not_done():
    """A staged but uncommitted save is not done and reads as staged."""
    h = make_handle()
    h.staged.set_result(None)
    assert not h.done()
    assert repr(h) == "SaveHandle(step=7, staged)"


def test_committed_handle_is_done_and_wait_returns_the_path():
    """Once committed, done() is True and wait() returns the committed directory."""
    h = make_handle()
    h.staged.set_result(None)
    h.committed.set_result("/ckpt/step_000000007")
    assert h.done()
    assert h.wait() == "/ckpt/step_000000007"
    assert repr(h) == "SaveHandle(step=7, committed)"


def test_error_set_on_a_writer_thread_is_raised_by_wait_on_the_caller():
    """A persist error set by another thread is raised, as the same exception, by wait() on this thread."""
    h = make_handle()
    error = CheckpointWriteError(28, "disk full")
    writer = threading.Thread(target=h.committed.set_exception, args=(error,))
    writer.start()
    writer.join()
    assert h.done()
    with pytest.raises(CheckpointWriteError) as info:
        h.wait()
    assert info.value is error
    assert repr(h) == "SaveHandle(step=7, failed)"


class _PendingFuture(Future):
    """A future that never resolves and records the timeout it was asked to wait (so a lost timeout cannot hang)."""

    def result(self, timeout=None):
        self.asked = timeout
        raise FutureTimeoutError()


def test_wait_with_a_timeout_on_a_pending_save_raises_timeout():
    """wait(timeout=...) passes the timeout to the committed future and raises its TimeoutError."""
    h = SaveHandle(1, Future(), _PendingFuture(), SaveStats(step=1))
    with pytest.raises(FutureTimeoutError):
        h.wait(timeout=2.5)
    assert h.committed.asked == 2.5


def test_gb_per_s_is_bytes_over_total_seconds():
    """gb_per_s is bytes / total_s in units of 10^9 bytes per second."""
    assert SaveStats(step=1, bytes=6_000_000_000, total_s=2.0).gb_per_s == pytest.approx(3.0)


def test_gb_per_s_is_zero_before_the_save_finishes():
    """With total_s still 0, gb_per_s is 0 rather than a division error."""
    assert SaveStats(step=1, bytes=10).gb_per_s == 0.0


def test_as_dict_has_every_field_and_the_throughput():
    """as_dict() holds every field by name plus gb_per_s."""
    d = SaveStats(step=3, bytes=10**9, total_s=0.5, mode="sync", wall_time=12.0).as_dict()
    assert d["step"] == 3 and d["mode"] == "sync" and d["wall_time"] == 12.0
    assert d["gb_per_s"] == pytest.approx(2.0)
    assert set(d) == {"step", "bytes", "blocking_s", "wait_for_previous_s", "staging_s", "persist_s", "total_s",
                      "files_bytes", "mode", "wall_time", "gb_per_s"}


def test_stats_fields_are_keyword_only():
    """SaveStats refuses positional fields, so a reordering cannot silently swap figures."""
    with pytest.raises(TypeError):
        SaveStats(1, 2)  # type: ignore[misc]
