"""Bad input: missing or wrong paths, mismatched states, unsupported values, tampered or corrupt files.

Every failure must be a clear, typed exception: a subclass of ``CheckpointError`` that also
inherits the builtin a caller would catch (``FileNotFoundError``, ``OSError``, ``ValueError``,
``KeyError``), and whose message names the path, step, key or file at fault.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from tests._format_fixtures import inline_shape_2_40, rank_json_nested_200k, rewrite, storage_data_not_a_dict
from torch_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    StateMismatchError,
    TrainState,
    UnsafeCheckpointError,
)

STEP_DIR = "step_{:09d}"


# -- helpers ---------------------------------------------------------------------------------------
def _dict_state(fill: float = 1.0) -> dict:
    return {"model": {"w": torch.full((4, 3), fill), "b": torch.full((3,), fill)}, "meta": {"epoch": 2}}


def _entries(root) -> list[str]:
    """Entries of a checkpoint root other than the root lock's files (.lock, .lock.owner)."""
    return sorted(n for n in os.listdir(root) if not n.startswith(".lock"))


def _save(root: Path, step: int, state, **kwargs) -> Path:
    with CheckpointManager(root, **kwargs) as mgr:
        mgr.save(step, state).wait()
    return root / STEP_DIR.format(step)


def _sizes_and_crc(path: Path) -> dict[str, int]:
    data = path.read_bytes()
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _edit_manifest(step_dir: Path, edit) -> None:
    """Apply ``edit(manifest_dict)`` and write the manifest back (as a tamperer would)."""
    path = step_dir / "manifest.json"
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_text(json.dumps(doc))


def _steps_1_and_2_with_manifest_2(root: Path, text: str) -> Path:
    """Save steps 1 (all 1.0) and 2 (all 2.0), then overwrite step 2's manifest with ``text``; returns its path."""
    _save(root, 1, _dict_state(1.0))
    manifest = _save(root, 2, _dict_state(2.0)) / "manifest.json"
    manifest.write_text(text)
    return manifest


def _shard(step_dir: Path) -> Path:
    shards = sorted(step_dir.glob("*.distcp"))
    assert shards, f"no shard file in {sorted(os.listdir(step_dir))}"
    return max(shards, key=lambda p: p.stat().st_size)


