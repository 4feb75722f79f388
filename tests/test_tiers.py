"""Two-tier storage: local commit first, background replication to a durable fsspec store.

S3 tests run against a real S3-compatible server (moto's threaded server on 127.0.0.1, as s3fs's
own tests do), started and stopped by a fixture; ``memory://`` covers the fsspec path without it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from torch_ckpt import CheckpointCorruptError, CheckpointManager, TrainState
from torch_ckpt.tiers._durable import DurableTier, DurableUnavailableError

s3fs = pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

from tests._s3 import S3  # noqa: E402, F401 - after the skips; tests/accelerate imports S3 from here


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
    from torch_ckpt.root._layout import read_manifest

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
        with pytest.raises(CheckpointCorruptError, match=r"step_000000002/__0_0\.distcp: CRC-32 .* corrupt"):
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


def committed_tier(tmp_path, url: str, options: dict | None = None) -> DurableTier:
    """A durable root holding step 1 of a small state, committed by a manager under ``tmp_path/local``."""
    state, *_ = _state()
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=options) as mgr:
        mgr.save(1, state)
        assert mgr.wait_durable(60)
    return DurableTier(url, storage_options=options)


def test_malformed_durable_manifest_is_skipped_with_a_warning(tmp_path, caplog):
    """A durable manifest with a 5000-digit integer is not listed (warning naming it); the tier lists the rest."""
    tier = committed_tier(tmp_path, f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    raw = tier.fs.cat_file(f"{tier.root}/step_000000001/manifest.json").decode()
    tier.fs.pipe_file(f"{tier.root}/step_000000004/manifest.json",
                      raw.replace('"step":1,', '"step":' + "4" * 5000 + ",", 1).encode())
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    assert list(tier.list_steps()) == [1]
    assert any("step_000000004" in r.getMessage() and "5000 digits" in r.getMessage() for r in caplog.records)


# -- uploads and fetches checked by format.verify_files (issue 15 item 2) ----------------------------
def _one_file(tmp_path, data: bytes = bytes(range(256)) * 64):
    """``(directory, manifest)`` of a one-file checkpoint ``f.bin`` of ``data``."""
    import zlib

    from torch_ckpt.format._files import Manifest

    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "f.bin").write_bytes(data)
    return local, Manifest(step=1, world_size=1, files={"f.bin": {"bytes": len(data), "crc32": zlib.crc32(data)}})


def _flip_object(tier: DurableTier, path: str) -> None:
    data = bytearray(tier.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    tier.fs.pipe_file(path, bytes(data))


def _local_corruption_text(tmp_path, local, manifest) -> str:
    """The problem text verify_files gives for ``f.bin`` of a copy of ``local`` with the same byte flipped."""
    from torch_ckpt.format._files import verify_files

    damaged = tmp_path / "damaged"
    shutil.copytree(local, damaged)
    data = bytearray((damaged / "f.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "f.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as exc:
        verify_files(damaged, manifest, checksums=True)
    return str(exc.value).removeprefix(f"{damaged / 'f.bin'}: ")


def _corrupting_put(tier: DurableTier, monkeypatch) -> None:
    """Make every upload of ``tier`` land with one byte flipped (same size)."""
    real_put = tier.fs.put_file

    def put(lpath, rpath, **kwargs):
        real_put(lpath, rpath, **kwargs)
        _flip_object(tier, rpath)

    monkeypatch.setattr(tier.fs, "put_file", put)


def test_upload_corrupted_in_the_store_fails_as_a_corrupt_local_file_does(tmp_path, monkeypatch):
    """An object whose bytes differ from the manifest fails the upload with the local file's error, on its URL."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    _corrupting_put(tier, monkeypatch)
    with pytest.raises(CheckpointCorruptError) as exc:
        tier.upload(local, manifest)
    assert str(exc.value) == f"{tier.describe(1)}/f.bin: {_local_corruption_text(tmp_path, local, manifest)}"
    assert tier.list_steps() == {}


