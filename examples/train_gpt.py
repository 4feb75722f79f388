#!/usr/bin/env python
"""Train a small character-level GPT on the Python standard library's own source, resumably.

The corpus is real text every machine has offline: the top-level ``*.py`` files of the running
interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), taken in sorted order until
``--corpus-chars`` characters. Training runs on the CPU, deterministically, and checkpoints every
``--save-every`` steps through torch-ckpt (or, with ``--mtbf``, at the interval that minimises the
expected overhead for that mean time between failures, from the measured save cost and step time);
started again with the same ``--ckpt-dir`` it resumes from the newest committed checkpoint and
continues bit for bit as if it had never stopped.

Lines that use the checkpoint library are marked ``# ckpt:``.

    python examples/train_gpt.py --steps 300 --ckpt-dir /tmp/gpt_ckpt --save-every 25 --log-jsonl /tmp/gpt.jsonl
    python examples/train_gpt.py --steps 300 --ckpt-dir /tmp/gpt_ckpt --mtbf 30s   # Young/Daly interval

Data parallel on CPU ranks (DDP over gloo, each rank a shuffled shard of the data, every rank saving
and restoring collectively; only rank 0 prints and writes the log, whose loss is the mean over ranks).
Either let the script start the ranks itself, or start it under torchrun:

    python examples/train_gpt.py --nproc 2 --steps 300 --ckpt-dir /tmp/gpt_ddp --log-jsonl /tmp/gpt_ddp.jsonl
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 300 --ckpt-dir /tmp/gpt_ddp

Both resume exactly at the same world size (the dataloader position and RNG are per rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise on every loader

try:
    from torch_ckpt import CheckpointManager, TrainState, YoungDaly  # ckpt:
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch_ckpt import CheckpointManager, TrainState, YoungDaly  # ckpt:
from torch_ckpt.durations import DURATION_FORMS, format_duration, parse_duration

# --------------------------------------------------------------------------------------------- data


def load_corpus(max_chars: int) -> str:
    """The top-level stdlib ``.py`` files in sorted order, concatenated, cut at ``max_chars``.

    Non-ASCII characters become ``?`` so the vocabulary is small and does not depend on locale.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no .py files found in the standard library directory {stdlib}")
    parts: list[str] = []
    total = 0
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        text = text.encode("ascii", errors="replace").decode("ascii")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    """Token ids (int64) and the vocabulary: the corpus's distinct characters in code-point order."""
    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    chars = np.unique(raw)
    lookup = np.zeros(256, dtype=np.int64)
    lookup[chars] = np.arange(len(chars), dtype=np.int64)
    return torch.from_numpy(lookup[raw]), [chr(c) for c in chars]


class CharWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens; item ``i`` is ``(x, y, i)``."""

    def __init__(self, data: torch.Tensor, block_size: int, max_windows: int | None = None):
        self.data = data
        self.block_size = block_size
        n = (len(data) - 1) // block_size
        self.n = n if max_windows is None else min(n, max_windows)
        if self.n <= 0:
            raise ValueError("corpus too small for one window")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:], i


# -------------------------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier for scheduler step ``s``: linear warmup, then cosine decay to ``min_ratio``."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# ---------------------------------------------------------------------------------------- training


def _duration(text: str, *, positive: bool) -> float:
    try:
        seconds = parse_duration(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds < 0 or (positive and seconds == 0):
        raise argparse.ArgumentTypeError(f"must be {'positive' if positive else '>= 0'}, got {text!r}")
    return seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps of the run")
    p.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint root; resumes from its newest checkpoint")
    p.add_argument("--save-every", type=int, default=25, help="save a checkpoint every K steps (0: never; "
                   "ignored with --mtbf)")
    p.add_argument("--mtbf", type=lambda t: _duration(t, positive=True), default=None, metavar="DURATION",
                   help="mean time between failures of the job, e.g. 30s or 8h: save whenever the Young/Daly "
                   "optimal interval (from the measured save cost and step time) has passed, instead of "
                   "--save-every, and print the policy's choices at the end. Durations: " + DURATION_FORMS)
    p.add_argument("--initial-save-cost", type=lambda t: _duration(t, positive=False), default=0.05,
                   metavar="DURATION", help="with --mtbf: the save cost assumed until a save is measured "
                   "(default 50ms)")
    p.add_argument("--keep-last", type=int, default=3, help="how many newest checkpoints to keep")
    p.add_argument("--persist", choices=("thread", "process"), default="thread", help="where checkpoint writes "
                   "run: a writer thread (default) or a writer process per rank")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-jsonl", type=Path, default=None, help="append one JSON object per optimizer step "
                   "(rank 0 only; the loss is the mean over ranks and the batch lists every rank's windows); with "
                   "--memory-root each node also appends its health() loss estimates to PATH.node<k>.health")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (1 keeps runs "
                   "bitwise reproducible)")
    p.add_argument("--nproc", type=int, default=1, help="start N data-parallel CPU ranks (DDP over gloo) with "
                   "torch.multiprocessing; under torchrun leave it out (the world size comes from the launcher)")
    # data
    p.add_argument("--simulate-nodes", type=int, default=1, metavar="N",
                   help="with --nproc: run the ranks as N simulated nodes (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK as "
                        "torchrun sets them), each with its own private checkpoint root CKPT_DIR/nodeK")
    p.add_argument("--durable-url", default=None, help="durable tier (fsspec URL, e.g. s3://bucket/run)")
    p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                   help="fsspec options of --durable-url as a JSON object (endpoint, credentials)")
    p.add_argument("--memory-root", type=Path, default=None, help="memory tier directory (tmpfs, e.g. "
                   "/dev/shm/<run>; per simulated node MEMORY_ROOT/nodeK); with --memory-every")
    p.add_argument("--memory-every", type=int, default=0, help="save into --memory-root every K steps when no disk "
                   "save is due (0: never); every node's newest memory step is also held by a partner node")
    add_model_arguments(p)
    # interruptions, for tests and demos
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL this process (every rank) right "
                   "after step N")
    p.add_argument("--stop-after-step", type=int, default=None, help="leave cleanly right after step N (preemption)")
    p.add_argument("--quiet", action="store_true", help="no per-interval progress lines")
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.simulate_nodes < 1 or args.nproc % args.simulate_nodes:
        p.error(f"--simulate-nodes must divide --nproc ({args.nproc}), got {args.simulate_nodes}")
    if (args.memory_root is None) != (args.memory_every == 0):
        p.error("--memory-root and --memory-every go together")
    return args


def _blocking_seconds(handle) -> float | None:
    stats = getattr(handle, "stats", None)
    if stats is None:
        return None
    value = stats.get("blocking_s") if isinstance(stats, dict) else getattr(stats, "blocking_s", None)
    return None if value is None else float(value)


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """The loss averaged over every rank: the same float on each rank and in every run."""
    total = loss.detach().clone()
    dist.all_reduce(total)  # sum; with the same inputs, the same bits
    return float((total / world).item())


def _gather_batch(idx: torch.Tensor, world: int) -> list[int]:
    """The window ids of this step on every rank, rank 0's first."""
    parts = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(parts, idx)
    return torch.cat(parts).tolist()


def _schedule_line(info: dict, save_steps: list[int]) -> str:
    """The save policy's choices, for humans."""

    def secs(v) -> str:
        return "n/a" if v is None else format_duration(v)

    steps, step_s = info.get("interval_steps"), info.get("step_time_s")
    every = "no interval yet (step time not measured)" if steps is None else (
        f"every {steps} steps = {secs(steps * step_s)} at {secs(step_s)}/step")
    overhead = info.get("expected_overhead")
    return (
        f"train_gpt: save policy {info.get('policy', '?')} ({info.get('formula')}), MTBF {secs(info.get('mtbf_s'))}: "
        f"{every} (formula's optimum {secs(info.get('optimal_interval_s'))}, limited by {info.get('limited_by')}); "
        f"measured save cost C {secs(info.get('cost_s'))}, durable after {secs(info.get('durable_after_s'))}; "
        f"expected overhead {'n/a' if overhead is None else f'{100 * overhead:.3g} %'}, expected lost work "
        f"{secs(info.get('expected_lost_work_s'))} per failure; {len(save_steps)} saves at steps {save_steps}"
    )


