"""Injected faults: disk full, read-only file system, permission denied, preemption, concurrent runs, hostile files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointError, CheckpointManager, CheckpointWriteError, TrainState

REPO = Path(__file__).resolve().parents[1]


def _model(width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))


@pytest.fixture
def tmpfs(tmp_path):
    """A tiny tmpfs mounted for the test (needs root); skipped where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_is_a_typed_error_and_earlier_checkpoints_survive(tmpfs):
    """ENOSPC surfaces as CheckpointWriteError(errno 28) naming the path; step 1 stays loadable."""
    small = TrainState(model=_model(16))
    with CheckpointManager(tmpfs / "run", keep_last=5) as mgr:
        mgr.save(1, small).wait()
        big = TrainState(model=_model(512))  # ~2 MB: does not fit next to step 1
        with pytest.raises(CheckpointWriteError) as info:
            mgr.save(2, big)
            mgr.wait()
        assert info.value.errno == 28 and "disk is full" in str(info.value) and str(tmpfs) in str(info.value)
        assert mgr.all_steps() == [1]
        assert not list((tmpfs / "run").glob(".step_*"))
        assert mgr.restore(TrainState(model=_model(16))) == 1


def test_read_only_file_system_is_a_typed_error(tmpfs):
    """EROFS surfaces as CheckpointWriteError(errno 30) telling to choose a writable directory."""
    state = TrainState(model=_model(16))
    run = tmpfs / "run"
    with CheckpointManager(run) as mgr:
        mgr.save(1, state).wait()
        # A failing disk is remounted read-only by the kernel even with files open for writing, but mount(8) refuses
        # (EBUSY) while the root lock's file is open read-write (filelock opens it so); a read-only bind mount over
        # the root has the same effect on every later write, with the lock still held.
        subprocess.run(["mount", "--bind", str(run), str(run)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(run)], check=True)
            with pytest.raises(CheckpointWriteError, match="read-only") as info:
                mgr.save(2, state)
                mgr.wait()
            assert info.value.errno == 30
            assert mgr.all_steps() == [1]
        finally:
            subprocess.run(["umount", str(run)], check=True)


def test_read_only_root_is_restored_with_read_only_true(tmpfs):
    """On a read-only file system the lock cannot be created (the error names read_only=True), which restores."""
    with CheckpointManager(tmpfs / "run") as mgr:
        mgr.save(1, TrainState(model=_model(16))).wait()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        with pytest.raises(CheckpointWriteError, match="read_only=True"):
            CheckpointManager(tmpfs / "run")
        model = _model(16)
        with torch.no_grad():
            model[0].weight.zero_()
        with CheckpointManager(tmpfs / "run", read_only=True) as mgr:
            assert mgr.all_steps() == [1] and mgr.restore(TrainState(model=model)) == 1
        assert torch.equal(model[0].weight, _model(16)[0].weight)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)


def test_permission_denied_is_a_typed_error(tmp_path, monkeypatch):
    """EACCES while writing a shard surfaces as CheckpointWriteError(errno 13) with advice."""
    real_open = Path.open

    def denied(self, mode="r", *args, **kwargs):  # as root, real permission bits are not enforced
        if self.name.endswith(".distcp") and ("w" in mode or "x" in mode):  # shards are created with "xb"
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointWriteError, match="permission") as info:
            mgr.save(1, TrainState(model=_model(16)))
            mgr.wait()
        assert info.value.errno == 13 and mgr.all_steps() == []


def test_warn_policy_keeps_training_going(tmp_path, disk_full_once, caplog):
    """on_write_error='warn' logs the failure, records it and lets the next save succeed."""
    state = TrainState(model=_model(16))
    with CheckpointManager(tmp_path, on_write_error="warn") as mgr:
        mgr.save(1, state)
        mgr.save(2, state).wait()
        assert mgr.all_steps() == [2]
        assert [f["step"] for f in mgr.checkpointer.failed_saves] == [1]
    assert any("training continues" in r.getMessage() for r in caplog.records)


def test_an_error_raised_by_handle_wait_is_not_raised_again_by_the_next_save(tmp_path, disk_full_once):
    """save(1).wait() raises the ENOSPC once; the next save() commits its own step instead of raising it again."""
    state = TrainState(model=_model(16))
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointWriteError, match="No space left"):
            mgr.save(1, state).wait()
        assert mgr.save(2, state).wait().endswith("step_000000002")
        mgr.wait()  # nothing pending either
        assert mgr.all_steps() == [2]


def test_an_error_not_taken_from_its_handle_is_raised_by_the_next_save(tmp_path, disk_full_once):
    """Without handle.wait(), the failed save's error is raised by the next save(), which saves nothing."""
    state = TrainState(model=_model(16))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        with pytest.raises(CheckpointWriteError, match="No space left"):
            mgr.save(2, state)
        assert mgr.save(3, state).wait() and mgr.all_steps() == [3]


