"""durable_url: committed checkpoints are replicated in the background and fetched back on resume."""

from __future__ import annotations

import shutil
import uuid

import pytest
import torch

pytest.importorskip("accelerate")
from acc_helpers import bitwise, make_run, train

import accelerate_ckpt
from torch_ckpt import ConfigError
from torch_ckpt.tiers._durable import DurableTier

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture
def url():
    """A fresh in-memory durable root, removed afterwards (fsspec's memory store is process-wide)."""
    import fsspec

    root = f"memory://accelerate-ckpt-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_committed_checkpoints_are_replicated(tmp_path, url):
    """Every committed checkpoint reaches the durable root; durable_total_limit keeps the newest there."""
    run = make_run(tmp_path, durable_url=url, durable_keep_last=2)
    for step in (3, 6, 9):
        train(run, step - 3, step)
        run.accelerator.save_state(step=step)
        run.ckpt.wait()
        assert run.ckpt.wait_replicated(30)
    assert run.ckpt.replication_stats()["durable_step"] == 2
    run.ckpt.close()
    assert list(DurableTier(url, naming=accelerate_ckpt.NAMING).list_steps()) == [1, 2]


def test_resume_after_losing_the_local_disk_is_exact(tmp_path, url):
    """With the local checkpoints gone, load_state() fetches the newest durable one and resumes bit for bit."""
    ref_run = make_run(tmp_path / "a", durable_url=url)
    reference = train(ref_run, 0, 14, save_at=(8,))
    ref_run.ckpt.close()  # flushes the upload
    shutil.rmtree(tmp_path / "a")
    run = make_run(tmp_path / "a", durable_url=url)
    assert run.ckpt.latest_checkpoint() is None  # nothing on local disk
    run.accelerator.load_state()
    assert (tmp_path / "a" / "checkpoints" / "checkpoint_0" / "manifest.json").exists()
    resumed = train(run, run.ckpt.step, 14)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[8:])


def test_unreachable_store_falls_back_to_local_checkpoints(tmp_path, url, monkeypatch):
    """If the durable root cannot be listed, resume uses the newest local checkpoint."""
    from torch_ckpt.tiers._durable import DurableUnavailableError

    run = make_run(tmp_path, durable_url=url)
    train(run, 0, 4)
    run.accelerator.save_state(step=4)
    run.ckpt.wait()
    assert run.ckpt.wait_replicated(60)  # else the upload meets the outage and close() waits out its retries
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    train(run, 4, 6)

    def outage(self):
        raise DurableUnavailableError("store down")

    monkeypatch.setattr(DurableTier, "list_steps", outage)
    run.accelerator.load_state()
    assert run.ckpt.step == 4 and all(torch.equal(v, saved[k]) for k, v in run.model.state_dict().items())
    run.ckpt.close()


def test_unusable_durable_url_raises_config_error(tmp_path):
    """A URL whose protocol fsspec does not know makes attach() raise ConfigError naming it."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    with pytest.raises(ConfigError, match="nosuchproto"):
        accelerate_ckpt.attach(Accelerator(cpu=True, project_config=project), durable_url="nosuchproto://bucket/run")


def test_durable_url_without_automatic_naming_raises_config_error():
    """durable_url replicates automatic checkpoints only; without automatic naming attach() raises ConfigError."""
    from accelerate import Accelerator

    with pytest.raises(ConfigError, match="durable_url needs .*automatic_checkpoint_naming"):
        accelerate_ckpt.attach(Accelerator(cpu=True), durable_url="memory://somewhere")


@pytest.fixture(scope="module")
def s3():
    """The core's moto S3 server (tests/test_tiers.py), on 127.0.0.1."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
    from test_tiers import S3

    server = S3()
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_s3_durable_copy_resumes_exactly_after_losing_the_local_disk(tmp_path, s3):
    """durable_url=s3://... through Accelerate: checkpoint_N objects in the bucket; a lost disk resumes bit for bit."""
    import s3fs

    bucket = s3.new_bucket()
    url = f"s3://{bucket}/run"
    ref_run = make_run(tmp_path / "a", durable_url=url, storage_options=s3.options)
    reference = train(ref_run, 0, 10, save_at=(3, 6))
    ref_run.ckpt.close()  # flushes the uploads
    assert sorted(p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem(**s3.options).ls(f"{bucket}/run")) == [
        "checkpoint_0", "checkpoint_1"]
    shutil.rmtree(tmp_path / "a")
    run = make_run(tmp_path / "a", durable_url=url, storage_options=s3.options)
    run.accelerator.load_state()
    resumed = train(run, run.ckpt.step, 10)
    run.ckpt.close()
    assert run.ckpt.step == 6 and bitwise(resumed) == bitwise(reference[6:])