class _RunsShell:
    """A pickle payload: unpickling it runs ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


# -- missing, misplaced and wrong roots -------------------------------------------------------------
@pytest.mark.timeout(60)
def test_manager_creates_a_root_whose_parents_are_missing(tmp_path):
    """CheckpointManager(path) creates the root and its missing parents, ready to save."""
    root = tmp_path / "no" / "such" / "parents" / "ckpt"
    with CheckpointManager(root) as mgr:
        assert root.is_dir()
        assert mgr.all_steps() == [] and mgr.latest_step() is None


@pytest.mark.timeout(60)
def test_restore_from_a_fresh_root_returns_none_and_logs_the_location(tmp_path, make_state, caplog):
    """restore() with nothing saved returns None and logs, at INFO, the directory it searched."""
    root = tmp_path / "missing_parent" / "ckpt"
    state, *_ = make_state()
    caplog.set_level(logging.INFO, logger="torch_ckpt")
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) is None
    infos = [r for r in caplog.records if r.levelno == logging.INFO and str(root) in r.getMessage()]
    assert infos, f"no INFO record names {root}: {[r.getMessage() for r in caplog.records]}"


@pytest.mark.timeout(60)
def test_restore_after_the_root_was_deleted_returns_none_and_logs_the_location(tmp_path, make_state, caplog):
    """A root removed after the manager started is searched, found empty, reported at INFO; None returned."""
    root = tmp_path / "ckpt"
    state, *_ = make_state()
    caplog.set_level(logging.INFO, logger="torch_ckpt")
    with CheckpointManager(root) as mgr:
        shutil.rmtree(root)  # the lock file goes too
        assert mgr.restore(state) is None
    assert any(r.levelno == logging.INFO and str(root) in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_explicit_step_in_a_deleted_root_raises_not_found(tmp_path, make_state):
    """restore(step=...) on a root that no longer exists raises CheckpointNotFoundError naming the root."""
    root = tmp_path / "ckpt"
    state, *_ = make_state()
    with CheckpointManager(root) as mgr:
        shutil.rmtree(root)  # the lock file goes too
        with pytest.raises(CheckpointNotFoundError) as info:
            mgr.restore(state, step=3)
    assert isinstance(info.value, FileNotFoundError)
    assert str(root) in str(info.value) and "3" in str(info.value)


@pytest.mark.timeout(60)
def test_root_that_is_a_file_is_refused_with_its_path(tmp_path):
    """CheckpointManager(path-of-a-file) raises a CheckpointError/OSError naming the path; the file is untouched."""
    root = tmp_path / "ckpt"
    root.write_bytes(b"not a directory")
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(root)
    assert isinstance(info.value, OSError)
    assert str(root) in str(info.value)
    assert root.read_bytes() == b"not a directory"


@pytest.mark.timeout(60)
def test_root_below_a_file_is_refused_with_its_path(tmp_path):
    """A root whose parent is a file raises a CheckpointError/OSError naming the root."""
    parent = tmp_path / "a_file"
    parent.write_bytes(b"x")
    root = parent / "ckpt"
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(root)
    assert isinstance(info.value, OSError)
    assert str(root) in str(info.value)


@pytest.mark.timeout(60)
def test_root_replaced_by_a_file_is_refused_on_restore(tmp_path, make_state):
    """restore() when the root has become a file raises a CheckpointError/OSError naming the path."""
    root = tmp_path / "ckpt"
    state, *_ = make_state()
    with CheckpointManager(root) as mgr:
        shutil.rmtree(root)  # the lock file goes too
        root.write_bytes(b"x")
        with pytest.raises(CheckpointError) as info:
            mgr.restore(state)
    assert isinstance(info.value, OSError)
    assert str(root) in str(info.value)


# -- steps -----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_explicit_missing_step_raises_not_found_naming_step_and_path(tmp_path, make_state):
    """restore(step=7) when only step 1 exists raises CheckpointNotFoundError naming 7 and the root; state untouched."""
    state, model, *_ = make_state(seed=0)
    _save(tmp_path, 1, state)
    live, live_model, *_ = make_state(seed=1)
    before = {k: v.clone() for k, v in live_model.state_dict().items()}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointNotFoundError) as info:
            mgr.restore(live, step=7)
    assert isinstance(info.value, FileNotFoundError)
    assert "7" in str(info.value) and str(tmp_path) in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in live_model.state_dict().items())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", [-1, 1.5, 2.0, "3", None, True, 2**63, 10**25])
def test_save_refuses_a_step_that_is_not_a_non_negative_int(tmp_path, step):
    """save() with a negative, float, str, None, bool or >= 2**63 step raises ConfigError naming it; nothing written."""
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError) as info:
            mgr.save(step, _dict_state())
        assert mgr.all_steps() == []
    assert isinstance(info.value, ValueError)
    assert repr(step) in str(info.value)
    assert _entries(tmp_path) == []  # only the root lock


@pytest.mark.timeout(60)
def test_the_largest_step_a_manifest_holds_saves_and_restores(tmp_path):
    """Step 2**63 - 1 (the manifest's limit) is saved, listed and restored."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2**63 - 1, _dict_state()).wait()
        assert mgr.all_steps() == [2**63 - 1] and mgr.restore(_dict_state()) == 2**63 - 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", [-1, 2**63, True])
def test_a_memory_save_refuses_a_step_a_manifest_cannot_hold(tmp_path, step):
    """save(tier="memory") refuses a negative, bool or >= 2**63 step with ConfigError naming it."""
    with CheckpointManager(tmp_path / "disk", memory_root=tmp_path / "mem") as mgr:
        with pytest.raises(ConfigError, match=r"step must be an integer from 0 to"):
            mgr.save(step, _dict_state(), tier="memory")


@pytest.mark.timeout(60)
def test_saving_the_same_step_twice_fails_and_keeps_the_first(tmp_path):
    """A second save of a committed step raises a CheckpointError naming the step; the first checkpoint stays intact."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, _dict_state(1.0)).wait()
        with pytest.raises(CheckpointError) as info:
            mgr.save(3, _dict_state(2.0))
            mgr.wait()  # an asynchronous save reports its failure here at the latest
        assert isinstance(info.value, (ValueError, OSError))
        assert "3" in str(info.value)
        assert mgr.all_steps() == [3]
        live = _dict_state(0.0)
        assert mgr.restore(live) == 3
    assert torch.equal(live["model"]["w"], torch.full((4, 3), 1.0))
    assert _entries(tmp_path) == [STEP_DIR.format(3)]


# -- state mismatches ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_mismatched_keys_list_missing_and_unexpected(tmp_path):
    """Restoring into a state with other keys raises StateMismatchError listing both sides (message, attributes)."""
    _save(tmp_path, 1, _dict_state())
    live = {"model": {"w": torch.zeros(4, 3), "extra": torch.zeros(2)}, "meta": {"epoch": 0}}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(live)
    exc = info.value
    assert isinstance(exc, KeyError) and isinstance(exc, CheckpointError)
    assert exc.missing == ["model.extra"] and exc.unexpected == ["model.b"]
    assert "model.extra" in str(exc) and "model.b" in str(exc)
    assert str(tmp_path) in str(exc)
    assert torch.equal(live["model"]["w"], torch.zeros(4, 3)), "a refused restore must not load anything"


@pytest.mark.timeout(60)
def test_train_state_of_another_model_lists_its_missing_keys(tmp_path):
    """A TrainState whose model has an extra layer raises StateMismatchError naming that layer's keys."""
    def build(layers: int) -> TrainState:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    _save(tmp_path, 1, build(2))
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(build(3))
    assert {"model.2.weight", "model.2.bias"} <= set(info.value.missing)
    assert info.value.unexpected == []
    assert "model.2.weight" in str(info.value)


@pytest.mark.timeout(60)
def test_mismatched_plain_value_keys_are_listed_too(tmp_path):
    """Non-tensor keys count: {'w','a'} saved vs {'w','b'} live raises StateMismatchError listing 'b' and 'a'."""
    _save(tmp_path, 1, {"w": torch.ones(2), "a": 1})
    live = {"w": torch.zeros(2), "b": 2}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(live)
    assert info.value.missing == ["b"] and info.value.unexpected == ["a"]
    assert live == {"w": live["w"], "b": 2} and torch.equal(live["w"], torch.zeros(2))


@pytest.mark.timeout(60)
def test_train_state_component_missing_from_the_checkpoint_is_refused_before_loading(tmp_path):
    """A TrainState with a scheduler, restored from a checkpoint without one: StateMismatchError, model untouched."""
    def build(seed: int, with_scheduler: bool) -> tuple[TrainState, torch.nn.Module]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2) if with_scheduler else None
        return TrainState(model=model, optimizer=opt, scheduler=sched), model

    saved, _ = build(0, with_scheduler=False)
    _save(tmp_path, 1, saved)
    live, live_model = build(1, with_scheduler=True)
    before = {k: v.clone() for k, v in live_model.state_dict().items()}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(live)
    assert "scheduler" in info.value.missing and "scheduler" in str(info.value)
    changed = [k for k, v in live_model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == [], f"a refused restore already overwrote {changed}"


@pytest.mark.timeout(60)
def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, make_state):
    """A model of another width raises StateMismatchError (KeyError) naming the tensor and both shapes."""
    state, *_ = make_state(width=16)
    _save(tmp_path, 1, state)
    live, *_ = make_state(width=32)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(live)
    msg = str(info.value)
    assert isinstance(info.value, KeyError)
    assert "model.fc1.weight" in msg and "(16, 8)" in msg and "(32, 8)" in msg


