"""tiers._peers: the memory tier's peer replication: partners, checked transfer, node-loss restore, fallbacks."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

from torch_ckpt import CheckpointManager, ConfigError, TrainState
from torch_ckpt.manager import _memory
from torch_ckpt.root._layout import MANIFEST_NAME
from torch_ckpt.storage._crc import crc32
from torch_ckpt.tiers import _peers
from torch_ckpt.tiers._peers import (
    PEERS_DIR,
    _chunks,
    _listing,
    _Reader,
    _receive_into,
    _reusable,
    _Sink,
    _transfer,
    partners,
)


def _state(seed: int = 0, width: int = 16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState(model=model, optimizer=opt), model, opt


def _train(model, opt, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in root.glob("step_*") if (p / MANIFEST_NAME).is_file())


def _biggest(directory: Path) -> Path:
    return max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)


# -- partners and the checked byte stream, in one process ------------------------------------------------------
@pytest.mark.parametrize(("node", "count", "replicas", "stride", "want"), [
    (0, 2, 1, 1, [1]), (1, 2, 1, 1, [0]), (2, 3, 1, 1, [0]), (0, 5, 2, 1, [1, 2]), (1, 8, 1, 4, [5]),
    (3, 6, 2, 2, [5, 1]),
])
def test_partners_form_a_ring_with_a_stride(node, count, replicas, stride, want):
    """Node k's partners are k + stride * i (mod the node count), i = 1..replicas."""
    assert partners(node, count, replicas, stride) == want


@pytest.mark.parametrize(("count", "replicas", "stride"), [(2, 2, 1), (4, 1, 4), (4, 3, 2)])
def test_a_ring_without_distinct_partners_names_the_settings(count, replicas, stride):
    """More replicas than other nodes, or a stride the node count divides, is refused naming both settings."""
    with pytest.raises(ConfigError, match="memory_replicas.*memory_partner_stride"):
        partners(0, count, replicas, stride)


def _committed_copy(tmp_path: Path) -> Path:
    state, _, _ = _state()
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), async_save=False) as mgr:
        mgr.save(1, state, tier="memory")
    return tmp_path / "mem" / "step_000000001"


def _stream(source: Path, files, target: Path, skip=None, local=None) -> _Sink:
    """Stream ``source``'s listed files into ``target`` piece by piece in this process, in pieces of 1,000 bytes."""
    chunk, _peers.CHUNK_BYTES = _peers.CHUNK_BYTES, 1000
    try:
        reader, sink = _Reader(source, files, skip), _Sink(target, files, local)
    finally:
        _peers.CHUNK_BYTES = chunk
    assert [length for *_, length in reader.pieces] == [length for *_, length in sink.pieces]
    for i in range(len(reader.pieces)):
        sink.view(i).copy_(torch.frombuffer(reader.read(i), dtype=torch.uint8))
        sink.landed(i)
    sink.close()
    return sink


def test_a_streamed_copy_is_byte_identical(tmp_path):
    """A node's copy streamed in chunks smaller than its files arrives byte for byte, every CRC matching."""
    copy = _committed_copy(tmp_path)
    files = _listing(copy)
    sink = _stream(copy, files, tmp_path / "out")
    assert sink.problems == []
    assert all((tmp_path / "out" / name).read_bytes() == (copy / name).read_bytes() for name, _, _ in files)


def test_a_bit_flipped_in_the_sender_copy_is_named_by_the_receiver(tmp_path):
    """A file changed after its commit fails the receiver's CRC check against the sender's manifest, by name."""
    copy = _committed_copy(tmp_path)
    files = _listing(copy)
    data = _biggest(copy)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    sink = _stream(copy, files, tmp_path / "out")
    assert len(sink.problems) == 1 and sink.problems[0].startswith(data.name)


def test_a_truncated_sender_file_is_refused(tmp_path):
    """A sender file shorter than its manifest says is padded in the stream and refused by its CRC."""
    copy = _committed_copy(tmp_path)
    files = _listing(copy)
    data = _biggest(copy)
    data.write_bytes(data.read_bytes()[:-10])
    assert _stream(copy, files, tmp_path / "out").problems[0].startswith(data.name)


