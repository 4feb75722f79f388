#!/usr/bin/env python
"""Recovery after a node loss: a node's state back from a partner's memory vs from the durable tier (issue 29).

Two simulated nodes (two processes, one gloo rank each, ``GROUP_RANK`` 0 and 1, on 127.0.0.1) each hold a
replicated state of ``--mb`` MB (a dict of float32 tensors of 16 MiB). Each node has its own disk root
(under a temporary directory) and ``memory_root`` (under ``/dev/shm``, removed at the end); the durable
tier is a moto S3 server on 127.0.0.1 (a thread of the parent process). Setup: step 1 saved to memory on
both nodes (each node's copy replicated to the other over gloo, ``memory_replicas=1``). Per repeat, both
ranks build a new manager and time ``mgr.restore(state)``:

* ``peer``: node 1's ``memory_root`` removed first; node 1 gets step 1 streamed back from node 0's
  replica (``restore_source == "memory-peer"``), CRC-checked, then loaded;
* ``memory``: nothing removed; every node loads its own memory copy (the load part of ``peer``);
* ``durable`` (after the ``peer`` and ``memory`` repeats): step 2 saved to disk and the durable tier
  (``wait_durable``), newer than the memory step; node 1's ``memory_root`` and disk root removed first, so
  node 1 fetches its files from S3 (``restore_source == "durable-node"``).

Floors, per repeat: ``gloo_s``, one ``dist.send``/``recv`` of the replica's byte count from rank 0 to
rank 1 (best of 3), and ``tmpfs_read_s``, an ``os.read`` of node 0's replica files in 16 MiB chunks;
``floor_s = gloo_s + tmpfs_read_s`` (bytes over the loopback gloo bandwidth plus the tmpfs read); not in it,
informative: ``tmpfs_write_crc_s``, node 1 writing as many bytes into its tmpfs with a CRC-32 of each chunk
(the receiver's side of the stream).
Ratios: ``peer / floor``, ``peer / durable``, ``peer / memory`` of node 1's median times, and
``stream / floor``: node 1's seconds in the peer stream (``repair``, timed by a wrapper) over the floor, and
``peer / (floor + memory)``: against the stream floor plus node 1's restore of an intact own copy.
One more ``peer`` restore, untimed, runs under cProfile on both ranks (top entries in ``profile``).

    python benchmarks/recovery.py --mb 256 --repeats 5 --json benchmarks/results/recovery_cpu_256mb_session13.json

JSON: ``{"cases": {"peer"|"memory"|"durable": {"node1_s", "max_s", "min", "max", "sources"}}, "floors":
{...}, "ratios": {...}, "bytes": {...}, "machine": {"loadavg_start", "loadavg_end", ...}, "repeats": [...],
"profile": {"node0": [...], "node1": [...]}}``; times are medians over ``--repeats`` with their min and max.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, free_port, git_info, make_log, spawn_ranks  # noqa: E402

log = make_log("recovery")
TENSOR_BYTES = 16 << 20
CASES = ("peer", "memory", "durable")
#: the timed parts of a restore: the stream, the durable listing and fetch, the inventory gathering (``_plan``),
#: the agreement with the durable steps (``_decide``; inside ``load_into`` when a read precedes it) and the load
PARTS = ("repair", "listed", "fetch", "_plan", "_decide", "load_into")


def _state(mb: int, fill: float) -> dict[str, Any]:
    import torch

    n = max(1, (mb << 20) // TENSOR_BYTES)
    return {f"w{i:03d}": torch.full((TENSOR_BYTES // 4,), fill + i, dtype=torch.float32) for i in range(n)}


def _files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _tmpfs_read_s(directory: Path) -> float:
    """Seconds to ``os.read`` every file of ``directory`` in 16 MiB chunks (tmpfs: a copy out of RAM)."""
    t0 = time.perf_counter()
    for p in sorted(directory.iterdir()):
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.read(fd, TENSOR_BYTES):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _tmpfs_write_crc_s(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to ``path`` in 16 MiB ``os.write`` calls, CRC-32 of each (the receiver's work)."""
    from torch_ckpt.storage._crc import crc32

    chunk, crc = memoryview(bytearray(os.urandom(1 << 20)) * (TENSOR_BYTES >> 20)), 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, nbytes, TENSOR_BYTES):
            piece = chunk[:min(TENSOR_BYTES, nbytes - off)]
            os.write(fd, piece)
            crc = crc32(piece, crc)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def _gloo_s(rank: int, nbytes: int) -> float:
    """Best of 3 of one ``send`` of ``nbytes`` from rank 0 to rank 1 (the receiver's clock); every rank gets it."""
    import torch
    import torch.distributed as dist

    buf, best = torch.ones(nbytes, dtype=torch.uint8), float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)
        best = min(best, time.perf_counter() - t0)
    out = [None, None]
    dist.all_gather_object(out, best if rank == 1 else None)
    return out[1]


