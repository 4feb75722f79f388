"""The plugin among Lightning's other parts: trainer pickling, loggers that upload checkpoints,
trainer.save_checkpoint outside a run, a process leaving without teardown (issue 27, classes 6 and 7)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_helpers import TinyModule
from torch.utils.data import DataLoader, TensorDataset

import torch_ckpt.save._checkpointer as checkpointer
from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from torch_ckpt import ConfigError


def _slow_persist(monkeypatch, seconds: float = 0.5) -> None:
    persist = checkpointer.persist_checkpoint

    def slow(req, ctx):
        time.sleep(seconds)
        return persist(req, ctx)

    monkeypatch.setattr(checkpointer, "persist_checkpoint", slow)


def test_an_attached_trainer_pickles(make_trainer, tmp_path):
    """torch.save(trainer) / pickle.dumps(trainer) works after a fit with the plugin attached (no closures)."""
    trainer = make_trainer(max_steps=2, plugins=[AsyncDCPCheckpointIO()],
                           callbacks=[MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)])
    trainer.fit(TinyModule())
    clone = pickle.loads(pickle.dumps(trainer))
    assert isinstance(clone.strategy.checkpoint_io, AsyncDCPCheckpointIO) and clone.global_step == 2


def test_save_checkpoint_before_fit_returns_committed(make_trainer, tmp_path, monkeypatch):
    """trainer.save_checkpoint outside a run (the plugin never torn down) returns once the checkpoint is committed."""
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()])
    trainer.strategy.connect(TinyModule())
    _slow_persist(monkeypatch)
    trainer.save_checkpoint(tmp_path / "before.ckpt")
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "before.ckpt")


class UploadingLogger(CSVLogger):
    """A logger that uploads checkpoint files, as WandbLogger/MLflowLogger(log_model=True) do."""

    _log_model = True


def test_an_uploading_logger_is_refused_when_attached(make_trainer, tmp_path):
    """Attached, a logger with log_model raises ConfigError naming it before the first step."""
    module = TinyModule()
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO()], logger=UploadingLogger(tmp_path),
                           callbacks=[MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)])
    with pytest.raises(ConfigError, match="UploadingLogger with log_model"):
        trainer.fit(module)
    assert module.draws == []


def test_an_uploading_logger_is_warned_about_with_the_plugin_alone(make_trainer, tmp_path):
    """With the plugin alone, the first save warns that the log_model logger uploads nothing."""
    trainer = make_trainer(max_steps=1, plugins=[AsyncDCPCheckpointIO()], logger=UploadingLogger(tmp_path),
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "mc")])
    with pytest.warns(UserWarning, match="UploadingLogger with log_model uploads checkpoint files only"):
        trainer.fit(TinyModule())


_EXIT_WITHOUT_TEARDOWN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import torch_ckpt.save._checkpointer as checkpointer
    from lightning_helpers import lightning_dict
    from lightning_ckpt import AsyncDCPCheckpointIO

    persist = checkpointer.persist_checkpoint
    checkpointer.persist_checkpoint = lambda req, ctx: (time.sleep(0.5), persist(req, ctx))[1]
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(1), sys.argv[1] + "/epoch=1.ckpt")
    io.wait()
    io.save_checkpoint(lightning_dict(2), sys.argv[1] + "/epoch=2.ckpt")
    io.remove_checkpoint(sys.argv[1] + "/epoch=1.ckpt")  # save_top_k=1: waits for epoch=2's commit
    raise RuntimeError("crash in epoch 3")
""")


def test_a_process_leaving_without_teardown_commits_and_removes(tmp_path):
    """A worker that raises out of fit (ddp_spawn: no teardown there) commits the in-flight save and carries out
    the removal waiting for it: one checkpoint is left, as with the synchronous IO."""
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_TEARDOWN, str(tmp_path), here], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "crash in epoch 3" in done.stderr
    assert sorted(p for p in os.listdir(tmp_path) if not p.startswith(".")) == ["epoch=2.ckpt"]
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "epoch=2.ckpt")


def test_a_save_still_in_flight_after_the_exit_wait_leaves_its_removal_undone(tmp_path):
    """A process leaving while its save outlasts the core's bounded exit wait exits, keeping the older checkpoint."""
    script = _EXIT_WITHOUT_TEARDOWN.replace("time.sleep(0.5)", "time.sleep(3 if '2.ckpt' in str(req.final) else 0)")
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script.replace("AsyncDCPCheckpointIO()", "AsyncDCPCheckpointIO("
                           "timeout_seconds=1)"), str(tmp_path), here], env=env, capture_output=True, text=True,
                          timeout=120)
    assert "not carrying out ['remove" in done.stderr, done.stderr
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "epoch=1.ckpt")


@pytest.mark.slow
def test_save_checkpoint_in_the_main_process_after_ddp_spawn_returns_committed(tmp_path, monkeypatch):
    """After a ddp_spawn fit, trainer.save_checkpoint in the main process returns once committed."""
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        plugins=[AsyncDCPCheckpointIO()], enable_checkpointing=False)
    trainer.fit(TinyModule())
    _slow_persist(monkeypatch)
    trainer.save_checkpoint(tmp_path / "main.ckpt")
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "main.ckpt")


class SizedModule(L.LightningModule):
    """A module whose layer's shape comes from a hyper-parameter (LightningCLI must read it from the checkpoint)."""

    def __init__(self, out_dim: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, out_dim)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)

    predict_dataloader = train_dataloader


def test_lightning_cli_ckpt_path_reads_the_hyper_parameters_of_a_directory(make_trainer, tmp_path):
    """LightningCLI predict --ckpt_path DIR builds the model from the directory's hyper-parameters (out_dim=3)."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    trainer = make_trainer(max_steps=1, plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(SizedModule(out_dim=3))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    cli = LightningCLI(SizedModule, save_config_callback=None, args=[
        "predict", f"--ckpt_path={tmp_path / 'm.ckpt'}", "--trainer.logger=false", "--trainer.accelerator=cpu",
        "--trainer.devices=1", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.model.hparams.out_dim == 3 and cli.model.layer.out_features == 3