def test_a_sender_file_deleted_meanwhile_streams_as_zeros_and_is_refused(tmp_path):
    """A listed file gone from the sender's copy keeps the stream's length (zeros) and fails the receiver's CRC."""
    copy = _committed_copy(tmp_path)
    files = _listing(copy)
    data = _biggest(copy)
    data.unlink()
    sink = _stream(copy, files, tmp_path / "out")
    assert [p.split(":")[0] for p in sink.problems] == [data.name]


def test_a_chunk_whose_bytes_differ_on_the_receiver_is_sent_and_the_copy_verifies(tmp_path):
    """Chunks the receiver's own copy holds come from it; one whose bytes differ there is streamed instead."""
    copy = _committed_copy(tmp_path)
    own = tmp_path / "own"
    shutil.copytree(copy, own)  # the receiver's own copy of the same step
    files, chunks = _listing(copy), _chunks(copy)
    changed = max(range(len(chunks)), key=lambda k: chunks[k][2])
    name, at, length = chunks[changed][:3]
    raw = bytearray((own / name).read_bytes())
    raw[at + length // 2] ^= 0x01
    (own / name).write_bytes(bytes(raw))
    found, fds = _reusable(own, 1, 0, chunks, {n: b for n, b, _ in files})
    assert set(range(len(chunks))) - set(found) == {changed}
    skip, local = {}, {}
    for k, (fd, offset) in found.items():
        skip.setdefault(chunks[k][0], []).append(tuple(chunks[k][1:3]))
        local.setdefault(chunks[k][0], []).append((*chunks[k][1:3], fd, offset))
    sink = _stream(copy, files, tmp_path / "out", skip, local)
    assert sink.total == sum(size for _, size, _ in files) - sum(c[2] for c in chunks) + length
    for fd in fds:
        os.close(fd)
    assert sink.problems == []
    assert all((tmp_path / "out" / n).read_bytes() == (copy / n).read_bytes() for n, _, _ in files)


def test_one_node_warns_that_no_partner_holds_a_replica(tmp_path, caplog):
    """A memory tier on one node says at start that a node loss loses the memory copies."""
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem")).close()
    assert "no partner holds a replica" in caplog.text


def test_memory_replicas_zero_is_silent_on_one_node(tmp_path, caplog):
    """memory_replicas=0 turns replication off without the one-node warning."""
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), memory_replicas=0).close()
    assert "partner" not in caplog.text


@pytest.mark.parametrize(("field", "value"), [("memory_replicas", -1), ("memory_partner_stride", 0),
                                              ("memory_replication_bytes_per_second", "fast")])
