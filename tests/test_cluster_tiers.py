"""Two tiers at cluster scale, simulated on one machine: 4 gloo ranks as 2 nodes of 2, each node
with its own local root, a moto S3 server as the durable tier."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointManager, TrainState
from torch_ckpt.root._layout import read_manifest

pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")


def _as_nodes(rank: int, world: int, per_node: int, fn, *args) -> None:
    """Set torchrun's multi-node variables for ``rank`` (nodes of ``per_node`` ranks), then run ``fn``."""
    os.environ.update(LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      GROUP_RANK=str(rank // per_node))
    fn(rank, world, *args)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState(model=model, optimizer=opt), model, opt


def _train(model, opt, step):
    torch.manual_seed(100 + step)  # same data on every rank: the replicas stay equal (no DDP needed)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _root(base: str, rank: int, per_node: int) -> Path:
    return Path(base) / f"node{rank // per_node}"


def _save_steps(rank, world, base, url, options, steps):
    state, model, opt = _model()
    with CheckpointManager(_root(base, rank, 2), durable_url=url, storage_options=options, keep_last=5) as mgr:
        for step in range(1, steps + 1):
            _train(model, opt, step)
            mgr.save(step, state)
        mgr.wait()
        assert mgr.wait_durable(60)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(base) / f"ref{rank}.pt")


def _restore_after_replacement(rank, world, base, url, options, step):
    state, model, _ = _model()
    for p in model.parameters():
        p.data.zero_()
    with CheckpointManager(_root(base, rank, 2), durable_url=url, storage_options=options) as mgr:
        assert mgr.restore(state) == step
        expected = "local" if rank < 2 else "durable-node"
        assert mgr.restore_source == expected, (rank, mgr.restore_source)
    ref = torch.load(Path(base) / f"ref{rank}.pt")
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def _restore_resharded(rank, world, base, url, options, step):
    state, model, _ = _model()
    for p in model.parameters():
        p.data.zero_()
    root = Path(base) / f"small{rank}"
    with CheckpointManager(root, durable_url=url, storage_options=options, on_world_size_change="keep_live") as mgr:
        assert mgr.restore(state) == step
        assert mgr.restore_source == "durable-full"
    ref = torch.load(Path(base) / "ref0.pt")
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def _node_files(manifest, node):
    return {name for name, n in manifest.nodes["file_node"].items() if n == node}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, s3):
    """Steps 1 and 2 saved by 2 nodes of 2 ranks; returns the base directory."""
    base = tmp_path_factory.mktemp("cluster")
    url = f"s3://{s3.new_bucket()}/run"
    run_distributed(_as_nodes, 4, 2, _save_steps, str(base), url, s3.options, 2, timeout_s=240)
    (base / "url.json").write_text(json.dumps({"url": url}))
    return base


@pytest.mark.slow
def test_each_node_commits_only_its_own_shards(two_nodes):
    """Each node's root holds its ranks' shards, per-rank state and metadata, with a manifest naming its node."""
    tmp_path = two_nodes
    for node in (0, 1):
        step_dir = tmp_path / f"node{node}" / "step_000000002"
        manifest = read_manifest(step_dir)
        assert manifest.node == node and manifest.partial
        on_disk = {p.name for p in step_dir.iterdir()} - {"manifest.json"}
        assert on_disk == _node_files(manifest, node)
        assert {f"rank_{r:05d}.json" for r in (2 * node, 2 * node + 1)} <= on_disk


@pytest.mark.slow
def test_durable_tier_holds_each_tensor_once(two_nodes, s3):
    """Each node keeps its own copy of replicated tensors, but only the lowest node's copy is uploaded."""
    manifest = read_manifest(two_nodes / "node1" / "step_000000002")
    replicas = {n for n in manifest.local_files() if "_replica_" in n}
    assert replicas  # the model is replicated on every rank: node 1 holds its own copy
    from torch_ckpt.tiers._durable import DurableTier

    url = next(iter(json.loads((two_nodes / "url.json").read_text()).values()))
    durable = DurableTier(url, storage_options=s3.options)
    steps = set(durable.list_steps())
    assert 2 in steps and steps <= {1, 2}  # step 1 may be coalesced away when step 2 commits during its upload
    uploaded = {p.rsplit("/", 1)[-1] for p in durable.fs.find(f"{durable.root}/step_000000002")}
    assert not uploaded & replicas and "node_00001.metadata" not in uploaded
    assert durable.read_manifest(2).tensor_bytes == manifest.tensor_bytes


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ls", "verify", "inspect"])
def test_cli_says_a_node_copy_is_partial(two_nodes, command):
    """ls, verify and inspect report one node's copy as this node's (OK), not as corrupt."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "torch_ckpt", command, str(two_nodes / "node1")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    want = "node 1's copy of a node-local checkpoint" if command == "inspect" else \
        "partial: this node's copy of a node-local checkpoint (node 1 of 2); the other nodes' copies hold the rest"
    assert want in out.stdout
    assert "corrupt" not in out.stdout.replace("0 corrupt", "")


@pytest.mark.slow
def test_replaced_node_fetches_only_its_shards_and_resume_is_exact(tmp_path, s3):
    """Node 1's disk is lost: node 0 reads locally, node 1 fetches only its files from S3; then a
    restart at world size 2 reshards from the durable tier."""
    url = f"s3://{s3.new_bucket()}/run"
    from torch_ckpt.tiers._durable import DurableTier

    run_distributed(_as_nodes, 4, 2, _save_steps, str(tmp_path), url, s3.options, 3, timeout_s=240)
    shutil.rmtree(tmp_path / "node1")
    run_distributed(_as_nodes, 4, 2, _restore_after_replacement, str(tmp_path), url, s3.options, 3, timeout_s=240)
    durable = DurableTier(url, storage_options=s3.options).read_manifest(3)
    fetched = {p.name for p in (tmp_path / "node1" / "step_000000003").iterdir()} - {"manifest.json"}
    # node 1's ranks' files, the files holding the replicated tensors, the metadata; nothing else
    wanted = _node_files(durable, 1) | set(durable.nodes["shared"]) | {".metadata"}
    assert fetched == wanted and fetched < set(durable.files)
    assert not (tmp_path / "node1" / "step_000000002").exists()  # only the restored step was fetched
    run_distributed(_as_nodes, 2, 1, _restore_resharded, str(tmp_path), url, s3.options, 3, timeout_s=240)


def _per_rank(model, opt) -> TrainState:
    """Every tensor stored per rank: each node's ranks write, and link, their own files."""
    state = TrainState(model=model, optimizer=opt)
    state.replicated_keys = ()
    return state