# -- unsupported values ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_unsupported_value_raises_config_error_naming_the_key(tmp_path):
    """A value that would need pickling raises ConfigError (ValueError) naming its key; nothing is written."""
    state = {"model": {"w": torch.ones(2)}, "cfg": {"callback": object()}}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError) as info:
            mgr.save(1, state)
        assert mgr.all_steps() == []
    assert isinstance(info.value, ValueError)
    assert "cfg.callback" in str(info.value)
    assert _entries(tmp_path) == []  # only the root lock


@pytest.mark.timeout(60)
def test_unsupported_train_state_extra_raises_config_error_naming_the_key(tmp_path, make_state):
    """A lambda in TrainState.extras raises ConfigError naming 'extras.hook'."""
    state, *_ = make_state(extras={"hook": lambda x: x})
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match=r"extras\.hook"):
            mgr.save(1, state)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["object-array", "sparse-tensor"])
def test_value_that_cannot_round_trip_is_refused_in_save_before_any_io(tmp_path, value):
    """A numpy object array or a sparse tensor raises ConfigError in save() naming the key; no directory is created."""
    import numpy as np

    bad = np.array([None, 0.5]) if value == "object-array" else torch.eye(3).to_sparse()
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match=r"'extra\.v'"):
            mgr.save(1, {"model": {"w": torch.ones(2)}, "extra": {"v": bad}})
        assert sorted(os.listdir(tmp_path)) == []
        mgr.save(2, {"model": {"w": torch.ones(2)}, "extra": {"v": 1}}).wait()
        assert mgr.all_steps() == [2]


