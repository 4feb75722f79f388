"""Durable upload of a multi-node checkpoint to an S3-compatible server: N uploaders vs rank 0 alone.

A checkpoint of ``--nodes`` simulated nodes, each holding ``--files-per-node`` shard files of
``--file-mib`` MiB, is uploaded to a moto S3 server (its own process) through
:meth:`torch_ckpt.tiers._durable.DurableTier.upload_node` (every node uploads its own files, one process
per node, node 0 commits once all markers are there) and through :meth:`DurableTier.upload` from one
process (rank 0 uploads everything, as with a shared root). For each, the wall time, the
throughput per uploader, and the bytes read back from the store to verify the upload (0 with the
store's MD5/ETag check; the read-back mode is measured too).

    python benchmarks/upload.py --out benchmarks/results/upload_moto_cpu_run1.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, git_info, moto_server  # noqa: E402
from torch_ckpt.root._layout import Manifest  # noqa: E402
from torch_ckpt.tiers._durable import DurableTier  # noqa: E402


def _options(endpoint: str) -> dict:
    return {"key": "bench", "secret": "bench", "skip_instance_cache": True, "use_listings_cache": False,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def _make_checkpoint(base: Path, nodes: int, files_per_node: int, file_bytes: int) -> Manifest:
    files, file_node = {}, {}
    for node in range(nodes):
        d = base / f"node{node}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(files_per_node):
            name = f"__{node}_{i}.distcp"
            data = os.urandom(file_bytes)
            (d / name).write_bytes(data)
            files[name] = {"bytes": file_bytes, "crc32": zlib.crc32(data)}
            file_node[name] = node
    return Manifest(step=1, world_size=nodes, files=files,
                    nodes={"rank_node": list(range(nodes)), "file_node": file_node})


def _upload_node(url: str, endpoint: str, base: str, manifest_doc: dict, node: int, readback: bool, out,
                 ready, go) -> None:
    tier = DurableTier(url, storage_options=_options(endpoint))
    tier.fs.ls(tier.root.split("/")[0])  # connect before the clock starts
    ready.release()
    go.wait()
    if readback:
        tier._store_checked = False  # force the read-back check (stores without a checksum of their own)
    manifest = Manifest.from_json({**manifest_doc, "node": node}, "bench")
    t0 = time.perf_counter()
    tier.upload_node(Path(base) / f"node{node}", manifest, commit=node == 0, poll_seconds=0.01)
    out.put((node, time.perf_counter() - t0, tier.bytes_read_back, time.time()))


def _parallel(url, endpoint, base, manifest, readback) -> dict:
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.SimpleQueue(), ctx.Semaphore(0), ctx.Event()
    nodes = max(manifest.nodes["rank_node"]) + 1
    procs = [ctx.Process(target=_upload_node, args=(url, endpoint, str(base), manifest.to_json(), n, readback, out,
                                                    ready, go))
             for n in range(nodes)]
    for p in procs:
        p.start()
    for _ in procs:  # every uploader started and connected: the clock covers the uploads only
        ready.acquire()
    t0 = time.time()
    go.set()
    for p in procs:
        p.join()
    results = [out.get() for _ in procs]
    wall = max(r[3] for r in results) - t0
    if any(p.exitcode for p in procs):
        raise SystemExit("an uploader failed")
    return {"wall_s": wall, "per_uploader_s": {n: s for n, s, _, _ in results},
            "bytes_read_back": sum(r[2] for r in results)}


def _rank0_only(url, endpoint, base, manifest, readback) -> dict:
    import shutil

    flat = base / "all"
    flat.mkdir(exist_ok=True)
    for name, node in manifest.nodes["file_node"].items():
        target = flat / name
        if not target.exists():
            os.link(base / f"node{node}" / name, target) if hasattr(os, "link") else shutil.copy(
                base / f"node{node}" / name, target)
    tier = DurableTier(url, storage_options=_options(endpoint))
    tier.fs.ls(tier.root.split("/")[0])  # connect before the clock starts
    if readback:
        tier._store_checked = False
    t0 = time.perf_counter()
    tier.upload(flat, Manifest(step=1, world_size=manifest.world_size, files=manifest.files))
    return {"wall_s": time.perf_counter() - t0, "bytes_read_back": tier.bytes_read_back}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--files-per-node", type=int, default=2)
    p.add_argument("--file-mib", type=int, default=32)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/torch_ckpt_upload_bench"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import shutil

    shutil.rmtree(args.work_dir, ignore_errors=True)
    manifest = _make_checkpoint(args.work_dir, args.nodes, args.files_per_node, args.file_mib << 20)
    total = sum(i["bytes"] for i in manifest.files.values())
    try:
        with moto_server() as (endpoint, client):
            runs = {}
            for label, fn, readback in (("rank0_only", _rank0_only, False), ("per_node", _parallel, False),
                                        ("rank0_only_readback", _rank0_only, True),
                                        ("per_node_readback", _parallel, True)):
                bucket = label.replace("_", "-")
                client.create_bucket(Bucket=bucket)
                runs[label] = fn(f"s3://{bucket}/run", endpoint, args.work_dir, manifest, readback)
                uploaders = args.nodes if label.startswith("per_node") else 1
                runs[label]["uploaders"] = uploaders
                runs[label]["throughput_MiB_s"] = total / runs[label]["wall_s"] / 2**20
                runs[label]["per_uploader_MiB_s"] = total / uploaders / runs[label]["wall_s"] / 2**20
                committed = DurableTier(f"s3://{bucket}/run", storage_options=_options(endpoint)).list_steps()
                assert list(committed) == [1], committed
                print(f"{label:22s} {runs[label]['wall_s']:7.2f} s  {runs[label]['throughput_MiB_s']:7.1f} MiB/s  "
                      f"read back {runs[label]['bytes_read_back'] >> 20} MiB", flush=True)
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    result = {"benchmark": "upload", "git": git_info(), "cpus": os.cpu_count(), "nodes": args.nodes,
              "files_per_node": args.files_per_node, "file_bytes": args.file_mib << 20, "total_bytes": total,
              "store": "moto S3 server (own process, in memory, loopback)",
              "speedup_per_node_vs_rank0": runs["rank0_only"]["wall_s"] / runs["per_node"]["wall_s"], "runs": runs}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