def _frozen_base_saves(rank, world, base, url, options, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    model[0].requires_grad_(False)  # a frozen base far larger than the trained head
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    with CheckpointManager(_root(base, rank, 2), durable_url=url, storage_options=options, keep_last=2) as mgr:
        for step in range(1, steps + 1):
            _train(model, opt, step)
            mgr.save(step, _per_rank(model, opt)).wait()
            assert mgr.wait_durable(60)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(base) / f"ref{rank}.pt")


@pytest.mark.slow
def test_nodes_reference_the_unchanged_objects_of_an_earlier_durable_step(tmp_path, s3):
    """Incremental saves from 2 nodes: both nodes' unchanged files are referenced, not uploaded; durable
    retention keeps them, and a replaced node restores step 3 from them exactly."""
    from torch_ckpt.tiers._durable import DurableTier

    url = f"s3://{s3.new_bucket()}/run"
    run_distributed(_as_nodes, 4, 2, _frozen_base_saves, str(tmp_path), url, s3.options, 3, timeout_s=240)
    tier = DurableTier(url, storage_options=s3.options)
    manifest = tier.read_manifest(3)
    assert {manifest.nodes["file_node"][name] for name in manifest.stored} == {0, 1}  # each node's own files
    uploaded = {p.rsplit("/", 1)[-1] for p in tier.fs.find(tier.location(3).path)}
    assert not uploaded & set(manifest.stored)
    tier.delete(1)
    tier.delete(2)
    shutil.rmtree(tmp_path / "node1")

    run_distributed(_as_nodes, 4, 2, _restore_frozen_base, str(tmp_path), url, s3.options, timeout_s=240)