def test_invalid_replication_settings_name_the_field(tmp_path, field, value):
    """A bad replication setting is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=field):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), **{field: value})


# -- nodes over gloo: one rank per node, each with its own memory_root ---------------------------------------
def _node(rank: int, base: str) -> Path:
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    return Path(base) / f"node{rank}"


def _train_and_save(node: Path, width: int = 16, nudge: bool = False, **kwargs) -> dict:
    """Steps 1-5, a disk save at 2 and 4, memory saves at the others (``nudge``: a bias changed before the last,
    as DDP nondeterminism might); returns the health after close."""
    state, model, opt = _state(width=width)
    mgr = CheckpointManager(node / "disk", memory_root=str(node / "mem"), save_every_n_steps=2,
                            memory_every_n_steps=1, async_save=False, **kwargs)
    with mgr:
        for step in range(1, 6):
            _train(model, opt, step)
            if nudge and step == 5:
                model[2].bias.data += 1e-3
            mgr.save_if_due(step, state)
    torch.save(model.state_dict(), node / "want.pt")
    return mgr.health()


def _replicate_then_lose(rank, world, base, lost, damage, kwargs, width=16, nudged=None):
    node = _node(rank, base)
    health = _train_and_save(node, width, rank == nudged, **kwargs)
    data = sum(p.stat().st_size for p in (node / "mem" / "step_000000005").glob("*.distcp"))
    (node / "bytes.json").write_text(json.dumps({**health["memory_replication"], "data_bytes": data}))
    partner = (rank + 1) % world
    replica = node / "mem" / PEERS_DIR / f"node-{(rank - 1) % world}"
    assert _steps(replica) == [5], f"node {rank} holds {_steps(replica)}: {health}"
    assert health["memory_safe_step"] == 5 and health["memory_replication"]["partners"] == [partner]
    assert health["lost_steps_if_node_lost"] == 0
    cap = kwargs.get("memory_replication_bytes_per_second")
    if cap is not None:  # three rounds sent, each taking at least its bytes over the cap
        stats = health["memory_replication"]
        assert stats["transfer_s"] >= 0.9 * stats["sent_bytes"] / cap > 0.5
    torch.distributed.barrier()
    if rank == lost:
        shutil.rmtree(node / "mem")  # the node is replaced: its RAM is gone
    holder = (lost + 1) % world  # stride 1: node k's partner is node k + 1
    if rank == holder and damage == "flip":
        data = _biggest(node / "mem" / PEERS_DIR / f"node-{lost}" / "step_000000005")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    elif rank == holder and damage == "truncate":
        data = _biggest(node / "mem" / PEERS_DIR / f"node-{lost}" / "step_000000005")
        data.write_bytes(data.read_bytes()[:-8])
    leftover = node / "mem" / PEERS_DIR / f"node-{(rank - 1) % world}" / ".incoming.step_000000009.dead"
    if rank != lost:
        shutil.copytree(replica / "step_000000005", leftover)  # a receive that a kill interrupted
    torch.distributed.barrier()
    fresh, model2, _ = _state(seed=1, width=width)
    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), **kwargs) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
    assert not leftover.exists()  # removed at the start, never listed
    if damage is None:
        assert (got, source) == (5, "memory-peer" if rank == lost else "memory")
        want = torch.load(node / "want.pt")
        assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
        assert _steps(node / "mem") == ([5] if rank == lost else [3, 5])  # the lost node's copy is back
    else:
        assert (got, source) == (4, "local")


@pytest.mark.slow
def test_two_nodes_replicate_and_a_lost_node_resumes_from_its_partner(tmp_path):
    """2 nodes: each holds the other's newest memory step; a node whose RAM is wiped resumes it bitwise."""
    run_distributed(_replicate_then_lose, 2, str(tmp_path), 1, None, {}, timeout_s=240)


