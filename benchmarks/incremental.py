"""Incremental checkpoints: a LoRA-style fine-tune of the example GPT with a frozen base, incremental on vs off.

The example model (``examples/train_gpt.py``'s ``GPT``) gets low-rank adapters on every linear layer of
its blocks; the base is frozen (``requires_grad=False``) and only the adapters train, with AdamW. Each
configuration saves ``--saves`` checkpoints, ``--steps-between`` optimizer steps apart, to a local root
replicated to a moto S3 server (its own process, loopback). Per save: the bytes its save wrote and the
bytes it hard-linked (from the manifest), the bytes uploaded and referenced (replication stats),
the seconds from the local commit until the durable copy is committed (``commit_s``) and until durable
retention is done too (``durable_s``, what ``wait_durable`` waits for), and the persist seconds. The
reference for the saves after the first is what must change: trainable weights + optimizer state +
per-rank files (``rank_*.json``, ``.metadata``) as a save without incremental writes them; the written
records' framing (~600 bytes per tensor, in every save) and the record digests kept in the rank file come
on top. Then the newest retained step is uploaded ``--reps`` times straight through :class:`DurableTier`
(no replicator), its linked files referenced (the durable manifest points at the earlier step's objects)
vs all uploaded. The goal: durable seconds per later save, on vs off, fall like the bytes uploaded.

    python benchmarks/incremental.py --out benchmarks/results/incremental_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import emit_json, git_info, moto_server, start_run  # noqa: E402
from examples.train_gpt import GPT  # noqa: E402
from torch_ckpt import CheckpointManager, TrainState  # noqa: E402
from torch_ckpt.format._files import LINKED_FROM, bytes_written, read_manifest  # noqa: E402
from torch_ckpt.tiers._durable import DurableTier  # noqa: E402


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (rank ``r``)."""

    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(vocab_size=65, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                n_embd=args.n_embd, dropout=0.0)
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv, args.rank)
        block.attn.proj = LoRALinear(block.attn.proj, args.rank)
        block.mlp[0] = LoRALinear(block.mlp[0], args.rank)
        block.mlp[2] = LoRALinear(block.mlp[2], args.rank)
    return model


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _s3(endpoint: str) -> dict:
    return {"key": "bench", "secret": "bench", "skip_instance_cache": True, "use_listings_cache": False,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def run(args: argparse.Namespace, work: Path, endpoint: str, bucket: str, incremental: bool) -> dict:
    model = lora_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    state = TrainState(model=model, optimizer=opt)
    root = work / f"incremental_{incremental}"
    saves = []
    with CheckpointManager(root, durable_url=f"s3://{bucket}/run", storage_options=_s3(endpoint), keep_last=3,
                           durable_keep_last=3, incremental=incremental) as mgr:
        for i in range(args.saves):
            for _ in range(args.steps_between):
                idx = torch.randint(0, 65, (args.batch, args.block_size + 1))
                model(idx[:, :-1], idx[:, 1:]).backward()  # the example's loss: next-character cross-entropy
                opt.step()
                opt.zero_grad()
            step = (i + 1) * args.steps_between
            before = dict(mgr.replication_stats())
            handle = mgr.save(step, state)
            handle.wait()
            t0 = time.perf_counter()
            while (mgr.replication_stats()["durable_step"] or 0) < step and time.perf_counter() - t0 < 600:
                time.sleep(0.001)
            commit_s = time.perf_counter() - t0  # until the durable manifest is written
            assert mgr.wait_durable(600)
            durable_s = time.perf_counter() - t0  # and durable retention is done
            after = mgr.replication_stats()
            manifest = json.loads((root / f"step_{step:09d}" / "manifest.json").read_text())
            written, linked = bytes_written(manifest["files"])
            per_rank = sum(f["bytes"] for n, f in manifest["files"].items() if not n.endswith(".distcp"))
            saves.append({"step": step, "written_bytes": written, "linked_bytes": linked,
                          "per_rank_file_bytes": per_rank,
                          "uploaded_bytes": after["uploaded_bytes"] - before.get("uploaded_bytes", 0),
                          "referenced_bytes": after["referenced_bytes"] - before.get("referenced_bytes", 0),
                          "commit_s": commit_s, "durable_s": durable_s, "persist_s": handle.stats.persist_s,
                          "blocking_s": handle.stats.blocking_s})
            print(f"incremental={incremental} step {step}: wrote {written / 2**20:.2f} MiB, linked "
                  f"{linked / 2**20:.2f} MiB, uploaded {saves[-1]['uploaded_bytes'] / 2**20:.2f} MiB, durable "
                  f"{durable_s:.2f} s", file=sys.stderr, flush=True)
    state_bytes = _tensor_bytes(model.state_dict().values())
    frozen = _tensor_bytes(t for k, t in model.state_dict().items() if "lora_" not in k)
    optim = _tensor_bytes(v for st in opt.state_dict()["state"].values() for v in st.values()
                          if isinstance(v, torch.Tensor))
    return {"saves": saves, "model_bytes": state_bytes, "frozen_bytes": frozen,
            "trainable_bytes": _tensor_bytes(trainable), "optimizer_bytes": optim}


def direct_uploads(root: Path, endpoint: str, client, reps: int) -> dict:
    """Seconds of :meth:`DurableTier.upload` of the newest retained step, its linked files referenced
    (the previous step already uploaded) vs every file uploaded (``linked_from`` dropped), ``reps`` times each."""
    steps = sorted(root.glob("step_*"))
    prev_dir, last_dir = steps[-2], steps[-1]
    client.create_bucket(Bucket="incremental-direct")
    tier = DurableTier("s3://incremental-direct/run", storage_options=_s3(endpoint))
    tier.upload(prev_dir, read_manifest(prev_dir))
    manifest = read_manifest(last_dir)
    plain = dataclasses.replace(manifest, files={n: {"bytes": i["bytes"], "crc32": i["crc32"]}
                                                 for n, i in manifest.files.items()})
    out: dict = {}
    for label, m in (("reference", manifest), ("upload", plain)) * reps:
        uploaded0, referenced0, read0 = tier.bytes_uploaded, tier.bytes_referenced, tier.bytes_read_back
        t0 = time.perf_counter()
        tier.upload(last_dir, m)
        row = out.setdefault(label, {"seconds": [], "uploaded_bytes": 0, "referenced_bytes": 0, "read_back_bytes": 0})
        row["seconds"].append(time.perf_counter() - t0)
        row["uploaded_bytes"] = tier.bytes_uploaded - uploaded0
        row["referenced_bytes"] = tier.bytes_referenced - referenced0
        row["read_back_bytes"] = tier.bytes_read_back - read0
        tier.delete(m.step)
    for row in out.values():
        row["median_s"] = statistics.median(row["seconds"])
    # the floor of each way on this store: its files' bytes PUT at once by boto3 (no reading, no checks),
    # then the manifest (a commit needs the files before the manifest: two request rounds at least)
    sent = {"reference": [n for n, i in manifest.files.items() if LINKED_FROM not in i],
            "upload": list(manifest.files)}
    body = {n: (last_dir / n).read_bytes() for n in manifest.files}
    doc = (last_dir / "manifest.json").read_bytes()
    with ThreadPoolExecutor(16) as pool:
        for label, names in list(sent.items()) * reps:
            t0 = time.perf_counter()
            list(pool.map(lambda n: client.put_object(Bucket="incremental-direct", Key=f"floor/{n}", Body=body[n]),
                          names))
            client.put_object(Bucket="incremental-direct", Key="floor/manifest.json", Body=doc)
            out[label].setdefault("floor_seconds", []).append(time.perf_counter() - t0)
    for row in out.values():
        row["floor_median_s"] = statistics.median(row["floor_seconds"])
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--steps-between", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="direct uploads of one step, each way")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = start_run("torch_ckpt_incremental_", args.threads, None)
    try:
        with moto_server() as (endpoint, client):
            runs = {}
            for incremental in (False, True):
                bucket = f"incremental-{str(incremental).lower()}"
                client.create_bucket(Bucket=bucket)
                runs["on" if incremental else "off"] = run(args, work, endpoint, bucket, incremental)
            direct = direct_uploads(work / "incremental_True", endpoint, client, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on, off = runs["on"], runs["off"]
    later_on, later_off = on["saves"][1:], off["saves"][1:]
    # per-rank files as a save without incremental writes them: the digests an incremental save keeps in its
    # rank file (for the first save after a restart) count as overhead, like the record framing
    must_change = on["trainable_bytes"] + on["optimizer_bytes"] + _mean([s["per_rank_file_bytes"] for s in later_off])
    summary = {
        "frozen_share_of_state_bytes": on["frozen_bytes"] / (on["model_bytes"] + on["optimizer_bytes"]),
        "must_change_bytes": must_change,
        "written_per_later_save_on": _mean([s["written_bytes"] for s in later_on]),
        "written_per_later_save_off": _mean([s["written_bytes"] for s in later_off]),
        "uploaded_per_later_save_on": _mean([s["uploaded_bytes"] for s in later_on]),
        "uploaded_per_later_save_off": _mean([s["uploaded_bytes"] for s in later_off]),
        "durable_s_per_later_save_on": _mean([s["durable_s"] for s in later_on]),
        "durable_s_per_later_save_off": _mean([s["durable_s"] for s in later_off]),
        "commit_s_median_later_save_on": statistics.median(s["commit_s"] for s in later_on),
        "commit_s_median_later_save_off": statistics.median(s["commit_s"] for s in later_off),
        "persist_s_per_later_save_on": _mean([s["persist_s"] for s in later_on]),
        "persist_s_per_later_save_off": _mean([s["persist_s"] for s in later_off]),
        "blocking_s_per_save_on": _mean([s["blocking_s"] for s in on["saves"]]),
        "blocking_s_per_save_off": _mean([s["blocking_s"] for s in off["saves"]]),
    }
    summary["written_ratio_to_must_change"] = summary["written_per_later_save_on"] / must_change
    summary["uploaded_ratio_to_must_change"] = summary["uploaded_per_later_save_on"] / must_change
    summary["durable_s_ratio_on_vs_off"] = (summary["durable_s_per_later_save_on"]
                                            / summary["durable_s_per_later_save_off"])
    summary["written_ratio_on_vs_off"] = summary["written_per_later_save_on"] / summary["written_per_later_save_off"]
    summary["uploaded_ratio_on_vs_off"] = (summary["uploaded_per_later_save_on"]
                                           / summary["uploaded_per_later_save_off"])
    summary["commit_s_ratio_on_vs_off"] = (summary["commit_s_median_later_save_on"]
                                           / summary["commit_s_median_later_save_off"])
    # 1.0: the durable time falls exactly as the bytes; the fixed cost of a save (listing, manifest) lifts it
    summary["durable_s_ratio_over_uploaded_ratio"] = (summary["durable_s_ratio_on_vs_off"]
                                                      / summary["uploaded_ratio_on_vs_off"])
    summary["direct_upload_median_s_reference"] = direct["reference"]["median_s"]
    summary["direct_upload_median_s_full"] = direct["upload"]["median_s"]
    summary["direct_upload_s_ratio_reference_vs_full"] = (direct["reference"]["median_s"]
                                                          / direct["upload"]["median_s"])
    # over the floor of the same requests (bytes PUT at once, then the manifest; boto3, same server, same run)
    summary["direct_upload_floor_s_reference"] = direct["reference"]["floor_median_s"]
    summary["direct_upload_floor_s_full"] = direct["upload"]["floor_median_s"]
    summary["direct_upload_over_floor_reference"] = (direct["reference"]["median_s"]
                                                     / direct["reference"]["floor_median_s"])
    summary["direct_upload_over_floor_full"] = direct["upload"]["median_s"] / direct["upload"]["floor_median_s"]
    summary["commit_s_over_floor_on"] = summary["commit_s_median_later_save_on"] / direct["reference"]["floor_median_s"]
    summary["commit_s_over_floor_off"] = summary["commit_s_median_later_save_off"] / direct["upload"]["floor_median_s"]
    record_framing = sum(s["written_bytes"] - s["per_rank_file_bytes"] for s in later_on) / len(later_on) \
        - on["trainable_bytes"] - on["optimizer_bytes"]
    summary["record_framing_bytes_per_later_save"] = record_framing  # zip headers and pickle of the written records
    summary["digest_bytes_per_later_save"] = (_mean([s["per_rank_file_bytes"] for s in later_on])
                                              - _mean([s["per_rank_file_bytes"] for s in later_off]))
    result = {"benchmark": "incremental", "git": git_info(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "model": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                        "block_size": args.block_size, "lora_rank": args.rank},
              "saves": args.saves, "steps_between": args.steps_between,
              "store": "moto S3 server (own process, in memory, loopback)", "summary": summary, "runs": runs,
              "direct_uploads": direct, "load_average": os.getloadavg()}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
