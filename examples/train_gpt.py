#!/usr/bin/env python
"""Train a small character-level GPT on the Python standard library's own source, resumably.

The corpus is real text every machine has offline: the top-level ``*.py`` files of the running
interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), taken in sorted order until
``--corpus-chars`` characters. Training runs on the CPU, deterministically, and checkpoints every
``--save-every`` steps through torch-ckpt; started again with the same ``--ckpt-dir`` it resumes from
the newest committed checkpoint and continues bit for bit as if it had never stopped.

Lines that use the checkpoint library are marked ``# ckpt:``.

    python examples/train_gpt.py --steps 300 --ckpt-dir /tmp/gpt_ckpt --save-every 25 --log-jsonl /tmp/gpt.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise on every loader

try:
    from torch_ckpt import CheckpointManager, TrainState  # ckpt:
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch_ckpt import CheckpointManager, TrainState  # ckpt:


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps of the run")
    p.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint root; resumes from its newest checkpoint")
    p.add_argument("--save-every", type=int, default=25, help="save a checkpoint every K steps (0: never)")
    p.add_argument("--keep-last", type=int, default=3, help="how many newest checkpoints to keep")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-jsonl", type=Path, default=None, help="append one JSON object per optimizer step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 keeps runs bitwise reproducible)")
    # data
    p.add_argument("--corpus-chars", type=int, default=1_000_000, help="characters of stdlib source to use")
    p.add_argument("--max-windows", type=int, default=None, help="cap the dataset at this many windows (short epochs)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    # model / optimisation
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    # interruptions, for tests and demos
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL this process right after step N")
    p.add_argument("--stop-after-step", type=int, default=None, help="leave cleanly right after step N (preemption)")
    p.add_argument("--quiet", action="store_true", help="no per-interval progress lines")
    return p.parse_args(argv)


def _blocking_seconds(handle) -> float | None:
    stats = getattr(handle, "stats", None)
    if stats is None:
        return None
    value = stats.get("blocking_s") if isinstance(stats, dict) else getattr(stats, "blocking_s", None)
    return None if value is None else float(value)


def main(argv: list[str] | None = None) -> dict:
    """Run (or resume) training; returns a summary dict. ``argv`` defaults to ``sys.argv[1:]``."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    data, vocab = encode(load_corpus(args.corpus_chars))
    dataset = CharWindows(data, args.block_size, args.max_windows)
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
        generator=torch.Generator().manual_seed(args.seed + 1),  # base seeds only (unused with 0 workers)
    )
    if len(loader) == 0:
        raise ValueError(f"{len(dataset)} windows do not make one batch of {args.batch_size}")

    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.warmup, args.steps, args.min_lr_ratio)
    )
    state = TrainState(  # ckpt: the complete training state, RNG of every kind included
        model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader, step=0, epoch=0
    )

    log = open(args.log_jsonl, "a", encoding="utf-8") if args.log_jsonl else None
    handles = []
    loss_value = float("nan")
    try:
        with CheckpointManager(args.ckpt_dir, keep_last=args.keep_last) as mgr:  # ckpt: one manager per run root
            resumed = mgr.restore(state)  # ckpt: newest committed checkpoint, loaded in place; None: fresh start
            if not args.quiet:
                where = f"resumed from step {resumed}" if resumed is not None else "starting fresh"
                print(
                    f"train_gpt: {where}; corpus {len(data)} chars, vocab {len(vocab)}, "
                    f"{len(dataset)} windows, {len(loader)} batches/epoch, "
                    f"{sum(p.numel() for p in model.parameters())} params",
                    flush=True,
                )
            model.train()
            while state.step < args.steps:
                for x, y, idx in loader:
                    lr = optimizer.param_groups[0]["lr"]
                    loss = model(x, y)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if args.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                    optimizer.step()
                    scheduler.step()
                    state.step += 1
                    loss_value = float(loss.item())
                    if log is not None:
                        rec = {"step": state.step, "loss": loss_value, "lr": float(lr), "epoch": state.epoch,
                               "batch": idx.tolist()}
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                    if not args.quiet and state.step % 50 == 0:
                        print(f"  step {state.step:5d}  epoch {state.epoch}  loss {loss_value:.4f}  lr {lr:.2e}",
                              flush=True)
                    if args.save_every and state.step % args.save_every == 0:
                        handles.append(mgr.save(state.step, state))  # ckpt: returns after staging
                    if args.crash_at_step is not None and state.step == args.crash_at_step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if state.step >= args.steps or state.step == args.stop_after_step:
                        break
                else:
                    state.epoch += 1  # the loader ran out: a new epoch (and a new shuffle) begins
                    continue
                break
        # ckpt: leaving the with-block waited for the in-flight save
    finally:
        if log is not None:
            log.close()

    seconds = time.perf_counter() - t0
    blocking = [b for b in map(_blocking_seconds, handles) if b is not None]
    summary = {
        "steps": state.step,
        "epoch": state.epoch,
        "final_loss": loss_value,
        "resumed_from": resumed,
        "seconds": seconds,
        "saves": len(handles),
        "save_blocking_s": blocking,
    }
    line = (
        f"train_gpt: step {state.step}/{args.steps}, epoch {state.epoch}, final loss {loss_value:.4f}, "
        f"resumed from {resumed}, {seconds:.1f} s, {len(handles)} saves"
    )
    if blocking:
        line += f", save blocking s: mean {sum(blocking) / len(blocking):.4f} max {max(blocking):.4f}"
    print(line, flush=True)
    return summary


if __name__ == "__main__":
    main()
