"""Two-tier storage: local commit first, background replication to a durable fsspec store.

S3 tests run against a real S3-compatible server (moto's threaded server on 127.0.0.1, as s3fs's
own tests do), started and stopped by a fixture; ``memory://`` covers the fsspec path without it.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from torch_ckpt import CheckpointCorruptError, CheckpointManager, TrainState
from torch_ckpt.tiers import DurableTier, DurableUnavailableError

s3fs = pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3:
    """A moto S3 server on loopback that can be stopped and restarted on the same port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                        "use_listings_cache": False,
                        "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                        "config_kwargs": {"connect_timeout": 1, "read_timeout": 10, "retries": {"max_attempts": 1}}}

    def start(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def new_bucket(self) -> str:
        import boto3

        name = f"ckpt-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="module")
def s3():
    server = S3()
    server.start()
    yield server
    server.stop()


def _state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return TrainState(model=model, optimizer=opt, scheduler=sched), model, opt, sched


def _train(model, opt, sched, n=1):
    for _ in range(n):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_memory_url_roundtrip_after_local_loss(tmp_path):
    """With memory:// as durable tier, a lost local root is restored from the durable copy exactly."""
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    state, model, opt, sched = _state()
    with CheckpointManager(tmp_path / "local", durable_url=url) as mgr:
        for step in (1, 2, 3):
            _train(model, opt, sched)
            mgr.save(step, state)
        assert mgr.wait_durable(60)
        assert mgr.replication_stats()["durable_step"] == 3
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    shutil.rmtree(tmp_path / "local")
    state2, model2, *_ = _state(seed=5)
    with CheckpointManager(tmp_path / "local", durable_url=url) as mgr:
        assert mgr.restore(state2) == 3
    assert all(torch.equal(v, ref[k]) for k, v in model2.state_dict().items())


def test_local_manifest_records_the_durable_copy(tmp_path):
    """After replication the local manifest lists the durable tier holding a verified copy."""
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    state, *_ = _state()
    with CheckpointManager(tmp_path, durable_url=url) as mgr:
        mgr.save(1, state)
        assert mgr.wait_durable(60)
    from torch_ckpt.layout import read_manifest

    tiers = read_manifest(tmp_path / "step_000000001").tiers
    assert tiers["durable"]["url"] == url


@pytest.mark.slow
def test_s3_resume_in_fresh_process_after_local_loss(tmp_path, s3):
    """Steps replicated to S3 restore exactly in a new process after the local directory is deleted."""
    url = f"s3://{s3.new_bucket()}/runs/exp1"
    state, model, opt, sched = _state()
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=s3.options) as mgr:
        for step in (1, 2, 3):
            _train(model, opt, sched)
            mgr.save(step, state)
        assert mgr.wait_durable(60)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "ref.pt")
    shutil.rmtree(tmp_path / "local")
    script = textwrap.dedent(f"""
        import torch
        from tests.test_tiers import _state
        from torch_ckpt import CheckpointManager
        state, model, *_ = _state(seed=9)
        with CheckpointManager({str(tmp_path / 'local')!r}, durable_url={url!r}, storage_options={s3.options!r}) as m:
            assert m.restore(state) == 3
        ref = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
        print("RESTORED")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert "RESTORED" in out.stdout, out.stderr[-3000:]


def test_s3_keys_keep_the_url_scheme(tmp_path, s3):
    """Objects land under bucket/prefix/step_N/ (no 's3:/' mangling) with the manifest written last."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/a/b"
    state, *_ = _state()
    with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options) as mgr:
        mgr.save(7, state)
        assert mgr.wait_durable(60)
    fs = s3fs.S3FileSystem(**s3.options)
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/a/b/step_000000007")}
    assert {"manifest.json", ".metadata", "__0_0.distcp", "rank_00000.json"} <= names
    assert DurableTier(url, storage_options=s3.options).describe(7) == f"s3://{bucket}/a/b/step_000000007"


def test_outage_keeps_training_and_catches_up(tmp_path, s3, caplog):
    """With the server down saves still commit locally, the backlog coalesces, and uploads resume after."""
    url = f"s3://{s3.new_bucket()}/run"
    state, model, opt, sched = _state()
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options, keep_last=10) as mgr:
        mgr.save(1, state)
        assert mgr.wait_durable(60)
        s3.stop()
        try:
            for step in range(2, 7):
                _train(model, opt, sched)
                mgr.save(step, state).wait()
            assert mgr.all_steps() == [1, 2, 3, 4, 5, 6]  # local saves went on
            deadline = time.monotonic() + 30
            while mgr.replication_stats()["last_error"] is None and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = mgr.replication_stats()
            assert stats["last_error"] and stats["durable_step"] == 1 and stats["skipped"] >= 1
            assert any("retrying" in r.getMessage() for r in caplog.records)
        finally:
            s3.start()
        assert mgr.wait_durable(60)
        assert mgr.replication_stats()["durable_step"] == 6
    durable = DurableTier(url, storage_options=s3.options).list_steps()
    assert 6 in durable and set(durable) <= {1, 2, 3, 4, 5, 6}
    for step, manifest in durable.items():  # everything listed is complete
        assert manifest.step == step


