"""Tiers heal each other with several ranks (issue 26, item 3): 2 gloo ranks as 2 simulated nodes
with node-local roots, and 2 ranks on one shared root; durable tiers on moto S3 and ``file://``."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointManager, TrainState

pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")


def _as_nodes(rank: int, world: int, fn, *args) -> None:
    """Make each rank a node of its own (torchrun's multi-node variables), then run ``fn``."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    fn(rank, world, *args)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return TrainState(model=model), model


def _root(base: str, rank: int, node_local: bool) -> Path:
    return Path(base) / (f"node{rank}" if node_local else "shared")


def _save(rank, world, base, url, options, node_local, persist):
    state, model = _model()
    with CheckpointManager(_root(base, rank, node_local), durable_url=url, storage_options=options, keep_last=5,
                           persist=persist) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(float(step))
            mgr.save(step, state).wait()
        assert mgr.wait_durable(60)


def _restore(rank, world, base, url, options, node_local, persist, expected, sources):
    state, model = _model()
    with CheckpointManager(_root(base, rank, node_local), durable_url=url, storage_options=options,
                           persist=persist, durable_flush_timeout_seconds=0) as mgr:
        assert mgr.restore(state) == expected
        if sources is not None:
            assert mgr.restore_source == sources[rank], (rank, mgr.restore_source)
    assert torch.equal(model.weight, torch.full_like(model.weight, float(expected)))


def _damage(step_dir: Path) -> None:
    """Flip one byte of the largest data file (same size: only the checksum finds it)."""
    shard = max((p for p in step_dir.iterdir() if p.name.endswith(".distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_node_local_damaged_copy_is_taken_from_the_durable_tier(tmp_path, s3, persist):
    """Node 1's copy of step 2 is damaged: step 2 is restored on both nodes, fetched from S3, not step 1."""
    url = f"s3://{s3.new_bucket()}/run"
    daemon = persist == "thread"  # a rank with a writer process must not be a daemon process
    run_distributed(_as_nodes, 2, _save, str(tmp_path), url, s3.options, True, persist, timeout_s=180, daemon=daemon)
    _damage(tmp_path / "node1" / "step_000000002")
    run_distributed(_as_nodes, 2, _restore, str(tmp_path), url, s3.options, True, persist, 2,
                    {0: "durable-node", 1: "durable-node"}, timeout_s=180, daemon=daemon)


def test_shared_root_two_ranks_damaged_copy_is_taken_from_the_durable_tier(tmp_path):
    """2 ranks on one root with a file:// durable tier: a damaged local step 2 is restored from the durable copy."""
    url = f"file://{tmp_path / 'durable'}"
    run_distributed(_as_nodes_off, 2, _save, str(tmp_path), url, None, False, "thread", timeout_s=180)
    _damage(tmp_path / "shared" / "step_000000002")
    run_distributed(_as_nodes_off, 2, _restore, str(tmp_path), url, None, False, "thread", 2, None, timeout_s=180)


def _as_nodes_off(rank: int, world: int, fn, *args) -> None:
    """Both ranks on one node (one shared root)."""
    fn(rank, world, *args)


def _restore_store_fails_on_node1(rank, world, base, url, options, expected):
    if rank == 1:  # node 1's reads of durable objects fail (EIO: its mount went away after rank 0 listed)
        from fsspec.implementations.local import LocalFileSystem

        def eio(self, *args, **kwargs):
            raise OSError(5, "Input/output error")

        LocalFileSystem._open = eio
    _restore(rank, world, base, url, options, True, "thread", expected, {0: "local", 1: "local"})


def test_node_local_store_failing_during_download_falls_back_to_a_step_every_node_holds(tmp_path):
    """Node 1 lost step 2 and the store fails while it fetches it: both nodes restore step 1 from their disks."""
    url = f"file://{tmp_path / 'durable'}"
    run_distributed(_as_nodes, 2, _save, str(tmp_path), url, None, True, "thread", timeout_s=180)
    shutil.rmtree(tmp_path / "node1" / "step_000000002")
    run_distributed(_as_nodes, 2, _restore_store_fails_on_node1, str(tmp_path), url, None, 1, timeout_s=180)


def _restore_while_rank0_lists_slowly(rank, world, base, url):
    from torch_ckpt.errors import CheckpointError, CheckpointTimeoutError
    from torch_ckpt.tiers._durable import DurableTier

    if rank == 0:
        DurableTier.list_names = lambda self: time.sleep(8) or []  # a store that takes its time to answer
    state, _ = _model()
    mgr = CheckpointManager(_root(base, rank, True), durable_url=url, timeout_seconds=2,
                            durable_timeout_seconds=4, durable_flush_timeout_seconds=0)
    try:
        if rank == 1:
            with pytest.raises(CheckpointTimeoutError) as exc:
                mgr.restore(state)
            message = str(exc.value)
            assert "rank 0, which was listing the node-local roots and the durable tier" in message, message
            assert "did every rank call the same checkpoint method" not in message
        else:
            try:
                mgr.restore(state)
            except CheckpointError:
                pass  # rank 1 has stopped waiting: what rank 0 then sees is not under test
    finally:
        mgr.close()


def test_node_local_rank_waiting_for_the_listing_is_told_what_rank_0_is_doing(tmp_path):
    """A rank timing out while rank 0 lists the durable tier gets a message naming that, not a method mismatch."""
    url = f"file://{tmp_path / 'durable'}"
    run_distributed(_as_nodes, 2, _restore_while_rank0_lists_slowly, str(tmp_path), url, timeout_s=120)
