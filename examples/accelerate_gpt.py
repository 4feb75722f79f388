#!/usr/bin/env python
"""Train train_gpt.py's character-level GPT on its real corpus with Hugging Face Accelerate, resumably.

The model, the corpus (the standard library's own ``*.py`` source) and the LR schedule are imported
from ``examples/train_gpt.py``; the loop is a plain Accelerate loop. One line attaches torch-ckpt:
from then on ``accelerator.save_state()`` returns once the state is staged and writes in the
background, and ``accelerator.load_state()`` restores everything (model, optimizer, scheduler,
RNG of every process, dataloader epoch, step). Checkpoints land in
``PROJECT_DIR/checkpoints/checkpoint_<step>`` (``ProjectConfiguration(automatic_checkpoint_naming=True)``);
``--total-limit`` keeps the newest ones, deleting only after a newer one is committed. Started
again with the same ``--project-dir``, the run resumes from the newest committed checkpoint (after
a SIGKILL too) and continues bit for bit as if it had never stopped.

Lines that use the checkpoint library are marked ``# ckpt:``.

    python examples/accelerate_gpt.py --steps 300 --project-dir /tmp/acc_gpt --save-every 25
    python examples/accelerate_gpt.py --steps 300 --project-dir /tmp/acc_gpt --config examples/accelerate/ckpt.yaml
    ACCELERATE_CKPT_CONFIG=examples/accelerate/ckpt.yaml python examples/accelerate_gpt.py --project-dir /tmp/acc_gpt

Two CPU processes (gloo), started by the script itself or by torchrun:

    python examples/accelerate_gpt.py --nproc 2 --steps 300 --project-dir /tmp/acc_gpt2
    torchrun --standalone --nproc-per-node 2 examples/accelerate_gpt.py --steps 300 --project-dir /tmp/acc_gpt2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import (  # the same model and real data
    GPT,
    CharWindows,
    add_model_arguments,
    encode,
    free_port,
    load_corpus,
    warmup_cosine,
)

try:
    import accelerate_ckpt  # ckpt:
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import accelerate_ckpt  # ckpt:
from torch_ckpt.durations import parse_duration

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps of the run")
    p.add_argument("--project-dir", type=Path, required=True, help="Accelerate project dir; checkpoints go to "
                   "PROJECT_DIR/checkpoints and the run resumes from the newest committed one")
    p.add_argument("--config", type=Path, default=None, help="accelerate_ckpt settings file (YAML); the "
                   f"environment variable {accelerate_ckpt.ENV_VAR} wins over it")
    p.add_argument("--save-every", type=int, default=None, help="save every K steps (0: never; default 25 unless "
                   "a settings file chooses the policy)")
    p.add_argument("--mtbf", type=parse_duration, default=None, metavar="DURATION",
                   help="save at the Young/Daly interval for this mean time between failures (e.g. 30s, 8h)")
    p.add_argument("--total-limit", type=int, default=3, help="committed checkpoints to keep")
    p.add_argument("--sync", action="store_true", help="save synchronously (async_save: false)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-jsonl", type=Path, default=None, help="append one JSON object per optimizer step "
                   "(main process; per-process losses and the global batch)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--nproc", type=int, default=1, help="start N CPU processes (gloo) with torch.multiprocessing")
    add_model_arguments(p)
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL every process right after step N")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    """Run (or resume) training as one Accelerate process; returns the main process's summary."""
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    # a sampler reseeded per epoch: skip_first_batches then replays the interrupted epoch's order
    loader_config = {"use_seedable_sampler": True}
    if "data_seed" in DataLoaderConfiguration.__dataclass_fields__:  # not in accelerate 1.0.x
        loader_config["data_seed"] = args.seed
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(args.project_dir), automatic_checkpoint_naming=True,
                                            total_limit=args.total_limit),
        dataloader_config=DataLoaderConfiguration(**loader_config),
    )
    settings = {}
    if args.sync:
        settings["async_save"] = False
    if args.mtbf is not None:
        settings["mtbf_seconds"] = args.mtbf
    if args.save_every is None and args.mtbf is None and args.config is None \
            and not os.environ.get(accelerate_ckpt.ENV_VAR):
        args.save_every = 25
    if args.save_every:
        settings["save_every_n_steps"] = args.save_every
    ckpt = accelerate_ckpt.attach(accelerator, config=args.config, **settings)  # ckpt: one line

    data, vocab = encode(load_corpus(args.corpus_chars))
    dataset = CharWindows(data, args.block_size, args.max_windows)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed + 1))
    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    torch.manual_seed(args.seed + 1 + accelerator.process_index)  # same initial weights, dropout per process
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps, args.min_lr_ratio))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, resumed = 0, None
    if ckpt.latest_checkpoint() is not None:  # ckpt: newest *committed* checkpoint
        accelerator.load_state()  # ckpt: everything, in place (RNG, dataloader epoch, step included)
        step = resumed = ckpt.step  # ckpt:
    lead = accelerator.is_main_process
    if lead and not args.quiet:
        print(f"accelerate_gpt: {'resumed from step ' + str(resumed) if resumed is not None else 'starting fresh'}; "
              f"{accelerator.num_processes} process(es), {len(dataset)} windows, {len(loader)} batches/epoch "
              f"per process, {sum(p.numel() for p in model.parameters())} params", flush=True)
    log = open(args.log_jsonl, "a", encoding="utf-8") if args.log_jsonl is not None and lead else None
    saves, blocking = [], []
    epoch, skip = divmod(step, len(loader))
    model.train()
    try:
        while step < args.steps:
            loader.set_epoch(epoch)  # this epoch's shuffle
            batches = accelerator.skip_first_batches(loader, skip) if skip else loader  # resume mid-epoch
            skip = 0
            for x, y, idx in batches:
                lr = scheduler.get_last_lr()[0]
                loss = model(x, y)
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                if args.grad_clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
                scheduler.step()
                step += 1
                losses = accelerator.gather(loss.detach().reshape(1)).tolist()
                batch = accelerator.gather(idx).tolist()
                if log is not None:
                    log.write(json.dumps({"step": step, "losses": losses, "lr": lr, "epoch": epoch, "batch": batch})
                              + "\n")
                    log.flush()
                if lead and not args.quiet and step % 50 == 0:
                    print(f"  step {step:5d}  epoch {epoch}  loss {sum(losses) / len(losses):.4f}", flush=True)
                # ckpt: save_state() when the policy says so; it returns once the state is staged
                handle = ckpt.save_if_due(step) if args.save_every != 0 else None
                if handle is not None:
                    saves.append(step)
                    blocking.append(handle.stats.blocking_s)
                if step == args.crash_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step >= args.steps:
                    break
            else:
                epoch += 1
                continue
            break
    finally:
        if log is not None:
            log.close()
        ckpt.close()  # ckpt: waits for the last save to commit
    summary = {"steps": step, "resumed_from": resumed, "saves": saves, "save_blocking_s": blocking,
               "seconds": time.perf_counter() - t0, "world_size": accelerator.num_processes}
    if lead and not args.quiet:
        mean = f", save blocking mean {sum(blocking) / len(blocking):.4f} s" if blocking else ""
        print(f"accelerate_gpt: step {step}/{args.steps}, resumed from {resumed}, saves at {saves}{mean}, "
              f"{summary['seconds']:.1f} s", flush=True)
    return summary


def _process_entry(rank: int, nproc: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
    train(parse_args(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, where torch's C++ helper threads can abort after the work is done


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (128 + signal number when a process was killed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        # fork (Linux) starts the processes with everything already imported; nothing has touched a
        # device or started a thread yet. Elsewhere spawn re-imports this script in each process.
        method = "fork" if sys.platform == "linux" else "spawn"
        ctx = mp.start_processes(_process_entry, args=(args.nproc, free_port(), argv), nprocs=args.nproc,
                                 join=False, start_method=method)
        try:
            while not ctx.join():
                pass
        except mp.ProcessExitedException as exc:
            signum = getattr(signal, exc.signal_name, None) if exc.signal_name else None
            print(f"accelerate_gpt: process {exc.error_index} {exc}", file=sys.stderr, flush=True)
            return 128 + int(signum) if signum is not None else (exc.exit_code or 1)
        except mp.ProcessRaisedException as exc:
            print(f"accelerate_gpt: process {exc.error_index} failed:\n{exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    train(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: no interpreter teardown (see above)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
