"""Temporaries of failed saves: removed by the next save of the same incarnation, nothing else touched."""

from __future__ import annotations

import torch

from torch_ckpt import AsyncCheckpointer
from torch_ckpt.temporaries import remove_failed_temporaries

INC = "aaaaaaaaaaaaaaaa"


def test_the_named_failed_saves_temporaries_go_and_nothing_else(tmp_path):
    """Only ``.NAME.tmp.<same id>`` of the given failed names goes; other ids, hooks dirs, downloads, steps stay."""
    names = [f".step_000000003.tmp.{INC}", f".step_000000004.tmp.{INC}", ".step_000000003.tmp.bbbbbbbbbbbbbbbb",
             f".step_000000002.download.tmp.{INC}", f".checkpoint_4.hooks.tmp.{INC}", f".step_000000001.tmp.{INC}",
             "step_000000002"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    removed = remove_failed_temporaries(tmp_path, f".step_000000004.tmp.{INC}", ["step_000000003", "step_000000004"])
    assert [p.name for p in removed] == [f".step_000000003.tmp.{INC}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_a_current_name_without_an_incarnation_removes_nothing(tmp_path):
    """A legacy ``.NAME.tmp`` current name carries no id: nothing is removed."""
    (tmp_path / f".step_000000001.tmp.{INC}").mkdir()
    assert remove_failed_temporaries(tmp_path, ".step_000000002.tmp", ["step_000000001"]) == []
    assert (tmp_path / f".step_000000001.tmp.{INC}").is_dir()


def test_the_next_save_removes_the_temporary_a_failed_save_left(tmp_path, monkeypatch):
    """A save that failed and left its temporary (as after a timed-out collective) loses it at the next save."""
    import torch_ckpt.persist as persist_mod

    real = persist_mod._write_and_commit

    def leave_it(req, ctx, final, tmp, error):
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
        assert [p.name for p in tmp_path.iterdir()] == [f".a.tmp.{ck.incarnation}"]
        monkeypatch.setattr(persist_mod, "_write_and_commit", real)
        ck.save(tmp_path / "b", {"w": torch.ones(3)})
        ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
