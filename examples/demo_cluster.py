#!/usr/bin/env python
"""A node is replaced mid-run, on one machine: 2 simulated nodes of 2 ranks, node-local roots, S3.

1. start a local S3-compatible server (moto) as the durable tier;
2. a reference run of ``--steps`` steps (4 gloo ranks as 2 nodes, each node its own root);
3. the same run in a fresh directory, stopped cleanly after ``--stop-after`` (a checkpoint step):
   every node committed its own copy and uploaded its own shards;
4. node 1's disk is lost: its root is deleted (a fresh replacement node);
5. the same command again: node 0 restores from its own disk, node 1 fetches only its shards from
   S3, and every step logged after the resume point must match the reference: learning rate, epoch
   and batch exactly, the loss to float32 rounding (the loss is all-reduced over 4 gloo ranks, whose
   summation is not bitwise reproducible across a restart: a plain ``--nproc 4`` stop and resume
   with one shared root shows the same last-bit differences; ``make demo`` checks bitwise equality
   with one rank, and tests/test_cluster_tiers.py the exact restored state on 2 nodes).

Exits non-zero when anything differs, nothing was resumed, or node 1 read anything but its shards.

With ``--memory`` (``make demo-cluster-memory``) the run also saves into the memory tier (a tmpfs directory per
node, under ``/dev/shm`` when there is one) every step, each node's newest memory step replicated to the other
node; the run is killed mid-run between two disk saves (one rank SIGKILLs itself, the launcher stops the
rest), node 1's disk and tmpfs are wiped, and the same command resumes: node 0 from its own memory, node 1
from the copy node 0 held for it (``memory-peer``), at a step newer than any disk or durable checkpoint.

    python examples/demo_cluster.py --work-dir demo_cluster [--memory]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo import compare, read_jsonl, run_to_end  # noqa: E402 - the example next to this one
from train_gpt import free_port  # noqa: E402

TRAIN = Path(__file__).resolve().with_name("train_gpt.py")


def start_s3() -> tuple[object, dict, str]:
    """A moto S3 server on loopback and a fresh bucket; returns (server, fsspec options, bucket)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access-log line per S3 request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="demo", aws_secret_access_key="demo",
                 region_name="us-east-1").create_bucket(Bucket="demo")
    options = {"key": "demo", "secret": "demo", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    return server, options, "demo"


def train_cmd(args: argparse.Namespace, ckpt_dir: Path, log: Path, url: str, options: dict,
              stop_after: int | None = None, memory: Path | None = None) -> list[str]:
    cmd = [
        sys.executable, str(TRAIN), "--nproc", "4", "--simulate-nodes", "2",
        "--steps", str(args.steps), "--save-every", str(args.save_every), "--seed", str(args.seed),
        "--max-windows", str(args.max_windows), "--corpus-chars", "200000", "--n-layer", "1", "--n-embd", "32",
        "--ckpt-dir", str(ckpt_dir), "--log-jsonl", str(log), "--quiet",
        "--durable-url", url, "--storage-options", json.dumps(options),
    ]  # fmt: skip
    cmd += ["--memory-root", str(memory), "--memory-every", "1"] if memory is not None else []
    return cmd + (["--stop-after-step", str(stop_after)] if stop_after is not None else [])


def memory_node_loss(args: argparse.Namespace, options: dict, bucket: str, ref_log: Path) -> list[str]:
    """Every rank killed at ``--stop-after + 5``, node 1's disk and tmpfs wiped, resumed from memory; problems."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else args.work_dir
    memory = Path(tempfile.mkdtemp(prefix="torch-ckpt-demo-cluster-", dir=shm))
    run_dir, run_log = args.work_dir / "run", args.work_dir / "run.jsonl"
    kill_at = args.stop_after + args.save_every // 2
    try:
        cmd = train_cmd(args, run_dir, run_log, f"s3://{bucket}/run", options, memory=memory)
        print(f"\n== the run, every rank killed (SIGKILL) after step {kill_at}\n$ {' '.join(cmd)}", flush=True)
        proc = subprocess.run([*cmd, "--crash-at-step", str(kill_at)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode == 0:
            return ["the run was not killed"]
        print(f"\n== node 1 is replaced: deleting its disk {run_dir / 'node1'} and its tmpfs {memory / 'node1'}",
              flush=True)
        shutil.rmtree(run_dir / "node1")
        shutil.rmtree(memory / "node1")
        before = len(read_jsonl(run_log))
        out = run_to_end(cmd, "the same command on the new node set")
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    problems = []
    found = dict(re.findall(r"node (\d) \(rank \d\) restored step (\d+) from memory", out))
    steps = {int(v) for v in found.values()}
    if "memory-peer" not in out or len(found) != 2 or len(steps) != 1:
        problems.append("node 0 did not resume from its memory and node 1 from its partner's replica")
    restored = steps.pop() if len(steps) == 1 else -1
    if restored <= args.stop_after:
        problems.append(f"the resumed step {restored} is not newer than the last disk save {args.stop_after}")
    ref = {r["step"]: r for r in read_jsonl(ref_log)}
    resumed = read_jsonl(run_log)[before:]
    problems += compare(ref, resumed, loss_rtol=1e-5)
    if not resumed or resumed[0]["step"] != restored + 1:
        problems.append(f"the resumed run did not continue at step {restored + 1}")
    if not problems:
        print(f"demo-cluster: OK: every rank killed after step {kill_at}, node 1's disk and RAM wiped; both nodes "
              f"resumed step {restored} from memory (node 1 from node 0's replica; {kill_at - restored} step(s) "
              f"lost, the last disk save was step {args.stop_after}); steps {resumed[0]['step']}..{resumed[-1]['step']}"
              " match the reference", flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, required=True, help="scratch directory (emptied first)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--stop-after", type=int, default=30, help="stop the run after this step (a save step)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-windows", type=int, default=400)
    p.add_argument("--memory", action="store_true", help="the memory tier: a node lost between disk saves resumes "
                   "from its partner's RAM")
    args = p.parse_args(argv)
    if args.stop_after % args.save_every:
        p.error("--stop-after must be a multiple of --save-every")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    server, options, bucket = start_s3()
    try:
        ref_log, run_log = args.work_dir / "reference.jsonl", args.work_dir / "run.jsonl"
        run_to_end(train_cmd(args, args.work_dir / "reference", ref_log, f"s3://{bucket}/reference", options),
                   "reference run")
        if args.memory:
            problems = memory_node_loss(args, options, bucket, ref_log)
            if problems:
                print("demo-cluster: FAILED\n  " + "\n  ".join(problems[:20]), flush=True)
            return 1 if problems else 0
        run_dir = args.work_dir / "run"
        cmd = train_cmd(args, run_dir, run_log, f"s3://{bucket}/run", options)
        run_to_end(train_cmd(args, run_dir, run_log, f"s3://{bucket}/run", options, args.stop_after),
                   f"run stopped after step {args.stop_after}")
        print(f"\n== node 1 is replaced: deleting its disk {run_dir / 'node1'}", flush=True)
        shutil.rmtree(run_dir / "node1")
        before = len(read_jsonl(run_log))
        out = run_to_end(cmd, "the same command on the new node set")
    finally:
        server.stop()
    problems = []
    if f"node 0 (rank 0) restored step {args.stop_after} from local" not in out:
        problems.append("node 0 did not restore from its own disk")
    if f"node 1 (rank 2) restored step {args.stop_after} from durable-node" not in out:
        problems.append("node 1 did not fetch its own shards from the durable tier")
    from torch_ckpt.root._layout import read_manifest

    step_dir = run_dir / "node1" / f"step_{args.stop_after:09d}"
    if step_dir.is_dir():
        manifest = read_manifest(step_dir)
        fetched = {f.name for f in step_dir.iterdir()} - {"manifest.json"}
        if fetched != set(manifest.local_files()) or manifest.node != 1:
            problems.append(f"node 1 holds {sorted(fetched)}, not exactly its own files")
        print(f"demo: node 1 fetched {len(fetched)} of the checkpoint's {len(manifest.files)} files", flush=True)
    ref = {r["step"]: r for r in read_jsonl(ref_log)}
    resumed = read_jsonl(run_log)[before:]
    problems += compare(ref, resumed, loss_rtol=1e-5)
    if not resumed or resumed[0]["step"] != args.stop_after + 1:
        problems.append(f"the resumed run did not continue at step {args.stop_after + 1}")
    if problems:
        print("demo-cluster: FAILED\n  " + "\n  ".join(problems[:20]), flush=True)
        return 1
    print(f"demo-cluster: OK: node 1 replaced after step {args.stop_after}; node 0 resumed from its disk, node 1 from "
          f"its shards in S3; steps {resumed[0]['step']}..{resumed[-1]['step']} match the reference (lr, epoch, batch "
          "exactly; loss to float32 rounding)",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
