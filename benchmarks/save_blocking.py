#!/usr/bin/env python
"""How long does one checkpoint save hold the training loop, and when is it durable?

Builds a realistic training state (the parameter layout of ``examples/train_gpt.py``'s GPT with
d_model 768, vocab 8192, 1024 positions, tied embedding/head, N layers chosen to reach
``--size-gib``, plus its AdamW state after one optimizer step; 12 layers give the
1.03 GiB / 592-tensor layout of ``notes/perf-baseline.md``), then measures in ONE run, round-robin,
one warm-up round discarded, ``--reps`` rounds kept:

* floors, every round: ``memcpy_s`` (per-tensor ``copy_`` of the same tensors into pre-faulted,
  preallocated buffers, torch threads = ``--threads``) and ``disk_s`` (Python ``os.write`` of the
  same bytes in 16 MiB chunks + ``fsync``, into the same directory); informative, not a goal's
  denominator: ``disk_writebehind_s``, the same write with writeback started per 64 MiB window
  (``durable_over_disk_writebehind``);
* peers: ``torch.save`` (+ explicit fsync), ``dcp.save``, ``dcp.async_save`` (defaults), Lightning
  ``AsyncCheckpointIO(TorchCheckpointIO())``, ``Accelerator.save_state``;
* torch-ckpt: thread / process persistence, with and without ``overlap_staging``, a thread
  writer at nice 19, and the memory tier (``ours_memory``: a save into a tmpfs ``memory_root``; its
  ``durable_s`` is the memory commit, not a disk write).

Per method and round: ``blocking_s`` (the call returns), ``safe_s`` (the live state may be mutated
again; differs from blocking only with overlap staging), ``durable_s`` (files fsynced; for methods
that do not fsync themselves an explicit fsync of their files and directory is included), and
``peak_rss_bytes`` (peak extra resident memory over the pre-method baseline, sampled every 5 ms by a
background thread, writer processes included, shared memory counted once, plus the staging buffers
a method keeps between saves). Ratios are computed per round against the same round's floors, then
the median is taken. Between methods the outputs are removed, ``sync`` runs and the page cache is
dropped (skipped with a note when not permitted).

    python benchmarks/save_blocking.py --size-gib 1 --reps 5 --json /tmp/save_blocking.json
    python benchmarks/save_blocking.py --quick --json /tmp/quick.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil
import torch
from _common import (  # noqa: E402
    CHUNK,  # noqa: F401 - benchmarks/restore.py reads it as sb.CHUNK
    close_all,
    dcp_default_stager,
    disk_floor_s,
    emit_json,
    free_port,
    git_info,
    make_log,
    remove,
    select_methods,
    start_run,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FLOOR_NAMES = ("memcpy", "disk")
PEER_NAMES = ("torch_save", "dcp_save", "dcp_async_default", "dcp_async_stager", "lightning_async",
              "accelerate_save_state")
OURS_NAMES = ("ours_thread", "ours_thread_overlap", "ours_process", "ours_process_overlap", "ours_thread_nice19",
              "ours_memory")
# set up last: it initialises a one-rank gloo process group, which the methods set up before never see
LAST_NAMES = ("dcp_async_process",)
ALL_METHODS = PEER_NAMES + OURS_NAMES + LAST_NAMES
D_MODEL, VOCAB, BLOCK, N_HEAD = 768, 8192, 1024, 12


log = make_log("save_blocking")


# ------------------------------------------------------------------------------------------ state


class _Block(torch.nn.Module):
    """Parameter layout of one block of ``examples/train_gpt.py``'s GPT (same names and shapes)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(d, 3 * d)
        self.attn.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))


class GPTLike(torch.nn.Module):
    """The example GPT's parameters (tied token embedding / head), without its forward.

    Built here rather than imported so the benchmark runs where ``torchdata`` (imported by the
    example) is not installed, e.g. on the GPU machine.
    """

    def __init__(self, vocab: int, block: int, n_layer: int, d: int) -> None:
        super().__init__()
        self.tok_emb = torch.nn.Embedding(vocab, d)
        self.pos_emb = torch.nn.Embedding(block, d)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n_layer))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight


def layers_for(size_gib: float) -> int:
    """Layers of the d=768 / vocab 8192 GPT whose fp32 params + AdamW moments reach ``size_gib``."""
    per_layer = 12 * D_MODEL * D_MODEL + 13 * D_MODEL
    fixed = VOCAB * D_MODEL + BLOCK * D_MODEL + 2 * D_MODEL  # tied embedding/head, positions, final LN
    target_params = size_gib * 2**30 / 12  # params, exp_avg, exp_avg_sq: 3 x 4 bytes each
    return max(1, round((target_params - fixed) / per_layer))


def build_state(size_gib: float, device: str, seed: int = 0):
    """GPT-like model + AdamW after one optimizer step (random gradients), on ``device``."""
    torch.manual_seed(seed)
    n_layer = layers_for(size_gib)
    with torch.device(device):
        model = GPTLike(VOCAB, BLOCK, n_layer, D_MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, n_layer


class ManySmall(torch.nn.Module):
    """``n`` parameters of ``nbytes`` each (float32): the many-small-tensors case."""

    def __init__(self, n: int, nbytes: int) -> None:
        super().__init__()
        self.p = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(nbytes // 4)) for _ in range(n))


def build_small_state(n: int, nbytes: int, device: str, seed: int = 0):
    """``n`` tensors of ``nbytes`` with plain SGD (no optimizer state: exactly ``n`` tensors)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = ManySmall(n, nbytes)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4), 0


def unique_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every distinct tensor of the state (tied weights once): params/buffers, then optimizer state."""
    out, seen = [], set()
    items = list(model.state_dict(keep_vars=False).values())
    for st in opt.state.values():
        items.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    for t in items:
        key = (t.device.type, t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out.append(t.detach())
    return out


def device_sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ OS helpers

_LIBC = None


def malloc_trim() -> None:
    """Return free heap pages to the OS so every method starts from the same resident baseline."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class CacheDropper:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; degrades to ``sync`` when not permitted."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.permitted: bool | None = None

    def __call__(self) -> None:
        os.sync()
        if not self.enabled or self.permitted is False:
            return
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            self.permitted = True
        except OSError as exc:
            self.permitted = False
            log(f"cannot drop the page cache ({exc}); continuing with sync only")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or the file itself), then the directories and the parent."""
    if path.is_file():
        fsync_path(path)
        fsync_path(path.parent)
        return
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))
    fsync_path(path.parent)


# ---------------------------------------------------------------------------------- RSS sampling


class RssSampler:
    """Peak resident memory of this process and its children (writer processes) over a window.

    Total = sum over processes of private RSS (``rss - shared``) + the largest ``shared``, so
    shared memory (the process writer's arena, mapped libraries) is counted once.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.me = psutil.Process()
        self._children: list[psutil.Process] = []
        self._children_t = 0.0
        self._active = False
        self._base = 0
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss_sampler", daemon=True)
        self.samples = 0

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def measure(self) -> int:
        now = time.monotonic()
        if now - self._children_t > 0.2:
            try:
                self._children = self.me.children(recursive=True)
            except psutil.Error:
                self._children = []
            self._children_t = now
        private, shared = 0, 0
        for p in [self.me, *self._children]:
            try:
                mi = p.memory_info()
            except psutil.Error:
                continue
            private += mi.rss - mi.shared
            shared = max(shared, mi.shared)
        return private + shared

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._active:
                v = self.measure()
                self.samples += 1
                self._peak = max(self._peak, v)
                self._stop.wait(self.interval_s)
            else:
                self._stop.wait(0.05)

    def begin(self) -> int:
        self._children_t = 0.0
        self._base = self._peak = self.measure()
        self._active = True
        return self._base

    def end(self) -> int:
        """Peak bytes over the baseline since :meth:`begin`."""
        self._active = False
        v = self.measure()
        return max(0, max(self._peak, v) - self._base)


# -------------------------------------------------------------------------------------- floors


class Floors:
    """The physical limits for the same bytes: copy into pre-faulted buffers, write + fsync."""

    def __init__(self, tensors: list[torch.Tensor], directory: Path, device: str) -> None:
        self.tensors = tensors
        self.dir = directory
        self.cuda = device.startswith("cuda")
        offsets, off = [], 0
        for t in tensors:
            offsets.append(off)
            off += (t.numel() * t.element_size() + 63) // 64 * 64
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.arena = torch.empty(off, dtype=torch.uint8, pin_memory=self.cuda)
        self.arena.fill_(0)  # pre-fault every page
        self.views = []
        for t, o in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            self.views.append(self.arena[o : o + n].view(t.dtype).view(t.shape))

    def memcpy_s(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(self.views, self.tensors):
            dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def disk_s(self) -> float:
        return disk_floor_s(self.dir / "_disk_floor.bin", memoryview(self.arena.numpy())[: self.nbytes], self.nbytes)

    def disk_writebehind_s(self) -> float:
        return disk_floor_s(self.dir / "_disk_floor.bin", memoryview(self.arena.numpy())[: self.nbytes], self.nbytes,
                            write_behind=True)


# ------------------------------------------------------------------------------------- methods


class Method:
    """One way to save. ``run`` returns ``{"blocking_s", "safe_s", "durable_s", ...}``."""

    name = "?"

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.out = ctx.dir / self.name
        self.out.mkdir(parents=True, exist_ok=True)

    def setup(self) -> None:
        pass

    def run(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def retained_bytes(self) -> int:
        """Host buffers this method keeps between saves (resident, so absent from the delta)."""
        return 0

    def clean(self) -> None:
        for p in list(self.out.iterdir()):
            remove(p)

    def close(self) -> None:
        pass


class TorchSave(Method):
    name = "torch_save"

    def run(self, step):
        c = self.ctx
        path = self.out / f"ckpt_{step}.pt"
        device_sync(c.device)
        t0 = time.perf_counter()
        torch.save({"model": c.model.state_dict(), "optimizer": c.opt.state_dict(), "step": step}, path)
        t1 = time.perf_counter()
        fsync_tree(path)
        t2 = time.perf_counter()
        return {"blocking_s": t1 - t0, "safe_s": t1 - t0, "durable_s": t2 - t0}


def dcp_state(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ctx.model, ctx.opt)
    return {"model": msd, "optim": osd}


class DcpSave(Method):
    """``dcp.save`` with the default ``FileSystemWriter`` (it fsyncs its files itself)."""

    name = "dcp_save"

    def run(self, step):
        import torch.distributed.checkpoint as dcp

        path = self.out / f"step_{step}"
        device_sync(self.ctx.device)
        t0 = time.perf_counter()
        dcp.save(dcp_state(self.ctx), checkpoint_id=str(path), no_dist=True)
        t1 = time.perf_counter()
        return {"blocking_s": t1 - t0, "safe_s": t1 - t0, "durable_s": t1 - t0}


class DcpAsyncDefault(Method):
    """``dcp.async_save`` with its defaults (thread, a fresh default stager per call)."""

    name = "dcp_async_default"

    def run(self, step):
        import torch.distributed.checkpoint as dcp

        path = self.out / f"step_{step}"
        device_sync(self.ctx.device)
        t0 = time.perf_counter()
        fut = dcp.async_save(dcp_state(self.ctx), checkpoint_id=str(path), no_dist=True)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        return {"blocking_s": t1 - t0, "safe_s": t1 - t0, "durable_s": t2 - t0}


class DcpAsyncStager(Method):
    """``dcp.async_save`` (thread) with ONE ``DefaultStager`` reused across calls, so its buffers are cached."""

    name = "dcp_async_stager"
    kind = "THREAD"
    shared = False

    def setup(self):
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.stager = dcp_default_stager(self.ctx.device.startswith("cuda"), self.shared)
        self.type = getattr(AsyncCheckpointerType, self.kind)
        self._save(self.out / "warmup")  # first call allocates the stager's cache (and starts a process)
        self.clean()

    def _save(self, path: Path):
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        resp = dcp.async_save(dcp_state(self.ctx), checkpoint_id=str(path), async_stager=self.stager,
                              async_checkpointer_type=self.type, no_dist=self.type.name == "THREAD")
        t1 = time.perf_counter()
        staged = getattr(resp, "staging_completion", None)
        if staged is not None:
            staged.result()
        ts = time.perf_counter()
        getattr(resp, "upload_completion", resp).result()
        t2 = time.perf_counter()
        return {"blocking_s": t1 - t0, "safe_s": ts - t0, "durable_s": t2 - t0}

    def run(self, step):
        device_sync(self.ctx.device)
        return self._save(self.out / f"step_{step}")

    def close(self):
        self.stager.close()

    def retained_bytes(self) -> int:
        """Bytes of the staged copies the reused ``DefaultStager`` caches between saves (0 if unknown)."""
        cache = getattr(getattr(self.stager, "_state_dict_stager", None), "_cached_storage_mapping", None)
        try:
            return sum(int(s.nbytes()) for s in cache.values()) if cache is not None else 0
        except Exception:  # noqa: BLE001 - a private attribute of DCP: never fail the benchmark over it
            return 0


class DcpAsyncProcess(DcpAsyncStager):
    """``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` (shared-memory stager), warmed up in setup."""

    name = "dcp_async_process"
    kind = "PROCESS"
    shared = True

    def setup(self):
        import torch.distributed as dist

        if not dist.is_initialized():  # the process executor needs a process group, even of one rank
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        logging.getLogger().setLevel(logging.WARNING)  # its writer process logs every request at INFO
        super().setup()


class LightningAsync(Method):
    """Lightning ``AsyncCheckpointIO(TorchCheckpointIO())``; durable = teardown (wait) + fsync."""

    name = "lightning_async"

    def setup(self):
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def run(self, step):
        c = self.ctx
        path = self.out / f"ckpt_{step}.ckpt"
        device_sync(c.device)
        t0 = time.perf_counter()
        ckpt = {"state_dict": c.model.state_dict(), "optimizer_states": [c.opt.state_dict()], "global_step": step}
        self.io.save_checkpoint(ckpt, path)
        t1 = time.perf_counter()
        del ckpt
        self.io.teardown()  # waits for the writer thread
        fsync_tree(path)
        t2 = time.perf_counter()
        return {"blocking_s": t1 - t0, "safe_s": t1 - t0, "durable_s": t2 - t0}

    def close(self):
        self.io.teardown()


class AccelerateSaveState(Method):
    """``Accelerator.save_state`` (safetensors model + optimizer.bin); durable = + fsync of its files."""

    name = "accelerate_save_state"

    def setup(self):
        from accelerate import Accelerator

        logging.getLogger("accelerate").setLevel(logging.ERROR)
        self.acc = Accelerator(cpu=not self.ctx.device.startswith("cuda"))
        self.pmodel, self.popt = self.acc.prepare(self.ctx.model, self.ctx.opt)

    def run(self, step):
        path = self.out / f"step_{step}"
        device_sync(self.ctx.device)
        t0 = time.perf_counter()
        self.acc.save_state(str(path))
        t1 = time.perf_counter()
        fsync_tree(path)
        t2 = time.perf_counter()
        return {"blocking_s": t1 - t0, "safe_s": t1 - t0, "durable_s": t2 - t0}


class Ours(Method):
    """torch-ckpt ``CheckpointManager`` (kept open across rounds, as a training run keeps it)."""

    def __init__(self, ctx, name, persist, overlap, niceness):
        self.name = name
        super().__init__(ctx)
        self.kw = {"persist": persist, "overlap_staging": overlap, "writer_niceness": niceness}

    def setup(self):
        from torch_ckpt import CheckpointManager, TrainState

        self.mgr = CheckpointManager(self.out, keep_last=1, async_save=True, **self.kw)  # library defaults
        self.state = TrainState(model=self.ctx.model, optimizer=self.ctx.opt)

    def run(self, step):
        device_sync(self.ctx.device)
        t0 = time.perf_counter()
        h = self.save(step)
        t1 = time.perf_counter()
        h.staged.result()
        ts = time.perf_counter()
        h.committed.result()
        t2 = time.perf_counter()
        st = h.stats.as_dict()
        return {
            "blocking_s": t1 - t0,
            "safe_s": ts - t0,
            "durable_s": t2 - t0,
            "lib_staging_s": st["staging_s"],
            "lib_persist_s": st["persist_s"],
        }

    def save(self, step):
        return self.mgr.save(step, self.state)

    def retained_bytes(self):
        # the staging arena (private attribute; the manager may hold it through its checkpointer)
        for owner in (self.mgr, getattr(self.mgr, "_ckpt", None)):
            stager = getattr(owner, "_stager", None)
            if stager is not None:
                return int(getattr(stager, "allocated_bytes", 0) or 0)
        return 0

    def clean(self):
        for p in list(self.out.iterdir()):
            if p.name.startswith("step_") or p.name.startswith(".step_"):
                remove(p)

    def close(self):
        self.mgr.close()


class OursMemory(Ours):
    """torch-ckpt's memory tier: ``save(step, state, tier="memory")`` into a ``memory_root`` on ``/dev/shm``
    (tmpfs; the run directory when there is none). ``durable_s`` is the memory commit (files and manifest in
    tmpfs, renamed into place): it survives a process restart, not a node loss. The goal's denominator is
    ``memcpy`` (a memory save blocks <= 1.2x the copy floor)."""

    def __init__(self, ctx):
        super().__init__(ctx, "ours_memory", "thread", False, 0)

    def setup(self):
        import tempfile

        from torch_ckpt import CheckpointManager, TrainState

        shm = Path("/dev/shm")
        self.mem = Path(tempfile.mkdtemp(prefix="torch-ckpt-bench-", dir=shm if shm.is_dir() else self.out.parent))
        self.mgr = CheckpointManager(self.out, keep_last=1, async_save=True, memory_root=str(self.mem),
                                     memory_keep_last=1, **self.kw)
        self.state = TrainState(model=self.ctx.model, optimizer=self.ctx.opt)

    def save(self, step):
        return self.mgr.save(step, self.state, tier="memory")

    def clean(self):
        super().clean()
        for p in list(self.mem.iterdir()):
            if p.name.startswith("step_") or p.name.startswith(".step_"):
                remove(p)

    def close(self):
        super().close()
        remove(self.mem)


OURS_CONFIG = {
    "ours_thread": ("thread", False, 0),
    "ours_thread_overlap": ("thread", True, 0),
    "ours_process": ("process", False, 0),
    "ours_process_overlap": ("process", True, 0),
    "ours_thread_nice19": ("thread", False, 19),
}
PEERS = {c.name: c for c in (TorchSave, DcpSave, DcpAsyncDefault, DcpAsyncStager, DcpAsyncProcess, LightningAsync,
                              AccelerateSaveState)}


def make_method(name: str, ctx: Ctx) -> Method:
    if name == "ours_memory":
        return OursMemory(ctx)
    if name in OURS_CONFIG:
        return Ours(ctx, name, *OURS_CONFIG[name])
    return PEERS[name](ctx)


class Ctx:
    def __init__(self, model, opt, device, directory):
        self.model, self.opt, self.device, self.dir = model, opt, device, directory


# ------------------------------------------------------------------------------------- summary


def summarize(values: list[float]) -> tuple[float, float, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return statistics.median(vals), min(vals), max(vals)


def machine_info(device: str, directory: Path, dropper: CacheDropper) -> dict[str, Any]:
    import numpy

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "dir": str(directory),
        "drop_caches": dropper.permitted,
        "loadavg_start": os.getloadavg(),
        "git": git_info(),
    }
    for mod in ("lightning", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            info[mod] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype, opts = line.split()[:4]
            if str(directory).startswith(mnt) and len(mnt) >= len(best.split(" ")[1] if best else ""):
                best = f"{dev} {mnt} {fstype} {opts}"
        info["filesystem"] = best
        info["dirty_ratio"] = int(Path("/proc/sys/vm/dirty_ratio").read_text())
        info["dirty_background_ratio"] = int(Path("/proc/sys/vm/dirty_background_ratio").read_text())
    except OSError:
        pass
    return info


# ---------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="target state size (params + AdamW moments)")
    p.add_argument("--reps", type=int, default=5, help="kept rounds (one more warm-up round is discarded)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here (also printed to stdout)")
    p.add_argument("--dir", type=Path, default=None, help="parent directory for the checkpoints (default: $TMPDIR)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help=f"comma/space separated subset of {', '.join(ALL_METHODS)} (floors memcpy,disk always run)",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the live state lives (default: cuda if available)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the memcpy floor uses these)")
    p.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 2 reps")
    p.add_argument("--small-tensors", type=int, default=0, metavar="N",
                   help="instead of the GPT, a state of N tensors of --small-bytes each (e.g. 20000)")
    p.add_argument("--small-bytes", type=int, default=1024, help="bytes per tensor with --small-tensors")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache between methods")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib, args.reps = 0.25, 2
    args.methods = select_methods(p, args.methods, ALL_METHODS, also=FLOOR_NAMES)
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    directory = start_run("save_blocking_", args.threads, args.dir)
    dropper = CacheDropper(enabled=not args.no_drop_caches)
    methods: list[Method] = []
    sampler = RssSampler()
    try:
        t = time.perf_counter()
        if args.small_tensors:
            model, opt, n_layer = build_small_state(args.small_tensors, args.small_bytes, args.device)
        else:
            model, opt, n_layer = build_state(args.size_gib, args.device)
        tensors = unique_tensors(model, opt)
        state_bytes = sum(x.numel() * x.element_size() for x in tensors)
        log(
            f"state: {n_layer} layers, {len(tensors)} tensors, {state_bytes / 2**30:.3f} GiB "
            f"on {args.device} (built in {time.perf_counter() - t:.1f} s); dir {directory}"
        )
        floors = Floors(tensors, directory, args.device)
        ctx = Ctx(model, opt, args.device, directory)
        sampler.start()
        setup_rss: dict[str, int] = {}
        errors: dict[str, str] = {}
        for name in args.methods:
            before = sampler.measure()
            t = time.perf_counter()
            try:
                m = make_method(name, ctx)
                m.setup()
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                errors[name] = f"setup: {type(exc).__name__}: {exc}"
                log(f"{name}: setup failed: {errors[name]}")
                continue
            methods.append(m)
            setup_rss[name] = max(0, sampler.measure() - before)
            log(f"{name}: set up in {time.perf_counter() - t:.1f} s")

        rounds: list[dict[str, Any]] = []
        step = 0
        for r in range(args.reps + 1):
            t_round = time.perf_counter()
            rec: dict[str, Any] = {"warmup": r == 0, "loadavg": os.getloadavg()}
            dropper()
            rec["memcpy_s"] = floors.memcpy_s()
            dropper()
            rec["disk_s"] = floors.disk_s()
            dropper()
            rec["disk_writebehind_s"] = floors.disk_writebehind_s()
            rec["methods"] = {}
            for m in methods:
                if m.name in errors:
                    continue
                m.clean()
                dropper()
                gc.collect()
                malloc_trim()
                step += 1
                sampler.begin()
                try:
                    res = m.run(step)
                except Exception as exc:  # noqa: BLE001
                    sampler.end()
                    errors[m.name] = f"round {r}: {type(exc).__name__}: {exc}"
                    log(f"{m.name}: failed: {errors[m.name]}")
                    continue
                extra = sampler.end()
                res["peak_rss_bytes"] = extra + m.retained_bytes()
                res["retained_bytes"] = m.retained_bytes()
                rec["methods"][m.name] = res
            for m in methods:
                m.clean()
            rounds.append(rec)
            short = " ".join(f"{k}={v['blocking_s']:.3f}/{v['durable_s']:.2f}" for k, v in rec["methods"].items())
            log(
                f"round {r}{' (warm-up)' if r == 0 else ''} in {time.perf_counter() - t_round:.1f} s: "
                f"memcpy {rec['memcpy_s']:.3f} disk {rec['disk_s']:.2f} "
                f"(write-behind {rec['disk_writebehind_s']:.2f}) | {short}"
            )

        kept = rounds[1:]
        out_floors: dict[str, Any] = {"min": {}, "max": {}}
        for key in ("memcpy_s", "disk_s", "disk_writebehind_s"):
            med, lo, hi = summarize([rd[key] for rd in kept])
            out_floors[key], out_floors["min"][key], out_floors["max"][key] = med, lo, hi
        out_methods: dict[str, Any] = {}
        for m in methods:
            per = [(rd, rd["methods"][m.name]) for rd in kept if m.name in rd["methods"]]
            if not per:
                out_methods[m.name] = {"error": errors.get(m.name, "no result")}
                continue
            series: dict[str, list[float]] = {}
            for rd, res in per:
                for k, v in res.items():
                    series.setdefault(k, []).append(v)
                series.setdefault("blocking_over_memcpy", []).append(res["blocking_s"] / rd["memcpy_s"])
                series.setdefault("safe_over_memcpy", []).append(res["safe_s"] / rd["memcpy_s"])
                series.setdefault("durable_over_disk", []).append(res["durable_s"] / rd["disk_s"])
                series.setdefault("durable_over_disk_writebehind", []).append(
                    res["durable_s"] / rd["disk_writebehind_s"])
                series.setdefault("extra_rss_over_state", []).append(res["peak_rss_bytes"] / state_bytes)
            entry: dict[str, Any] = {"n": len(per), "min": {}, "max": {}}
            for k, vals in series.items():
                med, lo, hi = summarize(vals)
                if k in ("peak_rss_bytes", "retained_bytes"):
                    med, lo, hi = int(med), int(lo), int(hi)
                entry[k], entry["min"][k], entry["max"][k] = med, lo, hi
            entry["setup_rss_bytes"] = setup_rss.get(m.name, 0)
            entry["warmup"] = rounds[0]["methods"].get(m.name)
            if m.name in errors:
                entry["error"] = errors[m.name]
            out_methods[m.name] = entry
        for name, err in errors.items():
            out_methods.setdefault(name, {"error": err})
        info = machine_info(args.device, directory, dropper)
        info["loadavg_end"] = os.getloadavg()
        info["rss_samples"] = sampler.samples
        result = {
            "floors": out_floors,
            "methods": out_methods,
            "state_bytes": state_bytes,
            "n_tensors": len(tensors),
            "reps": args.reps,
            "machine": info,
            "config": {
                "size_gib": args.size_gib,
                "small_tensors": args.small_tensors,
                "small_bytes": args.small_bytes,
                "n_layer": n_layer,
                "d_model": D_MODEL,
                "vocab": VOCAB,
                "device": args.device,
                "threads": args.threads,
                "methods": args.methods,
                "warmup_rounds": 1,
                "runtime_s": None,
            },
            "rounds": rounds,
        }
    finally:
        sampler.stop()
        close_all(methods, log)
        shutil.rmtree(directory, ignore_errors=True)
    result["config"]["runtime_s"] = time.perf_counter() - t_start
    emit_json(result, args.json)
    log(f"done in {result['config']['runtime_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
