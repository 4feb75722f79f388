"""Lifecycle of AsyncDCPCheckpointIO in a Trainer: no torch-ckpt thread outlives fit or a save outside it,
and a second Trainer of the same process saves into the same folders."""

from __future__ import annotations

from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO
from tests._threads import ckpt_threads
from torch_ckpt import is_committed


def test_fit_then_save_checkpoint_by_hand_leaves_no_thread(make_trainer, tmp_path):
    """After fit and a trainer.save_checkpoint(path) after it, no torch-ckpt thread is left (committed first)."""
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(TinyModule())
    assert ckpt_threads(0) == []
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    assert ckpt_threads(0) == [] and is_committed(tmp_path / "manual.ckpt")


def test_save_checkpoint_before_fit_leaves_no_thread_once_committed(make_trainer, tmp_path):
    """A save before any fit (no teardown follows) ends its writer thread with the commit."""
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    trainer.strategy.connect(TinyModule())
    trainer.save_checkpoint(tmp_path / "early.ckpt")
    assert ckpt_threads() == [] and is_committed(tmp_path / "early.ckpt")


def test_second_trainer_saves_into_the_folder_of_one_still_referenced(make_trainer, tmp_path):
    """Trainer 1 fits and saves by hand into a folder, stays referenced; trainer 2 fits saving into it too."""
    first = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    first.fit(TinyModule())
    first.save_checkpoint(tmp_path / "checkpoints" / "manual.ckpt")
    second = make_trainer(plugins=[AsyncDCPCheckpointIO()], max_steps=8)
    second.fit(TinyModule())
    second.save_checkpoint(tmp_path / "checkpoints" / "manual-2.ckpt")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if is_committed(p))
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "manual-2.ckpt", "manual.ckpt"]
