"""Temporary step directories: incarnation-id names and the clean-up of stale ones (torch_ckpt.root._layout)."""

from __future__ import annotations

import os

import pytest

from torch_ckpt import CheckpointManager
from torch_ckpt.root._layout import (
    clean_stale_temporaries,
    is_temporary_name,
    new_incarnation,
    step_dir_name,
    temporary_name,
)
from torch_ckpt.tools.listing import list_root

_STALE = [".step_000000001.tmp", ".step_000000002.tmp.0a1b2c3d4e5f6789", ".step_000000003.download.tmp",
          ".step_000000004.download.tmp.ffee", ".trash_step_000000005"]


def _make(root, names):
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "__0_0.distcp").write_bytes(b"partial")


def test_temporary_name_carries_the_incarnation_id():
    """`.step_N.tmp.<id>` is the name of step N's temporary written by incarnation <id>."""
    assert temporary_name(step_dir_name(7), "abc123") == ".step_000000007.tmp.abc123"
    assert temporary_name("torch_ckpt", "abc123") == ".torch_ckpt.tmp.abc123"


@pytest.mark.parametrize("bad", ["", "ABC", "ab/cd", "../x", "a" * 65, 12])
def test_temporary_name_refuses_a_malformed_incarnation_id(bad):
    """An incarnation id other than 1-64 lowercase hex digits is refused (it becomes part of a path)."""
    with pytest.raises(ValueError, match="incarnation id"):
        temporary_name("step_000000001", bad)


def test_new_incarnations_are_distinct_hex_ids():
    """Each new incarnation id is 16 lowercase hex digits and differs from the others."""
    ids = {new_incarnation() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 16 and int(i, 16) >= 0 and i == i.lower() for i in ids)


@pytest.mark.parametrize("name, expected", [(".step_000000001.tmp", True), (".step_000000001.tmp.9f", True),
                                            (".step_000000001.download.tmp.9f", True), ("step_000000001", False),
                                            (".step_000000001.tmp.XYZ", False), (".step_000000001.tmpx", False)])
def test_is_temporary_name_knows_both_naming_forms(name, expected):
    """Old (`.step_N.tmp`) and incarnation-id (`.step_N.tmp.<id>`) names are temporaries; others are not."""
    assert is_temporary_name(name) is expected


def test_clean_removes_every_stale_temporary_form(tmp_path):
    """Old-form, incarnation-id, download and trash leftovers are all removed; other entries stay."""
    _make(tmp_path, _STALE + ["step_000000006"])
    (tmp_path / "notes.txt").write_text("keep")
    removed = clean_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == sorted(_STALE)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step_000000006"]


def test_clean_keeps_the_callers_own_temporary(tmp_path):
    """The temporary of the caller's own incarnation (a save in flight) survives; other incarnations' do not."""
    _make(tmp_path, [".step_000000002.tmp.aaaa", ".step_000000002.tmp.bbbb", ".step_000000002.tmp"])
    clean_stale_temporaries(tmp_path, keep_incarnation="aaaa")
    assert os.listdir(tmp_path) == [".step_000000002.tmp.aaaa"]


def test_manager_start_removes_a_previous_incarnations_temporary(tmp_path):
    """A new CheckpointManager removes the temporary another (dead) incarnation left, whatever its id."""
    _make(tmp_path, [".step_000000002.tmp.0123456789abcdef"])
    with CheckpointManager(tmp_path):
        assert not any(is_temporary_name(n) for n in os.listdir(tmp_path))


def test_list_root_reports_an_incarnation_temporary_as_partial(tmp_path):
    """`.step_N.tmp.<id>` is listed as a partial entry of step N, like the old form."""
    _make(tmp_path, [".step_000000003.tmp.ab12"])
    rows = list_root(tmp_path)["steps"]
    assert [(r["step"], r["status"]) for r in rows] == [(3, "partial")]
