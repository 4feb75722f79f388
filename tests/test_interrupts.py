"""Ctrl-C safety helpers: threads that all work or none, and a Ctrl-C held while the live state is written."""

from __future__ import annotations

import signal
import threading

import pytest

from torch_ckpt.restore._interrupts import InterruptHold, Launch


def test_launch_runs_every_target_once_all_threads_started():
    """Without an interrupt every target runs once."""
    ran: list[int] = []
    launch = Launch([lambda: ran.append(1), lambda: ran.append(2)], "t")
    launch.start()
    for t in launch.threads:
        t.join()
    assert launch.working and sorted(ran) == [1, 2]


def test_launch_interrupted_while_starting_runs_no_target(monkeypatch):
    """A KeyboardInterrupt in the second Thread.start(): working is False and no target ever runs."""
    ran: list[int] = []
    real_start, calls = threading.Thread.start, []

    def start_then_interrupt(self):
        real_start(self)
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    launch = Launch([lambda: ran.append(1), lambda: ran.append(2)], "t")
    with pytest.raises(KeyboardInterrupt):
        launch.start()
    for t in launch.threads:
        t.join(timeout=10)
    assert not launch.working and ran == []


def test_hold_raises_a_ctrl_c_only_at_release():
    """SIGINT between start() and release() is raised by release(); the default handler is back."""
    hold = InterruptHold()
    hold.start()
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        hold.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_hold_leaves_a_custom_sigint_handler_alone():
    """With the application's own SIGINT handler installed, the hold changes nothing."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: seen.append(1))
    try:
        hold = InterruptHold()
        hold.start()
        signal.raise_signal(signal.SIGINT)
        hold.release()
        assert seen == [1]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_while_one_is_held_is_raised_at_once():
    """Two SIGINTs while held: the second raises immediately (a hung write can still be stopped)."""
    hold = InterruptHold()
    hold.start()
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        hold.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