def _restore_frozen_base(rank, world, base, url, options):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    with CheckpointManager(_root(base, rank, 2), durable_url=url, storage_options=options) as mgr:
        assert mgr.restore(_per_rank(model, opt)) == 3
        assert mgr.restore_source == ("local" if rank < 2 else "durable-node"), (rank, mgr.restore_source)
    ref = torch.load(Path(base) / f"ref{rank}.pt")
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def _upload_dies_on_node1(rank, world, base, url, options):
    from torch_ckpt.tiers._durable import DurableTier

    if rank // 2 == 1:
        real = DurableTier._put_verified
        calls = []

        def dying(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise ConnectionError("uploader killed")
            return real(self, *args, **kwargs)

        DurableTier._put_verified = dying
    state, model, opt = _model()
    with CheckpointManager(_root(base, rank, 2), durable_url=url, storage_options=options,
                           durable_flush_timeout_seconds=3) as mgr:
        _train(model, opt, 1)
        mgr.save(1, state)
        mgr.wait()
        mgr.wait_durable(3)


@pytest.mark.slow
def test_uploader_killed_midway_never_shows_the_step(tmp_path, s3):
    """Node 1's uploader dies after one file: node 0 never writes the durable manifest, so S3 lists no step."""
    from torch_ckpt.tiers._durable import DurableTier

    url = f"s3://{s3.new_bucket()}/run"
    run_distributed(_as_nodes, 4, 2, _upload_dies_on_node1, str(tmp_path), url, s3.options, timeout_s=240)
    tier = DurableTier(url, storage_options=s3.options)
    assert tier.list_steps() == {}
    objects = [p.rsplit("/", 1)[-1] for p in tier.fs.find(tier.root)]
    assert "_uploaded_node_00000.json" in objects and "_uploaded_node_00001.json" not in objects
    assert "manifest.json" not in objects


@pytest.mark.slow
def test_durable_upload_to_s3_reads_nothing_back(tmp_path, s3):
    """On S3 each upload is verified by the store's MD5 ETag (single and multipart): zero bytes read back."""
    from torch_ckpt.tiers._durable import DurableTier

    url = f"s3://{s3.new_bucket()}/run"
    (tmp_path / "big").write_bytes(os.urandom(11 << 20))  # 2+ parts of 5 MiB
    (tmp_path / "small").write_bytes(b"x" * 1000)
    import zlib

    from torch_ckpt.root._layout import Manifest

    files = {n: {"bytes": (tmp_path / n).stat().st_size, "crc32": zlib.crc32((tmp_path / n).read_bytes())}
             for n in ("big", "small")}
    tier = DurableTier(url, storage_options=s3.options, part_bytes=5 << 20)
    tier.upload(tmp_path, Manifest(step=1, world_size=1, files=files))
    assert tier.bytes_read_back == 0
    assert set(tier.list_steps()) == {1}
    etag = tier.fs.info(f"{tier.root}/step_000000001/big")["ETag"].strip('"')
    assert etag.endswith("-3")  # multipart: 5 + 5 + 1 MiB


@pytest.mark.slow
def test_bytes_changed_in_transit_fail_the_upload(tmp_path, s3, monkeypatch):
    """A one-request upload stored as other bytes of the same size (its ETag is not their MD5) fails as corrupt."""
    import zlib

    from torch_ckpt import CheckpointCorruptError
    from torch_ckpt.root._layout import Manifest
    from torch_ckpt.tiers._durable import DurableTier

    url = f"s3://{s3.new_bucket()}/run"
    (tmp_path / "f").write_bytes(b"a" * 100)
    files = {"f": {"bytes": 100, "crc32": zlib.crc32(b"a" * 100)}}
    tier = DurableTier(url, storage_options=s3.options)
    real_call = tier.fs._call_s3

    async def garbling_call(method, *args, **kwargs):
        if method == "put_object" and kwargs.get("Key", "").endswith("/f"):
            kwargs["Body"] = b"b" * 100
        return await real_call(method, *args, **kwargs)

    monkeypatch.setattr(tier.fs, "_call_s3", garbling_call)
    with pytest.raises(CheckpointCorruptError, match=r"step_000000001/f: CRC-32 .* does not match the manifest"):
        tier.upload(tmp_path, Manifest(step=1, world_size=1, files=files))
    assert tier.list_steps() == {}


@pytest.mark.slow
def test_multipart_object_overwritten_after_upload_fails_it(tmp_path, s3, monkeypatch):
    """A multipart upload whose object then holds other bytes of the same size (HEAD's ETag differs) is corrupt."""
    import zlib

    from torch_ckpt import CheckpointCorruptError
    from torch_ckpt.root._layout import Manifest
    from torch_ckpt.tiers._durable import DurableTier

    url = f"s3://{s3.new_bucket()}/run"
    data = os.urandom(11 << 20)
    (tmp_path / "f").write_bytes(data)
    files = {"f": {"bytes": len(data), "crc32": zlib.crc32(data)}}
    tier = DurableTier(url, storage_options=s3.options, part_bytes=5 << 20)
    real_put = tier.fs.put_file

    def corrupting_put(lpath, rpath, **kwargs):
        real_put(lpath, rpath, **kwargs)
        tier.fs.pipe_file(rpath, bytes(len(data)))  # the store now holds other bytes of the same size

    monkeypatch.setattr(tier.fs, "put_file", corrupting_put)
    tier._store_checked = True  # this store's ETags are known to be MD5s
    with pytest.raises(CheckpointCorruptError, match="does not match the manifest"):
        tier.upload(tmp_path, Manifest(step=1, world_size=1, files=files))
    assert tier.list_steps() == {}


def test_manifest_node_fields_are_validated(tmp_path):
    """A manifest whose node fields do not cover every file is corrupt, naming the field."""
    from torch_ckpt import CheckpointCorruptError
    from torch_ckpt.format._files import parse_manifest

    doc = {"format": "torch-ckpt", "format_version": 1, "step": 1, "world_size": 2, "wall_time": 1.0,
           "torch_version": "x", "files": {"a": {"bytes": 1, "crc32": 0}, "b": {"bytes": 1, "crc32": 0}},
           "nodes": {"rank_node": [0, 1], "file_node": {"a": 0}}, "node": 0}
    with pytest.raises(CheckpointCorruptError, match="file_node"):
        parse_manifest(json.dumps(doc).encode(), "m")


def _same_root_on_two_nodes(rank, world, base):
    from torch_ckpt import ConfigError

    with pytest.raises(ConfigError, match="local_root_shared=True"):
        CheckpointManager(Path(base) / "shared")


@pytest.mark.slow
def test_shared_directory_taken_for_node_local_is_refused(tmp_path):
    """Two nodes given one directory (a shared file system) are refused at start, naming the option."""
    run_distributed(_as_nodes, 2, 1, _same_root_on_two_nodes, str(tmp_path), timeout_s=120)
