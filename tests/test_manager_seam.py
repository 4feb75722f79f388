"""Tests of the manager's services for adapters: naming, explicit paths, atomic replace, remove, callbacks."""

import logging
import os

import pytest
import torch

import torch_ckpt.root._layout as layout
from tests._dist import run_distributed
from torch_ckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointWriteError,
    ConfigError,
    PatternNaming,
    is_committed,
)


def _state(fill: float = 1.0) -> dict:
    return {"w": torch.full((4,), fill), "meta": {"epoch": 1}}


def test_pattern_naming_names_and_lists_checkpoints(tmp_path):
    """With PatternNaming('checkpoint_{step}') saves land in checkpoint_N and are listed by step."""
    with CheckpointManager(tmp_path, naming=PatternNaming("checkpoint_{step}"), keep_last=2) as mgr:
        for step in (0, 1, 2):
            mgr.save(step, _state(float(step))).wait()
        assert mgr.checkpoints() == {1: tmp_path / "checkpoint_1", 2: tmp_path / "checkpoint_2"}
    assert not (tmp_path / "checkpoint_0").exists()


def test_foreign_folder_with_a_parsed_name_is_never_touched(tmp_path):
    """A manifest-less checkpoint_3 of another tool is not listed, not pruned, and not written into."""
    foreign = tmp_path / "checkpoint_3"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"x")
    with CheckpointManager(tmp_path, naming=PatternNaming("checkpoint_{step}"), keep_last=1) as mgr:
        mgr.save(4, _state()).wait()
        mgr.save(5, _state()).wait()
        assert mgr.all_steps() == [5]
        with pytest.raises(ConfigError, match="not a torch-ckpt checkpoint"):
            mgr.save(3, _state())
    assert sorted(p.name for p in foreign.iterdir()) == ["model.safetensors"]


def test_explicit_path_is_replaced_atomically(tmp_path):
    """Saving twice to the same explicit folder replaces it; the second save's values are loaded."""
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, _state(1.0), path=tmp_path / "latest").wait()
        mgr.save(2, _state(2.0), path=tmp_path / "latest").wait()
        target = _state(0.0)
        assert mgr.restore(target, path=tmp_path / "latest") == 2
    assert torch.equal(target["w"], torch.full((4,), 2.0))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_replace_without_rename_exchange_keeps_the_old_checkpoint_on_failure(tmp_path, monkeypatch):
    """Without renameat2, a failing second rename puts the old checkpoint back and the save fails typed."""
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    real = layout.os.rename

    def fail_rename_in(src, dst):
        if ".tmp." in str(src) and str(dst).endswith("latest"):
            raise OSError(5, "Input/output error", str(src))
        return real(src, dst)

    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(1.0), path="latest")
        monkeypatch.setattr(layout.os, "rename", fail_rename_in)
        with pytest.raises(CheckpointWriteError, match="latest"):
            mgr.save(2, _state(2.0), path="latest")
        monkeypatch.setattr(layout.os, "rename", real)
        target = _state(0.0)
        assert mgr.restore(target, path="latest") == 1
    assert torch.equal(target["w"], torch.full((4,), 1.0))


def test_interrupted_replace_is_undone_at_the_next_start(tmp_path):
    """A crash between the two renames (old checkpoint at .NAME.replaced.<id>, no NAME) is renamed back."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1.0), path="latest").wait()
    os.rename(tmp_path / "latest", tmp_path / ".latest.replaced.0123456789abcdef")
    with CheckpointManager(tmp_path) as mgr:
        target = _state(0.0)
        assert mgr.restore(target, path="latest") == 1
    assert not (tmp_path / ".latest.replaced.0123456789abcdef").exists()


def test_explicit_path_that_is_not_a_checkpoint_is_refused(tmp_path):
    """An existing non-checkpoint folder or file at the explicit path raises ConfigError and stays as it was."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    with CheckpointManager(tmp_path / "root") as mgr:
        for target in ("out", "file"):
            with pytest.raises(ConfigError, match="never"):
                mgr.save(1, _state(), path=tmp_path / target)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "x"


