"""A script run by ``accelerate launch`` following the protocol of Accelerate's own checkpointing test script
(``accelerate/test_utils/scripts/external_deps/test_checkpointing.py``), with a tiny model and data made here
instead of BERT on GLUE (no downloads). Used by ``tests/accelerate/test_accelerate_lifecycle.py``.

    accelerate launch --cpu --num_processes 2 accelerate_epochs.py --output_dir DIR [--attach]
        [--resume_from_checkpoint DIR/epoch_N] [--num_epochs 2] [--slow_persist SECONDS] [--no_end_training]

Training: each epoch ends with ``save_state(DIR/epoch_N)``, an evaluation, and (main process)
``DIR/state_N.json`` with the evaluation loss, the scheduler's and the optimizer's learning rate and
the epoch; the script ends with ``accelerator.end_training()``, as every Accelerate example does.
Resume: ``load_state(DIR/epoch_N)``, evaluate, and assert the values equal ``state_N.json``
(exit code 1 with the difference otherwise). ``--slow_persist`` makes every background write take
that much longer, so the last save is still in flight when ``end_training()`` runs (or, with
``--no_end_training``, when the script simply ends and the interpreter exits).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
from accelerate import Accelerator


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader) -> float:
    model.eval()
    total = torch.zeros(())
    with torch.no_grad():
        for x, y in loader:
            total += accelerator.gather_for_metrics(torch.nn.functional.mse_loss(model(x), y).reshape(1)).sum()
    model.train()
    return float(total)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--attach", action="store_true")
    parser.add_argument("--slow_persist", type=float, default=0.0)
    parser.add_argument("--no_end_training", action="store_true")
    args = parser.parse_args()
    if args.slow_persist:
        import torch_ckpt.save._checkpointer as checkpointer

        persist = checkpointer.persist_checkpoint
        checkpointer.persist_checkpoint = lambda req, ctx: (time.sleep(args.slow_persist), persist(req, ctx))[1]

    accelerator = Accelerator(cpu=True)
    if args.attach:
        import accelerate_ckpt

        accelerate_ckpt.attach(accelerator)
    torch.manual_seed(42)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    train = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    evaluation = torch.utils.data.DataLoader(data, batch_size=16)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                  total_iters=len(train) * args.num_epochs)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation,
                                                                         scheduler)
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        epoch = int(re.search(r"epoch_(\d+)", args.resume_from_checkpoint).group(1))
        with open(os.path.join(args.output_dir, f"state_{epoch}.json"), encoding="utf-8") as f:
            saved = json.load(f)
        now = {"loss": evaluate(accelerator, model, evaluation), "lr": scheduler.get_last_lr()[0],
               "optimizer_lr": optimizer.param_groups[0]["lr"], "epoch": epoch}
        if now != saved:
            print(f"resumed state differs: {now} != {saved}", file=sys.stderr)
            return 1
        return 0
    for epoch in range(args.num_epochs):
        for x, y in train:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        state = {"loss": evaluate(accelerator, model, evaluation), "lr": scheduler.get_last_lr()[0],
                 "optimizer_lr": optimizer.param_groups[0]["lr"], "epoch": epoch}
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with open(os.path.join(args.output_dir, f"state_{epoch}.json"), "w", encoding="utf-8") as f:
                json.dump(state, f)
    if not args.no_end_training:
        accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