def _time_calls(owner: Any, name: str, parts: dict[str, float]) -> None:
    """Wrap ``owner.name`` so that every call adds its seconds to ``parts[name]`` (observes, changes nothing)."""
    fn = getattr(owner, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)


class Node:
    """One rank's side: its roots, the managers' settings, and the timed restores."""

    def __init__(self, rank: int, base: Path, shm: Path, url: str, options: dict, mb: int,
                 listing_latency_s: float = 0.0) -> None:
        self.rank, self.disk, self.mem = rank, base / f"node{rank}" / "disk", shm / f"node{rank}"
        self.kwargs = {"memory_root": str(self.mem), "memory_replicas": 1, "durable_url": url,
                       "storage_options": options}
        self.target = _state(mb, fill=-1.0)
        self.parts: dict[str, float] = {}  # seconds of the timed parts of the last restore on this rank
        from torch_ckpt.manager import _memory
        from torch_ckpt.save import _checkpointer
        from torch_ckpt.tiers._durable import DurableTier

        if listing_latency_s:  # a remote store's round trips: waited with the GIL released, as a socket wait is
            def slow(tier, original=DurableTier.listed):
                time.sleep(listing_latency_s)
                return original(tier)
            DurableTier.listed = slow
        for owner, name in ((_memory, "repair"), (DurableTier, "listed"), (DurableTier, "fetch"),
                            (_memory.MemoryTier, "_plan"), (_memory.MemoryTier, "_decide"),
                            (_checkpointer, "load_into")):
            _time_calls(owner, name, self.parts)

    def manager(self, **extra):
        from torch_ckpt import CheckpointManager

        return CheckpointManager(self.disk, **self.kwargs, **extra)

    def restore(self, wipe: tuple[Path, ...], profile: cProfile.Profile | None = None) -> dict[str, Any]:
        """Node 1 removes ``wipe``; both ranks build a manager and time ``restore``.

        Returns ``{"node0"|"node1": (seconds, step, source, parts)}``, ``parts`` the seconds in the peer stream
        (``repair``), the durable listing (``listed``) and the durable fetch (``fetch``) on that rank.
        """
        import torch.distributed as dist

        if self.rank == 1:
            for path in wipe:
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        with self.manager() as mgr:
            dist.barrier()
            self.parts.clear()
            if profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            step = mgr.restore(self.target)
            dt = time.perf_counter() - t0
            if profile is not None:
                profile.disable()
            source = mgr.restore_source
        out: list[Any] = [None, None]
        dist.all_gather_object(out, (dt, step, source, dict(self.parts)))
        return {"node0": out[0], "node1": out[1]}


def _rank_main(rank: int, port: int, base: str, shm: str, url: str, options: dict, args: argparse.Namespace,
               results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    node = Node(rank, Path(base), Path(shm), url, options, args.mb, args.listing_latency_s)
    source = _state(args.mb, fill=1.0)
    t0 = time.perf_counter()
    with node.manager(async_save=False) as mgr:
        mgr.save(1, source, tier="memory")
    if rank == 0:
        log(f"step 1 saved to memory and replicated in {time.perf_counter() - t0:.1f} s")
    replica = node.mem / ".peers" / f"node-{1 - rank}" / "step_000000001"
    nbytes = _files_bytes(replica)
    repeats: list[dict[str, Any]] = []
    for r in range(args.repeats):
        rec: dict[str, Any] = {"loadavg": os.getloadavg(), "gloo_s": _gloo_s(rank, nbytes)}
        floor = _tmpfs_read_s(replica) if rank == 0 else _tmpfs_write_crc_s(node.mem / "_floor.bin", nbytes)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, floor)
        rec["tmpfs_read_s"], rec["tmpfs_write_crc_s"] = gathered
        rec["peer"] = node.restore((node.mem,))
        rec["memory"] = node.restore(())
        repeats.append(rec)
        if rank == 0:
            log(f"repeat {r}: peer {rec['peer']['node1'][0]:.3f} s memory {rec['memory']['node1'][0]:.3f} s "
                f"floor {rec['gloo_s'] + rec['tmpfs_read_s']:.3f} s load {rec['loadavg'][0]:.1f}")
    profile = cProfile.Profile()
    profiled = node.restore((node.mem,), profile)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.profile_top)
    profiles: list[Any] = [None, None]
    dist.all_gather_object(profiles, text.getvalue().splitlines())
    t0 = time.perf_counter()
    with node.manager() as mgr:
        mgr.save(2, source)
        mgr.wait()
        assert mgr.wait_durable(600), "the durable upload of step 2 did not finish"
    if rank == 0:
        log(f"step 2 saved to disk and the durable tier in {time.perf_counter() - t0:.1f} s")
    fetched = 0
    for r, rec in enumerate(repeats):
        rec["durable"] = node.restore((node.mem, node.disk))
        rec["loadavg_durable"] = os.getloadavg()
        if rank == 1:
            fetched = _files_bytes(node.disk / "step_000000002")
        if rank == 0:
            log(f"repeat {r}: durable {rec['durable']['node1'][0]:.3f} s load {rec['loadavg_durable'][0]:.1f}")
    if rank == 1:
        results.put({"repeats": repeats, "replica_bytes": nbytes, "durable_fetched_bytes": fetched,
                     "profiled_restore": profiled, "profile": {"node0": profiles[0], "node1": profiles[1]}})
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown, where torch's helper threads can abort after the work is done


