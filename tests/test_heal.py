"""Tiers heal each other, and a durable store never blocks the caller for minutes (issue 26, item 3).

A damaged local copy is taken from the durable tier; a store that goes down between listing and
downloading falls back to the newest intact local step; a deleted bucket is an error, never a silent
fresh start, and is not re-created unless asked; a store that accepts connections but never answers
costs ``health()`` nothing and ``restore()`` at most about ``durable_timeout_seconds``. Durable tiers
are ``file://`` directories and a moto S3 server on 127.0.0.1; the silent store is a loopback TCP
server that accepts and never replies.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointManager, TrainState
from torch_ckpt.storage._locations import DurableUnavailableError
from torch_ckpt.tiers._durable import DurableTier

pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

#: A correctness bound on the caller's wait for a silent store: durable_timeout_seconds times a
#: small factor (the worker's start, the fallback's local load, a loaded CI machine).
TIMEOUT_S = 2.0
BOUND_S = 5 * TIMEOUT_S


class SilentServer:
    """A loopback TCP server that accepts connections and never answers; stops itself after ``life_s``."""

    def __init__(self, life_s: float = 120.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self._deadline = time.monotonic() + life_s
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self._held.append(conn)  # read nothing, answer nothing
        self.close()

    def close(self) -> None:
        self._stop.set()
        for conn in self._held:
            conn.close()
        self.sock.close()

    @property
    def options(self) -> dict:
        """s3fs options pointing at this server, with no timeout or retry settings of their own (the defaults)."""
        return {"key": "testing", "secret": "testing", "skip_instance_cache": True, "use_listings_cache": False,
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-east-1"}}


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def _state(seed: int = 0) -> tuple[TrainState, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return TrainState(model=model), model


def _save(root: Path, steps, **settings) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` (each with other weights) and wait for replication; returns each step's weights."""
    state, model = _state()
    saved = {}
    with CheckpointManager(root, keep_last=10, **settings) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.fill_(float(step))
            mgr.save(step, state).wait()
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr.wait_durable(60)
    return saved


