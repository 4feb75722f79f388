"""The Accelerate load path never executes code from a checkpoint."""

import pytest
from acc_helpers import make_run, train

from tests._hostile import plant_malicious_metadata
from torch_ckpt import CheckpointError


def test_load_state_refuses_a_malicious_metadata_pickle(tmp_path):
    """accelerator.load_state() after attach() raises on a tampered .metadata and never runs its payload."""
    run = make_run(tmp_path)
    train(run, 0, 2)
    folder = run.accelerator.save_state()
    run.ckpt.close()
    step_dir = next(p.parent for p in folder.rglob("manifest.json"))
    marker = tmp_path / "pwned"
    plant_malicious_metadata(step_dir, marker)
    run2 = make_run(tmp_path)
    with pytest.raises(CheckpointError):
        run2.accelerator.load_state(str(folder))
    run2.ckpt.close()
    assert not marker.exists()
