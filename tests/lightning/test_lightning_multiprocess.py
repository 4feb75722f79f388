"""Two CPU processes: the plugin with ModelCheckpoint on DDP, FSDP2 and ddp_spawn (issue 17 items 1 and 8)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from tests._dist import run_distributed


def _save_last_body(rank: int, world: int, root: str, strategy: str, mtbf: bool) -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    io = AsyncDCPCheckpointIO()
    mc = ModelCheckpoint(dirpath=Path(root) / "mc", every_n_train_steps=1, save_last=True)
    callbacks = [mc] + ([MTBFCheckpoint(Path(root) / "mtbf", mtbf_seconds=None, save_every_n_steps=2)] if mtbf else [])
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, plugins=[io], callbacks=callbacks,
                        strategy=DDPStrategy() if strategy == "ddp" else ModelParallelStrategy(
                            data_parallel_size=2, tensor_parallel_size=1))
    if not mtbf:
        io.attach(trainer)
    from test_lightning_attach import ShardedModule

    trainer.fit(TinyModule() if strategy == "ddp" else ShardedModule())
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(Path(root) / "mc" / "last.ckpt")
    assert trainer.global_step == 6


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("mtbf", [False, True], ids=["attach", "with-mtbf"])
def test_overwriting_last_ckpt_on_two_ranks_never_crashes(tmp_path, strategy, mtbf):
    """ModelCheckpoint(save_last=True) rewrites last.ckpt every step on 2 ranks: fit completes, last.ckpt committed."""
    run_distributed(_save_last_body, 2, str(tmp_path), strategy, mtbf, timeout_s=240)


@pytest.mark.slow
def test_attach_before_fit_works_with_ddp_spawn(tmp_path):
    """plugin.attach(trainer) before fit with ddp_spawn: the trainer pickles, both ranks save, checkpoints commit."""
    io = AsyncDCPCheckpointIO()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        plugins=[io], callbacks=[ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=1,
                                                                 save_top_k=-1)])
    io.attach(trainer)
    trainer.fit(TinyModule())
    saved = sorted(p for p in os.listdir(tmp_path / "mc") if not p.startswith("."))
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    manifest = (tmp_path / "mc" / "epoch=0-step=3.ckpt" / "manifest.json").read_text()
    assert json.loads(manifest)["world_size"] == 2