def _damage(step_dir: Path) -> Path:
    """Flip one byte in the middle of the largest data file (its size stays: only the checksum finds it)."""
    shard = max((p for p in step_dir.iterdir() if p.name.endswith(".distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


@pytest.fixture(params=["file", "s3"])
def durable(request, tmp_path, s3):
    """``(durable_url, storage_options)`` of an empty durable tier: a file:// directory or an S3 bucket."""
    if request.param == "file":
        return f"file://{tmp_path / 'durable'}", None
    return f"s3://{s3.new_bucket()}/run", s3.options


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_damaged_local_copy_is_taken_from_the_durable_tier(tmp_path, durable, persist, caplog):
    """A local copy that fails its checksum is replaced by its intact durable copy: the same step is restored."""
    url, options = durable
    root = tmp_path / "local"
    saved = _save(root, [1, 2], durable_url=url, storage_options=options, persist=persist)
    shard = _damage(root / "step_000000002")
    state, model = _state(seed=1)
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), \
            CheckpointManager(root, durable_url=url, storage_options=options, persist=persist) as mgr:
        assert mgr.restore(state) == 2
    assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())
    assert "taking step 2 from the durable tier" in caplog.text
    with CheckpointManager(root) as local_only:  # the local tier is healed: its copy of step 2 verifies again
        assert local_only.restore(_state(seed=2)[0]) == 2
    assert shard.exists()


def test_damaged_local_copy_of_an_explicit_step_is_taken_from_the_durable_tier(tmp_path, durable):
    """restore(step=N) with a damaged local copy of N loads N from the durable tier, not an error."""
    url, options = durable
    root = tmp_path / "local"
    saved = _save(root, [1, 2], durable_url=url, storage_options=options)
    _damage(root / "step_000000001")
    state, model = _state(seed=1)
    with CheckpointManager(root, durable_url=url, storage_options=options) as mgr:
        assert mgr.restore(state, step=1) == 1
    assert all(torch.equal(v, saved[1][k]) for k, v in model.state_dict().items())


def test_store_down_between_listing_and_download_falls_back_to_the_newest_local_step(tmp_path, caplog):
    """The S3 store dies after listing a durable-only step: the newest intact local step is restored, with a warning."""
    from tests._s3 import S3

    server = S3()
    server.start()
    try:
        url = f"s3://{server.new_bucket()}/run"
        root = tmp_path / "local"
        saved = _save(root, [1, 2, 3], durable_url=url, storage_options=server.options)
        shutil.rmtree(root / "step_000000003")  # step 3 is durable only
        real = DurableTier.listed

        def listed_then_down(self):
            out = real(self)
            server.stop()
            return out

        state, model = _state(seed=1)
        with caplog.at_level(logging.WARNING, logger="torch_ckpt"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(DurableTier, "listed", listed_then_down)
            with CheckpointManager(root, durable_url=url, storage_options=server.options,
                                   durable_flush_timeout_seconds=0) as mgr:
                assert mgr.restore(state) == 2
        assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())
        assert "falling back to step 2 (local copy)" in caplog.text
    finally:
        if server.server is not None:
            try:
                server.stop()
            except Exception:  # noqa: BLE001 - already stopped
                pass


def test_file_store_failing_during_download_falls_back_to_the_newest_local_step(tmp_path, monkeypatch, caplog):
    """A file:// store whose reads fail (EIO, a dead NFS mount) after listing: the newest local step is restored."""
    url = f"file://{tmp_path / 'durable'}"
    root = tmp_path / "local"
    saved = _save(root, [1, 2], durable_url=url)
    shutil.rmtree(root / "step_000000002")

    from fsspec.implementations.local import LocalFileSystem

    def eio(self, *args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(LocalFileSystem, "_open", eio)  # the tier's reads of object contents fail
    state, model = _state(seed=1)
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), CheckpointManager(root, durable_url=url) as mgr:
        assert mgr.restore(state) == 1
    assert all(torch.equal(v, saved[1][k]) for k, v in model.state_dict().items())
    assert "falling back to step 1" in caplog.text


def test_store_down_at_download_without_a_local_step_raises(tmp_path):
    """The store dies after listing and no local step can stand in: DurableUnavailableError, nothing restored."""
    from tests._s3 import S3

    server = S3()
    server.start()
    url = f"s3://{server.new_bucket()}/run"
    root = tmp_path / "local"
    _save(root, [1], durable_url=url, storage_options=server.options)
    shutil.rmtree(root / "step_000000001")
    real = DurableTier.listed

    def listed_then_down(self):
        out = real(self)
        server.stop()
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DurableTier, "listed", listed_then_down)
        with CheckpointManager(root, durable_url=url, storage_options=server.options,
                               durable_flush_timeout_seconds=0) as mgr:
            with pytest.raises(DurableUnavailableError, match="step 1|step_000000001"):
                mgr.restore(_state(seed=1)[0])
            assert mgr.restored_step is None


def _delete_bucket(s3, url: str) -> None:
    import boto3

    bucket = url.removeprefix("s3://").split("/", 1)[0]
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)


def _bucket_exists(s3, bucket: str) -> bool:
    import boto3

    names = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-east-1").list_buckets()["Buckets"]
    return any(b["Name"] == bucket for b in names)


def test_deleted_bucket_and_empty_local_disk_is_an_error_not_a_fresh_start(tmp_path, s3):
    """The bucket is deleted and the local disk is empty: restore raises, naming the bucket and durable_create."""
    url = f"s3://{s3.new_bucket()}/run"
    root = tmp_path / "local"
    _save(root, [1], durable_url=url, storage_options=s3.options)
    _delete_bucket(s3, url)
    shutil.rmtree(root)
    with CheckpointManager(root, durable_url=url, storage_options=s3.options, durable_flush_timeout_seconds=0) as mgr:
        with pytest.raises(DurableUnavailableError, match=r"bucket .* does not exist.*durable_create=True"):
            mgr.restore(_state()[0])


