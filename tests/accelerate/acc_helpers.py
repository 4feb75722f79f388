"""A tiny Accelerate training run used by the adapter tests (model, data, loop, tracker)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch

WINDOWS = 24
BATCH = 4  # 6 batches per epoch


class TinyNet(torch.nn.Module):
    """Linear -> dropout -> linear: the dropout makes the loss depend on the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Counter:
    """An object for ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.value = 0
        self.history: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value, self.history = sd["value"], list(sd["history"])


@dataclass
class Run:
    """One Accelerator with its prepared objects and the attached checkpointer."""

    accelerator: Any
    ckpt: Any
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    extra: dict = field(default_factory=dict)


def make_run(project_dir: os.PathLike | None, *, total_limit: int | None = None, attach: bool = True,
             stateful: bool = False, seed: int = 0, **attach_kwargs: Any) -> Run:
    """Build (and prepare) the tiny run; ``attach`` the adapter unless told not to."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    import accelerate_ckpt

    torch.manual_seed(seed)
    project = ProjectConfiguration(project_dir=None if project_dir is None else str(project_dir),
                                   automatic_checkpoint_naming=project_dir is not None, total_limit=total_limit)
    seeded = {"data_seed": seed} if "data_seed" in inspect.signature(DataLoaderConfiguration).parameters else {}
    acc = Accelerator(cpu=True, project_config=project,  # data_seed: accelerate >= 1.1
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, **seeded,
                                                                use_stateful_dataloader=stateful))
    ckpt = accelerate_ckpt.attach(acc, **attach_kwargs) if attach else None
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(WINDOWS, 4, generator=torch.Generator().manual_seed(9)),
                                          torch.arange(WINDOWS))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed + 1))
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    return Run(acc, ckpt, model, opt, sched, loader)


def train(run: Run, start: int, stop: int, *, save_at: tuple[int, ...] = (), skip: bool = True,
          if_due: bool = False) -> list[tuple]:
    """Steps ``start+1 .. stop``; returns ``(step, loss, lr, batch ids)`` per step; saves at ``save_at``, and
    with ``if_due`` calls ``ckpt.save_if_due(step)`` after every step.

    Resuming mid-epoch uses ``skip_first_batches`` (``skip=True``) or the loader's own position
    (stateful loaders, ``skip=False``).
    """
    acc, records, step = run.accelerator, [], start
    epoch, offset = divmod(step, len(run.loader))
    while step < stop:
        run.loader.set_epoch(epoch)
        batches = acc.skip_first_batches(run.loader, offset) if (offset and skip) else run.loader
        offset = 0
        for x, idx in batches:
            loss = run.model(x).pow(2).mean()
            run.optimizer.zero_grad()
            acc.backward(loss)
            run.optimizer.step()
            run.scheduler.step()
            step += 1
            records.append((step, loss.item(), run.scheduler.get_last_lr()[0], idx.tolist()))
            if step in save_at:
                acc.save_state(step=step)
            if if_due:
                run.ckpt.save_if_due(step)
            if step >= stop:
                break
        else:
            epoch += 1
            continue
        break
    return records


def bitwise(records: list[tuple]) -> list[tuple]:
    """Records with floats as their exact ``repr`` (``==`` on the result is a bitwise comparison)."""
    return [(s, repr(loss), repr(lr), batch) for s, loss, lr, batch in records]