@pytest.mark.timeout(60)
def test_numpy_datetime_and_str_scalars_restore_with_their_exact_type(tmp_path):
    """np.datetime64, np.timedelta64, np.str_ and a 0-d array saved through the manager come back exactly."""
    import numpy as np

    extra = {"when": np.datetime64("2024-05-01T12:00:00.5", "ms"), "gap": np.timedelta64(3, "h"),
             "name": np.str_("run-7"), "scalar_array": np.array(2.5), "raw": bytearray(b"x")}
    _save(tmp_path, 1, {"w": torch.ones(2), "extra": extra})
    target = {"w": torch.zeros(2), "extra": {"when": np.datetime64("NaT", "ms"), "gap": np.timedelta64(0, "h"),
                                             "name": np.str_(""), "scalar_array": np.array(0.0), "raw": bytearray()}}
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(target)
    for key, value in extra.items():
        got = target["extra"][key]
        assert type(got) is type(value) and np.array_equal(got, value), key
    assert target["extra"]["scalar_array"].shape == ()


# -- hostile and corrupt files ---------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_metadata_with_a_code_executing_pickle_is_refused_without_running_it(tmp_path):
    """A .metadata pickle calling os.system (manifest fixed up to match) raises UnsafeCheckpointError; nothing runs."""
    step_dir = _save(tmp_path / "ckpt", 1, _dict_state())
    control = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(_RunsShell(f"touch {control}")))  # the payload is live when unpickled plainly
    assert control.exists()

    marker = tmp_path / "pwned_marker"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_RunsShell(f"touch {marker}")))
    _edit_manifest(step_dir, lambda m: m["files"].__setitem__(".metadata", _sizes_and_crc(step_dir / ".metadata")))

    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.latest_step() == 1  # sizes and checksums match: only the unpickler can catch it
        with pytest.raises(UnsafeCheckpointError) as info:
            mgr.restore(_dict_state(0.0))
    assert isinstance(info.value, ValueError)
    assert ".metadata" in str(info.value) and "system" in str(info.value)
    assert not marker.exists(), "the checkpoint executed code"


def _truncate(shard: Path) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


def _flip_one_bit(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", [_truncate, _flip_one_bit, Path.unlink], ids=["truncated", "flipped_bit", "missing"])
def test_damaged_shard_is_reported_with_its_file(tmp_path, damage):
    """A shard cut short, with one flipped bit (same size) or deleted raises CheckpointCorruptError naming it."""
    step_dir = _save(tmp_path, 1, _dict_state())
    shard = _shard(step_dir)
    damage(shard)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointCorruptError) as info:
            mgr.restore(_dict_state(0.0))
    assert isinstance(info.value, ValueError)
    assert str(shard) in str(info.value)


@pytest.mark.timeout(60)
def test_checkpoint_with_an_invalid_json_manifest_is_not_listed(tmp_path):
    """A checkpoint whose manifest is not valid JSON is skipped: latest_step() names the previous one."""
    _steps_1_and_2_with_manifest_2(tmp_path, '{"format": "torch-ckpt", "step": 2,')
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.latest_step() == 1
        live = _dict_state(0.0)
        assert mgr.restore(live) == 1
    assert torch.equal(live["model"]["w"], torch.full((4, 3), 1.0))


@pytest.mark.timeout(60)
def test_explicit_restore_of_a_step_with_an_invalid_json_manifest_names_the_manifest(tmp_path):
    """restore(step=2) when step 2's manifest is invalid JSON raises a CheckpointError naming that manifest file."""
    manifest = _steps_1_and_2_with_manifest_2(tmp_path, '{"format": "torch-ckpt", "step": 2,')
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointError) as info:
            mgr.restore(_dict_state(0.0), step=2)
    # The checkpoint exists but is damaged: the error must say so and point at the file, not
    # claim the step was never saved.
    assert str(manifest) in str(info.value), str(info.value)
    assert isinstance(info.value, CheckpointCorruptError), type(info.value)