def summarize(raw: dict[str, Any], mb: int) -> dict[str, Any]:
    """Medians, min and max over the repeats of every case and floor, and the issue's ratios."""
    reps = raw["repeats"]

    def stat(vals: list[float]) -> dict[str, float]:
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    cases = {}
    for case in CASES:
        node1 = [rec[case]["node1"][0] for rec in reps]
        both = [max(rec[case]["node0"][0], rec[case]["node1"][0]) for rec in reps]
        cases[case] = {"node1_s": stat(node1), "max_s": stat(both),
                       "sources": sorted({f"node{n}:{rec[case][f'node{n}'][2]}" for rec in reps for n in (0, 1)}),
                       "steps": sorted({rec[case][f"node{n}"][1] for rec in reps for n in (0, 1)}),
                       "parts_s": {f"node{n}_{part}": stat([rec[case][f"node{n}"][3].get(part, 0.0) for rec in reps])
                                   for n in (0, 1) for part in PARTS
                                   if any(part in rec[case][f"node{n}"][3] for rec in reps)}}
    gloo = [rec["gloo_s"] for rec in reps]
    read = [rec["tmpfs_read_s"] for rec in reps]
    floor = [g + t for g, t in zip(gloo, read)]
    nbytes = raw["replica_bytes"]
    floors = {"gloo_s": stat(gloo), "tmpfs_read_s": stat(read), "floor_s": stat(floor),
              "tmpfs_write_crc_s": stat([rec["tmpfs_write_crc_s"] for rec in reps]),
              "gloo_MiB_s": stat([nbytes / g / 2**20 for g in gloo])}
    peer = [rec["peer"]["node1"][0] for rec in reps]
    med = {c: cases[c]["node1_s"]["median"] for c in CASES}
    ratios = {
        "peer_over_floor": med["peer"] / floors["floor_s"]["median"],
        "peer_over_durable": med["peer"] / med["durable"],
        "peer_over_memory": med["peer"] / med["memory"],
        "stream_over_floor": cases["peer"]["parts_s"]["node1_repair"]["median"] / floors["floor_s"]["median"],
        "peer_over_floor_plus_memory": med["peer"] / (floors["floor_s"]["median"] + med["memory"]),
        "peer_over_floor_per_repeat": stat([p / f for p, f in zip(peer, floor)]),
        "peer_over_durable_per_repeat": stat([p / rec["durable"]["node1"][0] for p, rec in zip(peer, reps)]),
        "goal": {"peer_over_floor": 1.3, "peer_over_durable": 0.25},
    }
    ratios["met"] = {"peer_over_floor": ratios["peer_over_floor"] <= 1.3,
                     "peer_over_durable": ratios["peer_over_durable"] <= 0.25}
    return {"cases": cases, "floors": floors, "ratios": ratios,
            "bytes": {"state_mb": mb, "replica_bytes": nbytes, "durable_fetched_bytes": raw["durable_fetched_bytes"]}}


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="state per node in MB (16 MiB tensors)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--dir", type=Path, default=None, help="parent of the disk roots (default: $TMPDIR)")
    p.add_argument("--profile-top", type=int, default=25, help="cProfile entries kept per rank (peer restore)")
    p.add_argument("--listing-latency-s", type=float, default=0.0,
                   help="seconds added before every durable listing (a remote store's round trips; default 0)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="torch_ckpt_recovery_", dir=str(args.dir) if args.dir else None))
    shm = Path(tempfile.mkdtemp(prefix="torch_ckpt_recovery_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    s3_port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{s3_port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        options = {"key": "bench", "secret": "bench", "skip_instance_cache": True, "use_listings_cache": False,
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        raw = spawn_ranks(_rank_main, 2, lambda rank, port, results: (
            rank, port, str(base), str(shm), "s3://bench/run", options, args, results))
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result = {"benchmark": "recovery", **summarize(raw, args.mb),
              "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                          "threads_per_rank": args.threads, "git": git_info(),
                          "store": "moto S3 server (thread of the parent process, in memory, loopback)",
                          "memory_root": "/dev/shm (tmpfs)"},
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "repeats": raw["repeats"], "profiled_restore": raw["profiled_restore"], "profile": raw["profile"],
              "runtime_s": time.perf_counter() - t_start}
    emit_json(result, args.json)
    r = result["ratios"]
    log(f"peer/floor {r['peer_over_floor']:.2f}x peer/durable {r['peer_over_durable']:.2f}x "
        f"peer/memory {r['peer_over_memory']:.2f}x in {result['runtime_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
