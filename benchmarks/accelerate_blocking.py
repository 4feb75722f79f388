#!/usr/bin/env python
"""Blocking time of ``accelerator.save_state()``: Accelerate's own vs. with ``accelerate_ckpt.attach``.

Same Accelerator, same state (examples/train_gpt.py's GPT at d_model 768 with as many layers as
``--size-mib`` of parameters needs, plus its AdamW state after one step), same directory. Rounds
alternate the two methods (one warm-up round discarded) and report medians of:

* ``accelerate_blocking_s``: Accelerate's synchronous ``save_state`` (safetensors + torch.save;
  note that Accelerate does not fsync, so its files may not even be durable when it returns);
* ``adapter_blocking_s``: ``save_state`` with the adapter (returns once staged), its
  ``staging_s`` (the host copy) and ``durable_s`` (until committed: fsynced and renamed);
* ``adapter_overlap_*``: the same with ``overlap_staging=True`` (parameters and optimizer state
  are copied after ``save_state`` returns; ``safe_s`` is when that copy is done).

The staging copy is bounded by memory bandwidth and Accelerate's write by the page cache, so the
ratio depends on the machine and on its load (2 busy cores slow the copy most).

Exits non-zero unless the adapter's blocking time is below ``--max-ratio`` (default 0.5) times
Accelerate's. Writes the numbers as JSON with ``--json``.

    python benchmarks/accelerate_blocking.py --size-mib 352 --reps 5 \
        --json benchmarks/results/accelerate_blocking_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from train_gpt import GPT

import accelerate_ckpt

warnings.filterwarnings("ignore")


def build_state(size_mib: int):
    """The GPT and its AdamW state after one step, with about ``size_mib`` MiB of fp32 parameters."""
    per_layer = 12 * 768 * 768 + 13 * 768  # attention + MLP + norms
    fixed = 8192 * 768 + 1024 * 768
    layers = max(1, round((size_mib * 2**20 / 4 - fixed) / per_layer))
    torch.manual_seed(0)
    model = GPT(vocab_size=8192, block_size=1024, n_layer=layers, n_head=12, n_embd=768, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt, layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=352, help="MiB of fp32 parameters (AdamW adds twice that)")
    p.add_argument("--reps", type=int, default=3, help="measured rounds (after one warm-up round)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--max-ratio", type=float, default=0.5, help="fail unless adapter/accelerate blocking < this")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from accelerate import Accelerator

    work = Path(tempfile.mkdtemp(prefix="acc_blocking_", dir=args.dir))
    acc = Accelerator(cpu=True)
    model, opt, layers = build_state(args.size_mib)
    model, opt = acc.prepare(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values()
        if isinstance(v, torch.Tensor))
    rows = []
    plain = accelerate_ckpt.attach(acc)  # one checkpointer per variant: its staging buffers are reused
    overlap = accelerate_ckpt.attach(acc, overlap_staging=True)  # the last attach owns acc.save_state
    try:
        for rnd in range(args.reps + 1):
            row = {}
            native = work / f"native_{rnd}"
            t0 = time.monotonic()
            type(acc).save_state(acc, str(native))  # Accelerate's own method (the adapters' hooks stay idle)
            row["accelerate_blocking_s"] = time.monotonic() - t0
            shutil.rmtree(native)
            os.sync()
            for name, ckpt in (("adapter", plain), ("adapter_overlap", overlap)):
                t0 = time.monotonic()
                ckpt.save_state(work / name / f"round_{rnd}", step=rnd)  # one root (parent) per checkpointer
                row[f"{name}_blocking_s"] = time.monotonic() - t0
                ckpt.last_handle.staged.result()
                row[f"{name}_safe_s"] = time.monotonic() - t0
                ckpt.wait()
                row[f"{name}_durable_s"] = time.monotonic() - t0
                row[f"{name}_staging_s"] = ckpt.last_handle.stats.staging_s
                shutil.rmtree(work / name / f"round_{rnd}")
                os.sync()
            if rnd:
                rows.append(row)
            print(f"round {rnd}{' (warm-up)' if not rnd else ''}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                  flush=True)
    finally:
        overlap.close()
        plain.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    ratio = med["adapter_blocking_s"] / med["accelerate_blocking_s"]
    result = {"state_bytes": state_bytes, "layers": layers, "reps": args.reps, "median": med,
              "blocking_ratio": ratio, "max_ratio": args.max_ratio, "rounds": rows, "torch": torch.__version__,
              "cpus": os.cpu_count(), "platform": platform.platform()}
    print(f"state {state_bytes / 2**20:.0f} MiB, medians: accelerate blocking {med['accelerate_blocking_s']:.3f} s; "
          f"adapter blocking {med['adapter_blocking_s']:.3f} s (staging {med['adapter_staging_s']:.3f} s, durable "
          f"{med['adapter_durable_s']:.3f} s); with overlap_staging blocking "
          f"{med['adapter_overlap_blocking_s']:.3f} s, "
          f"safe {med['adapter_overlap_safe_s']:.3f} s; ratio {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if ratio >= args.max_ratio:
        print(f"FAIL: adapter blocking is {ratio:.2f}x Accelerate's (limit {args.max_ratio})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
