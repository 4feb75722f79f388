"""What the plugin puts into users' folders, and when (issue 27: Lightning 5, 8, 9).

A save reserves its name when it starts, writes inside it and leaves nothing else in the folder: no
lock files, no temporaries beside the checkpoint (their names would be parsed by Lightning's own scans).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest.mock import Mock

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import TinyModule, lightning_dict

from lightning_ckpt import AsyncDCPCheckpointIO
from torch_ckpt import is_committed


@pytest.fixture
def held_writes(write_gate, monkeypatch):
    """Background writes wait until the plugin itself waits for them (the next save, a load, teardown).

    So every name and listing Lightning inspects between two saves is seen while the previous save is
    still in flight, as on a slow disk. Returns the list of ``io.saving`` values seen by ``probe()``.
    """
    original = AsyncDCPCheckpointIO.wait

    def wait(self):
        if self.saving:
            write_gate.release()
        original(self)

    monkeypatch.setattr(AsyncDCPCheckpointIO, "wait", wait)
    write_gate.hold()
    return write_gate


def test_versioned_names_see_the_in_flight_save_as_existing(make_trainer, tmp_path, held_writes):
    """A fixed filename gets -v9, -v10... while the previous save of that name is still in flight (rerun)."""
    dirpath = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = make_trainer(max_epochs=2, max_steps=-1, limit_train_batches=1, limit_val_batches=0, callbacks=[mc],
                           plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(TinyModule())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(TinyModule())
    expected = {"test.ckpt", "test-v9.ckpt", "test-v10.ckpt", "test-v11.ckpt"}
    assert {Path(f).name for f in mc.best_k_models} == expected
    assert set(os.listdir(dirpath)) == expected and all(is_committed(dirpath / n) for n in expected)


def test_listing_during_a_save_shows_only_the_checkpoint_name(make_trainer, tmp_path, held_writes):
    """At each epoch start (the last save in flight) the folder lists exactly ["model.ckpt"]: no lock, no temporary."""
    seen: list[tuple[list[str], bool]] = []

    class ListDir(TinyModule):
        def on_train_epoch_start(self):
            if self.current_epoch > 0:
                seen.append((os.listdir(tmp_path / "ckpts"), self.trainer.strategy.checkpoint_io.saving))

    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor=None, save_top_k=1, filename="model")
    trainer = make_trainer(max_epochs=3, max_steps=-1, limit_train_batches=1, limit_val_batches=0, callbacks=[mc],
                           plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(ListDir())
    assert seen == [(["model.ckpt"], True), (["model.ckpt"], True)]
    assert os.listdir(tmp_path / "ckpts") == ["model.ckpt"] and is_committed(tmp_path / "ckpts" / "model.ckpt")


def test_checkpoint_saved_outside_fit_loads_at_once(tmp_path, held_writes):
    """save_checkpoint() returns with the save in flight; an immediate load waits for it instead of failing."""
    io = AsyncDCPCheckpointIO()
    path = tmp_path / "manual.ckpt"
    io.save_checkpoint(lightning_dict(step=3), path)
    assert io.saving and path.is_dir() and not is_committed(path)  # the name is taken, the save not committed
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 3 and is_committed(path)
    io.teardown()


def test_folders_hold_only_checkpoints_after_fit_and_a_manual_save(make_trainer, tmp_path):
    """ModelCheckpoint's folder, default_root_dir and a manual save's folder hold nothing but checkpoint names."""
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, every_n_train_steps=2)
    trainer = make_trainer(callbacks=[mc], plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(TinyModule())
    trainer.save_checkpoint(tmp_path / "manual" / "final.ckpt")
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["ckpts", "manual"]
    assert os.listdir(tmp_path / "manual") == ["final.ckpt"]


_KILLED_MID_SAVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import lightning as L
    import torch_ckpt.save._persist as persist
    from lightning_ckpt import AsyncDCPCheckpointIO
    from lightning_helpers import TinyModule

    root = Path(sys.argv[1])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, max_steps=1,
                        plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(TinyModule())
    trainer.save_checkpoint(root / "hpc_ckpt_1.ckpt")  # after fit: committed when it returns

    def hang(*args, **kwargs):
        print("writing", flush=True)
        time.sleep(600)

    persist.commit_dir = hang  # hpc_ckpt_2 is fully written, the kill lands right before its commit
    trainer.save_checkpoint(root / "hpc_ckpt_2.ckpt")
""")


@pytest.mark.timeout(120)
def test_slurm_requeue_after_a_kill_mid_save_resumes_from_the_intact_hpc_checkpoint(make_trainer, tmp_path):
    """SIGKILL while hpc_ckpt_2 is saved: no temporary confuses Lightning's scan, and ckpt_path='hpc' resumes from 1."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert sorted(os.listdir(tmp_path)) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]  # nothing else: no temporary
    assert is_committed(tmp_path / "hpc_ckpt_1.ckpt") and not is_committed(tmp_path / "hpc_ckpt_2.ckpt")
    trainer = make_trainer(max_steps=1, enable_checkpointing=False, plugins=[AsyncDCPCheckpointIO()])
    connector = trainer._checkpoint_connector
    assert connector._CheckpointConnector__max_ckpt_version_in_folder(tmp_path, "hpc_ckpt_") == 2
    with pytest.warns(UserWarning, match="never committed"):
        trainer.fit(TinyModule(), ckpt_path="hpc")
    assert trainer.global_step == 1  # resumed at step 1: max_steps=1 leaves nothing to train


def test_link_hook_keeps_lightnings_behaviour_for_a_trainer_without_our_io(tmp_path):
    """ModelCheckpoint._link_checkpoint links at once for a trainer whose IO is not ours (a Mock included)."""
    AsyncDCPCheckpointIO()  # the hook is installed by then
    target = tmp_path / "file"
    target.touch()
    link = tmp_path / "link"
    ModelCheckpoint._link_checkpoint(Mock(), filepath=str(target), linkpath=str(link))
    assert os.path.islink(link) and os.path.realpath(link) == str(target)
