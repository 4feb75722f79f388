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


class _Validated(TinyModule):
    def validation_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()


def _folders(make_trainer, tmp_path, name, plugin, runs):
    """The checkpoints ModelCheckpoint(save_top_k=1, every 2 steps) leaves after ``runs`` on one plugin."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = tmp_path / name
    for run in runs:
        trainer = make_trainer(plugins=[plugin] if plugin is not None else None, max_steps=8,
                               callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=1, every_n_train_steps=2)])
        module = _Validated()
        if run == "validate":
            trainer.validate(module, module.train_dataloader(), verbose=False)
        trainer.fit(module)
    return sorted(p.name for p in folder.iterdir())


def test_validate_before_fit_keeps_the_removals_of_save_top_k(make_trainer, tmp_path):
    """validate() then fit() on the plugin alone: the same folders as plain Lightning (removals not dropped)."""
    plain = _folders(make_trainer, tmp_path, "plain", None, ["validate"])
    ours = _folders(make_trainer, tmp_path, "ours", AsyncDCPCheckpointIO(), ["validate"])
    assert ours == plain == ["epoch=0-step=8.ckpt"]


def test_a_plugin_reused_by_a_second_trainer_saves_asynchronously_and_removes(make_trainer, tmp_path):
    """One plugin, two fits in turn: the second fit's saves stay asynchronous and save_top_k still removes."""
    plugin = AsyncDCPCheckpointIO()
    _folders(make_trainer, tmp_path, "first", plugin, ["fit"])
    assert _folders(make_trainer, tmp_path, "ours", plugin, ["fit"]) == ["epoch=0-step=8.ckpt"]
    assert plugin.last_handle is not None and plugin.last_handle.stats.mode == "async"


def test_remove_checkpoint_outside_a_run_removes_a_committed_directory(make_trainer, tmp_path):
    """remove_checkpoint() of a committed checkpoint after the run (no manager open) deletes it, as Lightning would."""
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(TinyModule())
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    trainer.strategy.remove_checkpoint(tmp_path / "manual.ckpt")
    assert not (tmp_path / "manual.ckpt").exists() and ckpt_threads(0) == []


def test_a_full_save_onto_a_save_last_link_replaces_the_link_as_lightning_does(make_trainer, tmp_path):
    """After a resume, save_last="link" saves last.ckpt in full: the link is replaced, its target is kept."""
    import os

    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(TinyModule())
    target = tmp_path / "epoch=0-step=4.ckpt"
    trainer.save_checkpoint(target)
    os.symlink(target.name, tmp_path / "last.ckpt")
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and is_committed(tmp_path / "last.ckpt")
    assert is_committed(target)
