"""torch_ckpt.policy._preemption: signal parsing and a handler that only records the signal; the manager's
emergency save with a memory tier (memory first, then disk, then exit).

Signals are delivered to this process with ``os.kill`` while a test-installed handler is in place;
every test puts the previous handlers back.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointManager, TrainState
from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._preemption import PreemptionFlag, parse_signals
from torch_ckpt.root._layout import is_committed

REPO = Path(__file__).resolve().parents[1]

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


# -- the emergency save with a memory tier: memory, then disk, then exit ----------------------------------------
def _preempted_manager(tmp_path: Path, **kwargs) -> CheckpointManager:
    return CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), save_every_n_steps=1000,
                             preemption_signals=("SIGUSR1",), **kwargs)


def _preempt_at_step_3(mgr: CheckpointManager, state: TrainState) -> None:
    for step in (1, 2):
        mgr.save_if_due(step, state)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(SystemExit) as exited:
        mgr.save_if_due(3, state)
    assert exited.value.code == 128 + signal.SIGUSR1


def test_a_preemption_with_a_memory_tier_leaves_a_memory_and_a_disk_copy(tmp_path):
    """A preemption signal with memory_root saves the step into memory and to disk before exiting."""
    state = TrainState(model=torch.nn.Linear(8, 8))
    with _preempted_manager(tmp_path) as mgr:
        _preempt_at_step_3(mgr, state)
    assert is_committed(tmp_path / "mem" / "step_000000003") and is_committed(tmp_path / "disk" / "step_000000003")


def test_a_restart_after_a_preemption_with_a_memory_tier_resumes_the_step(tmp_path):
    """The step saved at the preemption is the one a restarted manager restores."""
    model = torch.nn.Linear(8, 8)
    with _preempted_manager(tmp_path) as mgr:
        _preempt_at_step_3(mgr, TrainState(model=model))
    fresh = torch.nn.Linear(8, 8)
    with _preempted_manager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=fresh)) == 3
    assert torch.equal(fresh.weight, model.weight)


def test_a_failed_memory_save_at_a_preemption_still_saves_to_disk(tmp_path, monkeypatch, caplog):
    """A memory save that fails at the preemption is logged, and the disk save and the exit still happen."""
    from torch_ckpt.save import _checkpointer

    real = _checkpointer.persist_checkpoint

    def memory_fails(req, ctx):
        if req.nodes is not None and req.nodes.node_local:
            raise OSError(28, "No space left on device")
        return real(req, ctx)

    state = TrainState(model=torch.nn.Linear(8, 8))
    with _preempted_manager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save_if_due(step, state)
        monkeypatch.setattr(_checkpointer, "persist_checkpoint", memory_fails)
        with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
            _preempt_at_step_3(mgr, state)
    assert "the memory save of step 3 failed" in caplog.text
    assert is_committed(tmp_path / "disk" / "step_000000003")


_STUCK_DISK = textwrap.dedent("""
    import sys, threading, time, torch
    from torch_ckpt import CheckpointManager, TrainState
    import torch_ckpt.save._checkpointer as ck
    base = sys.argv[1]
    never, real = threading.Event(), ck.persist_checkpoint
    def stuck_disk(req, ctx):  # the disk save never commits; the memory save does
        if req.nodes is None or not req.nodes.node_local:
            never.wait()
        return real(req, ctx)
    ck.persist_checkpoint = stuck_disk
    model = torch.nn.Linear(8, 8)
    state = TrainState(model=model)
    with CheckpointManager(base + "/disk", memory_root=base + "/mem", save_every_n_steps=10_000,
                           preemption_signals=("SIGTERM",), preemption_timeout_seconds=1) as mgr:
        for step in range(1, 100_000):
            time.sleep(0.01)
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save_if_due(step, state)
            if step == 3:
                print("STEPPED", flush=True)  # the signal now lands after step 3
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_disk_save_that_times_out_leaves_the_memory_copy_a_restart_resumes(tmp_path):
    """When the emergency disk save cannot commit in time, the restart resumes the step from memory."""
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_DISK, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "STEPPED"
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)  # the disk persist never returns: only the 1 s deadline ends it
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "not committed within" in err and "resumes its memory copy" in err
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem")) as mgr:
        step = mgr.restore(TrainState(model=model))
        assert step is not None and step > 3 and mgr.restore_source == "memory"
    assert mgr.all_steps() == [] and torch.equal(model.weight, torch.full((8, 8), float(step)))
