"""Checkpoints at fsspec URLs (memory://, moto S3): committed locally, uploaded verified with the manifest last."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO
from torch_ckpt import ConfigError


def test_model_checkpoint_to_a_memory_url_keeps_the_top_k_committed(make_trainer):
    """ModelCheckpoint(dirpath='memory://...', save_top_k=1): one committed checkpoint there, loadable by the plugin."""
    root = f"memory://lt-{uuid.uuid4().hex[:8]}/ckpts"
    model, io = TinyModule(), AsyncDCPCheckpointIO()
    trainer = make_trainer(max_steps=3, plugins=[io], callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=1)])
    trainer.fit(model)
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root.removeprefix("memory://"), detail=False))
    assert names == ["epoch=0-step=3.ckpt"]
    assert fs.exists(f"{root.removeprefix('memory://')}/epoch=0-step=3.ckpt/manifest.json")
    loaded = AsyncDCPCheckpointIO().load_checkpoint(f"{root}/epoch=0-step=3.ckpt")
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["layer.weight"], model.layer.weight)


def test_save_checkpoint_to_s3_honours_storage_options(make_trainer, s3):
    """trainer.save_checkpoint('s3://...', storage_options=...) after fit returns with the checkpoint committed."""
    url = f"s3://{s3.new_bucket()}/run/m.ckpt"
    model, io = TinyModule(), AsyncDCPCheckpointIO()
    trainer = make_trainer(max_steps=2, plugins=[io])
    trainer.fit(model)
    trainer.save_checkpoint(url, storage_options=s3.options)
    fs = fsspec.filesystem("s3", **s3.options)
    assert fs.exists(f"{url.removeprefix('s3://')}/manifest.json")
    loaded = io.load_checkpoint(url)
    assert torch.equal(loaded["state_dict"]["layer.weight"], model.layer.weight)


def test_storage_options_must_be_a_dict_for_a_url_and_are_refused_for_local_paths(tmp_path):
    """storage_options for a URL is a dict of fsspec options (ConfigError otherwise); for a local path TypeError."""
    from lightning_helpers import lightning_dict

    io = AsyncDCPCheckpointIO()
    with pytest.raises(TypeError, match="fsspec URLs only"):
        io.save_checkpoint(lightning_dict(1), tmp_path / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(ConfigError, match="storage_options"):
        io.save_checkpoint(lightning_dict(1), f"memory://lt-{uuid.uuid4().hex[:8]}/a.ckpt", storage_options="opts")
    assert io.last_handle is None
    io.teardown()


def test_a_failed_upload_raises_and_keeps_the_older_checkpoint(s3):
    """An upload that fails (no such bucket) raises CheckpointWriteError at wait(); the removal waiting for it is
    dropped, so the older checkpoint stays."""
    from lightning_helpers import lightning_dict

    from torch_ckpt import CheckpointWriteError

    good = f"s3://{s3.new_bucket()}/run/a.ckpt"
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(1), good, storage_options=s3.options)
    io.wait()
    io.save_checkpoint(lightning_dict(2), "s3://no-such-bucket-lt/run/b.ckpt", storage_options=s3.options)
    io.remove_checkpoint(good)
    with pytest.raises(CheckpointWriteError, match="no-such-bucket-lt/run/b.ckpt"):
        io.wait()
    assert io.load_checkpoint(good)["global_step"] == 1
    io.teardown()
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(io._remote.local_path("s3://no-such-bucket-lt/run/b.ckpt"))


def _ddp_to_s3_body(rank: int, world: int, root: str, url: str, options: dict) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    class SaveAtEnd(Callback):
        def on_train_end(self, trainer, pl_module):
            trainer.save_checkpoint(url, storage_options=options)  # every rank; rank 0 uploads once committed

    io = AsyncDCPCheckpointIO()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_steps=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, plugins=[io],
                        callbacks=[SaveAtEnd()])
    io.attach(trainer)
    trainer.fit(TinyModule())  # teardown waits for the commit and the upload
    if rank == 0:
        fs = fsspec.filesystem("s3", **options)
        manifest = fs.cat_file(f"{url.removeprefix('s3://')}/manifest.json")
        assert b'"world_size":2' in manifest.replace(b" ", b"")


@pytest.mark.slow
def test_two_ranks_save_one_checkpoint_to_s3(tmp_path, s3):
    """Attached on 2 DDP ranks, trainer.save_checkpoint(s3 URL) commits one checkpoint written by both ranks."""
    from tests._dist import run_distributed

    run_distributed(_ddp_to_s3_body, 2, str(tmp_path), f"s3://{s3.new_bucket()}/run/ddp.ckpt", s3.options,
                    timeout_s=240)


def test_load_from_checkpoint_reads_a_url(make_trainer):
    """Model.load_from_checkpoint(url) (Lightning's pl_load) reads a torch-ckpt checkpoint at an fsspec URL."""
    url = f"memory://lt-{uuid.uuid4().hex[:8]}/m.ckpt"
    model = TinyModule(lr=0.25)
    trainer = make_trainer(max_steps=1, plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(model)
    trainer.save_checkpoint(url)
    loaded = TinyModule.load_from_checkpoint(url)
    assert loaded.hparams.lr == 0.25 and torch.equal(loaded.layer.weight, model.layer.weight)
