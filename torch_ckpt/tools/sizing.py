"""Checkpoint sizing and interval plans (``torch-ckpt plan``), and this machine's floors (``bench``).

Sizes in bytes, reported in decimal units (1 GB = 10^9 bytes); bandwidths in GB/s; times in seconds.
The sizing model is mixed-precision training with a data-parallel sharded optimizer (ZeRO-1,
Megatron's distributed optimizer, FSDP): the weights (``params x bytes(param_dtype)``) are split
over the ``tp x pp`` model-parallel ranks and replicated over ``dp``; the fp32 optimizer state (a
master copy unless the weights are fp32, plus the moments: Adam 2, SGD with momentum 1) is split
``tp x pp x dp`` ways. A checkpoint stores each byte once; a rank stages (device to host) its whole
local state, so blocking time is that over the per-GPU device-to-host bandwidth and a node needs
host RAM for its ranks' copies; the write time is the total over the aggregate storage bandwidth.

The floors bound a save and a restore here: host copy into preallocated memory (and device to
pinned host with CUDA: the blocking part of an asynchronous save), write + fsync (the time until
durable) and read with the page cache dropped (``posix_fadvise(DONTNEED)``: a lower bound on a
restore). Each phase stops at a time limit, measuring what it did.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from typing import Any

from torch_ckpt._values import check_int, to_seconds
from torch_ckpt.policy._schedule import checkpoint_interval, expected_overhead, young_interval

__all__ = ["DTYPE_BYTES", "OPTIMIZER_MOMENTS", "checkpoint_size", "interval_plan", "measure_floors", "parse_count",
           "recommend"]

#: Bytes per element of the supported parameter dtypes.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: fp32 moment tensors per parameter kept by each optimizer (``sgd`` means SGD with momentum).
OPTIMIZER_MOMENTS: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 1, "none": 0}
_COUNT_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_IO_CHUNK = _PATTERN_BYTES = 16 << 20


def parse_count(value: str | float | int) -> float:
    """A parameter count: ``70e9``, ``70000000000``, ``70B``, ``7.5b``, ``1.2T``, ``350M`` (suffix K, M, B/G, T).

    Raises:
        ValueError: not a positive, finite count (the message repeats it).
    """
    count = math.nan
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", value.lower())
        try:
            count = float(match.group(1)) * _COUNT_SUFFIX[match.group(2)] if match else math.nan
        except ValueError:
            pass
    else:
        count = float(value)
    if not math.isfinite(count) or count <= 0:
        raise ValueError(f"invalid parameter count {value!r}: expected a positive number such as 70e9 or 70B")
    return count


def _positive(name: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def checkpoint_size(params: float, *, tp: int = 1, pp: int = 1, dp: int = 1, param_dtype: str = "bf16",
                    optimizer: str = "adam", gpus_per_node: int = 8, d2h_gbps: float = 25.0,
                    storage_gbps: float = 100.0) -> dict[str, Any]:
    """Bytes per component and per rank, staging RAM, blocking and write time of one checkpoint.

    For 70e9 bf16 parameters with Adam on tp=8, dp=32: model 140 GB, optimizer 840 GB (fp32 master
    280 GB + two moments 560 GB), total 980 GB; 17.5 GB of weights and 3.28 GB of optimizer state per
    rank; about 9.8 s to write at 100 GB/s.

    Args:
        params: number of model parameters; ``tp``, ``pp``, ``dp``: the parallel degrees (the
            optimizer is sharded over ``dp``); ``param_dtype``: a key of :data:`DTYPE_BYTES`;
            ``optimizer``: a key of :data:`OPTIMIZER_MOMENTS`; ``gpus_per_node``: ranks per node;
            ``d2h_gbps``: device-to-host bandwidth of one GPU; ``storage_gbps``: aggregate write
            bandwidth of the checkpoint storage (both GB/s).

    Returns:
        A JSON-serialisable dict; byte counts end in ``_bytes``, times in ``_s``.

    Raises:
        ValueError: an argument is out of range, or an unknown dtype/optimizer is named.
    """
    params = _positive("params", params)
    tp, pp, dp, gpus_per_node = (check_int(n, v, 1) for n, v in (("tp", tp), ("pp", pp), ("dp", dp),
                                                                  ("gpus_per_node", gpus_per_node)))
    d2h_gbps, storage_gbps = _positive("d2h_gbps", d2h_gbps), _positive("storage_gbps", storage_gbps)
    if param_dtype not in DTYPE_BYTES:
        raise ValueError(f"param_dtype must be one of {sorted(DTYPE_BYTES)}, got {param_dtype!r}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_MOMENTS)}, got {optimizer!r}")
    world = tp * pp * dp
    model = params * DTYPE_BYTES[param_dtype]
    moments = params * 4 * OPTIMIZER_MOMENTS[optimizer]
    master = params * 4 if optimizer != "none" and param_dtype != "fp32" else 0.0
    total, optim = model + master + moments, master + moments
    staged = model / (tp * pp) + optim / world
    return {"params": params, "tp": tp, "pp": pp, "dp": dp, "world_size": world,
            "nodes": math.ceil(world / gpus_per_node), "param_dtype": param_dtype, "optimizer": optimizer,
            "model_bytes": model, "optimizer_master_bytes": master, "optimizer_moments_bytes": moments,
            "optimizer_bytes": optim, "total_bytes": total, "model_bytes_per_rank": model / (tp * pp),
            "optimizer_bytes_per_rank": optim / world, "staged_bytes_per_rank": staged,
            "written_bytes_per_rank": total / world, "gpus_per_node": gpus_per_node,
            "host_ram_per_node_bytes": staged * min(gpus_per_node, world), "d2h_gbps": d2h_gbps,
            "blocking_s": staged / (d2h_gbps * 1e9), "storage_gbps": storage_gbps,
            "write_s": total / (storage_gbps * 1e9)}


def interval_plan(mtbf_s: float, cost_s: float, *, durability_lag_s: float = 0.0,
                  step_time_s: float | None = None) -> dict[str, Any]:
    """Young and Daly intervals and the expected cost of saving at the recommended one.

    The recommended interval is :func:`torch_ckpt.policy._schedule.checkpoint_interval`'s, as the
    runtime ``YoungDaly`` policy uses: Daly's (2006), raised to the time a save needs to become
    durable (``cost_s + durability_lag_s``) so saves never pile up; in steps (``step_time_s``), the
    nearest whole step of Daly's interval, raised to the durability time rounded up.

    Returns:
        ``mtbf_s``, ``save_cost_s``, ``durability_lag_s``, ``young_interval_s``, ``daly_interval_s``,
        ``recommended_interval_s``, ``limited_by`` (``"daly"`` or ``"durability"``),
        ``expected_overhead`` and ``expected_lost_work_s`` (at the recommended interval),
        ``young_expected_overhead``, and with ``step_time_s`` also it and ``interval_steps``.

    Raises:
        ValueError: zero or negative MTBF, cost or step time.
    """
    cost_s = to_seconds("cost_s (the save cost)", cost_s, positive=True)
    if step_time_s is not None:
        step_time_s = to_seconds("step_time_s", step_time_s, positive=True)
    chosen = checkpoint_interval(mtbf_s, cost_s, durability_lag_s, step_time_s)
    young = young_interval(mtbf_s, cost_s)
    plan: dict[str, Any] = {
        "mtbf_s": float(mtbf_s), "save_cost_s": float(cost_s), "durability_lag_s": float(durability_lag_s),
        "young_interval_s": young, "daly_interval_s": chosen.optimal_interval_s,
        "recommended_interval_s": chosen.interval_s,
        "limited_by": "daly" if chosen.limited_by == "formula" else chosen.limited_by,
        "expected_overhead": chosen.expected_overhead, "expected_lost_work_s": chosen.expected_lost_work_s,
        "young_expected_overhead": expected_overhead(young, cost_s, mtbf_s, durability_lag_s)}
    if step_time_s is not None:
        plan.update(step_time_s=step_time_s, interval_steps=chosen.interval_steps)
    return plan


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _best_copy(nbytes: int, time_limit_s: float, *, cuda: bool) -> tuple[float, int]:
    """``(best seconds, copies run)`` of up to 3 copies into preallocated memory (``cuda``: device to pinned host)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu").fill_(7)
    # faulted in, like the reused staging arena
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if cuda else torch.zeros(nbytes, dtype=torch.uint8)
    if cuda:
        dst.copy_(src)  # warm-up
        torch.cuda.synchronize()
    best, done, start = float("inf"), 0, time.perf_counter()
    while done < 3:
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best, done = min(best, time.perf_counter() - t0), done + 1
        if time.perf_counter() - start > time_limit_s:
            break
    return best, done