def train(args: argparse.Namespace, rank: int = 0, world: int = 1) -> dict:
    """Run (or resume) training as rank ``rank`` of ``world`` (an initialised process group if > 1)."""
    t0 = time.perf_counter()
    distributed, lead = world > 1, rank == 0
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    data, vocab = encode(load_corpus(args.corpus_chars))
    dataset = CharWindows(data, args.block_size, args.max_windows)
    if distributed:
        # One shuffled order (the same seed on every rank, reshuffled per epoch by set_epoch), each rank
        # reading its own shard of it. The sampler's position (windows yielded this epoch) is part of the
        # loader's state_dict, its epoch is not: the loop calls set_epoch(state.epoch) before each epoch,
        # the one resumed into included. drop_last: every rank gets the same number of batches.
        sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                             drop_last=True)
    else:
        # Shuffle with a sampler that owns its generator. torchdata's stateful RandomSampler records that
        # generator in the loader's state_dict. `shuffle=True, generator=g` would share g with the
        # per-epoch base-seed draw of every new loader iterator, a draw a resumed loader does not replay:
        # every epoch after a resumed one would then shuffle differently from the uninterrupted run.
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=0,
        # own generator: the loader's iterators never draw from the global RNG
        generator=torch.Generator().manual_seed(args.seed + 1),
    )
    if len(loader) == 0:
        raise ValueError(f"{len(sampler)} windows per rank do not make one batch of {args.batch_size}")

    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    net: nn.Module = model
    if distributed:
        torch.manual_seed(args.seed + 1 + rank)  # the same initial weights everywhere, but dropout per rank
        net = DistributedDataParallel(model)  # gradients averaged over ranks (gloo all-reduce)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.warmup, args.steps, args.min_lr_ratio)
    )
    state = TrainState(  # ckpt: the complete training state, RNG of every kind (per rank) included
        model=net, optimizer=optimizer, scheduler=scheduler, dataloader=loader, step=0, epoch=0
    )
    policy = None
    if args.mtbf is not None:  # ckpt: the MTBF-optimal interval, from the measured save cost and step time
        policy = YoungDaly(mtbf_seconds=args.mtbf, initial_cost_seconds=args.initial_save_cost)

    logging_on = args.log_jsonl is not None  # the same on every rank: gathering the batch is collective
    log = None
    health_log = None
    if logging_on and lead:
        args.log_jsonl.parent.mkdir(parents=True, exist_ok=True)
        log = open(args.log_jsonl, "a", encoding="utf-8")
    if logging_on and args.memory_root is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        health_log = open(f"{args.log_jsonl}.node{os.environ.get('GROUP_RANK', '0')}.health", "a", encoding="utf-8")
    handles, save_steps, decisions = [], [], []
    schedule: dict = {}
    loss_value = float("nan")
    try:
        # ckpt: one manager per run root; every rank builds it and calls restore/save collectively
        # ckpt: simulated nodes each get a private root (on a real cluster: the same path on each node's disk)
        node = f"node{os.environ.get('GROUP_RANK', '0')}"
        root = args.ckpt_dir / node if args.simulate_nodes > 1 else args.ckpt_dir
        memory_root = None if args.memory_root is None else \
            str(args.memory_root / node if args.simulate_nodes > 1 else args.memory_root)
        with CheckpointManager(root, keep_last=args.keep_last, save_policy=policy, persist=args.persist,
                               durable_url=args.durable_url, storage_options=args.storage_options,
                               memory_root=memory_root) as mgr:
            resumed = mgr.restore(state)  # ckpt: newest committed checkpoint, loaded in place; None: fresh start
            if args.simulate_nodes > 1 and resumed is not None and os.environ.get("LOCAL_RANK") == "0":
                sys.stdout.write(f"train_gpt: node {os.environ['GROUP_RANK']} (rank {rank}) restored step {resumed} "
                                 f"from {mgr.restore_source}\n")  # one write: the nodes' lines never run together
                sys.stdout.flush()
            if lead and not args.quiet:
                where = f"resumed from step {resumed}" if resumed is not None else "starting fresh"
                print(
                    f"train_gpt: {where}; {world} rank(s), corpus {len(data)} chars, vocab {len(vocab)}, "
                    f"{len(dataset)} windows, {len(loader)} batches/epoch per rank, "
                    f"{sum(p.numel() for p in model.parameters())} params",
                    flush=True,
                )
            net.train()
            while state.step < args.steps:
                if distributed:
                    sampler.set_epoch(state.epoch)  # this epoch's shuffle (not in the loader's state_dict)
                for x, y, idx in loader:
                    lr = optimizer.param_groups[0]["lr"]
                    loss = net(x, y)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if args.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                    optimizer.step()
                    scheduler.step()
                    state.step += 1
                    loss_value = _mean_over_ranks(loss, world) if distributed else float(loss.item())
                    if logging_on:
                        batch = _gather_batch(idx, world) if distributed else idx.tolist()
                        if log is not None:
                            rec = {"step": state.step, "loss": loss_value, "lr": float(lr), "epoch": state.epoch,
                                   "batch": batch}
                            log.write(json.dumps(rec) + "\n")
                            log.flush()
                    if lead and not args.quiet and state.step % 50 == 0:
                        print(f"  step {state.step:5d}  epoch {state.epoch}  loss {loss_value:.4f}  lr {lr:.2e}",
                              flush=True)
                    if policy is not None:
                        handle = mgr.save_if_due(state.step, state)  # ckpt: rank 0 decides, every rank saves
                    elif args.save_every and state.step % args.save_every == 0:
                        handle = mgr.save(state.step, state)  # ckpt: returns after staging
                    elif args.memory_every and state.step % args.memory_every == 0:
                        handle = mgr.save(state.step, state, tier="memory")  # ckpt: into tmpfs, then a partner
                    else:
                        handle = None
                    if handle is not None:
                        handles.append(handle)
                        save_steps.append(state.step)
                        if policy is not None:
                            info = mgr.schedule_info()  # ckpt: this decision's inputs and interval
                            decisions.append({"step": state.step, "interval_steps": info.get("interval_steps"),
                                              "steps_since_save": info.get("steps_since_save")})
                    if health_log is not None:  # ckpt: what a loss of this node, or of the whole job, costs now
                        h = mgr.health()
                        health_log.write(json.dumps({"step": state.step, **{k: h[k] for k in (
                            "memory_safe_step", "lost_steps_if_node_lost", "lost_steps_if_job_lost")}}) + "\n")
                        health_log.flush()
                    if args.crash_at_step is not None and state.step == args.crash_at_step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if state.step >= args.steps or state.step == args.stop_after_step:
                        break
                else:
                    state.epoch += 1  # the loader ran out: a new epoch (and a new shuffle) begins
                    continue
                break
            if policy is not None:
                schedule = {**mgr.schedule_info(), "saves": len(save_steps), "decisions": decisions}
        # ckpt: leaving the with-block waited for the in-flight save
    finally:
        for f in (log, health_log):
            if f is not None:
                f.close()

    seconds = time.perf_counter() - t0
    blocking = [b for b in map(_blocking_seconds, handles) if b is not None]
    summary = {
        "steps": state.step,
        "epoch": state.epoch,
        "final_loss": loss_value,
        "resumed_from": resumed,
        "seconds": seconds,
        "saves": len(handles),
        "save_steps": save_steps,
        "save_blocking_s": blocking,
        "rank": rank,
        "world_size": world,
    }
    if policy is not None:
        summary["schedule"] = schedule
    if lead:
        line = (
            f"train_gpt: step {state.step}/{args.steps}, epoch {state.epoch}, final loss {loss_value:.4f}, "
            f"resumed from {resumed}, {seconds:.1f} s, {len(handles)} saves"
        )
        if blocking:
            line += f", save blocking s: mean {sum(blocking) / len(blocking):.4f} max {max(blocking):.4f}"
        print(line, flush=True)
        if policy is not None:
            print(_schedule_line(schedule, save_steps), flush=True)
    return summary