def test_deleted_bucket_is_not_recreated_by_replication(tmp_path, s3):
    """Saving while the bucket is gone reports the missing bucket and leaves it missing."""
    url = f"s3://{s3.new_bucket()}/run"
    _delete_bucket(s3, url)
    with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options,
                           durable_flush_timeout_seconds=0) as mgr:
        mgr.save(1, _state()[0]).wait()
        deadline = time.monotonic() + 30
        while mgr.replication_stats()["last_error"] is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the first upload attempt is under way
        assert "does not exist" in (mgr.replication_stats()["last_error"] or "")
        assert mgr.replication_stats()["durable_step"] is None
    assert not _bucket_exists(s3, url.removeprefix("s3://").split("/", 1)[0])


def test_durable_create_creates_a_missing_bucket(tmp_path, s3):
    """With durable_create=True a missing bucket is created: a fresh start, then the step is replicated."""
    bucket = f"made-{tmp_path.name[-8:].lower().replace('_', '-')}"
    url = f"s3://{bucket}/run"
    with CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options, durable_create=True) as mgr:
        assert mgr.restore(_state()[0]) is None
        mgr.save(1, _state()[0]).wait()
        assert mgr.wait_durable(30)
    assert _bucket_exists(s3, bucket)
    assert list(DurableTier(url, storage_options=s3.options).list_steps()) == [1]


def test_file_store_whose_parent_directory_is_gone_is_an_error(tmp_path):
    """A file:// durable root whose parent directory is missing (an unmounted share) is refused, not created."""
    url = f"file://{tmp_path / 'mnt' / 'share' / 'run'}"
    with CheckpointManager(tmp_path / "local", durable_url=url, durable_flush_timeout_seconds=0) as mgr:
        with pytest.raises(DurableUnavailableError, match="parent directory .* does not exist"):
            mgr.restore(_state()[0])
        mgr.save(1, _state()[0]).wait()
        assert not mgr.wait_durable(1)
    assert not (tmp_path / "mnt").exists()


def test_file_store_with_durable_create_creates_its_parent_directory(tmp_path):
    """durable_create=True creates a missing parent directory of a file:// root and replicates into it."""
    url = f"file://{tmp_path / 'mnt' / 'share' / 'run'}"
    with CheckpointManager(tmp_path / "local", durable_url=url, durable_create=True) as mgr:
        assert mgr.restore(_state()[0]) is None
        mgr.save(1, _state()[0]).wait()
        assert mgr.wait_durable(30)
    assert list(DurableTier(url).list_steps()) == [1]


def test_empty_bucket_is_a_fresh_start(tmp_path, s3, caplog):
    """An existing, empty bucket and an empty local disk: restore returns None, saying what the store answered."""
    url = f"s3://{s3.new_bucket()}/run"
    with caplog.at_level(logging.INFO, logger="torch_ckpt"), \
            CheckpointManager(tmp_path, durable_url=url, storage_options=s3.options) as mgr:
        assert mgr.restore(_state()[0]) is None
    assert "answered: no committed step" in caplog.text


def test_silent_store_health_returns_at_once(tmp_path, silent):
    """health() does no network I/O: with a store that never answers it returns at once, durable state unknown."""
    _save(tmp_path, [1])
    with CheckpointManager(tmp_path, durable_url="s3://bucket/run", storage_options=silent.options,
                           durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
        t0 = time.monotonic()
        report = mgr.health()
        assert time.monotonic() - t0 < TIMEOUT_S
    assert report["latest_step"] == 1 and report["tiers"] == {1: {"local": "complete", "durable": None}}
    assert report["durable_newest_step"] is None


def test_silent_store_restore_falls_back_to_local_within_the_timeout(tmp_path, silent, caplog):
    """restore() with a store that never answers gives up after durable_timeout_seconds and restores the local step."""
    saved = _save(tmp_path, [1, 2])
    state, model = _state(seed=1)
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), \
            CheckpointManager(tmp_path, durable_url="s3://bucket/run", storage_options=silent.options,
                              durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
        t0 = time.monotonic()
        assert mgr.restore(state) == 2
        assert time.monotonic() - t0 < BOUND_S
    assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())
    assert "did not answer for 2 s (durable_timeout_seconds)" in caplog.text