def test_remove_deletes_a_committed_checkpoint_and_refuses_foreign_folders(tmp_path):
    """remove() deletes by step or path, is a no-op for missing ones and refuses non-checkpoints."""
    (tmp_path / "other").mkdir()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, _state()).wait()
        mgr.save(2, _state(), path="named").wait()
        mgr.remove(1)
        mgr.remove("named")
        mgr.remove(99)
        with pytest.raises(ConfigError, match="not a torch-ckpt checkpoint"):
            mgr.remove("other")
        assert mgr.all_steps() == []
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["other"]


def test_remove_waits_for_the_in_flight_save_of_that_checkpoint(tmp_path):
    """remove() of the checkpoint being written waits for its commit and then deletes it."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.randn(256, 256)}, path="x")
        mgr.remove("x")
        assert not (tmp_path / "x").exists()


def test_restore_by_path_falls_back_along_a_sequence(tmp_path, caplog):
    """A damaged first candidate is skipped with a warning naming it; a single damaged path raises."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, _state(1.0), path="a").wait()
        mgr.save(2, _state(2.0), path="b").wait()
    shard = next(p for p in (tmp_path / "b").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with CheckpointManager(tmp_path) as mgr:
        target = _state(0.0)
        with caplog.at_level(logging.WARNING):
            assert mgr.restore(target, path=["b", "a"]) == 1
        assert str(tmp_path / "b") in caplog.text
        with pytest.raises(CheckpointCorruptError):
            mgr.restore(_state(0.0), path="b")
    assert torch.equal(target["w"], torch.full((4,), 1.0))


def test_restore_by_path_supersedes_newer_steps_at_the_next_save(tmp_path):
    """Restoring an older checkpoint by path moves the newer named steps aside at the next save."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step))).wait()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.restore(_state(), path=tmp_path / "step_000000001") == 1
        mgr.save(2, _state()).wait()
        assert mgr.all_steps() == [1, 2]


def test_commit_callbacks_run_before_retention_and_never_fail_the_save(tmp_path):
    """Callbacks see each committed directory (still present) and a raising one is only logged."""
    seen = []
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.add_commit_callback(
            lambda step, path: seen.append((step, path.name, (tmp_path / "step_000000000").exists())))
        mgr.add_commit_callback(lambda step, path: 1 / 0)
        mgr.save(0, _state()).wait()
        mgr.save(1, _state()).wait()
    assert seen == [(0, "step_000000000", True), (1, "step_000000001", True)]
    assert not (tmp_path / "step_000000000").exists()


def test_is_committed_checks_manifest_and_file_sizes(tmp_path):
    """is_committed is True for a checkpoint and False once a listed file is truncated or for a plain folder."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, _state()).wait()
    ckpt = tmp_path / "step_000000000"
    assert is_committed(ckpt) and not is_committed(tmp_path)
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    os.truncate(shard, shard.stat().st_size - 1)
    assert not is_committed(ckpt)


def _replace_on_two_ranks(rank, world_size, root):
    with CheckpointManager(root) as mgr:
        for step in range(3):
            mgr.save(step, {"w": torch.full((8,), float(step))}, path="last").wait()
        target = {"w": torch.zeros(8)}
        assert mgr.restore(target, path="last") == 2
        assert torch.equal(target["w"], torch.full((8,), 2.0))


@pytest.mark.slow
def test_explicit_path_replace_on_two_ranks(tmp_path):
    """Two gloo ranks overwrite the same explicit folder three times and load the newest one back."""
    run_distributed(_replace_on_two_ranks, 2, str(tmp_path))


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_extra_dir_is_committed_and_replaced_with_the_checkpoint(tmp_path, persist):
    """Hook files in extra_dir (nested too) land in the committed folder; a replace swaps them with it."""
    for n in (1, 2):
        extra = tmp_path / f"hooks{n}"
        (extra / "unet").mkdir(parents=True)
        (extra / "unet" / "config.json").write_text(f"v{n}")
    with CheckpointManager(tmp_path / "root", persist=persist) as mgr:
        mgr.save(1, _state(), path="latest", extra_dir=tmp_path / "hooks1").wait()
        assert (tmp_path / "root" / "latest" / "unet" / "config.json").read_text() == "v1"
        mgr.save(2, _state(), path="latest", extra_dir=tmp_path / "hooks2").wait()
    assert (tmp_path / "root" / "latest" / "unet" / "config.json").read_text() == "v2"
    assert not (tmp_path / "hooks1").exists() and not (tmp_path / "hooks2").exists()
    assert is_committed(tmp_path / "root" / "latest")


def test_extra_dir_with_a_reserved_name_fails_the_save(tmp_path):
    """An extra file named like a checkpoint file (manifest.json) fails the save; nothing is committed."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "manifest.json").write_text("{}")
    with CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        with pytest.raises(CheckpointWriteError, match="reserved"):
            mgr.save(1, _state(), path="x", extra_dir=tmp_path / "hooks")
    assert not (tmp_path / "root" / "x").exists()


def test_extra_dir_is_taken_inside_save_so_it_can_be_refilled(tmp_path):
    """Files written into extra_dir after an async save() returned belong to the next save, not this one."""
    extra = tmp_path / "hooks"
    extra.mkdir()
    (extra / "a.txt").write_text("1")
    with CheckpointManager(tmp_path / "root") as mgr:
        handle = mgr.save(1, _state(), path="ck1", extra_dir=extra)
        extra.mkdir()
        (extra / "b.txt").write_text("2")
        handle.committed.result()
        mgr.save(2, _state(), path="ck2", extra_dir=extra).wait()
    assert sorted(p.name for p in (tmp_path / "root" / "ck1").iterdir() if p.suffix == ".txt") == ["a.txt"]
    assert sorted(p.name for p in (tmp_path / "root" / "ck2").iterdir() if p.suffix == ".txt") == ["b.txt"]


@pytest.mark.parametrize("which", ["root", "parent_of_root", "target", "missing"])
def test_extra_dir_that_is_or_holds_the_root_is_refused_and_nothing_moves(tmp_path, which):
    """An extra_dir equal to or containing the root (or the target, or missing) is a ConfigError; nothing is moved."""
    root = tmp_path / "root"
    (tmp_path / "keep").mkdir()
    with CheckpointManager(root, keep_last=None) as mgr:
        mgr.save(1, _state(), path="zz").wait()
        extra = {"root": root, "parent_of_root": tmp_path, "target": root / "zz", "missing": tmp_path / "nope"}[which]
        with pytest.raises(ConfigError, match="extra_dir"):
            mgr.save(2, _state(), path="zz", extra_dir=extra)
        assert (tmp_path / "keep").is_dir() and is_committed(root / "zz")
        mgr.save(3, _state()).wait()  # the lock and the run are intact


def test_reserved_name_in_extra_dir_moves_nothing(tmp_path):
    """A reserved name anywhere in extra_dir fails the save before any entry is moved."""
    extra = tmp_path / "hooks"
    extra.mkdir()
    (extra / "a.txt").write_text("keep me")
    (extra / "rank_00000.json").write_text("{}")
    with CheckpointManager(tmp_path / "root") as mgr:
        with pytest.raises(CheckpointWriteError, match="reserved"):
            mgr.save(1, _state(), path="x", extra_dir=extra)
    assert (extra / "a.txt").read_text() == "keep me"


def test_explicit_path_named_as_another_step_is_refused(tmp_path):
    """save(5, path='step_000000001') would replace step 1 with data listed nowhere: ConfigError, step 1 kept."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, _state()).wait()
        with pytest.raises(ConfigError, match="step 1"):
            mgr.save(5, _state(), path="step_000000001")
        assert mgr.all_steps() == [1]