@pytest.mark.slow
def test_three_nodes_rebuild_a_lost_node_from_its_partner(tmp_path):
    """3 nodes (odd count): the wiped node 0 gets its copy from node 1, the others read their own."""
    run_distributed(_replicate_then_lose, 3, str(tmp_path), 0, None, {}, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_replica_falls_back_to_the_disk_step(tmp_path, damage):
    """A replica with a flipped bit or cut short is refused at restore; every node resumes the disk step."""
    run_distributed(_replicate_then_lose, 2, str(tmp_path), 1, damage, {}, timeout_s=240)


@pytest.mark.slow
def test_a_bandwidth_cap_still_replicates(tmp_path):
    """memory_replication_bytes_per_second slows the sender but every replica arrives and restores."""
    run_distributed(_replicate_then_lose, 2, str(tmp_path), 0, None,
                    {"memory_replication_bytes_per_second": 40_000}, timeout_s=240)


@pytest.mark.slow
def test_replication_works_with_a_writer_process(tmp_path):
    """persist="process": the replication rounds follow the writer process's commits as the thread's."""
    run_distributed(_replicate_then_lose, 2, str(tmp_path), 1, None, {"persist": "process"}, timeout_s=300,
                    daemon=False)


def _stream_both_ways(rank, world, base):
    _peers.CHUNK_BYTES = 1000  # many pieces, so that piece i + 1 is in flight while piece i lands
    data = os.urandom(10_500 if rank == 0 else 2_100)  # 11 and 3 chunks: the shorter stream ends first
    out, into = Path(base) / f"out{rank}", Path(base) / f"in{rank}"
    out.mkdir()
    (out / "a.bin").write_bytes(data)
    files = [("a.bin", len(data), crc32(data))]
    torch.distributed.all_gather_object(listings := [None, None], files)
    peer = 1 - rank
    sink = _Sink(into, listings[peer])
    _transfer(None, [(peer, _Reader(out, files))], [(peer, sink)], bytes_per_second=None)
    sink.close()
    assert sink.problems == []
    assert (into / "a.bin").read_bytes() == (Path(base) / f"out{peer}" / "a.bin").read_bytes()


@pytest.mark.slow
def test_two_streams_of_many_chunks_cross_intact(tmp_path):
    """Two nodes stream each other files of 11 and 3 pieces at once (two in flight); both arrive byte for byte."""
    run_distributed(_stream_both_ways, 2, str(tmp_path), timeout_s=120)


def _durable_beside_a_lost_copy(rank, world, base, durable_newer):
    node = _node(rank, base)
    url = (Path(base) / "durable").as_uri()
    state, model, opt = _state()
    kwargs = {"memory_root": str(node / "mem"), "durable_url": url}
    with CheckpointManager(node / "disk", async_save=False, durable_create=True, **kwargs) as mgr:
        for step in (4, 5, 6) if durable_newer else (4, 5):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory" if step == 5 else "disk")
        assert mgr.wait_durable(60)
    torch.save(model.state_dict(), node / "want.pt")
    torch.distributed.barrier()
    shutil.rmtree(node / "disk")  # every node lost its disk: its disk steps are in the durable tier only
    if rank == 1:
        shutil.rmtree(node / "mem")  # node 1 lost its RAM: its copy of step 5 is on node 0
    torch.distributed.barrier()
    streamed = []
    _memory.repair = lambda *a, original=_memory.repair: streamed.append(a[4]) or original(*a)
    fresh, model2, _ = _state(seed=1)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
    want = torch.load(node / "want.pt")
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    assert streamed == [5]  # started before the durable listing was in, and streamed once
    if durable_newer:
        assert (got, source) == (6, "durable-node")
    else:
        assert (got, source) == (5, "memory-peer" if rank == 1 else "memory")


@pytest.mark.slow
@pytest.mark.parametrize("durable_newer", [True, False])
def test_the_durable_listing_decides_after_a_lost_copy_streamed_back(tmp_path, durable_newer):
    """A lost node's memory copy streams back while the durable tier is listed; a newer durable step still wins,
    an older one leaves the streamed copy to be loaded."""
    run_distributed(_durable_beside_a_lost_copy, 2, str(tmp_path), durable_newer, timeout_s=240)


def _read_while_listed(rank, world, base, durable_newer):
    import threading

    from torch_ckpt.restore import _restore
    from torch_ckpt.tiers._durable import DurableTier

    node = _node(rank, base)
    kwargs = {"memory_root": str(node / "mem"), "durable_url": (Path(base) / "durable").as_uri()}
    state, model, opt = _state()
    with CheckpointManager(node / "disk", async_save=False, durable_create=True, **kwargs) as mgr:
        for step in (4, 5, 6) if durable_newer else (4, 5):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory" if step == 5 else "disk")
        assert mgr.wait_durable(60)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.distributed.barrier()
    shutil.rmtree(node / "disk")  # the disk steps are in the durable tier only; every node keeps its memory copy
    torch.distributed.barrier()
    read, listings = threading.Event(), []
    _restore.load_direct = lambda *a, original=_restore.load_direct, **k: (read.set(), original(*a, **k))[1]

    def listed(tier, original=DurableTier.listed):  # the coordinator's listing waits for the memory read
        listings.append(read.wait(60))
        return original(tier)
    DurableTier.listed = listed
    fresh, model2, _ = _state(seed=1)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
    assert listings[:1] == [True] if rank == 0 else not listings  # (the disk/durable path lists once more)
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    assert (got, source) == ((6, "durable-node") if durable_newer else (5, "memory"))


@pytest.mark.slow
@pytest.mark.parametrize("durable_newer", [True, False])
def test_the_own_memory_copy_is_read_while_the_durable_tier_is_listed(tmp_path, durable_newer):
    """Each node reads its memory copy while the coordinator lists the durable tier; a newer durable step still
    wins (the read is dropped), an older one leaves the memory step to be written into the live state."""
    run_distributed(_read_while_listed, 2, str(tmp_path), durable_newer, timeout_s=240)


def _fsdp_memory_restore(rank, world, base):
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int):
        _, model, _ = _state(seed)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return TrainState(model=model, optimizer=opt), model, opt

    node = _node(rank, base)
    kwargs = {"memory_root": str(node / "mem")}
    state, model, opt = sharded(0)
    with CheckpointManager(node / "disk", async_save=False, **kwargs) as mgr:
        for step in (1, 2):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory" if step == 2 else "disk")
    want = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 1:
        shutil.rmtree(node / "mem")  # node 1's shards come back from node 0's replica
    torch.distributed.barrier()
    fresh, model2, opt2 = sharded(1)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
    assert (got, source) == (2, "memory-peer" if rank == 1 else "memory")
    assert all(torch.equal(want[k], v.full_tensor()) for k, v in model2.state_dict().items())
    assert opt2.state_dict()["state"] and all(
        torch.equal(a.full_tensor(), b.full_tensor()) for k in opt.state_dict()["state"]
        for a, b in zip(opt.state_dict()["state"][k].values(), opt2.state_dict()["state"][k].values())
        if isinstance(a, torch.Tensor) and a.dim())


