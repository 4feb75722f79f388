"""Chained resumes with MTBFCheckpoint are bitwise equal to the uninterrupted run (issue 17 items 3 and 4).

A small model with dropout trains 24 optimizer steps over 10-batch epochs with validation every 5
batches. Its train loader is a ``StatefulDataLoader`` built the ordinary way (``shuffle=True``, no
``generator=``, so every iterator draws a seed from the global RNG) or with explicit generators; its
validation loader is a plain ``DataLoader`` without a generator. Each run is stopped at one point and
resumed with ``ckpt_path``; every loss after the resume must equal the uninterrupted run's.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from tests._dist import run_distributed

TOTAL = 24  # optimizer steps of the uninterrupted run; 10 batches per epoch, validation every 5 batches


class DropoutModule(L.LightningModule):
    """Linear + dropout; records every step's loss; loaders ordinary or with explicit generators."""

    def __init__(self, generators: bool = False, dropout: float = 0.5, sigterm_at: int | None = None) -> None:
        super().__init__()
        self.generators, self.sigterm_at = generators, sigterm_at
        self.layer = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(dropout)
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        if self.sigterm_at == self.trainer.global_step + 1:
            os.kill(os.getpid(), signal.SIGTERM)
        loss = self.drop(self.layer(batch[0])).pow(2).mean()
        self.losses[self.trainer.global_step + 1] = loss.item()
        return loss

    def validation_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(40, 4, generator=torch.Generator().manual_seed(0)))
        if self.trainer.world_size > 1:  # Lightning's injected DistributedSampler does not resume mid-epoch
            sampler = StatefulDistributedSampler(data, num_replicas=self.trainer.world_size,
                                                 rank=self.trainer.global_rank, shuffle=True, seed=0)
            extra = {"generator": torch.Generator().manual_seed(2)} if self.generators else {}
            return StatefulDataLoader(data, batch_size=4, sampler=sampler, **extra)
        if self.generators:
            return StatefulDataLoader(data, batch_size=4, generator=torch.Generator().manual_seed(2),
                                      sampler=RandomSampler(data, generator=torch.Generator().manual_seed(1)))
        return StatefulDataLoader(data, batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(3))), batch_size=4)


class ShardedDropoutModule(DropoutModule):
    """The same module, its layer sharded with FSDP2 over the data-parallel mesh."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])


def fit(root: Path, max_steps: int, *, ckpt_path: str | None = None, every: int | None = None,
        generators: bool = False, accumulate: int = 1, sigterm_at: int | None = None,
        module_cls: type[DropoutModule] | None = None, **trainer_kwargs) -> dict[int, float]:
    """One fit from a fixed seed (a resumed one from another seed); returns ``{step: loss}``."""
    torch.manual_seed(999 if ckpt_path else 7)
    from lightning.pytorch.strategies import ModelParallelStrategy

    sharded = isinstance(trainer_kwargs.get("strategy"), ModelParallelStrategy)
    module = (module_cls or (ShardedDropoutModule if sharded else DropoutModule))(generators, sigterm_at=sigterm_at)
    callback = MTBFCheckpoint(root, mtbf_seconds=None, save_every_n_steps=every, keep_last=None, log_stats=False,
                              prog_bar=False)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=root, val_check_interval=5, accumulate_grad_batches=accumulate)
    options.update(trainer_kwargs)
    callbacks = [*options.pop("callbacks", []), callback]
    trainer = L.Trainer(max_steps=max_steps, plugins=[AsyncDCPCheckpointIO()], callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return module.losses


@pytest.fixture(scope="module", params=[False, True], ids=["ordinary-loaders", "explicit-generators"])
def uninterrupted(request, tmp_path_factory):
    """The uninterrupted run, saving every step (its checkpoints are the crash points)."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("full")
    return request.param, root, fit(root, TOTAL, every=1, generators=request.param)


STOPS = {"mid-epoch": 3, "after-validation": 5, "epoch-end": 10, "second-epoch-end": 20}


@pytest.mark.parametrize("stop", list(STOPS))
def test_resume_from_a_periodic_checkpoint_is_bitwise(uninterrupted, tmp_path, stop):
    """A crash after the checkpoint of a step, then a resume from it, continues the uninterrupted losses."""
    generators, root, full = uninterrupted
    step = STOPS[stop]
    resumed = fit(tmp_path, TOTAL, ckpt_path=str(root / f"step_{step:09d}"), generators=generators)
    assert resumed == {s: full[s] for s in range(step + 1, TOTAL + 1)}


