"""What follows a commit (manager._manager): retention hides retired checkpoints first, deletes them after."""

from __future__ import annotations

import shutil
import threading

import torch

import torch_ckpt.manager._manager as mc
from torch_ckpt import CheckpointManager


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 16, dtype=torch.float32)}


def test_committed_resolves_before_the_retired_checkpoint_is_deleted(tmp_path, monkeypatch):
    """keep_last=1: the old checkpoint is hidden (no manifest) when committed resolves; its bytes go after."""
    release, started = threading.Event(), threading.Event()
    real = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        started.set()
        assert release.wait(30), "test never released the deletion"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mc.shutil, "rmtree", slow_rmtree)
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, _state()).wait()
        handle = mgr.save(2, _state())
        handle.committed.result(timeout=30)  # resolves while the deletion is held
        assert started.wait(30)
        assert mgr.all_steps() == [2]
        trash = [p for p in tmp_path.iterdir() if p.name.startswith(".torch-ckpt.tmp.")]
        assert len(trash) == 1 and not (trash[0] / "manifest.json").exists()
        assert sorted(p.name for p in tmp_path.iterdir() if (p / "manifest.json").exists()) == [
            mgr.naming.name(2)]
        release.set()
        mgr.wait()
    assert not any(p.name.startswith(".torch-ckpt.tmp.") for p in tmp_path.iterdir())


def test_a_failing_deletion_after_commit_is_logged_and_the_save_stays_committed(tmp_path, monkeypatch, caplog):
    """An error deleting a retired checkpoint never fails the save that retired it."""
    def broken(path, *args, **kwargs):
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(mc.shutil, "rmtree", broken)
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, _state()).wait()
        assert mgr.save(2, _state()).committed.result(timeout=30)
        mgr.wait()
        assert mgr.all_steps() == [2]
    assert "cleanup after committing step 2 failed" in caplog.text


def test_a_listing_right_after_wait_shows_no_retired_checkpoint(tmp_path, monkeypatch):
    """mgr.wait() returns only once retired checkpoints are deleted: no hidden trash in os.listdir after it."""
    import os
    import time

    real = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        time.sleep(0.3)  # a large checkpoint: the deletion outlasts the commit
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mc.shutil, "rmtree", slow_rmtree)
    from torch_ckpt.policy._naming import PatternNaming

    with CheckpointManager(tmp_path, keep_last=1, naming=PatternNaming("checkpoint_{step}")) as mgr:
        for step in range(1, 4):
            mgr.save(step, _state())
            mgr.wait()
            names = sorted(n for n in os.listdir(tmp_path) if not n.startswith(".lock"))
            assert names == [f"checkpoint_{step}"], names