@pytest.mark.slow
def test_fsdp2_shards_restore_bitwise_from_each_node_s_memory_copy(tmp_path):
    """FSDP2 on 2 nodes of one rank: each rank reads its node's memory copy alone (one rebuilt from the partner's
    replica), and the sharded model and optimizer state come back bitwise."""
    run_distributed(_fsdp_memory_restore, 2, str(tmp_path), timeout_s=240)


def _own_copy_flipped(rank, world, base):
    from torch_ckpt.tools.listing import verify_checkpoint

    node = _node(rank, base)
    kwargs = {"memory_root": str(node / "mem")}
    state, model, opt = _state()
    with CheckpointManager(node / "disk", async_save=False, **kwargs) as mgr:
        for step in (2, 3):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory" if step == 3 else "disk")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.distributed.barrier()
    own = node / "mem" / "step_000000003"
    if rank == 1:  # node 1 keeps its copy, but one bit of it flipped since its commit
        data = _biggest(own)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        data.write_bytes(bytes(raw))
    torch.distributed.barrier()
    fresh, model2, _ = _state(seed=1)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
    assert (got, source) == (3, "memory-peer" if rank == 1 else "memory")
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    assert verify_checkpoint(own)["ok"]  # the damaged copy was replaced by the rebuilt one


@pytest.mark.slow
def test_an_own_memory_copy_failing_its_crc_is_rebuilt_from_the_partner(tmp_path):
    """A node whose own memory copy fails its CRC-32 check gets it rebuilt from its partner's replica and resumes the
    memory step with every other node, instead of every node falling back to the older disk step."""
    run_distributed(_own_copy_flipped, 2, str(tmp_path), timeout_s=240)


def _figures(base: Path, world: int) -> list[dict]:
    return [json.loads((base / f"node{rank}" / "bytes.json").read_text()) for rank in range(world)]


@pytest.mark.slow
def test_a_ddp_job_replicates_kilobytes_and_a_lost_node_resumes_bitwise(tmp_path):
    """2 nodes holding the same model and optimizer state send a few kB per round, every data byte taken from the
    partner's own copy; a node whose RAM is wiped still resumes its replica bitwise."""
    run_distributed(_replicate_then_lose, 2, str(tmp_path), 1, None, {}, 4096, None, timeout_s=240)
    for stats in _figures(tmp_path, 2):  # three rounds
        assert stats["data_bytes"] > 500_000 and stats["reused_bytes"] == 3 * stats["data_bytes"], stats
        assert stats["sent_bytes"] < 3 * 64_000, stats


@pytest.mark.slow
def test_a_tensor_that_differs_between_nodes_is_sent_and_restores_bitwise(tmp_path):
    """A replicated tensor whose bytes differ on the partner (node 1's nudged bias) is streamed, the rest reused;
    the rebuilt node 1 resumes its own values bitwise."""
    run_distributed(_replicate_then_lose, 2, str(tmp_path), 1, None, {}, 4096, 1, timeout_s=240)
    for stats in _figures(tmp_path, 2):
        assert 2 * stats["data_bytes"] < stats["reused_bytes"] < 3 * stats["data_bytes"], stats