@pytest.mark.parametrize("stop", [3, 10, 13, 20], ids=["mid-epoch", "epoch-end", "after-epoch", "second-epoch-end"])
def test_resume_from_the_train_end_checkpoint_is_bitwise(uninterrupted, tmp_path, stop):
    """A run stopped by max_steps, resumed with ckpt_path="last" and a larger max_steps, continues exactly."""
    generators, _root, full = uninterrupted
    before = fit(tmp_path, stop, generators=generators)
    after = fit(tmp_path, TOTAL, ckpt_path="last", generators=generators)
    assert before == {s: full[s] for s in range(1, stop + 1)}
    assert after == {s: full[s] for s in range(stop + 1, TOTAL + 1)}


def test_resume_after_sigterm_at_an_epoch_end_is_bitwise(uninterrupted, tmp_path):
    """SIGTERM during the last batch of an epoch saves that step; resuming from it continues exactly."""
    generators, _root, full = uninterrupted
    with pytest.raises(SIGTERMException):
        fit(tmp_path, TOTAL, generators=generators, sigterm_at=10)
    after = fit(tmp_path, TOTAL, ckpt_path="last", generators=generators)
    assert after == {s: full[s] for s in range(11, TOTAL + 1)}


@pytest.mark.parametrize("stop", [2, 5], ids=["mid-epoch", "epoch-end"])
def test_resume_with_gradient_accumulation_is_bitwise(tmp_path, stop):
    """With accumulate_grad_batches=2 (5 optimizer steps per epoch), resumes continue the losses exactly."""
    full = fit(tmp_path / "full", 12, every=1, accumulate=2)
    resumed = fit(tmp_path / "resumed", 12, ckpt_path=str(tmp_path / "full" / f"step_{stop:09d}"), accumulate=2)
    assert resumed == {s: full[s] for s in range(stop + 1, 13)}


@pytest.mark.parametrize("generators", [False, True], ids=["ordinary-loaders", "explicit-generators"])
def test_resume_after_max_epochs_continues_the_next_epoch_bitwise(tmp_path, generators):
    """Ended by max_epochs=1, resumed with max_epochs=3: the next two epochs continue the uninterrupted losses."""
    full = fit(tmp_path / "full", -1, max_epochs=3, generators=generators)
    fit(tmp_path / "run", -1, max_epochs=1, generators=generators)
    after = fit(tmp_path / "run", -1, ckpt_path="last", max_epochs=3, generators=generators)
    assert after == {s: full[s] for s in range(11, 31)}


class StopAfterFirstEpoch(L.Callback):
    """Sets should_stop at the end of the first epoch, as EarlyStopping would."""

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


class StopsItselfAfterFirstEpoch(DropoutModule):
    """The module sets should_stop in its own ``on_train_epoch_end`` of the first epoch."""

    def on_train_epoch_end(self):
        if self.current_epoch == 0:
            self.trainer.should_stop = True


class LogsWorseningValidation(DropoutModule):
    """Logs ``val`` 0 until step 10, then 1: ``EarlyStopping(patience=0)`` stops at the first epoch end."""

    def validation_step(self, batch, batch_idx):
        self.log("val", float(self.trainer.global_step >= 10))
        return super().validation_step(batch, batch_idx)


