"""torch_ckpt.root._layout: listing, committing, replacing, quarantining and removing step directories of a root."""

from __future__ import annotations

import json
import os
import zlib

import pytest

from torch_ckpt.errors import CheckpointNotFoundError, CheckpointWriteError
from torch_ckpt.policy._naming import PatternNaming, StepNaming
from torch_ckpt.root import _layout as layout
from torch_ckpt.root._layout import (
    MANIFEST_NAME,
    Manifest,
    check_root,
    commit_dir,
    is_committed,
    quarantine_step_dir,
    read_manifest,
    remove_step_dir,
    replace_dir,
    scan_committed,
    update_manifest_tiers,
    write_json_durable,
)

NAMING = StepNaming()


def make_ckpt(directory, step, *, manifest_step=None, files=None):
    """A directory holding ``files`` ({name: bytes}) and a manifest listing them."""
    directory.mkdir(parents=True)
    files = files or {}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    listed = {name: {"bytes": len(data), "crc32": zlib.crc32(data)} for name, data in files.items()}
    write_json_durable(directory / MANIFEST_NAME, Manifest(step=step if manifest_step is None else manifest_step,
                                                           world_size=1, files=listed).to_json())
    return directory


def test_scan_orders_by_integer_step(tmp_path):
    """Committed steps are returned ascending by their integer step, whatever the name order."""
    for s in (1000, 20, 3):
        make_ckpt(tmp_path / NAMING.name(s), s)
    assert list(scan_committed(tmp_path)) == [3, 20, 1000]
    assert scan_committed(tmp_path)[20] == tmp_path / NAMING.name(20)


def test_scan_skips_temporaries_unmanifested_and_mismatched(tmp_path):
    """Temporaries, directories without a manifest and ones whose manifest names another step are not listed."""
    make_ckpt(tmp_path / NAMING.name(1), 1)
    make_ckpt(tmp_path / f".{NAMING.name(2)}.tmp.abc", 2)
    (tmp_path / NAMING.name(3)).mkdir()
    make_ckpt(tmp_path / NAMING.name(4), 40)
    (tmp_path / NAMING.name(5)).write_text("a file, not a directory")
    assert list(scan_committed(tmp_path)) == [1]


def test_scan_lists_only_names_of_the_given_naming(tmp_path):
    """Directories of another naming are ignored."""
    make_ckpt(tmp_path / "checkpoint_7", 7)
    make_ckpt(tmp_path / NAMING.name(8), 8)
    assert list(scan_committed(tmp_path, PatternNaming("checkpoint_{step}"))) == [7]


def test_scan_of_a_missing_root_is_empty(tmp_path):
    """A root that does not exist has no committed checkpoints."""
    assert scan_committed(tmp_path / "absent") == {}


def test_write_json_durable_returns_size_and_crc(tmp_path):
    """write_json_durable returns the byte count and CRC-32 of exactly what it wrote."""
    n, crc = write_json_durable(tmp_path / "x.json", {"a": [1, 2]})
    data = (tmp_path / "x.json").read_bytes()
    assert (n, crc) == (len(data), zlib.crc32(data)) and json.loads(data) == {"a": [1, 2]}


def test_commit_publishes_the_temporary(tmp_path):
    """commit_dir renames the temporary to its final name."""
    tmp = make_ckpt(tmp_path / ".step.tmp", 1, files={"a": b"x"})
    final = tmp_path / NAMING.name(1)
    commit_dir(tmp, final)
    assert not tmp.exists() and (final / "a").read_bytes() == b"x"


def test_commit_over_an_existing_checkpoint_is_refused(tmp_path):
    """Without replace, an existing final directory raises CheckpointWriteError and is left intact."""
    final = make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"old"})
    tmp = make_ckpt(tmp_path / ".step.tmp", 1, files={"a": b"new"})
    with pytest.raises(CheckpointWriteError, match="already committed"):
        commit_dir(tmp, final)
    assert (final / "a").read_bytes() == b"old"


def test_commit_with_replace_swaps_in_the_new_checkpoint(tmp_path):
    """With replace, the new checkpoint takes the final name and the old one and the temporary are gone."""
    final = make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"old"})
    tmp = make_ckpt(tmp_path / ".step.tmp", 1, files={"a": b"new"})
    commit_dir(tmp, final, replace=True)
    assert (final / "a").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAMING.name(1)]


def test_replace_without_rename_exchange_uses_two_renames(tmp_path, monkeypatch):
    """Where renameat2 exchange is unsupported, the fallback replaces the checkpoint and leaves nothing aside."""
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    final = make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"old"})
    tmp = make_ckpt(tmp_path / ".step.tmp", 1, files={"a": b"new"})
    replace_dir(tmp, final)
    assert (final / "a").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAMING.name(1)]


def test_failed_fallback_replace_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    """If renaming the new one in fails, the old checkpoint is renamed back and CheckpointWriteError is raised."""
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    final = make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"old"})
    tmp = make_ckpt(tmp_path / ".step.tmp", 1, files={"a": b"new"})
    real_rename = os.rename

    def rename(src, dst):
        if str(src) == str(tmp):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointWriteError, match="cannot replace"):
        replace_dir(tmp, final)
    assert (final / "a").read_bytes() == b"old"


