"""Tests of the persistence modes: writer process, overlapped staging, writer failure."""

import os
import signal

import pytest
import torch

from tests.conftest import train_steps
from torch_ckpt import CheckpointManager, CheckpointWriteError, ConfigError, TrainState


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_process_writer_roundtrip(tmp_path, make_state):
    """persist='process' commits checkpoints that restore exactly."""
    state, model, opt, sched = make_state()
    with CheckpointManager(tmp_path, persist="process") as mgr:
        for step in (1, 2):
            train_steps(model, opt, sched, 1)
            mgr.save(step, state)
        mgr.wait()
        assert mgr.all_steps() == [1, 2]
    ref = _params(model)
    state2, model2, *_ = make_state(seed=4)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(state2) == 2
    assert all(torch.equal(v, ref[k]) for k, v in model2.state_dict().items())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dead_writer_process_is_reported(tmp_path, make_state):
    """A writer process killed mid-save turns that save into a CheckpointWriteError, not a hang."""
    state, *_ = make_state()
    with pytest.raises(CheckpointWriteError, match="writer process died"):
        with CheckpointManager(tmp_path, persist="process") as mgr:
            pid = mgr.checkpointer._process_writer._proc.pid
            os.kill(pid, signal.SIGSTOP)  # the save below waits for it
            mgr.save(1, state)
            os.kill(pid, signal.SIGKILL)
            mgr.wait()
    assert not (tmp_path / "step_000000001").exists()


def test_overlap_waits_for_staging_before_optimizer_step(tmp_path, make_state):
    """With overlap_staging the next optimizer.step() waits, so the checkpoint holds the pre-step values."""
    state, model, opt, sched = make_state()
    train_steps(model, opt, sched, 1)
    expected = _params(model)
    with CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        handle = mgr.save(1, state)
        train_steps(model, opt, sched, 1)  # mutates parameters through opt.step()
        assert handle.staged.done()
        handle.wait()
    assert any(not torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    state2, model2, *_ = make_state(seed=4)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(state2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_wait_staged_returns_after_copy(tmp_path, make_state):
    """wait_staged() is the explicit barrier for mutations outside optimizer.step()."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        handle = mgr.save(1, state)
        mgr.wait_staged()
        assert handle.staged.done()


def test_optimizer_hooks_removed_on_close(tmp_path, make_state):
    """Closing the manager removes its optimizer step pre-hooks."""
    state, model, opt, sched = make_state()
    with CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        mgr.save(1, state)
        assert len(opt._optimizer_step_pre_hooks) == 1
    assert len(opt._optimizer_step_pre_hooks) == 0


@pytest.mark.parametrize("kwargs, field", [({"persist": "fork"}, "persist"), ({"writer_niceness": 40}, "niceness"),
                                            ({"thread_count": 0}, "thread_count"),
                                            ({"thread_count": True}, "thread_count"), ({"keep_last": 0}, "keep_last")])
def test_invalid_options_rejected(tmp_path, kwargs, field):
    """Invalid constructor options raise ConfigError naming the option."""
    with pytest.raises(ConfigError, match=field):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.cuda
def test_cuda_state_roundtrip_with_overlap(tmp_path):
    """A CUDA model is staged through pinned memory and restores exactly."""
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64, device="cuda")).sum().backward()
    opt.step()
    ref = _params(model)
    with CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
    model2 = torch.nn.Linear(64, 64).cuda()
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(TrainState(model=model2, optimizer=torch.optim.AdamW(model2.parameters())))
    assert all(torch.equal(v, ref[k]) for k, v in model2.state_dict().items())


def test_the_copy_ends_before_the_writer_starts(tmp_path, monkeypatch):
    """save() has copied every tensor before the writer writes any (no pipelined staging)."""
    from torch_ckpt.format import _dcp_write as dcp_io
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}
    copied, seen = [0], []
    real_write, real_copy = dcp_io._FileSink.write, torch._foreach_copy_

    def copy(dst, src):
        real_copy(dst, src)
        copied[0] += len(dst)

    def write(self, b):
        if memoryview(b).nbytes >= 4096:
            seen.append(copied[0])
        return real_write(self, b)

    monkeypatch.setattr(dcp_io._FileSink, "write", write)
    with CheckpointManager(tmp_path, thread_count=1) as mgr:
        monkeypatch.setattr(torch, "_foreach_copy_", copy)
        mgr.save(1, state).wait()
        monkeypatch.setattr(torch, "_foreach_copy_", real_copy)
        assert mgr.all_steps() == [1]
    assert seen and all(n == len(state) for n in seen)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_copy_failure_fails_the_save_once_and_commits_nothing(tmp_path, monkeypatch, threads):
    """A copy that fails mid-way raises from save(), leaves no checkpoint or temporary, and the next save works."""
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}
    real_copy = torch._foreach_copy_

    def copy(dst, src):
        raise RuntimeError("copy broke mid-way")

    with CheckpointManager(tmp_path, thread_count=threads) as mgr:
        mgr.save(1, state).wait()
        monkeypatch.setattr(torch, "_foreach_copy_", copy)
        with pytest.raises(RuntimeError, match="mid-way"):
            mgr.save(2, state)
        monkeypatch.setattr(torch, "_foreach_copy_", real_copy)
        mgr.save(3, state).wait()  # the failed step's error is not raised a second time
        assert mgr.all_steps() == [1, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if "step" in p.name) == ["step_000000001", "step_000000003"]


@pytest.mark.parametrize("bad", [0, -5, float("inf"), "soon", True])
def test_checkpointer_timeout_must_be_a_positive_duration(bad):
    """AsyncCheckpointer refuses a timeout that is not a positive, finite duration, naming timeout_seconds."""
    from torch_ckpt.save import AsyncCheckpointer

    with pytest.raises(ConfigError, match="timeout_seconds"):
        AsyncCheckpointer(timeout_seconds=bad)


def test_checkpointer_timeout_accepts_a_duration_string():
    """AsyncCheckpointer(timeout_seconds="2m") waits 120 s for its collectives."""
    from torch_ckpt.save import AsyncCheckpointer

    with AsyncCheckpointer(timeout_seconds="2m") as ck:
        assert ck._ctx.timeout_seconds == 120.0


@pytest.mark.parametrize("bad", [0, 257, True])
def test_checkpointer_thread_count_is_bounded_like_the_config(bad):
    """AsyncCheckpointer refuses thread_count outside 1-256 (CheckpointConfig's bound), naming thread_count."""
    from torch_ckpt.save import AsyncCheckpointer

    with pytest.raises(ConfigError, match="thread_count must be an integer in \\[1, 256\\]"):
        AsyncCheckpointer(thread_count=bad)