def test_silent_store_without_a_local_step_raises_within_the_timeout(tmp_path, silent):
    """restore() with a store that never answers and an empty disk raises DurableUnavailableError, promptly."""
    with CheckpointManager(tmp_path, durable_url="s3://bucket/run", storage_options=silent.options,
                           durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
        t0 = time.monotonic()
        with pytest.raises(DurableUnavailableError, match="durable_timeout_seconds"):
            mgr.restore(_state()[0])
        assert time.monotonic() - t0 < BOUND_S


def test_silent_file_store_restore_is_bounded(tmp_path, monkeypatch):
    """A file:// store whose listing blocks (a hung NFS mount) costs restore() about durable_timeout_seconds."""
    saved = _save(tmp_path / "local", [1])
    release = threading.Event()
    monkeypatch.setattr(DurableTier, "list_names", lambda self: release.wait(60) and [])
    state, model = _state(seed=1)
    try:
        with CheckpointManager(tmp_path / "local", durable_url=f"file://{tmp_path / 'durable'}",
                               durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
            t0 = time.monotonic()
            assert mgr.restore(state) == 1
            assert time.monotonic() - t0 < BOUND_S
    finally:
        release.set()
    assert all(torch.equal(v, saved[1][k]) for k, v in model.state_dict().items())


def test_silent_store_explicit_step_absent_locally_is_unavailable_promptly(tmp_path, silent):
    """restore(step=N) for a step absent locally, with a silent store: DurableUnavailableError within the bound."""
    _save(tmp_path, [1])
    with CheckpointManager(tmp_path, durable_url="s3://bucket/run", storage_options=silent.options,
                           durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
        t0 = time.monotonic()
        with pytest.raises(DurableUnavailableError, match="step 5 is not under"):
            mgr.restore(_state()[0], step=5)
        assert time.monotonic() - t0 < BOUND_S


def test_durable_timeout_seconds_is_validated():
    """durable_timeout_seconds must be a positive duration; durable_create a bool."""
    from torch_ckpt.config import CheckpointConfig
    from torch_ckpt.errors import ConfigError

    assert CheckpointConfig(durable_timeout_seconds="1m").durable_timeout_seconds == 60.0
    with pytest.raises(ConfigError, match="durable_timeout_seconds"):
        CheckpointConfig(durable_timeout_seconds=0)
    with pytest.raises(ConfigError, match="durable_create"):
        CheckpointConfig(durable_create="yes")


class RefusingServer:
    """A loopback HTTP server answering every request with ``status`` (an S3 error document); stops itself."""

    def __init__(self, status: int, life_s: float = 120.0) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        code = {403: "AccessDenied", 503: "ServiceUnavailable"}[status]

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                        f"<Message>refused</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self._timer = threading.Timer(life_s, self.close)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    @property
    def options(self) -> dict:
        return {"key": "testing", "secret": "testing", "skip_instance_cache": True, "use_listings_cache": False,
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-east-1"}}


@pytest.mark.parametrize("status", [403, 503])
def test_refusing_store_with_an_empty_disk_is_an_error_not_a_fresh_start(tmp_path, status):
    """A store answering 403 or 503 to everything, and no local step: DurableUnavailableError, promptly."""
    server = RefusingServer(status)
    try:
        with CheckpointManager(tmp_path, durable_url="s3://bucket/run", storage_options=server.options,
                               durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
            t0 = time.monotonic()
            with pytest.raises(DurableUnavailableError, match="refusing to start from scratch"):
                mgr.restore(_state()[0])
            assert time.monotonic() - t0 < BOUND_S * 3  # botocore's standard retries back off on 503
    finally:
        server.close()


@pytest.mark.parametrize("status", [403, 503])
def test_refusing_store_with_a_local_step_restores_it(tmp_path, status):
    """A store answering 403 or 503 to everything: the local step is restored."""
    saved = _save(tmp_path, [1])
    server = RefusingServer(status)
    state, model = _state(seed=1)
    try:
        with CheckpointManager(tmp_path, durable_url="s3://bucket/run", storage_options=server.options,
                               durable_timeout_seconds=TIMEOUT_S, durable_flush_timeout_seconds=0) as mgr:
            assert mgr.restore(state) == 1
    finally:
        server.close()
    assert all(torch.equal(v, saved[1][k]) for k, v in model.state_dict().items())


def test_a_bucket_deleted_before_a_gone_reference_is_uploaded_names_the_bucket(tmp_path, s3):
    """A save's referenced object is gone and the bucket goes away after the save's own files went up: the upload
    that replaces the reference fails as any put into a deleted bucket does (DurableUnavailableError naming it)."""
    from torch_ckpt.format._files import read_manifest

    url = f"s3://{s3.new_bucket()}/run"
    frozen = torch.randn(256, 256)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, TrainState(extras={"frozen": frozen, "step": torch.tensor(step)}, rng=False)).wait()
    tier = DurableTier(url, storage_options=s3.options)
    tier.upload(tmp_path / "step_000000001", read_manifest(tmp_path / "step_000000001"))
    references, put = tier._references, tier._put_verified
    candidates: dict[str, str] = {}

    def found(files, local_root):
        candidates.update(references(files, local_root))
        assert set(candidates.values()) == {"step_000000001"}  # step 2 linked the frozen tensor's file
        return candidates

    def bucket_gone(local, loc, name, info):
        if name in candidates:  # the second round: the listing found the reference gone, the own files are up
            _delete_bucket(s3, url)
        return put(local, loc, name, info)

    tier._references, tier._put_verified = found, bucket_gone
    tier._sizes = lambda directories: {}  # every referenced object reads as gone
    with pytest.raises(DurableUnavailableError, match=r"bucket 'ckpt-[0-9a-f]+' does not exist"):
        tier.upload(tmp_path / "step_000000002", read_manifest(tmp_path / "step_000000002"))


def test_a_bucket_deleted_right_before_the_commit_names_the_bucket(tmp_path, s3):
    """The bucket goes away after every file of a save went up, before its manifest: DurableUnavailableError
    naming the bucket, and nothing committed."""
    from torch_ckpt.format._files import read_manifest

    url = f"s3://{s3.new_bucket()}/run"
    _save(tmp_path, [1])
    tier = DurableTier(url, storage_options=s3.options)
    pipe = tier.fs.pipe_file

    def bucket_gone(path, *args, **kwargs):
        if path.endswith("/manifest.json"):
            _delete_bucket(s3, url)
        return pipe(path, *args, **kwargs)

    tier.fs.pipe_file = bucket_gone
    with pytest.raises(DurableUnavailableError, match=r"bucket 'ckpt-[0-9a-f]+' does not exist"):
        tier.upload(tmp_path / "step_000000001", read_manifest(tmp_path / "step_000000001"))


def test_a_one_process_node_local_root_restores_from_the_durable_tier(tmp_path):
    """One process with a node-local root whose local copies are gone restores its node's copy fetched from the
    durable tier (a fetched copy lists the files it holds; verifying only its small files must not trip on them)."""
    url = f"file://{tmp_path / 'durable'}"
    (tmp_path / "durable").mkdir()
    saved = _save(tmp_path / "local", [1, 2], durable_url=url, local_root_shared=False)
    shutil.rmtree(tmp_path / "local")
    state, model = _state()
    with CheckpointManager(tmp_path / "local", durable_url=url, local_root_shared=False) as mgr:
        assert mgr.restore(state) == 2
        assert mgr.restore_source == "durable-node"
    assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())
