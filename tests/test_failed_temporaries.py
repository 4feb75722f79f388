"""Temporaries of failed saves: removed by the next save of the same incarnation, nothing else touched."""

from __future__ import annotations

import torch

from torch_ckpt.root._layout import PARTIAL_PREFIX, remove_failed_temporaries
from torch_ckpt.save import AsyncCheckpointer

INC = "aaaaaaaaaaaaaaaa"
OTHER = "bbbbbbbbbbbbbbbb"


def _tree(root):
    """The names of ``root``'s entries and of their entries (two levels)."""
    top = [p.name for p in root.iterdir()]
    return sorted(top + [f"{d.name}/{p.name}" for d in root.iterdir() for p in d.iterdir()])


def test_the_named_failed_saves_partials_go_and_nothing_else(tmp_path):
    """Only ``NAME/.torch-ckpt.partial.<same id>`` of the given failed names goes; other ids, hooks dirs, downloads,
    steps stay."""
    names = [f"step_000000003/{PARTIAL_PREFIX}{INC}", f"step_000000004/{PARTIAL_PREFIX}{INC}",
             f"step_000000005/{PARTIAL_PREFIX}{OTHER}", f".step_000000002.download.tmp.{INC}",
             f".checkpoint_4.hooks.tmp.{INC}", f"step_000000001/{PARTIAL_PREFIX}{INC}", "step_000000002"]
    for name in names:
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "f").write_text("x")
    removed = remove_failed_temporaries(tmp_path, tmp_path / names[1],
                                        ["step_000000003", "step_000000004", "step_000000005"])
    assert [p.relative_to(tmp_path).as_posix() for p in removed] == [names[0]]
    assert not (tmp_path / "step_000000003").exists()  # the failed save's reservation went with its partial
    assert (tmp_path / names[2]).is_dir()  # another incarnation's partial: clean_stale_temporaries' business


def test_a_failed_commits_side_directory_goes(tmp_path):
    """A ``.torch-ckpt.tmp.<same id>`` a failed commit left beside the names goes; another id's stays."""
    (tmp_path / f".torch-ckpt.tmp.{INC}").mkdir()
    (tmp_path / f".torch-ckpt.tmp.{OTHER}").mkdir()
    (tmp_path / "step_000000002").mkdir()
    removed = remove_failed_temporaries(tmp_path, tmp_path / "step_000000002" / f"{PARTIAL_PREFIX}{INC}",
                                        ["step_000000001"])
    assert [p.name for p in removed] == [f".torch-ckpt.tmp.{INC}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".torch-ckpt.tmp.{OTHER}", "step_000000002"]


def test_a_current_name_that_is_not_a_partial_removes_nothing(tmp_path):
    """A legacy ``.NAME.tmp`` current name carries no id: nothing is removed."""
    (tmp_path / "step_000000001" / f"{PARTIAL_PREFIX}{INC}").mkdir(parents=True)
    assert remove_failed_temporaries(tmp_path, tmp_path / ".step_000000002.tmp", ["step_000000001"]) == []
    assert (tmp_path / "step_000000001" / f"{PARTIAL_PREFIX}{INC}").is_dir()


def test_the_next_save_removes_the_partial_a_failed_save_left(tmp_path, monkeypatch):
    """A save that failed and left its partial and reservation (as after a timed-out collective) loses both at the
    next save."""
    import torch_ckpt.save._persist as persist_mod

    real = persist_mod._write_and_commit

    def leave_it(req, ctx, part, final, tmp, error, reserved):
        (tmp / "partial.distcp").write_bytes(b"x")
        raise persist_mod.CheckpointWriteError("the collective timed out")

    with AsyncCheckpointer() as ck:
        monkeypatch.setattr(persist_mod, "_write_and_commit", leave_it)
        monkeypatch.setattr(persist_mod.shutil, "rmtree", lambda *a, **k: None)  # as if rank 0 could not remove it
        try:
            ck.save(tmp_path / "a", {"w": torch.ones(3)}).committed.exception()
            ck.wait()
        except persist_mod.CheckpointWriteError:
            pass
        monkeypatch.undo()
        assert _tree(tmp_path) == ["a", f"a/{PARTIAL_PREFIX}{ck.incarnation}"]
        monkeypatch.setattr(persist_mod, "_write_and_commit", real)
        ck.save(tmp_path / "b", {"w": torch.ones(3)})
        ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