# ------------------------------------------------------------------------------------- ranks, launch


class RankFailed(RuntimeError):
    """A rank started by ``--nproc`` failed; ``exit_code`` is what the launcher should exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The data, model and optimiser options this example shares with ``accelerate_gpt.py``."""
    p.add_argument("--corpus-chars", type=int, default=1_000_000, help="characters of stdlib source to use")
    p.add_argument("--max-windows", type=int, default=None, help="cap the dataset at this many windows (short epochs)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size per rank (process)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, nproc: int, port: int, argv: list[str], results) -> None:
    """One rank started by ``--nproc``: the environment torchrun would give it, then :func:`main`."""
    per_node = nproc // parse_args(argv).simulate_nodes
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
    summary = main(argv)
    if rank == 0:
        results.put(summary)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, where torch's C++ helper threads can abort after the work is done


def launch(nproc: int, argv: list[str]) -> dict:
    """Start ``nproc`` ranks of this script (gloo on 127.0.0.1) and return rank 0's summary.

    On Linux the ranks are forked, so they reuse this process's imports (nothing has run a torch op or
    started a process group here yet); elsewhere they are spawned. A rank that fails or dies takes the
    others down with it (torch.multiprocessing terminates them).

    Raises:
        RankFailed: a rank raised, exited non-zero or was killed (``--crash-at-step``).
    """
    method = "fork" if sys.platform == "linux" else "spawn"
    results = mp.get_context(method).SimpleQueue()
    procs = mp.start_processes(_rank_entry, args=(nproc, free_port(), list(argv), results), nprocs=nproc,
                               join=False, start_method=method)
    summary = None
    try:
        while not procs.join(timeout=0.2):
            if summary is None and not results.empty():  # drain, so a large summary cannot block rank 0
                summary = results.get()
    except mp.ProcessExitedException as exc:
        signum = getattr(signal, exc.signal_name, None) if exc.signal_name else None
        code = 128 + int(signum) if signum is not None else (exc.exit_code or 1)
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
        raise RankFailed(f"rank {exc.error_index} (pid {exc.error_pid}) {how}", code) from None
    except mp.ProcessRaisedException as exc:
        raise RankFailed(f"rank {exc.error_index} (pid {exc.error_pid}) failed:\n{exc}", 1) from None
    return summary if summary is not None else results.get()


def _world_from_env() -> tuple[int, int]:
    """``(rank, world size)`` given by torchrun or ``--nproc``; ``(0, 1)`` for a plain run."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def main(argv: list[str] | None = None) -> dict:
    """Run (or resume) training; returns a summary dict (rank 0's). ``argv`` defaults to ``sys.argv[1:]``.

    Started by torchrun (``RANK``/``WORLD_SIZE`` set, world size > 1) it trains as one rank; with
    ``--nproc N`` (N > 1) outside a launcher it starts N ranks itself and waits for them.
    """
    args = parse_args(argv)
    rank, world = _world_from_env()
    if world == 1 and args.nproc > 1:
        return launch(args.nproc, sys.argv[1:] if argv is None else list(argv))
    if world > 1 and args.nproc not in (1, world):
        raise SystemExit(f"train_gpt: --nproc {args.nproc}, but the launcher started {world} ranks")
    if world == 1:
        return train(args)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # env://: MASTER_ADDR/MASTER_PORT
    try:
        return train(args, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except RankFailed as failure:
        print(f"train_gpt: {failure}", file=sys.stderr, flush=True)
        raise SystemExit(failure.exit_code) from None
    if _world_from_env()[1] > 1:  # a rank under torchrun: leave without interpreter teardown (see _rank_entry)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
