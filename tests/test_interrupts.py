"""Ctrl-C safety: a Ctrl-C held while a restore writes the live state, raised once it is written."""

from __future__ import annotations

import signal

import pytest

from torch_ckpt.restore._restore import InterruptHold


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
