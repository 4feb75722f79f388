"""lightning_ckpt._paths: atomic replace, link and remove of checkpoint names."""

from __future__ import annotations

import os

from lightning_ckpt._paths import link_path, remove_path, replace_path


def _ckpt_dir(path, content: str):
    path.mkdir()
    (path / "manifest.json").write_text(content)
    return path


def test_replace_swaps_a_directory_for_a_directory(tmp_path):
    """The target holds the new directory afterwards; neither the source nor trash is left behind."""
    target, new = _ckpt_dir(tmp_path / "last.ckpt", "old"), _ckpt_dir(tmp_path / ".last.ckpt.next", "new")
    replace_path(new, target)
    assert (target / "manifest.json").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_replace_puts_a_directory_in_place_of_a_plain_file(tmp_path):
    """A plain .ckpt file (written by TorchCheckpointIO) is replaced by a checkpoint directory."""
    (tmp_path / "last.ckpt").write_bytes(b"torch.save data")
    replace_path(_ckpt_dir(tmp_path / ".next", "new"), tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt" / "manifest.json").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_link_replaces_an_existing_link(tmp_path):
    """Linking over an existing link points it at the new target with a relative path."""
    _ckpt_dir(tmp_path / "a", "a")
    _ckpt_dir(tmp_path / "b", "b")
    link_path(tmp_path / "a", tmp_path / "last")
    link_path(tmp_path / "b", tmp_path / "last")
    assert os.readlink(tmp_path / "last") == "b"
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "last"]


def test_remove_deletes_a_directory_without_leftovers(tmp_path):
    """Removing a checkpoint directory leaves no trash directory behind."""
    remove_path(_ckpt_dir(tmp_path / "step", "x"))
    assert os.listdir(tmp_path) == []