def test_a_failed_upload_starts_no_further_file(tmp_path, monkeypatch):
    """With several upload threads the first failure ends the upload: the files not started yet are never sent."""
    import zlib

    from torch_ckpt.format._files import Manifest

    local, files = tmp_path / "ckpt", {}
    local.mkdir()
    for i in range(8):
        (local / f"f{i}.bin").write_bytes(bytes([i]) * 64)
        files[f"f{i}.bin"] = {"bytes": 64, "crc32": zlib.crc32(bytes([i]) * 64)}
    tier = DurableTier(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run", upload_threads=2)
    real_put, sent = tier.fs.put_file, []

    def put(lpath, rpath, **kwargs):
        sent.append(rpath.rsplit("/", 1)[-1])
        if rpath.endswith("/f0.bin"):
            raise OSError("connection reset by peer")
        time.sleep(0.2)
        real_put(lpath, rpath, **kwargs)

    monkeypatch.setattr(tier.fs, "put_file", put)
    with pytest.raises(OSError, match="connection reset by peer"):
        tier.upload(local, Manifest(step=1, world_size=1, files=files))
    assert "f0.bin" in sent and len(sent) <= 2  # f0, and f1 when the other thread had taken it already
    assert tier.list_steps() == {}


@pytest.mark.parametrize(("verify", "read_back"), [("checksum", 256 * 64), ("size", 0)])
def test_uploads_are_read_back_unless_verify_is_size(tmp_path, verify, read_back):
    """On a store without digests verify="checksum" reads every uploaded byte back; "size" reads none."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run", verify=verify)
    tier.upload(local, manifest)
    assert tier.bytes_read_back == read_back
    assert list(tier.list_steps()) == [1]


def test_size_verification_commits_a_same_size_corruption(tmp_path, monkeypatch):
    """verify="size" compares sizes only: an object changed in place (same size) is committed."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run", verify="size")
    _corrupting_put(tier, monkeypatch)
    tier.upload(local, manifest)
    assert list(tier.list_steps()) == [1]


def test_fetch_of_a_corrupted_object_fails_as_a_corrupt_local_file_does(tmp_path):
    """A flipped byte in the store fails download() with the local file's error, on the object's URL; nothing
    is committed locally."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    tier.upload(local, manifest)
    _flip_object(tier, f"{tier.location(1).path}/f.bin")
    with pytest.raises(CheckpointCorruptError) as exc:
        tier.download(1, tmp_path / "restored")
    assert str(exc.value) == f"{tier.describe(1)}/f.bin: {_local_corruption_text(tmp_path, local, manifest)}"
    assert list((tmp_path / "restored").iterdir()) == []


def test_fetch_checks_every_file_with_verify_files(tmp_path, monkeypatch):
    """download() checks each fetched file through format.verify_files, with checksums."""
    import torch_ckpt.tiers._durable

    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    tier = committed_tier(tmp_path, url)
    checked = []
    real = torch_ckpt.tiers._durable.verify_files

    def spy(where, manifest, **kwargs):
        checked.extend((name, kwargs["checksums"]) for name in manifest.files)
        return real(where, manifest, **kwargs)

    monkeypatch.setattr(torch_ckpt.tiers._durable, "verify_files", spy)
    tier.download(1, tmp_path / "restored")
    assert sorted(checked) == [(name, True) for name in sorted(tier.read_manifest(1).files)]


def test_s3_upload_of_a_file_changed_since_its_commit_is_refused(tmp_path, s3):
    """A local file that no longer has its manifest CRC-32 is not uploaded: the error names it."""
    local, manifest = _one_file(tmp_path)
    data = bytearray((local / "f.bin").read_bytes())
    data[0] ^= 0xFF
    (local / "f.bin").write_bytes(bytes(data))  # bit rot after the commit: same size
    tier = DurableTier(f"s3://{s3.new_bucket()}/run", storage_options=s3.options)
    with pytest.raises(CheckpointCorruptError) as exc:
        tier.upload(local, manifest)
    assert str(exc.value).startswith(f"{local / 'f.bin'}: CRC-32 ") and "changed since its commit" in str(exc.value)
    assert tier.list_steps() == {} and tier.bytes_uploaded == 0


def test_s3_upload_is_checked_by_the_store_digest_without_reading_back(tmp_path, s3):
    """On an S3 store whose ETags are MD5s an intact upload reads nothing back."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"s3://{s3.new_bucket()}/run", storage_options=s3.options)
    tier.upload(local, manifest)
    assert tier.bytes_read_back == 0 and list(tier.list_steps()) == [1]


