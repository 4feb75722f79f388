"""torch_ckpt.policy._preemption: signal parsing and a handler that only records the signal.

Signals are delivered to this process with ``os.kill`` while a test-installed handler is in place;
every test puts the previous handlers back.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._preemption import PreemptionFlag, parse_signals

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _keep_handlers():
    """Install a sentinel handler for the signals used, and restore the original ones afterwards."""
    original = {s: signal.getsignal(s) for s in SIGNALS}
    seen: list[int] = []
    for s in SIGNALS:
        signal.signal(s, lambda signum, frame: seen.append(signum))
    yield seen
    for s, h in original.items():
        signal.signal(s, h)


@pytest.mark.parametrize("given,expected", [
    ("SIGTERM", signal.SIGTERM), ("sigusr1", signal.SIGUSR1), ("USR2", signal.SIGUSR2), ("term", signal.SIGTERM),
    (15, signal.SIGTERM), (signal.SIGUSR1, signal.SIGUSR1),
])
def test_parse_signals_accepts_names_numbers_and_enums(given, expected):
    """Names with or without 'SIG' (any case), numbers and Signals values all parse."""
    assert parse_signals([given]) == [expected]


@pytest.mark.parametrize("bad", ["SIGNOPE", "", 100000, -1])
def test_parse_signals_refuses_unknown_signals(bad):
    """An unknown name or number raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=repr(bad)):
        parse_signals([bad])


def test_signal_sets_the_flag():
    """A signal sent to this process is recorded as the received one."""
    flag = PreemptionFlag(["SIGUSR1"])
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requested and flag.received is signal.SIGUSR1
    finally:
        flag.restore()


def test_handler_only_records_and_keeps_the_process_running(_keep_handlers):
    """SIGTERM neither ends the process nor reaches the previous handler: it is only recorded."""
    flag = PreemptionFlag(["SIGTERM"])
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.received is signal.SIGTERM
        assert _keep_handlers == []
    finally:
        flag.restore()


def test_first_signal_wins():
    """A second, different signal does not replace the first one recorded."""
    flag = PreemptionFlag(["SIGUSR1", "SIGUSR2"])
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received is signal.SIGUSR2
    finally:
        flag.restore()


def test_restore_reinstates_the_previous_handlers(_keep_handlers):
    """After restore, the handler installed before the flag receives the signal again."""
    flag = PreemptionFlag(["SIGUSR1"])
    flag.restore()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert _keep_handlers == [signal.SIGUSR1]
    assert not flag.requested


def test_only_the_given_signals_are_handled(_keep_handlers):
    """Signals not listed keep their previous handler and do not set the flag."""
    flag = PreemptionFlag(["SIGUSR1"])
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert not flag.requested and _keep_handlers == [signal.SIGUSR2]
    finally:
        flag.restore()


def test_trigger_sets_the_flag_without_a_signal():
    """trigger() records the given signal as if it had arrived."""
    flag = PreemptionFlag([])
    flag.trigger(signal.SIGUSR2)
    assert flag.requested and flag.received is signal.SIGUSR2


def test_trigger_does_not_replace_a_received_signal():
    """trigger() after a real signal keeps the signal that arrived first."""
    flag = PreemptionFlag(["SIGUSR1"])
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        flag.trigger(signal.SIGTERM)
        assert flag.received is signal.SIGUSR1
    finally:
        flag.restore()


@pytest.mark.parametrize(("signalled", "polled", "warnings"), [(True, False, 1), (True, True, 0), (False, False, 0)])
def test_an_unpolled_signal_is_logged_once(caplog, signalled, polled, warnings):
    """warn_if_unheeded logs once for a signal nothing polled, never for a polled flag or without a signal."""
    flag = PreemptionFlag(["SIGUSR1"])
    try:
        flag.polled = polled
        if signalled:
            os.kill(os.getpid(), signal.SIGUSR1)
        with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
            flag.warn_if_unheeded()
            flag.warn_if_unheeded()
    finally:
        flag.restore()
    assert caplog.text.count("SIGUSR1 received, but preemption_signals act only at") == warnings


def test_off_the_main_thread_no_handler_is_installed(caplog):
    """Built on another thread, the flag installs nothing, logs a warning, and trigger() still works."""
    before = signal.getsignal(signal.SIGUSR1)
    made: list[PreemptionFlag] = []
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
        t = threading.Thread(target=lambda: made.append(PreemptionFlag(["SIGUSR1"])))
        t.start()
        t.join()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert "not on the main thread" in caplog.text
    made[0].trigger()
    assert made[0].received is signal.SIGTERM
