#!/usr/bin/env python
"""How much does checkpointing every K steps slow the example's training loop?

Runs the training loop of ``examples/train_gpt.py`` (its GPT, its stdlib-text data through
``StatefulDataLoader``, AdamW, gradient clipping, warmup-cosine LR), with the model scaled up so one
checkpoint is about 150 MB (n_embd 512, 4 layers: 12.7M parameters, 152 MB with AdamW state), with
no checkpointing and with each checkpointing method, saving every ``--save-every`` (K) steps:

* torch-ckpt: ``ours_thread``, ``ours_thread_nice19``, ``ours_process``, ``ours_overlap``
  (thread + overlap_staging), ``ours_memory`` (the memory tier: saves into a tmpfs ``memory_root``),
  ``ours_memory_overlap`` (the same + overlap_staging), ``ours_memory_process`` (the same, writer process);
* peers: ``dcp_async`` (``dcp.async_save`` defaults; waits for the previous future before the next
  save, as DCP's docs do), ``dcp_async_stager`` (the same with one reused ``DefaultStager``),
  ``lightning_async`` (``AsyncCheckpointIO(TorchCheckpointIO())``),
  ``torch_save`` (synchronous ``torch.save`` to one file, no fsync, as most loops do).

Design (for a noisy, shared 2-core machine): after one discarded warm-up cycle per method, each
method runs ``--rounds`` segments of ``--steps`` steps, each segment right after its own
no-checkpoint segment of the same length (a pair); the method order rotates every round. A segment
saves after every K-th step except in its last K steps, so each save's background write overlaps
timed steps; the wait for a last straggling write and a ``sync`` follow the segment, untimed.
Per method: mean, median and p90 step time (a step includes the save call on save steps), slowdown
of the mean against the paired no-checkpoint segment (median over pairs, and pooled), the total
time the save calls blocked the loop (including any wait for the previous save), the extra wall
time per save (``extra_per_save_s``: segment time minus the paired segment's, over its saves) and
its ratio to the disk floor for the checkpoint's bytes (``extra_per_save_over_disk``; the floor,
``disk_floor_s``, is measured every round: ``os.write`` in 16 MiB chunks + ``fsync``), and a GIL
probe (``gil_probe``): a thread sleeping 1 ms in a loop records how late it wakes; its extra delay
per save over the paired segment is the time the persist path kept another Python thread waiting.
``--threads 1`` leaves one core to the writer (the proxy for a GPU node, where the scarce resource
is the Python thread launching kernels).

    python benchmarks/train_overhead.py --json /tmp/train_overhead.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CHUNK,
    close_all,
    dcp_default_stager,
    disk_floor_s,
    emit_json,
    git_info,
    make_log,
    remove,
    select_methods,
    start_run,
)

METHODS = (
    "none",
    "ours_thread",
    "ours_thread_nice19",
    "ours_process",
    "ours_memory",
    "ours_memory_overlap",
    "ours_memory_process",
    "ours_memory_overlap_process",
    "ours_overlap",
    "dcp_async",
    "dcp_async_stager",
    "lightning_async",
    "torch_save",
)


log = make_log("train_overhead")


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", REPO / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Env:
    """The example's model, data, optimizer and scheduler, with one endless batch stream."""

    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        from torch_ckpt import TrainState

        tg = load_example()
        torch.manual_seed(args.seed)
        data, vocab = tg.encode(tg.load_corpus(args.corpus_chars))
        dataset = tg.CharWindows(data, args.block_size)
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
        self.loader = StatefulDataLoader(
            dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=0
        )
        self.model = tg.GPT(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd, 0.1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, tg.warmup_cosine(20, 100_000, 0.1))
        self.state = TrainState(model=self.model, optimizer=self.opt, scheduler=self.sched, dataloader=self.loader)
        self.dir = directory
        self.step = 0
        self._it = iter(self.loader)
        self.model.train()

    def batch(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)

    def train_step(self) -> float:
        x, y, _ = self.batch()
        loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(loss.item())

    def state_bytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.model.parameters())
        n += sum(
            v.numel() * v.element_size()
            for st in self.opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return n


# --------------------------------------------------------------------------------------- savers


class Saver:
    name = "none"

    def __init__(self, env: Env) -> None:
        self.env = env
        self.out = env.dir / self.name
        self.out.mkdir(parents=True, exist_ok=True)
        self.lib_wait_prev = 0.0

    def setup(self) -> None:
        pass

    def save(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def clean(self) -> None:
        for p in list(self.out.iterdir()):
            remove(p)

    def close(self) -> None:
        pass


class Ours(Saver):
    CONFIG: ClassVar[dict[str, tuple[str, bool, int]]] = {
        "ours_thread": ("thread", False, 0),
        "ours_thread_nice19": ("thread", False, 19),
        "ours_process": ("process", False, 0),
        "ours_overlap": ("thread", True, 0),
    }

    def __init__(self, env, name):
        self.name = name
        super().__init__(env)

    def setup(self):
        from torch_ckpt import CheckpointManager

        persist, overlap, nice = self.CONFIG[self.name]
        self.mgr = CheckpointManager(
            self.out, keep_last=1, persist=persist, overlap_staging=overlap, writer_niceness=nice
        )

    def save(self, step):
        t = time.perf_counter()
        self.mgr.wait()  # save() waits for the previous save anyway; timed here to report it
        self.lib_wait_prev += time.perf_counter() - t
        self.mgr.save(step, self.env.state)

    def drain(self):
        self.mgr.wait()

    def clean(self):
        for p in self.out.iterdir():
            if p.name.startswith("step_"):
                shutil.rmtree(p, ignore_errors=True)

    def close(self):
        self.mgr.close()


class OursMemory(Ours):
    """The memory tier: ``save(step, state, tier="memory")`` into a ``memory_root`` on ``/dev/shm`` (tmpfs);
    ``ours_memory_overlap`` with ``overlap_staging``, ``ours_memory_process`` with the writer process,
    ``ours_memory_overlap_process`` with both."""

    MEMORY: ClassVar[dict[str, tuple[str, bool]]] = {
        "ours_memory": ("thread", False),
        "ours_memory_overlap": ("thread", True),
        "ours_memory_process": ("process", False),
        "ours_memory_overlap_process": ("process", True),
    }

    def __init__(self, env, name="ours_memory"):
        super().__init__(env, name)

    def setup(self):
        import tempfile

        from torch_ckpt import CheckpointManager

        shm = Path("/dev/shm")
        self.mem = Path(tempfile.mkdtemp(prefix="torch-ckpt-bench-", dir=shm if shm.is_dir() else self.out.parent))
        persist, overlap = self.MEMORY[self.name]
        self.mgr = CheckpointManager(self.out, keep_last=1, memory_root=str(self.mem), memory_keep_last=1,
                                     persist=persist, overlap_staging=overlap)

    def save(self, step):
        t = time.perf_counter()
        self.mgr.wait()
        self.lib_wait_prev += time.perf_counter() - t
        self.mgr.save(step, self.env.state, tier="memory")

    def clean(self):
        super().clean()
        for p in self.mem.iterdir():
            if p.name.startswith("step_"):
                shutil.rmtree(p, ignore_errors=True)

    def close(self):
        super().close()
        shutil.rmtree(self.mem, ignore_errors=True)


class DcpAsync(Saver):
    name = "dcp_async"

    def setup(self):
        self.fut = None
        self.done_dirs: list[Path] = []

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.fut is not None:  # one save in flight, as DCP's examples do
            t = time.perf_counter()
            self.fut.result()
            self.lib_wait_prev += time.perf_counter() - t
            for p in self.done_dirs[:-1]:
                shutil.rmtree(p, ignore_errors=True)
            self.done_dirs = self.done_dirs[-1:]
        msd, osd = get_state_dict(self.env.model, self.env.opt)
        path = self.out / f"step_{step}"
        self.fut = dcp.async_save(
            {"model": msd, "optim": osd, "sched": self.env.sched.state_dict()}, checkpoint_id=str(path), no_dist=True
        )
        self.done_dirs.append(path)

    def drain(self):
        if self.fut is not None:
            self.fut.result()
            self.fut = None


class DcpAsyncStager(DcpAsync):
    """``dcp.async_save`` with one reused ``DefaultStager`` (its staging buffers cached across saves)."""

    name = "dcp_async_stager"

    def setup(self):
        super().setup()
        self.stager = dcp_default_stager(torch.cuda.is_available(), shared=False)

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.fut is not None:
            t = time.perf_counter()
            self.fut.result()
            self.lib_wait_prev += time.perf_counter() - t
        msd, osd = get_state_dict(self.env.model, self.env.opt)
        resp = dcp.async_save({"model": msd, "optim": osd, "sched": self.env.sched.state_dict()},
                              checkpoint_id=str(self.out / f"step_{step}"), async_stager=self.stager, no_dist=True)
        self.fut = getattr(resp, "upload_completion", resp)

    def close(self):
        self.stager.close()


class LightningAsync(Saver):
    name = "lightning_async"

    def setup(self):
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, step):
        e = self.env
        ckpt = {
            "state_dict": e.model.state_dict(),
            "optimizer_states": [e.opt.state_dict()],
            "lr_schedulers": [e.sched.state_dict()],
            "global_step": step,
        }
        self.io.save_checkpoint(ckpt, self.out / f"step_{step}.ckpt")

    def drain(self):
        self.io.teardown()

    def close(self):
        self.io.teardown()


class TorchSave(Saver):
    name = "torch_save"

    def save(self, step):
        e = self.env
        torch.save(
            {
                "model": e.model.state_dict(),
                "optimizer": e.opt.state_dict(),
                "scheduler": e.sched.state_dict(),
                "step": step,
            },
            self.out / "last.pt",
        )


def make_saver(name: str, env: Env) -> Saver:
    if name in OursMemory.MEMORY:
        return OursMemory(env, name)
    if name in Ours.CONFIG:
        return Ours(env, name)
    return {"none": Saver, "dcp_async": DcpAsync, "dcp_async_stager": DcpAsyncStager, "lightning_async": LightningAsync,
            "torch_save": TorchSave}[name](env)


# ------------------------------------------------------------------------------------------ run


class GilProbe:
    """A thread that sleeps 1 ms in a loop and records how late it wakes up.

    A Python thread that wants the GIL waits until the holder releases it (at the latest every
    ``sys.getswitchinterval()``, 5 ms, for Python code; C code that keeps the GIL can hold it
    longer). The probe's extra wake-up delay during a segment, compared with the paired segment
    without checkpointing, is the time the persist path kept a Python thread (the one launching
    kernels on a GPU node) from running.
    """

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self._active = threading.Event()
        self._stop = threading.Event()
        self.delays: list[float] = []
        self._thread = threading.Thread(target=self._loop, name="gil_probe", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._active.wait(0.05):
                continue
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            self.delays.append(max(0.0, time.perf_counter() - t0 - self.period_s))

    def begin(self) -> None:
        self.delays = []
        self._active.set()

    def end(self) -> list[float]:
        self._active.clear()
        return self.delays

    def stop(self) -> None:
        self._stop.set()
        self._active.set()
        self._thread.join(timeout=2)


PROBE: GilProbe | None = None


def run_segment(env: Env, saver: Saver, steps: int, every: int, checkpoint: bool) -> dict[str, Any]:
    """``steps`` training steps, saving after every ``every``-th step except in the last ``every`` steps
    (so each save's background write overlaps timed steps); returns step and save-call times."""
    step_times, save_times = [], []
    if PROBE is not None:
        PROBE.begin()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        env.train_step()
        if checkpoint and i % every == 0 and i <= steps - every:
            ts = time.perf_counter()
            saver.save(env.step)
            save_times.append(time.perf_counter() - ts)
        step_times.append(time.perf_counter() - t0)
    probe = PROBE.end() if PROBE is not None else []
    t = time.perf_counter()
    saver.drain()
    drain_s = time.perf_counter() - t
    os.sync()
    saver.clean()
    return {"step_times": step_times, "save_times": save_times, "drain_s": drain_s, "probe": probe,
            "loadavg": os.getloadavg()[0]}


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    k = max(0, min(len(s) - 1, round(q * (len(s) - 1))))
    return s[k]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the summary here (also printed to stdout)")
    p.add_argument("--dir", type=Path, default=None, help="parent directory for checkpoints (default: $TMPDIR)")
    p.add_argument("--methods", nargs="+", default=None, help=f"comma/space separated subset of {', '.join(METHODS)}")
    p.add_argument("--rounds", type=int, default=3, help="pairs per method")
    p.add_argument("--steps", type=int, default=20, help="training steps per segment")
    p.add_argument("--save-every", type=int, default=5, help="K: checkpoint every K steps")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the training loop")
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--corpus-chars", type=int, default=400_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 pair of 10-step segments, save every 5")
    p.add_argument("--no-gil-probe", action="store_true", help="do not run the GIL probe thread")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.save_every = 1, 10, 5
    args.methods = ["none"] + [n for n in select_methods(p, args.methods, METHODS) if n != "none"]
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    directory = start_run("train_overhead_", args.threads, args.dir)
    savers: dict[str, Saver] = {}
    global PROBE
    disk_floors: list[float] = []
    try:
        env = Env(args, directory)
        env.train_step()  # creates the AdamW state, so the state has its full size
        state_bytes = env.state_bytes()
        log(
            f"model {sum(p.numel() for p in env.model.parameters()) / 1e6:.1f}M params, state "
            f"{state_bytes / 1e6:.0f} MB, threads {args.threads}, dir {directory}"
        )
        for name in args.methods:
            t = time.perf_counter()
            s = make_saver(name, env)
            s.setup()
            savers[name] = s
            log(f"{name}: set up in {time.perf_counter() - t:.1f} s")
        warm: dict[str, Any] = {}
        for name, s in savers.items():  # warm-up cycle: first-save allocations, thread/process start
            seg = run_segment(env, s, 2 * args.save_every, args.save_every, name != "none")
            warm[name] = {"step_s": sum(seg["step_times"]), "save_s": seg["save_times"]}
        log("warm-up done: " + " ".join(f"{k}={v['step_s']:.2f}s" for k, v in warm.items()))
        if not args.no_gil_probe:
            PROBE = GilProbe()
        # Paired design: every method segment runs right after its own no-checkpoint segment, so the
        # slowdown compares windows seconds apart (the load of a shared machine drifts over minutes).
        pairs: dict[str, list[dict[str, Any]]] = {n: [] for n in savers if n != "none"}
        names = list(pairs)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            t_round = time.perf_counter()
            os.sync()
            disk_floors.append(disk_floor_s(directory / "_disk_floor.bin", memoryview(bytearray(CHUNK)), state_bytes))
            line = []
            for name in order:
                base = run_segment(env, savers["none"], args.steps, args.save_every, False)
                seg = run_segment(env, savers[name], args.steps, args.save_every, True)
                seg["none_step_times"] = base["step_times"]
                seg["none_probe"] = base["probe"]
                pairs[name].append(seg)
                line.append(
                    f"{name}={statistics.mean(seg['step_times']) * 1e3:.0f}/"
                    f"{statistics.mean(base['step_times']) * 1e3:.0f}ms"
                )
            log(f"round {r} in {time.perf_counter() - t_round:.1f} s (method/none): " + " ".join(line))
        if PROBE is not None:
            PROBE.stop()
        disk_floor = statistics.median(disk_floors)
        out: dict[str, Any] = {}
        none_all = [t for segs in pairs.values() for sg in segs for t in sg["none_step_times"]]
        out["none"] = {
            "mean_step_s": statistics.mean(none_all),
            "median_step_s": statistics.median(none_all),
            "p90_step_s": pct(none_all, 0.9),
            "max_step_s": max(none_all),
            "slowdown_pct": 0.0,
            "n_steps": len(none_all),
            "n_saves": 0,
            "total_blocking_s": 0.0,
        }
        for name, segs in pairs.items():
            steps = [t for sg in segs for t in sg["step_times"]]
            base = [t for sg in segs for t in sg["none_step_times"]]
            saves = [t for sg in segs for t in sg["save_times"]]
            per_pair = [
                (statistics.mean(sg["step_times"]) / statistics.mean(sg["none_step_times"]) - 1) * 100 for sg in segs
            ]
            mean = statistics.mean(steps)
            # extra wall time of the segment over its paired no-checkpoint segment, per save
            extra = [
                (sum(sg["step_times"]) - statistics.mean(sg["none_step_times"]) * len(sg["step_times"]))
                / max(1, len(sg["save_times"]))
                for sg in segs
            ]
            probe_extra = [
                (sum(sg["probe"])
                 - sum(sg["none_probe"]) * sum(sg["step_times"]) / max(1e-9, sum(sg["none_step_times"])))
                / max(1, len(sg["save_times"]))
                for sg in segs
            ] if PROBE is not None else []
            delays = [d for sg in segs for d in sg["probe"]]
            out[name] = {
                "extra_per_save_s": statistics.median(extra),
                "extra_per_save_s_per_pair": extra,
                "extra_per_save_over_disk": statistics.median(extra) / disk_floor,
                "gil_probe": {
                    "extra_delay_per_save_s": statistics.median(probe_extra) if probe_extra else None,
                    "mean_delay_ms": statistics.mean(delays) * 1e3 if delays else None,
                    "p99_delay_ms": pct(delays, 0.99) * 1e3 if delays else None,
                    "max_delay_ms": max(delays) * 1e3 if delays else None,
                },
                "loadavg": [sg["loadavg"] for sg in segs],
                "mean_step_s": mean,
                "median_step_s": statistics.median(steps),
                "p90_step_s": pct(steps, 0.9),
                "max_step_s": max(steps),
                "slowdown_pct": statistics.median(per_pair),
                "slowdown_pct_pooled": (mean / statistics.mean(base) - 1) * 100,
                "slowdown_pct_per_pair": per_pair,
                "paired_none_mean_step_s": statistics.mean(base),
                "paired_none_p90_step_s": pct(base, 0.9),
                "n_steps": len(steps),
                "n_saves": len(saves),
                "total_blocking_s": sum(saves),
                "mean_blocking_s": statistics.mean(saves) if saves else 0.0,
                "max_blocking_s": max(saves) if saves else 0.0,
                "blocking_share_pct": sum(saves) / sum(steps) * 100,
                "waited_for_previous_s": savers[name].lib_wait_prev,
                "mean_drain_s": statistics.mean(sg["drain_s"] for sg in segs),
            }
        result = {
            "methods": out,
            "state_bytes": state_bytes,
            "disk_floor_s": disk_floor,
            "disk_floor_s_per_round": disk_floors,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "warmup": warm,
            "machine": {
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
                "loadavg_end": os.getloadavg(),
                "threads": args.threads,
                "git": git_info(),
            },
            "pairs": {
                k: [
                    {
                        "step_times": sg["step_times"],
                        "none_step_times": sg["none_step_times"],
                        "save_times": sg["save_times"],
                    }
                    for sg in segs
                ]
                for k, segs in pairs.items()
            },
        }
    finally:
        if PROBE is not None:
            PROBE.stop()
        close_all(savers.values(), log)
        shutil.rmtree(directory, ignore_errors=True)
    result["runtime_s"] = time.perf_counter() - t_start
    emit_json(result, args.json)
    for name, e in result["methods"].items():
        log(
            f"{name:20s} mean {e['mean_step_s'] * 1e3:7.1f} ms  p90 {e['p90_step_s'] * 1e3:7.1f} ms  "
            f"slowdown {e['slowdown_pct']:+6.1f}% (pooled {e.get('slowdown_pct_pooled', 0.0):+6.1f}%)  "
            f"blocking {e['total_blocking_s']:.2f} s over {e['n_saves']} saves  extra/save "
            f"{e.get('extra_per_save_s', 0.0):.3f} s = {e.get('extra_per_save_over_disk', 0.0):.2f}x disk"
        )
    log(f"done in {result['runtime_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