def test_second_run_on_the_same_root_is_refused(tmp_path):
    """A root in use by a live run is locked: the second manager fails naming host and pid."""
    with CheckpointManager(tmp_path):
        with pytest.raises(CheckpointWriteError, match=f"pid {os.getpid()}"):
            CheckpointManager(tmp_path)


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    """A lock left by a process that no longer exists does not block a new run."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 0}))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() is None


_PREEMPT = textwrap.dedent("""
    import sys, threading, time, torch
    from torch_ckpt import CheckpointManager, TrainState, EveryNSteps
    import torch_ckpt.save._persist as persist_mod
    root, sig, stuck, timeout = sys.argv[1], sys.argv[2], sys.argv[3] == "stuck", float(sys.argv[4])
    if stuck:  # the emergency save can never commit: only the deadline ends the run
        never = threading.Event()
        def stuck_persist(req, ctx):
            never.wait()
        import torch_ckpt.save._checkpointer as ck
        ck.persist_checkpoint = stuck_persist
    model = torch.nn.Linear(8, 8)
    state = TrainState(model=model)
    with CheckpointManager(root, save_policy=EveryNSteps(10_000), preemption_signals=(sig,),
                           preemption_timeout_seconds=timeout) as mgr:
        for step in range(1, 100_000):
            time.sleep(0.01)
            state.step = step
            mgr.save_if_due(step, state)
            if step == 3:
                print("STEPPED", flush=True)  # the signal now lands after step 3
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_preemption_signal_saves_at_next_step_and_exits(tmp_path, sig):
    """A preemption signal triggers one committed save at the next step boundary, then exit 128+signum."""
    # a deadline far beyond any loaded machine's commit time: this test is about the save, not the deadline
    proc = subprocess.Popen([sys.executable, "-c", _PREEMPT, str(tmp_path), sig, "ok", "60"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "STEPPED"
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, sig), err[-2000:]
    assert f"preempted by {sig}" in err and "committed" in err
    with CheckpointManager(tmp_path) as mgr:
        step = mgr.latest_step()
        assert step is not None and step > 3
        assert mgr.restore(TrainState(model=torch.nn.Linear(8, 8))) == step


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_preemption_timeout_leaves_no_half_marked_checkpoint(tmp_path):
    """When the emergency save cannot commit in time the process still exits and nothing partial is listed."""
    proc = subprocess.Popen([sys.executable, "-c", _PREEMPT, str(tmp_path), "SIGTERM", "stuck", "1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "STEPPED"
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)  # the persist never returns: only the 1 s deadline can end the run
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "not committed within" in err
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() is None


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_pickled_item_in_a_crafted_checkpoint_is_never_unpickled(tmp_path):
    """A DCP checkpoint whose non-tensor item is a malicious pickle is refused without running it."""
    import torch.distributed.checkpoint as dcp

    from torch_ckpt.format._files import FORMAT_NAME

    marker = tmp_path / "pwned"
    _Evil.marker = marker
    step_dir = tmp_path / "run" / "step_000000001"
    dcp.save({"model.weight": torch.zeros(2), "evil": _Evil()}, checkpoint_id=str(step_dir), no_dist=True)
    assert not marker.exists()
    tree = {"model": {"weight": {"__tensor__": "model.weight"}}, "evil": {"__tensor__": "evil"}}
    (step_dir / "rank_00000.json").write_text(json.dumps({"step": 1, "rank": 0, "world_size": 1, "tree": tree}))
    files = {}
    for p in step_dir.iterdir():
        data = p.read_bytes()
        files[p.name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (step_dir / "manifest.json").write_text(json.dumps({
        "format": FORMAT_NAME, "format_version": 1, "step": 1, "wall_time": 0, "world_size": 1,
        "torch_version": torch.__version__, "files": files}))
    target = {"model": {"weight": torch.ones(2)}, "evil": torch.ones(2)}
    with CheckpointManager(tmp_path / "run") as mgr, pytest.raises(CheckpointError):
        mgr.restore(target)
    from torch_ckpt.tools.convert import load_full_state

    with pytest.raises(CheckpointError, match="evil"):
        load_full_state(step_dir)
    assert not marker.exists()


def test_lock_naming_this_process_but_not_held_is_stale(tmp_path):
    """A lock with this very pid that this process does not hold (pid reuse after a restart) is taken over."""
    import socket

    (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": 0}))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() is None


def test_empty_old_lock_is_stale_and_unwritable_lock_is_typed(tmp_path, tmpfs):
    """An empty lock file of an earlier version is taken over and removed; on a full disk nothing is left behind."""
    lock = tmp_path / ".lock"
    lock.write_text("")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    with CheckpointManager(tmp_path):
        assert not lock.exists()
    (tmpfs / "run").mkdir()
    subprocess.run(["dd", "if=/dev/zero", f"of={tmpfs / 'fill'}", "bs=4k"], capture_output=True)  # fill it up
    mgr = CheckpointManager(tmpfs / "run")  # the lock writes nothing; the save reports the full disk
    try:
        with pytest.raises(CheckpointWriteError):
            mgr.save(1, {"w": torch.ones(1 << 16)})
            mgr.wait()
    finally:
        mgr.close()
    assert os.listdir(tmpfs / "run") == []


def test_durable_url_inside_the_local_root_is_refused(tmp_path):
    """A durable tier that is the local root itself is a ConfigError, not an endless retry."""
    from torch_ckpt import ConfigError

    with pytest.raises(ConfigError, match="durable_url"):
        CheckpointManager(tmp_path, durable_url=f"file://{tmp_path}")