@pytest.mark.timeout(60)
def test_resaving_a_step_whose_checkpoint_is_damaged_is_not_called_already_committed(tmp_path):
    """After step 2's manifest is damaged (so latest is 1), saving step 2 again commits it or blames the manifest."""
    _steps_1_and_2_with_manifest_2(tmp_path, "{")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 1  # a resumed run continues from step 1 and reaches step 2 again
        try:
            mgr.save(2, _dict_state(3.0))
            mgr.wait()
        except CheckpointError as exc:
            # Refusing is acceptable only if the message says what is wrong; step 2 is not committed.
            assert "manifest.json" in str(exc), f"misleading error: {exc}"
        else:
            assert mgr.all_steps() == [1, 2]
            live = _dict_state(0.0)
            assert mgr.restore(live, step=2) == 2 and torch.equal(live["model"]["w"], torch.full((4, 3), 3.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, where):
    """A manifest listing '../x' or an absolute path is refused on restore (named), even with matching checksums."""
    root = tmp_path / "ckpt"
    step_dir = _save(root, 1, _dict_state())
    outside = root / "outside.bin"
    outside.write_bytes(b"secret" * 100)
    name = "../outside.bin" if where == "relative" else str(outside)
    _edit_manifest(step_dir, lambda m: m["files"].__setitem__(name, _sizes_and_crc(outside)))
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointError) as info:
            mgr.restore(_dict_state(0.0), step=1)
    assert isinstance(info.value, ValueError)
    assert "outside.bin" in str(info.value)


def test_manifest_with_overflowing_numbers_is_skipped(tmp_path):
    """A manifest with 1e400 as step is reported corrupt and skipped, never a bare OverflowError."""
    import json as _json

    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((2,), float(step))}).wait()
    manifest = tmp_path / "step_000000002" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step":2', '"step":1e400'))
    assert "1e400" in manifest.read_text()
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 1
    _json.loads(manifest.read_text().replace("1e400", "2"))  # the rest of the file is intact


# -- malformed content is corruption, never a crash, and never breaks other steps (issue 14) -------
def _two_steps(root: Path, make_state) -> tuple[TrainState, torch.nn.Module, Path]:
    """Steps 1 and 2 of a TrainState (2 with other weights); returns (fresh live state, its model, step 2's dir)."""
    state, model, *_ = make_state(seed=0)
    with CheckpointManager(root) as mgr:
        mgr.save(1, state).wait()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        mgr.save(2, state).wait()
    live, live_model, *_ = make_state(seed=5)
    return live, live_model, root / STEP_DIR.format(2)


def _huge_int_manifest(step_dir: Path) -> str:
    path = step_dir / "manifest.json"
    path.write_text(path.read_text().replace('"tensor_bytes":', '"tensor_bytes":' + "7" * 5000 + ',"x":', 1))
    return "manifest.json"


def _deep_manifest(step_dir: Path) -> str:
    path = step_dir / "manifest.json"
    path.write_text(path.read_text().replace('"tiers":{}', '"tiers":{"x":' + "[" * 200_000 + "]" * 200_000 + "}", 1))
    return "manifest.json"


def _symlinked_shard(step_dir: Path) -> str:
    shard = _shard(step_dir)
    outside = step_dir.parent / "outside.distcp"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    return shard.name


def _symlinked_manifest(step_dir: Path) -> str:
    real = step_dir.parent / "manifest_copy.json"
    (step_dir / "manifest.json").rename(real)
    (step_dir / "manifest.json").symlink_to(real)
    return "manifest.json"


def _shape_beyond_chunks(step_dir: Path) -> str:
    from torch_ckpt.format._files import read_dcp_metadata

    md = read_dcp_metadata(step_dir / ".metadata")
    item = md.state_dict_metadata["model.fc1.weight"]
    item.size = torch.Size([item.size[0] + 4, *item.size[1:]])
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return ".metadata"


