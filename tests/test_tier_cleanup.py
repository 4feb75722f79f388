"""Uploads abandoned on the durable tier (torch_ckpt.tiers._durable): manifest-less step prefixes."""

from __future__ import annotations

import time
import uuid

import pytest

from torch_ckpt.root._layout import read_manifest
from torch_ckpt.tiers._durable import DurableTier, abandoned_uploads, remove_abandoned
from torch_ckpt.tiers._replicator import Replicator

pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

from tests.test_tiers import committed_tier  # noqa: E402


def _abandoned_setup(tmp_path, url: str, options: dict | None = None) -> DurableTier:
    """A durable root with committed step 1 and manifest-less prefixes of steps 2 and 3 (crashed uploads)."""
    tier = committed_tier(tmp_path, url, options)
    local = tmp_path / "local" / "step_000000001"
    for step in (2, 3):
        for name in sorted(read_manifest(local).files)[:2]:  # part of an upload, then a crash
            tier.fs.put_file(str(local / name), f"{tier.root}/step_{step:09d}/{name}")
    tier.refresh()
    return tier


def test_s3_abandoned_uploads_older_than_the_limit_are_removed(tmp_path, s3):
    """Manifest-less step prefixes idle longer than the limit are deleted; the committed step stays listed."""
    tier = _abandoned_setup(tmp_path, f"s3://{s3.new_bucket()}/run", s3.options)
    later = time.time() + 7200
    assert set(abandoned_uploads(tier, older_than_seconds=3600, now=later)) == {2, 3}
    assert remove_abandoned(tier, older_than_seconds=3600, now=later) == [2, 3]
    assert not tier.fs.exists(f"{tier.root}/step_000000002") and not tier.fs.exists(f"{tier.root}/step_000000003")
    assert list(tier.list_steps()) == [1]


def test_s3_recent_manifestless_prefix_is_never_removed(tmp_path, s3):
    """A prefix whose newest object is younger than the limit (maybe still uploading) is kept."""
    tier = _abandoned_setup(tmp_path, f"s3://{s3.new_bucket()}/run", s3.options)
    assert abandoned_uploads(tier, older_than_seconds=3600) == {}
    assert remove_abandoned(tier, older_than_seconds=3600) == []
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
    assert remove_abandoned(tier, older_than_seconds=3600) == [3]
    assert tier.fs.exists(f"{tier.root}/step_000000002/late.distcp")


def test_excluded_steps_are_never_removed(tmp_path):
    """Steps passed in exclude (queued or uploading here) stay even when old."""
    tier = _abandoned_setup(tmp_path, f"memory://ckpt-{uuid.uuid4().hex[:8]}/run")
    assert remove_abandoned(tier, older_than_seconds=3600, exclude={2}, now=time.time() + 7200) == [3]
    assert tier.fs.exists(f"{tier.root}/step_000000002")


def test_replicator_removes_abandoned_uploads_after_a_commit(tmp_path):
    """After its next durable commit the replicator deletes prefixes idle past abandoned_after_seconds."""
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
