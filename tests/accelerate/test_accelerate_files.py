"""What the adapter puts into users' folders, and when (issue 27: Accelerate 3, 4, 5).

No lock files anywhere, nothing left beside a checkpoint after close(), explicit folders lock nothing
but themselves, a save's folder exists as soon as ``save_state()`` returns, and an empty folder is a
valid save target.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from acc_helpers import make_run, train

from torch_ckpt import is_committed


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def held_write(monkeypatch):
    """Background writes wait until ``release.set()`` (a slow disk): what save_state() leaves is visible."""
    import torch_ckpt.save._checkpointer as checkpointer

    release = threading.Event()
    persist = checkpointer.persist_checkpoint

    def gated(req, ctx):
        assert release.wait(30), "held write never released"
        return persist(req, ctx)

    monkeypatch.setattr(checkpointer, "persist_checkpoint", gated)
    yield release
    release.set()


def test_save_state_into_an_existing_empty_folder_saves_and_loads(tmp_path):
    """An empty folder (made by the user, as plain Accelerate allows) is saved into and loads back exactly."""
    folder = tmp_path / "out"
    folder.mkdir()
    run = make_run(None)
    train(run, 0, 2)
    saved = params(run.model)
    assert run.accelerator.save_state(folder) == folder
    run.ckpt.wait()
    assert is_committed(folder)
    train(run, 2, 4)
    run.accelerator.load_state(folder)
    assert all(torch.equal(saved[k], v) for k, v in params(run.model).items())
    run.ckpt.close()


def test_explicit_folders_lock_nothing_beside_them(tmp_path):
    """Two runs saving sibling folders of one directory do not block each other; nothing else lands there."""
    first, second = make_run(None), make_run(None, seed=1)
    first.accelerator.save_state(tmp_path / "a")
    second.accelerator.save_state(tmp_path / "b")  # refused before: the parent was the locked root
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
    first.ckpt.close()
    second.ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and is_committed(tmp_path / "a") and is_committed(tmp_path / "b")


def test_project_folder_stays_usable_by_plain_accelerate_after_close(tmp_path):
    """After close() checkpoints/ holds only checkpoint_N folders; plain Accelerate's total_limit pruning then works."""
    run = make_run(tmp_path, total_limit=2)
    for step in range(1, 4):
        train(run, step - 1, step)
        run.accelerator.save_state()
    run.ckpt.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    plain = make_run(tmp_path, total_limit=2, attach=False)
    plain.accelerator.save_state()  # IndexError on '.lock' in its pruning before
    assert all(name.startswith("checkpoint_") for name in os.listdir(tmp_path / "checkpoints"))


def test_saved_folder_exists_when_save_state_returns(tmp_path, held_write):
    """With the write still in flight the folder's name is taken (and uncommitted); nothing else is beside it."""
    run = make_run(tmp_path, total_limit=2)
    folder = run.accelerator.save_state()
    assert folder.is_dir() and not is_committed(folder)
    assert os.listdir(tmp_path / "checkpoints") == [folder.name] and os.listdir(tmp_path) == ["checkpoints"]
    held_write.set()
    run.ckpt.close()
    assert is_committed(folder) and os.listdir(tmp_path / "checkpoints") == [folder.name]
