"""AsyncDCPCheckpointIO.attach: links and logger calls wait for commits; the sharded-strategy mechanism."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from tests._dist import run_distributed
from torch_ckpt import ConfigError


class ReleaseEachStep(Callback):
    """Lets one held write through at the start of every step, and all of them when training ends."""

    def __init__(self, gate, observe=None) -> None:
        self.gate, self.observe, self.seen = gate, observe, []

    def on_train_batch_start(self, trainer, *_):
        if self.observe is not None:
            self.seen.append(self.observe())
        self.gate.release()

    def on_train_end(self, trainer, *_):
        self.gate.open()


@pytest.mark.parametrize("attached", [True, False], ids=["attached", "plugin-alone"])
def test_save_last_link_only_ever_points_at_a_committed_checkpoint(make_trainer, tmp_path, write_gate, monkeypatch,
                                                                  attached):
    """With writes held, last.ckpt is absent or resolves to a committed checkpoint at every step, write and commit."""
    import torch_ckpt.save._checkpointer as checkpointer

    last = tmp_path / "mc" / "last.ckpt"

    def state():
        return None if not os.path.lexists(last) else (last / "manifest.json").is_file()

    seen_by_writer = []
    gated = checkpointer.persist_checkpoint

    def probing_persist(req, ctx):
        seen_by_writer.append(state())
        return gated(req, ctx)

    monkeypatch.setattr(checkpointer, "persist_checkpoint", probing_persist)
    io = AsyncDCPCheckpointIO()
    seen_at_commit: list = []

    def observe():  # every step; from the first save on, also at every commit (writer thread)
        if io.last_handle is not None and not seen_at_commit:
            seen_at_commit.append("registered")
            io.manager().add_commit_callback(lambda step, directory: seen_at_commit.append(state()))
        return state()

    release = ReleaseEachStep(write_gate, observe)
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=1, save_top_k=-1, save_last="link")
    trainer = make_trainer(plugins=[io], callbacks=[release, mc])
    if attached:
        io.attach(trainer)
    write_gate.hold()
    trainer.fit(TinyModule())
    assert release.seen == [None, None, True, True]
    assert seen_by_writer == [None, True, True, True]
    assert seen_at_commit[0] == "registered" and False not in seen_at_commit and seen_at_commit[-3:] == [True] * 3
    assert os.readlink(last) == "epoch=0-step=4.ckpt" and (last / "manifest.json").is_file()


class RecordingLogger(Logger):
    """Records, for every after_save_checkpoint call, whether the checkpoint it names is committed."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[bool] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def after_save_checkpoint(self, checkpoint_callback):
        self.committed.append(AsyncDCPCheckpointIO.is_checkpoint_dir(checkpoint_callback._last_checkpoint_saved))


def test_loggers_are_told_about_a_checkpoint_only_once_it_is_committed(make_trainer, tmp_path, write_gate):
    """after_save_checkpoint (checkpoint uploads) runs only when the checkpoint it refers to is committed."""
    io = AsyncDCPCheckpointIO()
    logger = RecordingLogger()
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(plugins=[io], callbacks=[ReleaseEachStep(write_gate), mc], logger=logger)
    io.attach(trainer)
    write_gate.hold()
    trainer.fit(TinyModule())
    assert logger.committed == [True, True, True, True]


def test_attach_requires_the_trainers_checkpoint_io(make_trainer):
    """Attaching a plugin that is not the trainer's checkpoint IO raises ConfigError."""
    with pytest.raises(ConfigError, match="plugins"):
        AsyncDCPCheckpointIO().attach(make_trainer())


def test_a_sharded_strategy_gathering_a_full_state_dict_is_refused(make_trainer):
    """ModelParallelStrategy(save_distributed_checkpoint=False) raises ConfigError: saves are sharded."""
    io = AsyncDCPCheckpointIO()
    trainer = make_trainer(devices=2, strategy=ModelParallelStrategy(save_distributed_checkpoint=False), plugins=[io])
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=True"):
        io.attach(trainer)