def test_is_committed_when_every_listed_file_has_its_size(tmp_path):
    """A manifest whose listed files are all present at their sizes is committed."""
    assert is_committed(make_ckpt(tmp_path / "c", 1, files={"a": b"xy", "b": b""}))


@pytest.mark.parametrize("damage", ["missing", "size", "symlink", "no-manifest"])
def test_is_committed_is_false_for_damage(tmp_path, damage):
    """A missing or resized listed file, a listed file that is a symlink, or no manifest: not committed."""
    d = make_ckpt(tmp_path / "c", 1, files={"a": b"xy"})
    if damage == "missing":
        (d / "a").unlink()
    elif damage == "size":
        (d / "a").write_bytes(b"xyz")
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"xy")
        (d / "a").unlink()
        (d / "a").symlink_to(tmp_path / "elsewhere")
    else:
        (d / MANIFEST_NAME).unlink()
    assert not is_committed(d)


def test_check_root_refuses_a_file(tmp_path):
    """A root that is a file raises CheckpointWriteError naming it."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointWriteError, match="not a directory"):
        check_root(tmp_path / "f", create=True)


def test_check_root_missing_without_create_is_not_found(tmp_path):
    """A missing root with create=False raises CheckpointNotFoundError and creates nothing."""
    with pytest.raises(CheckpointNotFoundError):
        check_root(tmp_path / "r", create=False)
    assert not (tmp_path / "r").exists()


def test_check_root_creates_missing_parents(tmp_path):
    """With create=True, the root and its parents are created."""
    check_root(tmp_path / "a" / "b", create=True)
    assert (tmp_path / "a" / "b").is_dir()


def test_quarantine_moves_aside_with_the_reason_and_time(tmp_path, monkeypatch):
    """A quarantined checkpoint moves to .REASON_NAME.TIME and is no longer listed."""
    monkeypatch.setattr(layout.time, "time", lambda: 1234.5)
    d = make_ckpt(tmp_path / NAMING.name(1), 1)
    target = quarantine_step_dir(d, reason="superseded")
    assert target == tmp_path / f".superseded_{NAMING.name(1)}.1234" and target.is_dir()
    assert scan_committed(tmp_path) == {}


def test_quarantine_twice_in_one_second_gets_a_suffix(tmp_path, monkeypatch):
    """A second quarantine of the same name within the same second gets '.1' appended."""
    monkeypatch.setattr(layout.time, "time", lambda: 99.0)
    first = quarantine_step_dir(make_ckpt(tmp_path / NAMING.name(1), 1))
    second = quarantine_step_dir(make_ckpt(tmp_path / NAMING.name(1), 1))
    assert first.name == f".corrupt_{NAMING.name(1)}.99" and second.name == f".corrupt_{NAMING.name(1)}.99.1"


def test_remove_step_dir_leaves_nothing(tmp_path):
    """remove_step_dir deletes the checkpoint and its hidden trash name."""
    remove_step_dir(make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"x"}))
    assert list(tmp_path.iterdir()) == []


def test_retired_checkpoint_is_hidden_and_no_longer_looks_committed(tmp_path):
    """retire_step_dir renames to the trash name and drops its manifest at once; the data is left to delete."""
    from torch_ckpt.root._layout import retire_step_dir

    trash = retire_step_dir(make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"x"}))
    assert [p.name for p in tmp_path.iterdir()] == [trash.name] and trash.name.startswith(".torch-ckpt.tmp.")
    assert NAMING.name(1) not in trash.name  # no scan of the folder by name mistakes it for the checkpoint
    assert sorted(p.name for p in trash.iterdir()) == ["a"]


def test_a_leftover_trash_of_the_same_name_never_blocks_removal(tmp_path):
    """A trash left by a crash (non-empty, any name) never makes remove_step_dir fail; each removal has its own."""
    leftover = tmp_path / f".trash_{NAMING.name(1)}"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "old.distcp").write_bytes(b"old")
    remove_step_dir(make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"x"}))
    remove_step_dir(make_ckpt(tmp_path / NAMING.name(1), 1, files={"a": b"x"}))
    assert list(tmp_path.iterdir()) == [leftover]  # removed at the next start (clean_stale_temporaries)


def test_update_manifest_tiers_merges_and_keeps_the_rest(tmp_path):
    """Tiers are merged into the manifest; other fields and earlier tiers stay; no temporary is left."""
    d = make_ckpt(tmp_path / "c", 5, files={"a": b"x"})
    update_manifest_tiers(d, {"durable": {"url": "s3://b/r"}})
    update_manifest_tiers(d, {"mirror": {"url": "/m"}})
    m = read_manifest(d)
    assert m.step == 5 and list(m.files) == ["a"]
    assert m.tiers == {"durable": {"url": "s3://b/r"}, "mirror": {"url": "/m"}}
    assert sorted(p.name for p in d.iterdir()) == ["a", MANIFEST_NAME]