def _storage_rewritten(step_dir: Path) -> str:
    from torch_ckpt.format._files import read_dcp_metadata

    elsewhere = step_dir.parent / "elsewhere.distcp"
    elsewhere.write_bytes(_shard(step_dir).read_bytes())
    md = read_dcp_metadata(step_dir / ".metadata")
    for info in md.storage_data.values():
        info.relative_path = str(elsewhere)
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return ".metadata"


def _fc1_weight_metadata(step_dir: Path, edit) -> str:
    """Apply ``edit(item, storage_info)`` to model.fc1.weight in .metadata; returns the data file holding it."""
    from torch_ckpt.format._files import read_dcp_metadata

    md = read_dcp_metadata(step_dir / ".metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.fc1.weight")
    edit(md.state_dict_metadata["model.fc1.weight"], info)
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return str(info.relative_path)


def _storage_8_short(step_dir: Path) -> str:
    return _fc1_weight_metadata(step_dir, lambda item, info: setattr(info, "length", info.length - 8))


def _declared_float64(step_dir: Path) -> str:
    return _fc1_weight_metadata(step_dir, lambda item, info: setattr(item.properties, "dtype", torch.float64))


def _declared_int32(step_dir: Path) -> str:
    return _fc1_weight_metadata(step_dir, lambda item, info: setattr(item.properties, "dtype", torch.int32))


def _chunk_reshaped(step_dir: Path) -> str:
    def edit(item, info):
        item.size = torch.Size(reversed(item.size))
        item.chunks[0].sizes = item.size

    return _fc1_weight_metadata(step_dir, edit)


def _rank_key_not_in_metadata(step_dir: Path) -> str:
    doc = json.loads((step_dir / "rank_00000.json").read_text())
    doc["tree"]["model"]["fc1.weight"] = {"__tensor__": "model.ghost"}
    rewrite(step_dir, "rank_00000.json", json.dumps(doc).encode())
    return "rank_00000.json"


_MALFORMED = {"storage-8-bytes-short": _storage_8_short, "declared-float64": _declared_float64,
              "declared-int32": _declared_int32, "chunk-reshaped": _chunk_reshaped,
              "rank-key-not-in-metadata": _rank_key_not_in_metadata,
              "5000-digit-int": _huge_int_manifest, "200k-deep-manifest": _deep_manifest,
              "storage_data=5": storage_data_not_a_dict, "inline-shape-2^40": inline_shape_2_40,
              "200k-deep-rank-json": rank_json_nested_200k, "symlinked-shard": _symlinked_shard,
              "symlinked-manifest": _symlinked_manifest, "shape-beyond-chunks": _shape_beyond_chunks,
              "storage-paths-rewritten": _storage_rewritten}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", list(_MALFORMED), ids=list(_MALFORMED))
def test_malformed_newest_step_falls_back_to_the_previous_one(tmp_path, make_state, damage):
    """restore() skips a newest step with malformed content (listed or not) and loads step 1, with a warning."""
    live, live_model, step2 = _two_steps(tmp_path, make_state)
    _MALFORMED[damage](step2)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(live) == 1
    _, model, *_ = make_state(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(live_model.state_dict().values(), model.state_dict().values()))


@pytest.mark.timeout(120)
def test_a_newest_step_without_a_valid_manifest_is_warned_about_once_per_open_and_restore(tmp_path, make_state,
                                                                                            caplog):
    """Opening a root and restoring past a step whose manifest is not JSON logs its 'ignoring' warning once."""
    live, _, step2 = _two_steps(tmp_path, make_state)
    (step2 / "manifest.json").write_text("{")
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(live) == 1
    assert [r.getMessage() for r in caplog.records].count(
        next(m for r in caplog.records if (m := r.getMessage()).startswith("ignoring"))) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", list(_MALFORMED), ids=list(_MALFORMED))
def test_explicit_restore_of_an_intact_step_works_beside_a_malformed_one(tmp_path, make_state, damage):
    """restore(step=1) succeeds however step 2 is malformed."""
    live, _, step2 = _two_steps(tmp_path, make_state)
    _MALFORMED[damage](step2)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(live, step=1) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", list(_MALFORMED), ids=list(_MALFORMED))
def test_explicit_restore_of_a_malformed_step_names_the_file(tmp_path, make_state, damage):
    """restore(step=2) of a malformed step raises CheckpointCorruptError naming the bad file; live state untouched."""
    live, live_model, step2 = _two_steps(tmp_path, make_state)
    bad = _MALFORMED[damage](step2)
    before = {k: v.clone() for k, v in live_model.state_dict().items()}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointCorruptError) as info:
            mgr.restore(live, step=2)
    assert str(step2 / bad) in str(info.value), str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in live_model.state_dict().items())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thread_count", [1, 2, 4])
