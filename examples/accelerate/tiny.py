"""The tiny model, data and one training step shared by the three ported Accelerate examples.

Each example is an everyday Accelerate checkpointing loop; ``--attach`` adds the one line
``accelerate_ckpt.attach(accelerator)`` and changes nothing else. Every step appends
``{"step", "loss", "lr", "batch"}`` to ``--log`` (JSON lines) so runs can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

BATCHES_PER_EPOCH = 5


def arguments(**extra: type) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--attach", action="store_true", help="route save_state/load_state through accelerate_ckpt")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after that step")
    p.add_argument("--log", required=True)
    for name, kind in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    return p.parse_args()


class Progress:
    """The training step, saved with ``register_for_checkpointing`` (Accelerate's recipe for custom state)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def setup(args: argparse.Namespace, project: ProjectConfiguration | None = None):
    """Accelerator (seedable sampler), model with dropout, AdamW, StepLR and a shuffled loader, prepared."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=project or ProjectConfiguration(),
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    ckpt = None
    if args.attach:
        import accelerate_ckpt

        ckpt = accelerate_ckpt.attach(acc)  # the one line
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    inputs = torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(inputs, torch.arange(4 * BATCHES_PER_EPOCH))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    return (acc, ckpt, *acc.prepare(model, opt, sched, loader))


def batches(acc: Accelerator, loader, step: int):
    """``(epoch, batch)`` from training step ``step`` on: ``set_epoch`` and ``skip_first_batches`` (exact resume)."""
    epoch, skip = divmod(step, len(loader))
    while True:
        loader.set_epoch(epoch)
        yield from acc.skip_first_batches(loader, skip) if skip else loader
        epoch, skip = epoch + 1, 0


def train_step(args, acc, model, opt, sched, batch, step: int) -> None:
    """One optimizer step; logs it; SIGKILLs the process after ``--kill-at``."""
    x, idx = batch
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    acc.backward(loss)
    opt.step()
    sched.step()
    with open(args.log, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "loss": repr(loss.item()), "lr": repr(sched.get_last_lr()[0]),
                            "batch": idx.tolist()}) + "\n")
    if step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
