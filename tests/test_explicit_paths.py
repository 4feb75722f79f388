"""CheckpointManager.save(path=...): any name is a checkpoint path except the forms of the manager's own files."""

from __future__ import annotations

import pytest
import torch

from torch_ckpt import CheckpointManager, ConfigError, load_full_state


def test_a_hidden_name_is_an_ordinary_checkpoint_path(tmp_path):
    """A hidden explicit path (Lightning's .lr_find_<uuid>.ckpt) is saved and loaded like any other."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, path=tmp_path / ".lr_find_1.ckpt").wait()
    state, _ = load_full_state(tmp_path / ".lr_find_1.ckpt")
    assert torch.equal(state["w"], torch.ones(2))


@pytest.mark.parametrize("name", [".torch-ckpt.partial.0123456789abcdef", ".torch-ckpt.tmp.0123456789abcdef",
                                  ".a.ckpt.tmp.0123456789abcdef", ".trash_step_000000001", ".superseded_x",
                                  ".corrupt_x", ".x.replaced.abc123", ".lock"])
def test_names_of_the_managers_own_files_are_refused(tmp_path, name):
    """A path with the form of a temporary, set-aside directory or the root lock is a ConfigError naming it."""
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ConfigError, match="torch-ckpt's own"):
        mgr.save(1, {"w": torch.ones(2)}, path=tmp_path / name)