def _lose_disk_and_memory_after_a_disk_save(rank, world, base, replicas):
    """Steps 1-6 (disk saves at 2, 4, 6; memory at 1, 3, 5), node 1 then loses its disk and RAM; restore, save 7."""
    node = _node(rank, base)
    state, model, opt = _state()
    kwargs = {"memory_replicas": replicas, "memory_root": str(node / "mem")} if replicas is not None else \
        {"local_root_shared": False}  # replicas None: no memory tier, node-local disk roots only
    with CheckpointManager(node / "disk", save_every_n_steps=2, memory_every_n_steps=1 if replicas is not None
                           else None, async_save=False, **kwargs) as mgr:
        for step in range(1, 7):
            _train(model, opt, step)
            if step == 5:
                want = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save_if_due(step, state)
    if replicas is not None:  # node-local disks and no durable tier: step 6 goes with the node, step 5 does not
        assert mgr.health()["lost_steps_if_node_lost"] == (1 if replicas else 6)
    torch.distributed.barrier()
    if rank == 1:
        shutil.rmtree(node / "disk")
        shutil.rmtree(node / "mem", ignore_errors=True)
    torch.distributed.barrier()
    fresh, model2, opt2 = _state(seed=1)
    with CheckpointManager(node / "disk", async_save=False, **kwargs) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
        exact = all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
        if got is None:
            mgr.save(2, fresh)  # a run from scratch saves the steps the leftovers hold, without a refusal
        else:
            _train(model2, opt2, 6)
            mgr.save(6, fresh)  # the step node 0 still held: it went aside, this one is the new timeline's
    aside = sorted(p.name.split(".")[1].removeprefix("superseded_") for p in (node / "disk").glob(".superseded_*"))
    if replicas:
        assert (got, source, exact) == (5, "memory-peer" if rank == 1 else "memory", True)
        assert _steps(node / "disk") == ([6] if rank == 1 else [2, 4, 6])
        assert aside == ([] if rank == 1 else ["step_000000006"])
    else:
        assert got is None and source is None
        assert _steps(node / "disk") == [2]
        assert aside == ([] if rank == 1 else ["step_000000002", "step_000000004", "step_000000006"])
        assert replicas is None or _steps(node / "mem") == []


@pytest.mark.slow
def test_a_node_lost_right_after_a_disk_save_resumes_the_replicated_memory_step(tmp_path):
    """The newest disk step gone with node 1's disk, every node resumes the newer memory step (node 1 from its
    partner), and node 0's orphaned disk copy of step 6 goes aside at the next save."""
    run_distributed(_lose_disk_and_memory_after_a_disk_save, 2, str(tmp_path), 1, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [0, None], ids=["memory-without-replicas", "node-local-disk-only"])
def test_a_node_lost_with_no_replica_starts_over_and_sets_the_leftovers_aside(tmp_path, replicas):
    """No step is complete anywhere (node 1's disk and RAM gone, no replica): the run starts from scratch, and
    its first save moves node 0's steps of the old timeline aside instead of being refused."""
    run_distributed(_lose_disk_and_memory_after_a_disk_save, 2, str(tmp_path), replicas, timeout_s=240)