class ShardedModule(L.LightningModule):
    """Two linear layers sharded with FSDP2 over the data-parallel mesh, AdamW, fixed data."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        x = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
        return StatefulDataLoader(torch.utils.data.TensorDataset(x), batch_size=2)


def _fit_sharded(root: Path, name: str, max_steps: int, ckpt_path: str | None = None) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)  # FSDP2 over both ranks
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        plugins=[AsyncDCPCheckpointIO()],
                        callbacks=[MTBFCheckpoint(root / name, mtbf_seconds=None, save_every_n_steps=3,
                                                  keep_last=None)])
    model = ShardedModule()
    trainer.fit(model, ckpt_path=ckpt_path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()}


def _model_parallel_body(rank: int, world: int, root: str) -> None:
    root = Path(root)
    uninterrupted = _fit_sharded(root, "a", 8)
    manifest = (root / "a" / "step_000000006" / "manifest.json").read_text()
    assert "__0_0.distcp" in manifest and "__1_0.distcp" in manifest  # every rank wrote its shards
    resumed = _fit_sharded(root, "b", 8, ckpt_path=str(root / "a" / "step_000000006"))
    assert uninterrupted.keys() == resumed.keys()
    for key in uninterrupted:
        assert torch.equal(uninterrupted[key], resumed[key]), key


def _interrupted_hpc_body(rank: int, world: int, root: str) -> None:
    import warnings

    root = Path(root)
    uninterrupted = _fit_sharded(root, "a", 8)
    if rank == 0:  # SLURM's layout: hpc_ckpt_1 committed (step 6), hpc_ckpt_2 a save a kill interrupted
        shutil.copytree(root / "a" / "step_000000006", root / "hpc" / "hpc_ckpt_1.ckpt")
        (root / "hpc" / "hpc_ckpt_2.ckpt" / ".torch-ckpt.partial.0123456789abcdef").mkdir(parents=True)
        (root / "hpc" / "ready").touch()
    while not (root / "hpc" / "ready").exists():
        time.sleep(0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit_sharded(root, "b", 8, ckpt_path=str(root / "hpc" / "hpc_ckpt_2.ckpt"))
    if rank == 0:
        assert any("never committed" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for key in uninterrupted:
        assert torch.equal(uninterrupted[key], resumed[key]), key


@pytest.mark.slow
def test_a_sharded_resume_from_an_interrupted_hpc_checkpoint_uses_the_older_one(tmp_path):
    """FSDP2 on 2 CPU ranks: resuming from an hpc_ckpt_N that never committed loads hpc_ckpt_(N-1), bitwise."""
    run_distributed(_interrupted_hpc_body, 2, str(tmp_path), timeout_s=150)


@pytest.mark.slow
def test_model_parallel_resume_continues_bitwise(tmp_path):
    """FSDP2 (ModelParallelStrategy) on 2 CPU ranks: sharded saves, resumed training matches uninterrupted."""
    run_distributed(_model_parallel_body, 2, str(tmp_path), timeout_s=150)


@pytest.mark.cuda
def test_fsdp_sharded_resume_continues_bitwise(tmp_path):
    """FSDPStrategy(state_dict_type='sharded') on one GPU: resumed training matches uninterrupted."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def fit(name: str, ckpt_path: str | None = None) -> dict:
        trainer = L.Trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy(state_dict_type="sharded"),
                            max_steps=8, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, plugins=[AsyncDCPCheckpointIO()],
                            callbacks=[MTBFCheckpoint(tmp_path / name, mtbf_seconds=None, save_every_n_steps=3)])
        model = TinyModule()
        trainer.fit(model, ckpt_path=ckpt_path)
        full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in full.items()}

    uninterrupted = fit("a")
    resumed = fit("b", ckpt_path=str(tmp_path / "a" / "step_000000006"))
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


@pytest.mark.parametrize("attached", [True, False], ids=["attached", "plugin-alone"])
def test_the_link_is_re_pointed_before_the_old_checkpoint_is_deleted(make_trainer, tmp_path, monkeypatch, attached):
    """save_top_k=1 with save_last="link": at every deletion, last.ckpt already names a committed checkpoint."""
    from torch_ckpt import CheckpointManager

    last = tmp_path / "mc" / "last.ckpt"
    seen = []
    real_remove = CheckpointManager.remove

    def remove(self, target):
        seen.append(AsyncDCPCheckpointIO.is_checkpoint_dir(last) and last.resolve() != Path(target).resolve())
        return real_remove(self, target)

    monkeypatch.setattr(CheckpointManager, "remove", remove)
    io = AsyncDCPCheckpointIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=1, save_top_k=1, save_last="link")
    trainer = make_trainer(plugins=[io], callbacks=[mc])
    if attached:
        io.attach(trainer)
    trainer.fit(TinyModule())
    assert len(seen) == 3 and all(seen)
    assert os.readlink(last) == "epoch=0-step=4.ckpt"


def test_links_of_a_trainer_without_the_plugin_are_lightnings(make_trainer, tmp_path):
    """The link hook leaves other checkpoint IOs alone: Lightning links its .ckpt file at once."""
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=1, save_top_k=1, save_last="link")
    make_trainer(max_steps=2, callbacks=[mc]).fit(TinyModule())
    assert os.readlink(tmp_path / "mc" / "last.ckpt") == "epoch=0-step=2.ckpt"
    assert (tmp_path / "mc" / "last.ckpt").is_file()
