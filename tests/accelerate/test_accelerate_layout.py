"""Checkpoint folders: committed = payload manifest present; numeric order; pruning after commit."""

from __future__ import annotations

from accelerate_ckpt import PAYLOAD
from accelerate_ckpt._layout import committed_checkpoints, is_committed, prune
from torch_ckpt.layout import Manifest, write_json_durable


def make(root, number: int, *, commit: bool = True):
    folder = root / f"checkpoint_{number}"
    payload = folder / (PAYLOAD if commit else f".{PAYLOAD}.tmp")
    payload.mkdir(parents=True)
    if commit:
        write_json_durable(payload / "manifest.json", Manifest(step=number, world_size=1, files={}).to_json())
    return folder


def test_committed_checkpoints_are_ordered_numerically(tmp_path):
    """checkpoint_9 comes before checkpoint_10 and checkpoint_11 (not string order)."""
    for n in (11, 9, 10):
        make(tmp_path, n)
    assert list(committed_checkpoints(tmp_path)) == [9, 10, 11]


def test_uncommitted_and_foreign_folders_are_not_checkpoints(tmp_path):
    """A folder without a committed payload, a hidden folder or another name is never listed."""
    make(tmp_path, 3)
    make(tmp_path, 4, commit=False)
    (tmp_path / ".trash_checkpoint_2").mkdir()
    (tmp_path / "checkpoint_x").mkdir()
    assert list(committed_checkpoints(tmp_path)) == [3]
    assert not is_committed(tmp_path / "checkpoint_4")


def test_prune_keeps_the_numerically_newest(tmp_path):
    """With steps 9, 10, 11 and keep=2, checkpoint_9 is removed."""
    for n in (9, 10, 11):
        make(tmp_path, n)
    assert prune(tmp_path, 2, newest=11) == [9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_10", "checkpoint_11"]


def test_prune_never_removes_the_checkpoint_just_committed(tmp_path):
    """The just-committed checkpoint survives even when higher-numbered ones fill the limit."""
    for n in (20, 30):
        make(tmp_path, n)
    make(tmp_path, 5)
    prune(tmp_path, 1, newest=5)
    assert list(committed_checkpoints(tmp_path)) == [5, 30]


def test_prune_removes_crashed_folders_below_the_new_checkpoint_only(tmp_path):
    """An uncommitted folder older than the new checkpoint is debris; a newer one is left alone."""
    make(tmp_path, 4, commit=False)
    make(tmp_path, 6)
    make(tmp_path, 8, commit=False)
    prune(tmp_path, 5, newest=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_6", "checkpoint_8"]


def test_prune_keeps_protected_numbers(tmp_path):
    """A checkpoint still being replicated (protected) survives pruning until its upload is done."""
    for n in (1, 2, 3):
        make(tmp_path, n)
    prune(tmp_path, 1, newest=3, protect={2})
    assert list(committed_checkpoints(tmp_path)) == [2, 3]