class EpochScheduler(DropoutModule):
    """Halves the learning rate at every epoch end (a scheduler stepped after the epoch's last batch)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "epoch"}]


def early_stopping():
    """Stops at the first validation whose ``val`` does not improve (that of the first epoch end)."""
    from lightning.pytorch.callbacks import EarlyStopping

    return EarlyStopping(monitor="val", mode="min", patience=0)


SHOULD_STOP = {  # fresh callbacks per run (EarlyStopping keeps its best score)
    "callback": lambda: dict(callbacks=[StopAfterFirstEpoch()]),
    "module": lambda: dict(module_cls=StopsItselfAfterFirstEpoch),
    "early-stopping": lambda: dict(module_cls=LogsWorseningValidation, callbacks=[early_stopping()]),
    "epoch-scheduler": lambda: dict(module_cls=EpochScheduler, callbacks=[StopAfterFirstEpoch()]),
    "periodic-save-at-the-stop": lambda: dict(every=10, callbacks=[StopAfterFirstEpoch()]),
}


@pytest.mark.parametrize("generators", [False, True], ids=["ordinary-loaders", "explicit-generators"])
@pytest.mark.parametrize("how", list(SHOULD_STOP))
def test_resume_after_should_stop_at_an_epoch_end_is_bitwise(tmp_path, how, generators):
    """Stopped by should_stop after epoch 1 of 3, resumed with ckpt_path="last": the next epochs continue exactly."""
    module_cls = EpochScheduler if how == "epoch-scheduler" else None
    full = fit(tmp_path / "full", -1, max_epochs=3, generators=generators, module_cls=module_cls)
    before = fit(tmp_path / "stopped", -1, max_epochs=3, generators=generators, **SHOULD_STOP[how]())
    after = fit(tmp_path / "stopped", -1, ckpt_path="last", max_epochs=3, generators=generators, module_cls=module_cls)
    assert before == {s: full[s] for s in range(1, 11)}
    assert after == {s: full[s] for s in range(11, 31)}


def test_should_stop_at_an_epoch_end_with_gradient_accumulation_resumes_bitwise(tmp_path):
    """With accumulate_grad_batches=3 (4 optimizer steps per 10-batch epoch), a should_stop resume is exact."""
    full = fit(tmp_path / "full", -1, max_epochs=3, accumulate=3)
    fit(tmp_path / "stopped", -1, max_epochs=3, accumulate=3, callbacks=[StopAfterFirstEpoch()])
    after = fit(tmp_path / "stopped", -1, ckpt_path="last", max_epochs=3, accumulate=3)
    assert after == {s: full[s] for s in range(5, 13)}


def test_should_stop_at_an_epoch_end_with_max_steps_resumes_bitwise(tmp_path):
    """Stopped by should_stop after epoch 1 with max_steps set, resumed: the losses continue exactly."""
    full = fit(tmp_path / "full", TOTAL)
    fit(tmp_path / "stopped", TOTAL, callbacks=[StopAfterFirstEpoch()])
    after = fit(tmp_path / "stopped", TOTAL, ckpt_path="last")
    assert after == {s: full[s] for s in range(11, TOTAL + 1)}


def _ddp_body(rank: int, world: int, root: str, strategy: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    root = Path(root)

    def make():
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if strategy == "fsdp2" \
            else DDPStrategy()

    common = dict(devices=2, num_nodes=1)
    full = fit(root / "full", TOTAL, every=1, strategy=make(), **common)
    for step in (3, 5, 7, 10):  # 2 ranks: 5 batches per epoch, so 5 and 10 are epoch ends
        resumed = fit(root / f"p{step}", TOTAL, ckpt_path=str(root / "full" / f"step_{step:09d}"), strategy=make(),
                      **common)
        assert resumed == {s: full[s] for s in range(step + 1, TOTAL + 1)}, (strategy, "periodic", step)
    for stop in (10, 13):  # the train-end checkpoint at an epoch end and inside one
        fit(root / f"end{stop}", stop, strategy=make(), **common)
        after = fit(root / f"end{stop}", TOTAL, ckpt_path="last", strategy=make(), **common)
        assert after == {s: full[s] for s in range(stop + 1, TOTAL + 1)}, (strategy, "train end", stop)


class ShuffledRankShard(DropoutModule):
    """Each rank shuffles its own half of the data in its loader (no distributed sampler, no epoch seed)."""

    def train_dataloader(self):
        data = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
        shard = TensorDataset(data[self.trainer.global_rank::self.trainer.world_size])
        return StatefulDataLoader(shard, batch_size=4, shuffle=True)


def _should_stop_body(rank: int, world: int, root: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    root = Path(root)
    common = dict(devices=2, num_nodes=1, use_distributed_sampler=False, module_cls=ShuffledRankShard)
    full = fit(root / "full", -1, max_epochs=3, strategy=DDPStrategy(), **common)
    before = fit(root / "stopped", -1, max_epochs=3, strategy=DDPStrategy(), callbacks=[StopAfterFirstEpoch()],
                 **common)
    after = fit(root / "stopped", -1, ckpt_path="last", max_epochs=3, strategy=DDPStrategy(), **common)
    assert before == {s: full[s] for s in range(1, 6)}, rank  # 2 ranks: 5 batches per epoch
    assert after == {s: full[s] for s in range(6, 16)}, rank


@pytest.mark.slow
def test_two_rank_resume_after_should_stop_at_an_epoch_end_is_bitwise(tmp_path):
    """DDP on 2 CPU processes, each rank shuffling its shard: a should_stop resume continues exactly."""
    run_distributed(_should_stop_body, 2, str(tmp_path), timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_rank_resumes_are_bitwise(tmp_path, strategy):
    """DDP and FSDP2 on 2 CPU processes: periodic (mid-epoch, epoch end) and train-end resumes are bitwise."""
    run_distributed(_ddp_body, 2, str(tmp_path), strategy, timeout_s=400)