def test_s3_one_request_upload_is_verified_by_its_answer(tmp_path, s3, monkeypatch):
    """A file sent in one PutObject is verified by the ETag answered: no HEAD, nothing read back."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"s3://{s3.new_bucket()}/run", storage_options=s3.options)
    real_call, methods = tier.fs._call_s3, []

    async def call(method, *args, **kwargs):
        methods.append(method)
        return await real_call(method, *args, **kwargs)

    monkeypatch.setattr(tier.fs, "_call_s3", call)
    tier.upload(local, manifest)
    assert [m for m in methods if m != "head_bucket"] == ["put_object", "put_object"]  # f.bin, then the manifest


def test_s3_store_answering_other_etags_is_read_back_with_a_warning(tmp_path, s3, monkeypatch, caplog):
    """A store whose PutObject ETag is not the MD5 of the bytes gets every upload read back, and says so once."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"s3://{s3.new_bucket()}/run", storage_options=s3.options)
    real_call = tier.fs._call_s3

    async def call(method, *args, **kwargs):
        answer = await real_call(method, *args, **kwargs)
        return {**answer, "ETag": '"kms-encrypted"'} if method == "put_object" else answer

    monkeypatch.setattr(tier.fs, "_call_s3", call)
    with caplog.at_level(logging.WARNING):
        tier.upload(local, manifest)
    assert tier.bytes_read_back == manifest.files["f.bin"]["bytes"] and list(tier.list_steps()) == [1]
    assert caplog.text.count("ETags are not MD5 digests") == 1


def test_history_steps_are_replicated_whatever_replicate_every_n_saves_says(tmp_path):
    """Multiples of durable_keep_every_n_steps are replicated even between every-n-th saves."""
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    state, *_ = _state()
    with CheckpointManager(tmp_path, durable_url=url, replicate_every_n_saves=3, durable_keep_last=10,
                           durable_keep_every_n_steps=2, keep_last=10) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.save(step, state).wait()
            assert mgr.wait_durable(60)
    assert sorted(DurableTier(url).list_steps()) == [2, 3, 4]


