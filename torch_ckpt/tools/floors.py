"""This machine's checkpointing floors, measured (``torch-ckpt bench``), and what they imply.

Three measurements bound how fast a save and a restore can be here:

* **copy into preallocated memory** (host memory bandwidth, and device-to-host into pinned memory
  when CUDA is available): the blocking part of an asynchronous save, which copies the state into
  a staging arena allocated once and reused;
* **write + fsync** into the checkpoint directory: how long until a save is durable;
* **read** back with the page cache dropped for that file (``posix_fadvise(DONTNEED)``, so
  "cold-ish": the device's caches still help): a lower bound on restore time.

Each phase stops early at a time limit (measuring what it did), so a default run stays under about
10 s even on slow disks. Bandwidths are in GB/s (10^9 bytes per second), as in ``torch-ckpt plan``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from torch_ckpt.tools.sizing import interval_plan

__all__ = ["measure_copy", "measure_d2h", "measure_floors", "measure_write_read", "recommend"]

_IO_CHUNK = 16 << 20
_PATTERN_BYTES = 16 << 20


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def measure_copy(nbytes: int, *, repeats: int = 3, time_limit_s: float = 2.0) -> dict[str, Any]:
    """Host memory copy into a preallocated, already faulted-in buffer (best of ``repeats``).

    Returns:
        ``{"copy_gbps", "copy_bytes", "copy_repeats"}``.
    """
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # faulted in, like the reused staging arena
    best, done, start = float("inf"), 0, time.perf_counter()
    while done < repeats:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        done += 1
        if time.perf_counter() - start > time_limit_s:
            break
    del src, dst
    return {"copy_gbps": _gbps(nbytes, best), "copy_bytes": nbytes, "copy_repeats": done}


def measure_d2h(nbytes: int, *, repeats: int = 3, time_limit_s: float = 2.0) -> dict[str, Any] | None:
    """Device-to-host copy into pinned memory on the current CUDA device; None without CUDA.

    Returns:
        ``{"d2h_gbps", "d2h_device"}`` or None.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)  # warm-up
    torch.cuda.synchronize()
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > time_limit_s:
            break
    name = torch.cuda.get_device_name()
    del src, dst
    return {"d2h_gbps": _gbps(nbytes, best), "d2h_device": name}


def measure_write_read(directory: str | os.PathLike, nbytes: int, *, time_limit_s: float = 4.0) -> dict[str, Any]:
    """Write ``nbytes`` (random data) into a temporary file of ``directory``, fsync, then read it back
    after dropping it from the page cache. The file is always removed.

    Returns:
        ``{"write_gbps", "write_bytes", "write_s", "read_gbps", "read_bytes", "read_s", "read_cold"}``;
        ``read_cold`` says whether the page cache could be dropped (``posix_fadvise``).

    Raises:
        OSError: the directory is not writable (or the disk is full).
    """
    import numpy as np

    pattern = np.random.default_rng(0).bytes(min(nbytes, _PATTERN_BYTES))
    view = memoryview(pattern)
    path = os.path.join(os.fspath(directory), f".torch-ckpt-bench.{os.getpid()}.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        written, t0 = 0, time.perf_counter()
        try:
            while written < nbytes:
                off = written % len(view)
                n = os.write(fd, view[off:off + min(_IO_CHUNK, nbytes - written, len(view) - off)])
                written += n
                if time.perf_counter() - t0 > time_limit_s:
                    break
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0

        cold = False
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                cold = True
            buf = bytearray(_IO_CHUNK)
            read, t0 = 0, time.perf_counter()
            while n := os.readv(fd, [buf]):
                read += n
                if time.perf_counter() - t0 > time_limit_s:
                    break
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return {"write_gbps": _gbps(written, write_s), "write_bytes": written, "write_s": write_s,
            "read_gbps": _gbps(read, read_s), "read_bytes": read, "read_s": read_s, "read_cold": cold}


def measure_floors(directory: str | os.PathLike = ".", *, size_bytes: int = 256 << 20,
                   time_limit_s: float = 4.0) -> dict[str, Any]:
    """All floors: memory copy, device-to-host (CUDA only), write+fsync and read in ``directory``.

    Args:
        directory: where checkpoints would be written (a temporary file is created and removed).
        size_bytes: bytes per measurement.
        time_limit_s: each disk phase stops after about this long (memory copies after half of it).

    Returns:
        ``{"directory", "size_bytes", "copy_gbps", "d2h_gbps"`` (None without CUDA) ``, "d2h_device",
        "write_gbps", "read_gbps", "read_cold", ..., "elapsed_s"}``.
    """
    start = time.perf_counter()
    out: dict[str, Any] = {"directory": os.path.abspath(os.fspath(directory)), "size_bytes": int(size_bytes)}
    out.update(measure_copy(size_bytes, time_limit_s=time_limit_s / 2))
    out.update(measure_d2h(size_bytes, time_limit_s=time_limit_s / 2) or {"d2h_gbps": None, "d2h_device": None})
    out.update(measure_write_read(directory, size_bytes, time_limit_s=time_limit_s))
    out["elapsed_s"] = time.perf_counter() - start
    return out


def recommend(floors: dict[str, Any], state_bytes: float, *, mtbf_s: float | None = None,
              step_time_s: float | None = None) -> dict[str, Any]:
    """Save cost, durability lag, restore time and (with ``mtbf_s``) the save interval implied by ``floors``.

    The save cost (training stall) of an asynchronous save is the copy of the state into the
    preallocated staging arena: device-to-host when CUDA was measured, host memory copy otherwise.
    It becomes durable after the write (``state_bytes`` at the write+fsync bandwidth), which is the
    durability lag in the Young/Daly plan (see :func:`torch_ckpt.tools.sizing.interval_plan`).

    Returns:
        ``{"state_bytes", "staging_floor"`` ("d2h" or "copy") ``, "save_cost_s", "write_s",
        "sync_save_cost_s"`` (stall of a synchronous save: copy + write) ``, "restore_read_s",
        "interval"`` (the plan dict, or None without ``mtbf_s``) ``}``.
    """
    floor = "d2h" if floors.get("d2h_gbps") else "copy"
    cost = state_bytes / (floors[f"{floor}_gbps"] * 1e9)
    write = state_bytes / (floors["write_gbps"] * 1e9)
    out: dict[str, Any] = {
        "state_bytes": float(state_bytes), "staging_floor": floor, "save_cost_s": cost, "write_s": write,
        "sync_save_cost_s": cost + write, "restore_read_s": state_bytes / (floors["read_gbps"] * 1e9),
        "interval": None,
    }
    if mtbf_s is not None:
        out["interval"] = interval_plan(mtbf_s, cost, durability_lag_s=write, step_time_s=step_time_s)
    return out
