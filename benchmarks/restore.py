#!/usr/bin/env python
"""How long does restoring a checkpoint into a live model take, cold and warm, against the read floor?

Builds the same GPT-like state as ``save_blocking.py`` (``--size-gib``; parameters + AdamW moments),
saves it once with every method, then measures per method and round, round-robin, one warm-up
round discarded:

* ``cold_s``: page cache dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, needs root), then the
  full restore into an already-built live model and optimizer (a second instance, other values);
* ``warm_s``: the same restore again right away, files in the page cache;
* ``peak_rss_bytes``: peak extra resident memory during the cold restore (psutil, every 5 ms).

Floor: ``cold_read_s``, ``os.read`` of a file of the same number of bytes in 16 MiB chunks after
dropping the page cache, measured at the start of every round and again right before every
method's cold restore (the VM's disk drifts between about 0.27 s and 1.2 s per GiB from one
second to the next). ``cold_over_read`` is a method's cold time over the floor measured right
before it, median over rounds; ``cold_over_median_read`` is its median cold time over the median
of its floors. Methods: ``ours`` (``CheckpointManager.restore`` by the manager that saved the
checkpoint, CRC-32 of every file verified; in one process each data file is read once,
checksummed in the same pass, into new buffers exchanged with the live tensors at the end),
``ours_noverify`` (sizes only), ``ours_fresh`` (a manager that has not saved in this process, as
after a restart), ``torch_load`` (``torch.load`` +
``load_state_dict``), ``dcp_load`` (``dcp.load`` + ``set_state_dict``), ``lightning_load``
(``TorchCheckpointIO.load_checkpoint`` + ``load_state_dict``) and ``accelerate_load``
(``Accelerator.load_state``).

    python benchmarks/restore.py --size-gib 1 --reps 3 --json /tmp/restore.json

JSON: ``{"floors": {"cold_read_s": ...}, "methods": {NAME: {"cold_s", "warm_s", "cold_over_read",
"cold_read_s", "cold_over_median_read", "peak_rss_bytes", ...}}, "state_bytes": ..., "machine": {...},
"rounds": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import save_blocking as sb  # noqa: E402
import torch  # noqa: E402
from _common import git_info  # noqa: E402

ALL_METHODS = ("ours", "ours_noverify", "ours_fresh", "torch_load", "dcp_load", "lightning_load", "accelerate_load")


def log(msg: str) -> None:
    print(f"[restore {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cold_read_s(path: Path) -> float:
    """Seconds to ``os.read`` the whole file in 16 MiB chunks (call after dropping the cache)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, sb.CHUNK):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0


