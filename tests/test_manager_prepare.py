"""The manager's step checks before a save: a step below the restored one (issue 26 item 6)."""

from __future__ import annotations

import pytest
import torch

from torch_ckpt import CheckpointManager, ConfigError


def test_saving_below_the_restored_step_says_so_and_keeps_restored_step(tmp_path):
    """restore() returned 1, save(0): refused naming both steps (not 'did not restore'); restored_step stays 1."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.zeros(2)}).wait()
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"w": torch.ones(2)}) == 1
        with pytest.raises(ConfigError, match="this manager restored step 1 and is now asked to save step 0") as info:
            mgr.save(0, {"w": torch.ones(2)})
        assert "did not restore" not in str(info.value)
        assert mgr.restored_step == 1
        mgr.save(2, {"w": torch.ones(2)}).wait()
        assert mgr.restored_step is None and mgr.all_steps() == [1, 2]
