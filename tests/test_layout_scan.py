"""scan_committed beside a writer: a checkpoint its retention removes mid-listing (issue 26 item 6)."""

from __future__ import annotations

import logging
import shutil

import torch

from torch_ckpt import CheckpointManager
from torch_ckpt.root import _layout as layout


def test_checkpoint_removed_while_listing_is_skipped_without_a_warning(tmp_path, monkeypatch, caplog):
    """A step directory retention moves away between the listing and its manifest read is skipped silently."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.zeros(2)}).wait()
    real = layout.read_manifest

    def retention_wins(entry, **kwargs):
        if entry.name == "step_000000001":  # what retention does: rename to a hidden trash name, then delete
            shutil.rmtree(entry.rename(entry.with_name(".trash_step_000000001")))
        return real(entry, **kwargs)

    monkeypatch.setattr(layout, "read_manifest", retention_wins)
    with caplog.at_level(logging.DEBUG, logger="torch_ckpt"):
        assert list(layout.scan_committed(tmp_path)) == [2]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_step_directory_without_manifest_is_still_warned_about(tmp_path, caplog):
    """A step-named directory that stays there with files but no manifest is skipped with a warning, as before."""
    (tmp_path / "step_000000003").mkdir()  # empty, it would be a reservation (a save in flight): silent
    (tmp_path / "step_000000003" / "__0_0.distcp").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
        assert layout.scan_committed(tmp_path) == {}
    assert "step_000000003" in caplog.text and "does not exist" in caplog.text
