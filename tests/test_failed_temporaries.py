"""Temporaries of failed saves: removed by the next save of the same incarnation, nothing else touched."""

from __future__ import annotations

from torch_ckpt.temporaries import remove_failed_temporaries


def test_leftovers_of_the_same_incarnation_are_removed_and_others_kept(tmp_path):
    """Only ``.NAME.tmp.<same id>`` other than the current one goes; other ids, downloads and steps stay."""
    names = [".step_000000003.tmp.aaaaaaaaaaaaaaaa", ".step_000000004.tmp.aaaaaaaaaaaaaaaa",
             ".step_000000003.tmp.bbbbbbbbbbbbbbbb", ".step_000000002.download.tmp.aaaaaaaaaaaaaaaa",
             "step_000000002"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    removed = remove_failed_temporaries(tmp_path, ".step_000000004.tmp.aaaaaaaaaaaaaaaa")
    assert [p.name for p in removed] == [".step_000000003.tmp.aaaaaaaaaaaaaaaa"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_a_name_without_an_incarnation_removes_nothing(tmp_path):
    """A legacy ``.NAME.tmp`` current name carries no id: nothing is removed."""
    (tmp_path / ".step_000000001.tmp.aaaaaaaaaaaaaaaa").mkdir()
    assert remove_failed_temporaries(tmp_path, ".step_000000002.tmp") == []
    assert (tmp_path / ".step_000000001.tmp.aaaaaaaaaaaaaaaa").is_dir()