def test_flipped_byte_in_durable_copy_falls_back(tmp_path, s3, caplog):
    """A corrupted uploaded object is detected on load: latest falls back with a warning, explicit step raises."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/run"
    state, model, opt, sched = _state()
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=s3.options) as mgr:
        for step in (1, 2):
            _train(model, opt, sched)
            mgr.save(step, state).wait()
            assert mgr.wait_durable(60)
    fs = s3fs.S3FileSystem(**s3.options)
    key = f"{bucket}/run/step_000000002/__0_0.distcp"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    shutil.rmtree(tmp_path / "local")
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    state2, *_ = _state(seed=3)
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=s3.options) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp.*step 2|step 2.*__0_0\.distcp"):
            mgr.restore(state2, step=2)
        assert mgr.restore(state2) == 1
    assert any("falling back to step 1" in r.getMessage() for r in caplog.records)


def test_durable_retention_keeps_last_n(tmp_path):
    """durable_keep_last prunes the durable tier after each durable commit."""
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    state, *_ = _state()
    with CheckpointManager(tmp_path, durable_url=url, keep_last=1, durable_keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, state).wait()
            assert mgr.wait_durable(60)
        assert mgr.all_steps() == [5]
    assert sorted(DurableTier(url).list_steps()) == [4, 5]


def test_unreachable_durable_with_no_local_checkpoint_is_an_error(tmp_path, s3):
    """An outage is not an empty store: with nothing local, restore raises instead of starting over."""
    url = f"s3://{s3.new_bucket()}/run"
    state, *_ = _state()
    s3.stop()
    try:
        with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options) as mgr:
            with pytest.raises(DurableUnavailableError, match="refusing to start from scratch"):
                mgr.restore(state)
    finally:
        s3.start()


def test_unreachable_durable_falls_back_to_local(tmp_path, s3, caplog):
    """With the store down, restore uses the local tier and says so."""
    url = f"s3://{s3.new_bucket()}/run"
    state, *_ = _state()
    with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options) as mgr:
        mgr.save(1, state).wait()
        assert mgr.wait_durable(60)
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    s3.stop()
    try:
        with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options,
                               durable_flush_timeout_seconds=1) as mgr:
            assert mgr.restore(_state(seed=2)[0]) == 1
    finally:
        s3.start()
    assert any("local tier only" in r.getMessage() for r in caplog.records)


def test_unknown_protocol_is_a_config_error(tmp_path):
    """A durable URL whose backend is unknown fails at construction with the URL named."""
    from torch_ckpt import ConfigError

    with pytest.raises(ConfigError, match="nosuchproto://x"):
        CheckpointManager(tmp_path, durable_url="nosuchproto://x")


def _sharded_replicate(rank, world, root, url, options):
    model = torch.nn.parallel.DistributedDataParallel(_state()[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    with CheckpointManager(root, durable_url=url, storage_options=options) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
        assert mgr.wait_durable(60)
    full = {k: v.clone() for k, v in model.module.state_dict().items()}
    if rank == 0:
        torch.save(full, f"{root}/ref.pt")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_rank_sharded_save_replicates(tmp_path, s3):
    """A checkpoint written by 2 gloo ranks is replicated completely and restores on one process."""
    from tests._dist import run_distributed

    url = f"s3://{s3.new_bucket()}/run"
    run_distributed(_sharded_replicate, 2, str(tmp_path / "local"), url, s3.options)
    manifest = DurableTier(url, storage_options=s3.options).list_steps()[1]
    assert {"__0_0.distcp", "__1_0.distcp", "rank_00000.json", "rank_00001.json"} <= set(manifest.files)
    ref = torch.load(tmp_path / "local" / "ref.pt", weights_only=True)
    shutil.rmtree(tmp_path / "local")
    _, model2, *_ = _state(seed=4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=s3.options,
                           on_world_size_change="keep_live") as mgr:
        assert mgr.restore(TrainState(model=model2, optimizer=opt2)) == 1
    assert all(torch.equal(v, ref[k]) for k, v in model2.state_dict().items())


# -- abandoned uploads (issue 14 item 5) -----------------------------------------------------------
def _abandoned_setup(tmp_path, url: str, options: dict | None = None) -> DurableTier:
    """A durable root with committed step 1 and manifest-less prefixes of steps 2 and 3 (crashed uploads)."""
    from torch_ckpt.layout import read_manifest

    state, *_ = _state()
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=options) as mgr:
        mgr.save(1, state)
        assert mgr.wait_durable(60)
    tier = DurableTier(url, storage_options=options)
    local = tmp_path / "local" / "step_000000001"
    for step in (2, 3):
        for name in sorted(read_manifest(local).files)[:2]:  # part of an upload, then a crash
            tier.fs.put_file(str(local / name), f"{tier.root}/step_{step:09d}/{name}")
    tier._refresh()
    return tier


def test_s3_abandoned_uploads_older_than_the_limit_are_removed(tmp_path, s3):
    """Manifest-less step prefixes idle longer than the limit are deleted; the committed step stays listed."""
    tier = _abandoned_setup(tmp_path, f"s3://{s3.new_bucket()}/run", s3.options)
    later = time.time() + 7200
    assert set(tier.abandoned_uploads(older_than_seconds=3600, now=later)) == {2, 3}
    assert tier.remove_abandoned(older_than_seconds=3600, now=later) == [2, 3]
    assert not tier.fs.exists(f"{tier.root}/step_000000002") and not tier.fs.exists(f"{tier.root}/step_000000003")
    assert list(tier.list_steps()) == [1]


def test_s3_recent_manifestless_prefix_is_never_removed(tmp_path, s3):
    """A prefix whose newest object is younger than the limit (maybe still uploading) is kept."""
    tier = _abandoned_setup(tmp_path, f"s3://{s3.new_bucket()}/run", s3.options)
    assert tier.abandoned_uploads(older_than_seconds=3600) == {}
    assert tier.remove_abandoned(older_than_seconds=3600) == []
    assert tier.fs.find(f"{tier.root}/step_000000002") and tier.fs.find(f"{tier.root}/step_000000003")


def _age_memory_objects(tier: DurableTier, *steps: int, seconds: float) -> None:
    """Backdate every object of the given memory:// step prefixes by ``seconds``."""
    import datetime as dt

    for step in steps:
        for path in tier.fs.find(f"{tier.root}/step_{step:09d}"):
            tier.fs.store[path].created -= dt.timedelta(seconds=seconds)


