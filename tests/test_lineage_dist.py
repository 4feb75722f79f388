"""Checkpoint lineage on real gloo ranks: a shared root with 2 ranks, and node-local roots with 4 ranks
as 2 nodes of 2 (a stale node plus a store outage at restart), with a moto S3 server as durable tier."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._dist import free_port, run_distributed
from torch_ckpt import CheckpointManager, TrainState
from torch_ckpt.tiers._durable import DurableTier

pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")


def _state(value: float):
    """A one-layer state filled with ``value`` (the same on every rank: it tells the timelines apart)."""
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return TrainState(model=model), model


def _save(mgr: CheckpointManager, step: int, value: float, *, durable: bool = True) -> None:
    mgr.save(step, _state(value)[0]).wait()
    if durable:
        assert mgr.wait_durable(60)


def _restore(mgr: CheckpointManager, step: int | None = None) -> tuple[int | None, float]:
    state, model = _state(-1.0)
    restored = mgr.restore(state, step=step)
    return restored, model.weight[0, 0].item()


def _shared_root_body(rank, world, base, url, options):
    root = Path(base) / "local"
    kw = {"durable_url": url, "storage_options": options, "keep_last": 10}
    with CheckpointManager(root, **kw) as mgr:
        for step in (100, 200, 300, 400):
            _save(mgr, step, step)
        assert _restore(mgr, 200) == (200, 200.0)
        for step in (300, 350):
            _save(mgr, step, step + 0.5)
    with CheckpointManager(root, **kw) as mgr:
        assert _restore(mgr) == (350, 350.5) and mgr.latest_step() == 350
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    dist.barrier()
    with CheckpointManager(root, **kw) as mgr:
        assert _restore(mgr) == (350, 350.5) and mgr.latest_step() == 350


@pytest.mark.timeout(240)
def test_two_ranks_resume_the_new_timeline_from_s3(tmp_path, s3):
    """2 ranks, shared root, S3 durable: after the rollback both restarts (disk intact, deleted) resume 350."""
    url = f"s3://{s3.new_bucket()}/run"
    run_distributed(_shared_root_body, 2, str(tmp_path), url, s3.options, timeout_s=200)
    assert sorted(DurableTier(url, storage_options=s3.options).list_steps()) == [100, 200, 300, 350]


def _as_nodes(rank: int, world: int, fn, *args) -> None:
    """Set torchrun's multi-node variables for 2 nodes of 2 ranks, then run ``fn``."""
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    fn(rank, world, *args)


def _stale_node_body(rank, world, base, url, options, dead):
    base = Path(base)
    root = base / f"node{rank // 2}"
    kw = {"durable_url": url, "storage_options": options, "keep_last": 10}
    with CheckpointManager(root, **kw) as mgr:
        for step in (100, 200, 300, 400):
            _save(mgr, step, step)
    if rank == 2:  # node 1's disk as it was before the rollback: it will come back stale
        shutil.copytree(root, base / "stale1", ignore=shutil.ignore_patterns(".lock*"))
    dist.barrier()
    with CheckpointManager(root, **kw) as mgr:
        assert _restore(mgr, 200) == (200, 200.0)
        for step in (300, 350):
            _save(mgr, step, step + 0.5)
    dist.barrier()
    if rank == 2:
        shutil.rmtree(root)
        shutil.move(base / "stale1", root)
    dist.barrier()
    # the store is unreachable: only the local copies count, and node 1's 300 and 400 are superseded
    with CheckpointManager(root, durable_url=url, storage_options=dead, keep_last=10,
                           durable_flush_timeout_seconds=1) as mgr:
        assert _restore(mgr) == (200, 200.0)  # the newest step live on both nodes, never a mixed 300
        _save(mgr, 250, 250.0, durable=False)  # the run goes on: a new timeline from 200
    dist.barrier()
    with CheckpointManager(root, **kw) as mgr:  # the store is back: its 300 and 350 are superseded now
        assert _restore(mgr) == (250, 250.0)
        _save(mgr, 260, 260.0)
    dist.barrier()
    if rank % 2 == 0:
        shutil.rmtree(root)  # both disks lost: only the durable tier is left
    dist.barrier()
    with CheckpointManager(root, **kw) as mgr:
        assert _restore(mgr) == (260, 260.0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_stale_node_and_outage_never_resume_the_abandoned_timeline(tmp_path, s3):
    """4 ranks on 2 node-local roots: a stale node during an outage resumes 200, the next restarts the new timeline."""
    url = f"s3://{s3.new_bucket()}/run"
    dead = {**s3.options, "client_kwargs": {**s3.options["client_kwargs"],
                                            "endpoint_url": f"http://127.0.0.1:{free_port()}"}}
    run_distributed(_as_nodes, 4, _stale_node_body, str(tmp_path), url, s3.options, dead, timeout_s=400)
    tier = DurableTier(url, storage_options=s3.options)
    assert sorted(tier.list_steps()) == [100, 200, 260]  # 250 was saved during the outage, never uploaded
    aside = sorted(n.split(".")[1] for n in tier.list_names() if n.startswith(".superseded_"))
    assert aside == [f"superseded_step_{s:09d}" for s in (300, 300, 350, 400)]
