"""Helpers of the Lightning adapter tests: a small LightningModule and a gate around background writes."""

from __future__ import annotations

import threading

import lightning as L
import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class TinyModule(L.LightningModule):
    """A linear layer with dropout on a fixed dataset; records one random draw per step.

    Args:
        lr: SGD learning rate.
        sigterm_at_step: send SIGTERM to this process during the step that brings the global step here.
    """

    def __init__(self, lr: float = 0.1, sigterm_at_step: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 2)
        self.drop = torch.nn.Dropout(0.5)
        self.draws: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.hparams.sigterm_at_step == self.trainer.global_step + 1:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        self.draws.append(float(torch.rand(())))
        return self.drop(self.layer(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return StatefulDataLoader(TensorDataset(x), batch_size=4)


class WriteGate:
    """Holds the core's background writes (after staging) until released; can make them fail."""

    def __init__(self) -> None:
        self.held = False
        self.fail_with: BaseException | None = None
        self._permits = threading.Semaphore(0)

    def hold(self) -> None:
        """Block every following write until :meth:`release`."""
        self.held = True

    def release(self, n: int = 1) -> None:
        """Let ``n`` held writes proceed."""
        for _ in range(n):
            self._permits.release()

    def open(self) -> None:
        """Stop holding and let every waiting write proceed."""
        self.held = False
        self.release(100)

    def wrap(self, persist):
        def gated(req, ctx):
            if self.held and not self._permits.acquire(timeout=20):
                raise TimeoutError("WriteGate: a write was held for 20 s")
            if self.fail_with is not None:
                raise self.fail_with
            return persist(req, ctx)

        return gated


def lightning_dict(step: int = 1, **extra) -> dict:
    """A checkpoint shaped like Lightning's ``dump_checkpoint`` output."""
    ckpt = {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"layer.weight": torch.full((2, 3), float(step)), "layer.bias": torch.zeros(2)},
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}, "state_dict": {}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5), "dirpath": "x"}},
        "optimizer_states": [{"state": {0: {"momentum_buffer": torch.ones(2, 3)}},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]}],
        "lr_schedulers": [{"step_size": 2, "last_epoch": step}],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.1},
    }
    ckpt.update(extra)
    return ckpt