def test_abandoned_upload_with_one_fresh_object_is_kept(tmp_path):
    """A prefix with old objects and one just written counts as active and is not removed; an idle one is."""
    tier = _abandoned_setup(tmp_path, f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    _age_memory_objects(tier, 2, 3, seconds=10_000)
    tier.fs.pipe_file(f"{tier.root}/step_000000002/late.distcp", b"x")
    assert tier.remove_abandoned(older_than_seconds=3600) == [3]
    assert tier.fs.exists(f"{tier.root}/step_000000002/late.distcp")


def test_excluded_steps_are_never_removed(tmp_path):
    """Steps passed in exclude (queued or uploading here) stay even when old."""
    tier = _abandoned_setup(tmp_path, f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    assert tier.remove_abandoned(older_than_seconds=3600, exclude={2}, now=time.time() + 7200) == [3]
    assert tier.fs.exists(f"{tier.root}/step_000000002")


def test_replicator_removes_abandoned_uploads_after_a_commit(tmp_path):
    """After its next durable commit the replicator deletes prefixes idle past abandoned_after_seconds."""
    from torch_ckpt.replicator import Replicator

    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    tier = _abandoned_setup(tmp_path, url)
    _age_memory_objects(tier, 2, 3, seconds=10_000)  # idle for ~3 h
    rep = Replicator(tier, abandoned_after_seconds=3600)
    try:
        rep.submit(1, tmp_path / "local" / "step_000000001")
        assert rep.wait(60)
    finally:
        rep.close(5)
    assert not tier.fs.exists(f"{tier.root}/step_000000002") and not tier.fs.exists(f"{tier.root}/step_000000003")
    assert list(tier.list_steps()) == [1]


def test_malformed_durable_manifest_is_skipped_with_a_warning(tmp_path, caplog):
    """A durable manifest with a 5000-digit integer is not listed (warning naming it); the tier lists the rest."""
    tier = _abandoned_setup(tmp_path, f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    raw = tier.fs.cat_file(f"{tier.root}/step_000000001/manifest.json").decode()
    tier.fs.pipe_file(f"{tier.root}/step_000000004/manifest.json",
                      raw.replace('"step":1,', '"step":' + "4" * 5000 + ",", 1).encode())
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    assert list(tier.list_steps()) == [1]
    assert any("step_000000004" in r.getMessage() and "5000 digits" in r.getMessage() for r in caplog.records)
