"""Checkpoint paths Lightning itself chooses (hidden names of the Tuner) work with the plugin."""

from __future__ import annotations

import torch
from lightning.pytorch.tuner import Tuner
from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO


def test_lr_find_restores_and_removes_its_hidden_checkpoint(make_trainer, tmp_path):
    """Tuner.lr_find saves to .lr_find_<uuid>.ckpt, restores it at once and removes it: all work with the plugin."""
    model = TinyModule()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    finder = Tuner(trainer).lr_find(model, num_training=5, update_attr=False)
    assert finder is not None and len(finder.results["lr"]) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored from the checkpoint
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".lr_find")]


def test_a_hidden_checkpoint_name_saves_and_loads(make_trainer, tmp_path):
    """trainer.save_checkpoint('.name.ckpt') writes a checkpoint that the plugin loads back."""
    model = TinyModule()
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(model)
    path = tmp_path / ".hidden.ckpt"
    trainer.save_checkpoint(path)
    loaded = trainer.strategy.checkpoint_io.load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["layer.weight"], model.layer.weight.detach())