def _measure_write_read(directory: str | os.PathLike, nbytes: int, *, time_limit_s: float = 4.0) -> dict[str, Any]:
    """Write random data into a temporary file, fsync, drop it from the page cache, read it back, remove it."""
    import numpy as np

    view = memoryview(np.random.default_rng(0).bytes(min(nbytes, _PATTERN_BYTES)))
    path = os.path.join(os.fspath(directory), f".torch-ckpt-bench.{os.getpid()}.tmp")
    # opened before the try: a file of that name that is not ours is never removed
    out = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb", buffering=0)
    try:
        with out:
            written, t0 = 0, time.perf_counter()
            while written < nbytes and time.perf_counter() - t0 <= time_limit_s:
                off = written % len(view)
                written += out.write(view[off:off + min(_IO_CHUNK, nbytes - written, len(view) - off)])
            os.fsync(out.fileno())
        write_s = time.perf_counter() - t0
        with open(path, "rb", buffering=0) as f:
            cold = hasattr(os, "posix_fadvise")
            if cold:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            buf, read, t0 = bytearray(_IO_CHUNK), 0, time.perf_counter()
            while (n := f.readinto(buf)) and time.perf_counter() - t0 <= time_limit_s:
                read += n
            read += n
            read_s = time.perf_counter() - t0
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return {"write_gbps": _gbps(written, write_s), "write_bytes": written, "write_s": write_s,
            "read_gbps": _gbps(read, read_s), "read_bytes": read, "read_s": read_s, "read_cold": cold}