def test_a_replica_deletion_cut_short_leaves_nothing_listed(tmp_path, monkeypatch):
    """A replica is renamed to a hidden name before its files go: a kill in the middle of the deletion never
    leaves a part of it under its step name."""
    from torch_ckpt.root import _layout

    copy = _committed_copy(tmp_path)
    replica = tmp_path / "mem" / PEERS_DIR / "node-1" / copy.name
    shutil.copytree(copy, replica)

    def killed(path, ignore_errors=False):  # the first file goes, then the process dies
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(_layout.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        _layout.discard_step_dir(replica)
    monkeypatch.undo()
    assert not replica.exists() and _steps(replica.parent) == []
    assert [p.name for p in replica.parent.iterdir() if p.name.startswith(".")]  # the hidden rest


def _replicated_saves_grow_rss_little(rank, world, base):
    import gc
    import time

    import psutil

    def settled(mgr):  # the newest memory step is committed and its replica confirmed: no round in flight
        mgr.wait()
        deadline = time.monotonic() + 60
        while (health := mgr.health())["memory_safe_step"] != health["memory_step"]:
            assert time.monotonic() < deadline, f"node {rank}: never replicated: {health}"
            time.sleep(0.05)
        gc.collect()
        return proc.memory_info().rss

    node = _node(rank, base)
    torch.manual_seed(rank)  # the nodes' bytes differ: nothing is taken from the partner's own copy
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # ~34 MB fp32
    state, proc = TrainState(model=model), psutil.Process()
    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_every_n_steps=1,
                           save_every_n_steps=1000) as mgr:
        for step in range(1, 24):
            with torch.no_grad():
                model[step % 8].weight.add_(1.0)  # a changed file each step: its chunks are streamed
            mgr.save_if_due(step, state)
            if step == 3:
                base_rss = settled(mgr)
        growth = settled(mgr) - base_rss
        sent = mgr.health()["memory_replication"]["sent_bytes"]
    state_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert sent > 2 * state_bytes, f"node {rank} streamed only {sent} bytes"
    assert growth < 0.25 * state_bytes, f"node {rank}: RSS grew by {growth} bytes over 20 replicated memory saves"


@pytest.mark.slow
def test_resident_memory_stays_flat_over_20_replicated_memory_saves(tmp_path):
    """Twenty memory saves, each streamed to the partner node, grow neither node's RSS by a quarter of the state."""
    run_distributed(_replicated_saves_grow_rss_little, 2, str(tmp_path), timeout_s=240)


def test_a_sink_that_cannot_write_keeps_receiving_and_names_the_error(tmp_path, monkeypatch):
    """ENOSPC while a replica is written is a problem of the copy, not an exception: every piece is still taken."""
    import errno

    copy = _committed_copy(tmp_path)
    files = _listing(copy)
    calls = []

    def full(self, data):
        calls.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_Sink, "_put", full)
    sink = _stream(copy, files, tmp_path / "out")  # would raise out of landed() and stop the stream
    assert len(calls) == 1 and len(sink.problems) == 1 and "No space left on device" in sink.problems[0]
    assert _receive_into(tmp_path / "final", sink, source=0, step=1) == sink.problems[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "final").exists()


def _receive_fails_then_recovers(rank, world, base):
    import errno
    import time

    node = _node(rank, base)
    flag = Path(base) / "full"
    if rank == 1:
        put = _Sink._put

        def full_while_flagged(self, data):
            if flag.exists():
                raise OSError(errno.ENOSPC, "No space left on device")
            put(self, data)

        _Sink._put = full_while_flagged
        flag.touch()
    torch.distributed.barrier()
    state, model, opt = _state(seed=rank)

    def until(mgr, what, ok):
        deadline = time.monotonic() + 60  # far below the group's timeout: a stuck stream fails here
        while not ok(health := mgr.health()):
            assert time.monotonic() < deadline, f"node {rank}: {what}: {health}"
            time.sleep(0.05)

    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), async_save=False) as mgr:
        _train(model, opt, 1)
        mgr.save(1, state, tier="memory")
        if rank == 1:
            until(mgr, "the full replica was never refused", lambda h: h["memory_replication"]["refused"] == 1)
            flag.unlink()
        else:
            until(mgr, "the round never ended", lambda h: h["memory_replication"]["rounds"] >= 1)
            assert mgr.health()["memory_safe_step"] is None
        torch.distributed.barrier()
        _train(model, opt, 2)
        mgr.save(2, state, tier="memory")
        until(mgr, "step 2 never became node-loss safe", lambda h: h["memory_safe_step"] == 2)
    assert not list((node / "mem" / PEERS_DIR).rglob(".incoming*")), "a refused replica was left behind"


@pytest.mark.slow
def test_a_partner_that_cannot_write_the_replica_refuses_it_without_stalling_the_stream(tmp_path):
    """ENOSPC on the receiving node: the round ends at once with the replica refused; the next one is kept."""
    run_distributed(_receive_fails_then_recovers, 2, str(tmp_path), timeout_s=240)
