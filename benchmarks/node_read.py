#!/usr/bin/env python
"""The ranks of one node restoring that node's memory copy, against the tmpfs read floor and DCP's own load.

``--ranks`` processes (gloo on 127.0.0.1) form one simulated node (``LOCAL_WORLD_SIZE`` = ``--ranks``,
``GROUP_RANK`` 0), each holding the same replicated state of ``--mb`` MB (a dict of float32 tensors of
16 MiB, as data parallelism holds a model). Step 1 is saved to the memory tier (``memory_root`` under
``/dev/shm``, removed at the end); per repeat, all ranks build a new manager and time
``mgr.restore(state)`` into new tensors (every file's CRC-32 checked, the work split over the ranks), then
``torch.distributed.checkpoint.load`` of the same step directory into new tensors with the same process
group (DCP's own collective load, no checksums): a peer in the same run. Floor, per repeat: every rank
reading the step's data files at once (``os.preadv`` into one reused buffer; each rank needs every byte
of a replicated state), the slowest rank's seconds. All times are the slowest rank's, after a barrier.

    python benchmarks/node_read.py --ranks 2 --mb 128 --repeats 5 --json /tmp/node_read.json

JSON: ``{"cases": {"torch_ckpt"|"dcp_load": {"median_s", "min_s", "max_s"}}, "floors": {"tmpfs_read_s": ...},
"ratios": {"torch_ckpt_over_floor", "torch_ckpt_over_dcp_load", "dcp_load_over_floor"}, "bytes", "machine",
"config", "repeats"}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, git_info, make_log, spawn_ranks  # noqa: E402

log = make_log("node_read")
TENSOR_BYTES = 16 << 20


def _state(mb: int, fill: float) -> dict[str, Any]:
    import torch

    return {f"w{i:03d}": torch.full((TENSOR_BYTES // 4,), fill) for i in range(max(1, (mb << 20) // TENSOR_BYTES))}


def _read_floor_s(step_dir: Path) -> float:
    """Seconds to read the step's data files once into one reused 16 MiB buffer."""
    buf = memoryview(bytearray(TENSOR_BYTES))
    t0 = time.perf_counter()
    for path in sorted(step_dir.glob("*.distcp")):
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while n := os.preadv(fd, [buf], at):
                at += n
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _rank_main(rank: int, world: int, port: int, base: str, shm: str, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torch_ckpt import CheckpointManager

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def manager():
        return CheckpointManager(Path(base) / "disk", memory_root=shm, memory_replicas=0, async_save=False)

    def slowest(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        took = [None] * world
        dist.all_gather_object(took, time.perf_counter() - t0)
        return max(took)

    with manager() as mgr:
        mgr.save(1, _state(args.mb, 1.0), tier="memory")
    step_dir = Path(shm) / "step_000000001"
    nbytes = sum(p.stat().st_size for p in step_dir.glob("*.distcp"))
    repeats: list[dict[str, Any]] = []
    for r in range(args.repeats):
        rec: dict[str, Any] = {"loadavg": os.getloadavg()}
        rec["tmpfs_read_s"] = slowest(lambda: _read_floor_s(step_dir))

        def ours() -> None:
            fresh = _state(args.mb, 0.0)
            with manager() as mgr:
                assert mgr.restore(fresh) == 1 and mgr.restore_source == "memory", mgr.restore_source
            assert all(bool((t == 1.0).all()) for t in fresh.values())

        def dcp_load() -> None:
            fresh = _state(args.mb, 0.0)
            dcp.load(fresh, checkpoint_id=str(step_dir))
            assert all(bool((t == 1.0).all()) for t in fresh.values())

        rec["torch_ckpt_s"] = slowest(ours)
        rec["dcp_load_s"] = slowest(dcp_load)
        repeats.append(rec)
        if rank == 0:
            log(f"repeat {r}: torch-ckpt {rec['torch_ckpt_s']:.3f} s, dcp.load {rec['dcp_load_s']:.3f} s, "
                f"floor {rec['tmpfs_read_s']:.3f} s, load {rec['loadavg'][0]:.1f}")
    if rank == 0:
        results.put({"repeats": repeats, "bytes": nbytes})
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown, where torch's helper threads can abort after the work is done


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the node (>= 2)")
    p.add_argument("--mb", type=int, default=128, help="replicated state in MB (16 MiB tensors)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error("--ranks must be >= 2 (ranks sharing a node)")
    t_start, load_start = time.perf_counter(), os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="torch_ckpt_node_read_"))
    shm = Path(tempfile.mkdtemp(prefix="torch_ckpt_node_read_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        raw = spawn_ranks(_rank_main, args.ranks,
                          lambda rank, port, results: (rank, args.ranks, port, str(base), str(shm), args, results))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    reps = raw["repeats"]

    def stats(key: str) -> dict[str, float]:
        values = [rec[key] for rec in reps]
        return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}

    cases = {"torch_ckpt": stats("torch_ckpt_s"), "dcp_load": stats("dcp_load_s")}
    floors = {"tmpfs_read_s": stats("tmpfs_read_s")}
    floor = floors["tmpfs_read_s"]["median_s"]
    result = {"benchmark": "node_read", "cases": cases, "floors": floors,
              "ratios": {"torch_ckpt_over_floor": cases["torch_ckpt"]["median_s"] / floor,
                         "torch_ckpt_over_dcp_load": cases["torch_ckpt"]["median_s"] / cases["dcp_load"]["median_s"],
                         "dcp_load_over_floor": cases["dcp_load"]["median_s"] / floor},
              "bytes": raw["bytes"],
              "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                          "threads_per_rank": args.threads, "memory_root": str(shm.parent), "git": git_info()},
              "config": {**vars(args), "json": None if args.json is None else str(args.json)},
              "repeats": reps, "runtime_s": time.perf_counter() - t_start}
    emit_json(result, args.json)
    log("torch-ckpt/floor {torch_ckpt_over_floor:.2f}x, torch-ckpt/dcp.load {torch_ckpt_over_dcp_load:.2f}x".format(
        **result["ratios"]))
    return result


if __name__ == "__main__":
    main()