def measure_floors(directory: str | os.PathLike = ".", *, size_bytes: int = 256 << 20,
                   time_limit_s: float = 4.0) -> dict[str, Any]:
    """All floors: memory copy, device-to-host (CUDA only), write + fsync and read in ``directory``.

    Args:
        directory: where checkpoints would be written (a temporary file is created and removed).
        size_bytes: bytes per measurement.
        time_limit_s: each disk phase stops after about this long (memory copies after half of it).

    Returns:
        ``{"directory", "size_bytes", "copy_gbps", "copy_bytes", "copy_repeats", "d2h_gbps"`` (None
        without CUDA) ``, "d2h_device", "write_gbps", "write_bytes", "write_s", "read_gbps",
        "read_bytes", "read_s", "read_cold"`` (whether the page cache could be dropped) ``, "elapsed_s"}``.

    Raises:
        OSError: the directory is not writable (or the disk is full).
    """
    start = time.perf_counter()
    out: dict[str, Any] = {"directory": os.path.abspath(os.fspath(directory)), "size_bytes": int(size_bytes)}
    import torch

    best, done = _best_copy(size_bytes, time_limit_s / 2, cuda=False)
    out.update(copy_gbps=_gbps(size_bytes, best), copy_bytes=size_bytes, copy_repeats=done, d2h_gbps=None,
               d2h_device=None)
    if torch.cuda.is_available():
        out.update(d2h_gbps=_gbps(size_bytes, _best_copy(size_bytes, time_limit_s / 2, cuda=True)[0]),
                   d2h_device=torch.cuda.get_device_name())
    out.update(_measure_write_read(directory, size_bytes, time_limit_s=time_limit_s))
    out["elapsed_s"] = time.perf_counter() - start
    return out


def recommend(floors: dict[str, Any], state_bytes: float, *, mtbf_s: float | None = None,
              step_time_s: float | None = None) -> dict[str, Any]:
    """Save cost, durability lag, restore time and (with ``mtbf_s``) the save interval implied by ``floors``.

    An asynchronous save stalls for the copy into the staging arena (device-to-host when CUDA was
    measured, else the host copy) and is durable after the write, its lag in :func:`interval_plan`.

    Returns:
        ``{"state_bytes", "staging_floor"`` ("d2h" or "copy") ``, "save_cost_s", "write_s",
        "sync_save_cost_s"`` (a synchronous save's stall: copy + write) ``, "restore_read_s",
        "interval"`` (the plan, or None without ``mtbf_s``) ``}``.
    """
    floor = "d2h" if floors.get("d2h_gbps") else "copy"
    cost, write = state_bytes / (floors[f"{floor}_gbps"] * 1e9), state_bytes / (floors["write_gbps"] * 1e9)
    return {"state_bytes": float(state_bytes), "staging_floor": floor, "save_cost_s": cost, "write_s": write,
            "sync_save_cost_s": cost + write, "restore_read_s": state_bytes / (floors["read_gbps"] * 1e9),
            "interval": None if mtbf_s is None else interval_plan(mtbf_s, cost, durability_lag_s=write,
                                                                  step_time_s=step_time_s)}
