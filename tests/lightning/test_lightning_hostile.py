"""The Lightning load path never executes code from a checkpoint."""

import pytest
import torch

from tests._hostile import plant_malicious_metadata
from torch_ckpt import CheckpointError


def test_load_checkpoint_refuses_a_malicious_metadata_pickle(tmp_path):
    """AsyncDCPCheckpointIO.load_checkpoint raises on a tampered .metadata and never runs its payload."""
    from lightning_ckpt import AsyncDCPCheckpointIO

    io = AsyncDCPCheckpointIO()
    path = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "epoch": 0, "global_step": 1}, path)
    io.teardown()
    marker = tmp_path / "pwned"
    plant_malicious_metadata(path, marker)
    with pytest.raises(CheckpointError):
        AsyncDCPCheckpointIO().load_checkpoint(path)
    assert not marker.exists()
