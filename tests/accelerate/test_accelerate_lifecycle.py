"""Lifecycle of an attached Accelerator: freed like a plain one, a second one in the same process uses the same
project folder, and ``end_training()`` commits the save in flight (or raises) before the process group goes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
from acc_helpers import make_run, train

import torch_ckpt.save._checkpointer as checkpointer
from tests._threads import ckpt_threads
from torch_ckpt import CheckpointWriteError, ConfigError, is_committed

SCRIPT = Path(__file__).resolve().parents[1] / "_helpers" / "accelerate_epochs.py"


@pytest.mark.parametrize("attach", [False, True], ids=["plain", "attached"])
def test_deleted_accelerator_frees_its_model_and_leaves_no_thread(tmp_path, attach):
    """del of the Accelerator and its prepared objects frees the model, attached as plain (no reference cycle)."""
    run = make_run(tmp_path, attach=attach)
    train(run, 0, 2)
    run.accelerator.save_state()
    model = weakref.ref(run.accelerator.unwrap_model(run.model))
    del run
    gc.collect()
    assert model() is None and ckpt_threads() == []


def test_a_deleted_attached_accelerator_is_freed_without_the_cycle_collector(tmp_path):
    """With a save in flight and its statistics waiting for the commit, ``del`` alone (no ``gc``) frees the
    checkpointer: nothing waiting after a commit holds it (no reference cycle)."""
    run = make_run(tmp_path)
    run.accelerator.save_state()
    ckpt = weakref.ref(run.ckpt)
    gc.disable()
    try:
        del run
        assert ckpt() is None
    finally:
        gc.enable()


def test_a_referenced_checkpointer_does_not_keep_its_accelerator_alive(tmp_path):
    """The user keeps only the object attach() returned: the Accelerator is still freed (held weakly)."""
    run = make_run(tmp_path)
    run.accelerator.save_state()
    ckpt, accelerator = run.ckpt, weakref.ref(run.accelerator)
    del run
    gc.collect()
    assert accelerator() is None
    with pytest.raises(ConfigError, match="was freed"):
        ckpt.save_state()
    ckpt.close()


def test_second_accelerator_resumes_the_save_the_first_left_in_flight(tmp_path, held_writes):
    """The first Accelerator is dropped mid-save; a second on the same project waits for it and loads it."""
    run = make_run(tmp_path)
    train(run, 0, 3)
    run.accelerator.save_state(step=3)
    del run
    threading.Timer(0.5, held_writes.set).start()
    run = make_run(tmp_path)
    run.accelerator.load_state()
    assert run.ckpt.step == 3 and run.accelerator.save_state().name == "checkpoint_1"
    run.ckpt.close()


def test_second_accelerator_while_the_first_is_referenced_names_this_process(tmp_path):
    """Both Accelerators still referenced and open: a clear error naming this process, never 'another run'."""
    first = make_run(tmp_path)
    first.accelerator.save_state()
    second = make_run(tmp_path)
    with pytest.raises(CheckpointWriteError, match="another CheckpointManager of this process") as info:
        second.accelerator.load_state()
    assert "another run" not in str(info.value)
    first.ckpt.close()
    second.accelerator.load_state()  # closed: taken over
    second.ckpt.close()


def test_end_training_commits_the_save_in_flight(tmp_path, held_writes):
    """end_training() with the last save still being written returns once it is committed."""
    run = make_run(tmp_path)
    train(run, 0, 2)
    folder = run.accelerator.save_state()
    threading.Timer(0.5, held_writes.set).start()
    run.accelerator.end_training()
    assert is_committed(folder) and "end_training" not in vars(run.accelerator)


def test_end_training_raises_when_the_save_in_flight_fails(tmp_path, monkeypatch):
    """A last save that fails makes end_training() raise; Accelerate's own end_training still runs."""
    def fail(req, ctx):
        time.sleep(0.3)
        raise CheckpointWriteError(28, "No space left on device")

    monkeypatch.setattr(checkpointer, "persist_checkpoint", fail)
    run = make_run(tmp_path)
    ended = []
    monkeypatch.setattr(type(run.accelerator), "end_training", lambda acc: ended.append(acc))
    folder = run.accelerator.save_state()
    with pytest.raises(CheckpointWriteError, match="No space left"):
        run.accelerator.end_training()
    assert ended == [run.accelerator] and not folder.exists()


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")])}
    env.pop("ACCELERATE_CKPT_CONFIG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_script_ending_with_end_training_keeps_its_last_checkpoint_and_resumes(tmp_path):
    """Accelerate's checkpointing-script protocol on 2 gloo processes: the last save, in flight at end_training(),
    is committed and resumes to the recorded loss and learning rates."""
    out = str(tmp_path)
    trained = _torchrun("--output_dir", out, "--attach", "--slow_persist", "1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert is_committed(tmp_path / "epoch_1")
    resumed = _torchrun("--output_dir", out, "--attach", "--resume_from_checkpoint", str(tmp_path / "epoch_1"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_script_ending_without_end_training_commits_its_last_save_at_exit(tmp_path):
    """The same script ending without end_training(): interpreter exit commits the save in flight on both ranks."""
    trained = _torchrun("--output_dir", str(tmp_path), "--attach", "--slow_persist", "1", "--no_end_training")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert is_committed(tmp_path / "epoch_1") and "waiting for the checkpoint of step 1" in trained.stderr


def test_attached_accelerator_pickles_and_its_copy_saves_on_its_own(tmp_path):
    """pickle.dumps(accelerator) works attached, after a save; the copy's save_state writes through its own manager."""
    import pickle

    run = make_run(tmp_path / "a")
    run.accelerator.save_state()
    run.ckpt.wait()
    copy = pickle.loads(pickle.dumps(run.accelerator))
    assert copy.save_state.__self__.accelerator is copy and copy.save_state.__self__.manager is None
    run.ckpt.close()
    assert copy.save_state().name == "checkpoint_1"
    copy.end_training()
    assert is_committed(tmp_path / "a" / "checkpoints" / "checkpoint_1")