def test_damaged_shard_header_without_verify_on_load_is_corrupt_naming_the_shard(tmp_path, make_state, thread_count):
    """verify_on_load=False: a shard with a flipped first byte raises CheckpointCorruptError naming it, no traceback."""
    state, *_ = make_state(seed=0)
    with CheckpointManager(tmp_path, thread_count=thread_count) as mgr:
        mgr.save(1, state).wait()
    shards = sorted((tmp_path / STEP_DIR.format(1)).glob("*.distcp"))
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[0] ^= 0xFF  # the zip header of the first tensor record
        shard.write_bytes(bytes(data))
    live, *_ = make_state(seed=1)
    with CheckpointManager(tmp_path, verify_on_load=False) as mgr:
        with pytest.raises(CheckpointCorruptError) as info:
            mgr.restore(live, step=1)
    message = str(info.value)
    assert any(str(s) in message for s in shards), message
    assert "Traceback" not in message and "CheckpointException" not in message
    assert "weights_only" not in message  # torch.load's advice to unpickle freely is never passed on


@pytest.mark.timeout(60)
def test_retention_error_after_commit_is_reported_as_retention_and_the_save_succeeds(tmp_path, monkeypatch, caplog):
    """A failing retention pass after the rename logs a retention error; the save is committed and not failed."""
    import torch_ckpt.manager._manager as commit_mod

    def broken(*args, **kwargs):
        raise RuntimeError("retention exploded")

    monkeypatch.setattr(commit_mod, "apply_retention", broken)
    caplog.set_level(logging.ERROR, logger="torch_ckpt")
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        handle = mgr.save(1, _dict_state())
        assert handle.committed.result(timeout=30) == str(tmp_path / STEP_DIR.format(1))
        mgr.save(2, _dict_state(2.0)).wait()
        assert mgr.all_steps() == [1, 2]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all("retention" in m and "retention exploded" in m for m in errors), errors
    assert not any("checkpoint step" in m and "failed" in m for m in errors)


def _w1_declared_float64(step_dir: Path) -> None:
    from torch_ckpt.format._files import read_dcp_metadata

    md = read_dcp_metadata(step_dir / ".metadata")
    md.state_dict_metadata["__rank1__.w1"].properties.dtype = torch.float64  # rank 1's own tensor (a per-rank key)
    rewrite(step_dir, ".metadata", pickle.dumps(md))


# case -> (each rank's state, rank 0's damage after the save, what the error must name)
_ONE_RANK_DAMAGE = {
    "rank_json_nested": (lambda rank: {"w": torch.full((4,), float(rank)), "meta": {"rank": rank}},
                         functools.partial(rank_json_nested_200k, rank=1), ["rank_00001.json"]),
    # rank 1's tensor lies in rank 1's data file
    "record_dtype": (lambda rank: {f"w{rank}": torch.full((4,), float(rank))},
                     _w1_declared_float64, ["'__rank1__.w1'", "float64"]),
}


def _restore_after_rank_0_damages(rank: int, world: int, root: str, case: str) -> None:
    from torch_ckpt import CheckpointCorruptError as Corrupt

    make_state, damage, named = _ONE_RANK_DAMAGE[case]
    state = make_state(rank)
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, state)
        mgr.wait()
        torch.distributed.barrier()
        if rank == 0:
            damage(Path(root) / STEP_DIR.format(1))
        torch.distributed.barrier()
        try:
            mgr.restore(state, step=1)
        except Corrupt as exc:
            assert all(n in str(exc) for n in named), str(exc)
        else:
            raise AssertionError(f"rank {rank}: restore after damage {case!r} succeeded")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(_ONE_RANK_DAMAGE))
def test_damage_to_one_ranks_share_fails_every_rank_without_a_hang(tmp_path, case):
    """2 ranks (gloo): rank 1's JSON nested 200k deep, or its record declared float64, fails restore on both ranks."""
    from tests._dist import run_distributed

    run_distributed(_restore_after_rank_0_damages, 2, str(tmp_path), case, timeout_s=150)