def test_fetch_of_a_deleted_object_fails_as_a_missing_local_file_does(tmp_path):
    """An object deleted from the store after its manifest fails download() as corrupt, naming its URL."""
    local, manifest = _one_file(tmp_path)
    tier = DurableTier(f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    tier.upload(local, manifest)
    tier.fs.rm_file(f"{tier.location(1).path}/f.bin")
    with pytest.raises(CheckpointCorruptError) as exc:
        tier.download(1, tmp_path / "restored")
    assert str(exc.value) == f"{tier.describe(1)}/f.bin: listed in the manifest but missing"
    assert list((tmp_path / "restored").iterdir()) == []


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_s3_restore_falls_back_when_an_object_of_the_newest_copy_was_deleted(tmp_path, s3, caplog, name):
    """Local root lost, one object of the newest durable step deleted: restore warns and loads the older step."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/run"
    with CheckpointManager(tmp_path / "local", durable_url=url, storage_options=s3.options) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((8,), float(step))}).wait()
        assert mgr.wait_durable(60)
    s3fs.S3FileSystem(**s3.options).rm_file(f"{bucket}/run/step_000000002/{name}")
    shutil.rmtree(tmp_path / "local")
    live = {"w": torch.zeros(8)}
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "local", durable_url=url,
                                                             storage_options=s3.options) as mgr:
        assert mgr.restore(live) == 1
    assert torch.equal(live["w"], torch.ones(8))
    assert f"step_000000002/{name}: listed in the manifest but missing" in caplog.text


@pytest.mark.parametrize("threads", [1, 2])
def test_s3_multipart_uploads_hold_at_most_upload_threads_parts(tmp_path, s3, threads):
    """A large file goes up in parts, but never more than ``upload_threads * part_bytes`` bytes are in flight
    (s3fs would read up to its ``max_concurrency`` (10) parts of one file at once)."""
    import threading
    import zlib

    from torch_ckpt.format._files import Manifest

    part = 5 << 20
    local = tmp_path / "ckpt"
    local.mkdir()
    files = {}
    for name, size in (("big.bin", 6 * part + 1), ("small.bin", 1000)):
        data = bytes([len(name)]) * size
        (local / name).write_bytes(data)
        files[name] = {"bytes": size, "crc32": zlib.crc32(data)}
    tier = DurableTier(f"s3://{s3.new_bucket()}/run", storage_options=s3.options, part_bytes=part,
                       upload_threads=threads)
    real_call, lock, flight = tier.fs._call_s3, threading.Lock(), {"now": 0, "most": 0}

    async def call(method, *args, **kwargs):
        body = kwargs.get("Body")
        size = len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0
        with lock:
            flight["now"] += size
            flight["most"] = max(flight["most"], flight["now"])
        try:
            return await real_call(method, *args, **kwargs)
        finally:
            with lock:
                flight["now"] -= size

    tier.fs._call_s3 = call
    tier.upload(local, Manifest(step=1, world_size=1, files=files))
    assert list(tier.list_steps()) == [1]
    assert 0 < flight["most"] <= threads * part


def test_s3_downloads_request_at_most_upload_threads_chunks_at_once(tmp_path, s3):
    """A download reads its objects in ``CHUNK_BYTES`` requests, at most ``upload_threads`` of them in flight
    (s3fs's default read-ahead cache would ask for two chunks at a time)."""
    import threading
    import zlib

    from torch_ckpt.format._files import Manifest
    from torch_ckpt.storage._locations import CHUNK_BYTES

    local = tmp_path / "ckpt"
    local.mkdir()
    files = {}
    for name, size in (("a.bin", 2 * CHUNK_BYTES + 5), ("b.bin", CHUNK_BYTES + 3)):
        data = bytes([len(name) + size % 7]) * size
        (local / name).write_bytes(data)
        files[name] = {"bytes": size, "crc32": zlib.crc32(data)}
    url = f"s3://{s3.new_bucket()}/run"
    DurableTier(url, storage_options=s3.options).upload(local, Manifest(step=1, world_size=1, files=files))
    tier = DurableTier(url, storage_options=s3.options, upload_threads=1)
    real_call, lock, flight = tier.fs._call_s3, threading.Lock(), {"now": 0, "most": 0}

    async def call(method, *args, **kwargs):
        asked = 0
        if method == "get_object" and isinstance(kwargs.get("Range"), str):
            first, last = kwargs["Range"].removeprefix("bytes=").split("-")
            asked = int(last) - int(first) + 1
        with lock:
            flight["now"] += asked
            flight["most"] = max(flight["most"], flight["now"])
        try:
            return await real_call(method, *args, **kwargs)
        finally:
            with lock:
                flight["now"] -= asked

    tier.fs._call_s3 = call
    got = tier.download(1, tmp_path / "restored")
    assert all((got / name).stat().st_size == info["bytes"] for name, info in files.items())
    assert 0 < flight["most"] <= CHUNK_BYTES