class Method:
    """Save once in :meth:`setup`; :meth:`restore` loads into ``target`` (model, optimizer)."""

    name = "?"

    def __init__(self, src, target, directory: Path) -> None:
        self.src, self.target = src, target
        self.out = directory / self.name
        self.out.mkdir(parents=True, exist_ok=True)

    def setup(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ours(Method):
    name = "ours"
    verify = True

    def setup(self):
        from torch_ckpt import CheckpointManager, TrainState

        self.mgr = CheckpointManager(self.out, keep_last=1, verify_on_load=self.verify)
        self.mgr.save(1, TrainState(model=self.src[0], optimizer=self.src[1])).wait()
        self.state = TrainState(model=self.target[0], optimizer=self.target[1])

    def restore(self):
        assert self.mgr.restore(self.state) == 1

    def close(self):
        self.mgr.close()


class OursNoVerify(Ours):
    name = "ours_noverify"
    verify = False


class OursFresh(Method):
    """A manager that has not saved in this process (a resume after a restart)."""

    name = "ours_fresh"

    def setup(self):
        from torch_ckpt import CheckpointManager, TrainState

        with CheckpointManager(self.out / "saved", keep_last=1) as mgr:
            mgr.save(1, TrainState(model=self.src[0], optimizer=self.src[1])).wait()
        self.step_dir = next((self.out / "saved").glob("step_*"))
        self.mgr = CheckpointManager(self.out / "fresh")
        self.state = TrainState(model=self.target[0], optimizer=self.target[1])

    def restore(self):
        assert self.mgr.restore(self.state, path=self.step_dir) == 1

    def close(self):
        self.mgr.close()


class TorchLoad(Method):
    name = "torch_load"

    def setup(self):
        self.path = self.out / "ckpt.pt"
        torch.save({"model": self.src[0].state_dict(), "optimizer": self.src[1].state_dict()}, self.path)

    def restore(self):
        ckpt = torch.load(self.path, map_location="cpu", weights_only=True)
        self.target[0].load_state_dict(ckpt["model"])
        self.target[1].load_state_dict(ckpt["optimizer"])


class DcpLoad(Method):
    name = "dcp_load"

    def setup(self):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(*self.src)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(self.out / "ckpt"), no_dist=True)

    def restore(self):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(*self.target)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(self.out / "ckpt"), no_dist=True)
        set_state_dict(*self.target, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class LightningLoad(Method):
    name = "lightning_load"

    def setup(self):
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        self.io = TorchCheckpointIO()
        self.path = self.out / "ckpt.ckpt"
        self.io.save_checkpoint({"state_dict": self.src[0].state_dict(),
                                 "optimizer_states": [self.src[1].state_dict()]}, self.path)

    def restore(self):
        ckpt = self.io.load_checkpoint(self.path, map_location="cpu", weights_only=True)
        self.target[0].load_state_dict(ckpt["state_dict"])
        self.target[1].load_state_dict(ckpt["optimizer_states"][0])


class AccelerateLoad(Method):
    name = "accelerate_load"

    def setup(self):
        from accelerate import Accelerator

        logging.getLogger("accelerate").setLevel(logging.ERROR)
        cpu = next(self.src[0].parameters()).device.type == "cpu"
        acc = Accelerator(cpu=cpu)
        acc.prepare(*self.src)
        acc.save_state(str(self.out / "ckpt"))
        acc.free_memory()
        self.acc = Accelerator(cpu=cpu)
        self.model, self.opt = self.acc.prepare(*self.target)

    def restore(self):
        self.acc.load_state(str(self.out / "ckpt"))


METHODS = {c.name: c for c in (Ours, OursNoVerify, OursFresh, TorchLoad, DcpLoad, LightningLoad, AccelerateLoad)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3, help="kept rounds (one more warm-up round is discarded)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--dir", type=Path, default=None, help="parent directory (default: $TMPDIR)")
    p.add_argument("--methods", nargs="+", default=None, help=f"subset of {', '.join(ALL_METHODS)}")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="where the live model lives (cpu or cuda)")
    p.add_argument("--small-tensors", type=int, default=0, metavar="N",
                   help="instead of the GPT, N tensors of --small-bytes each (e.g. 20000)")
    p.add_argument("--small-bytes", type=int, default=1024)
    args = p.parse_args(argv)
    names = [n for item in (args.methods or ALL_METHODS) for n in item.split(",") if n]
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {ALL_METHODS}")
    args.methods = [n for n in ALL_METHODS if n in names]
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="restore_", dir=str(args.dir) if args.dir else None))
    dropper = sb.CacheDropper()
    sampler = sb.RssSampler()
    methods: list[Method] = []
    try:
        if args.small_tensors:
            src = sb.build_small_state(args.small_tensors, args.small_bytes, args.device, seed=0)[:2]
            target = sb.build_small_state(args.small_tensors, args.small_bytes, args.device, seed=1)[:2]
        else:
            src = sb.build_state(args.size_gib, args.device, seed=0)[:2]
            target = sb.build_state(args.size_gib, args.device, seed=1)[:2]
        tensors = sb.unique_tensors(*src)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        floor_file = directory / "_read_floor.bin"
        with open(floor_file, "wb") as f:
            for t in tensors:
                f.write(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
            os.fsync(f.fileno())
        log(f"state {state_bytes / 2**30:.3f} GiB in {len(tensors)} tensors; dir {directory}")
        for name in args.methods:
            t = time.perf_counter()
            m = METHODS[name](src, target, directory)
            m.setup()
            methods.append(m)
            log(f"{name}: saved in {time.perf_counter() - t:.1f} s")
        sampler.start()
        rounds = []
        for r in range(args.reps + 1):
            rec: dict[str, Any] = {"warmup": r == 0, "loadavg": os.getloadavg(), "methods": {}}
            dropper()
            rec["cold_read_s"] = cold_read_s(floor_file)
            for m in methods:
                dropper()
                floor = cold_read_s(floor_file)  # the disk's speed right now: it drifts 2-4x within seconds
                dropper()
                sb.malloc_trim()
                sampler.begin()
                t0 = time.perf_counter()
                m.restore()
                sb.device_sync(args.device)
                cold = time.perf_counter() - t0
                peak = sampler.end()
                t0 = time.perf_counter()
                m.restore()
                sb.device_sync(args.device)
                warm = time.perf_counter() - t0
                rec["methods"][m.name] = {"cold_s": cold, "warm_s": warm, "peak_rss_bytes": peak,
                                          "cold_read_s": floor, "cold_over_read": cold / floor}
            rounds.append(rec)
            log(f"round {r}{' (warm-up)' if r == 0 else ''}: read {rec['cold_read_s']:.2f} s | " + " ".join(
                f"{k}={v['cold_s']:.2f}/{v['warm_s']:.2f}" for k, v in rec["methods"].items())
                + f" | load {rec['loadavg'][0]:.1f}")
        kept = rounds[1:]
        out: dict[str, Any] = {}
        for m in methods:
            entry: dict[str, Any] = {"min": {}, "max": {}}
            for k in ("cold_s", "warm_s", "cold_over_read", "peak_rss_bytes"):
                vals = [rd["methods"][m.name][k] for rd in kept]
                entry[k], entry["min"][k], entry["max"][k] = statistics.median(vals), min(vals), max(vals)
            entry["peak_rss_bytes"] = int(entry["peak_rss_bytes"])
            reads_m = [rd["methods"][m.name]["cold_read_s"] for rd in kept]
            entry["cold_read_s"] = statistics.median(reads_m)
            entry["cold_over_median_read"] = entry["cold_s"] / entry["cold_read_s"]
            entry["extra_rss_over_state"] = entry["peak_rss_bytes"] / state_bytes
            out[m.name] = entry
        reads = [rd["cold_read_s"] for rd in kept] + [v["cold_read_s"] for rd in kept for v in rd["methods"].values()]
        result = {
            "floors": {"cold_read_s": statistics.median(reads), "min": {"cold_read_s": min(reads)},
                       "max": {"cold_read_s": max(reads)}},
            "methods": out,
            "state_bytes": state_bytes,
            "n_tensors": len(tensors),
            "reps": args.reps,
            "machine": {**sb.machine_info(args.device, directory, dropper), "loadavg_end": os.getloadavg(),
                        "git": git_info()},
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rounds": rounds,
        }
    finally:
        sampler.stop()
        for m in methods:
            try:
                m.close()
            except Exception as exc:  # noqa: BLE001
                log(f"{m.name}: close failed: {exc}")
        shutil.rmtree(directory, ignore_errors=True)
    result["runtime_s"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    log(f"done in {result['runtime_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
