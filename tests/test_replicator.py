"""The replicator (torch_ckpt.tiers._replicator): one upload at a time, newer commits coalesce, history steps
are never coalesced away. Uploads are an injected function that blocks until the test releases it."""

from __future__ import annotations

import json
import queue
import threading
import uuid

import pytest

from torch_ckpt.format._files import MANIFEST_NAME, Manifest
from torch_ckpt.tiers._durable import DurableTier
from torch_ckpt.tiers._replicator import Replicator


class _Uploads:
    """An ``upload`` for the replicator: reports each start, then waits for :meth:`release`."""

    def __init__(self) -> None:
        self.started: queue.Queue[int] = queue.Queue()
        self.done: list[int] = []
        self.abandon_seen: dict[int, bool] = {}
        self._go = threading.Event()

    def __call__(self, local_dir, manifest, abandon) -> None:
        self.started.put(manifest.step)
        assert self._go.wait(30)
        self.abandon_seen[manifest.step] = abandon()
        self.done.append(manifest.step)

    def next_started(self) -> int:
        return self.started.get(timeout=30)

    def release(self) -> None:
        self._go.set()


def _committed(tmp_path, step: int):
    """A directory holding a valid manifest of ``step`` (the replicator reads only the manifest)."""
    path = tmp_path / f"step_{step:09d}"
    path.mkdir()
    (path / MANIFEST_NAME).write_text(json.dumps(Manifest(step=step, world_size=1, files={}).to_json()))
    return path


@pytest.fixture
def uploads():
    return _Uploads()


def _replicator(uploads, never_skip=None) -> Replicator:
    tier = DurableTier(f"memory://rep-{uuid.uuid4().hex[:8]}/run")
    return Replicator(tier, upload=uploads, abandoned_after_seconds=None, never_skip=never_skip)


def _run(tmp_path, uploads, rep, first: int, then: list[int]) -> None:
    """Submit ``first``, wait until its upload runs, submit ``then`` meanwhile, release, wait for the end."""
    try:
        rep.submit(first, _committed(tmp_path, first))
        assert uploads.next_started() == first
        for step in then:
            rep.submit(step, _committed(tmp_path, step))
        uploads.release()
        assert rep.wait(30)
    finally:
        rep.close(5)


def test_commits_during_an_upload_coalesce_to_the_newest(tmp_path, uploads):
    """Steps committed while step 1 uploads are replaced by the newest one; the others count as skipped."""
    rep = _replicator(uploads)
    _run(tmp_path, uploads, rep, 1, [2, 3, 4])
    assert uploads.done == [1, 4]
    assert rep.stats()["skipped"] == 2 and rep.stats()["durable_step"] == 4


def test_history_step_is_uploaded_after_the_newest(tmp_path, uploads):
    """A step never_skip keeps (a multiple of durable_keep_every_n_steps) is uploaded after the newest, not dropped."""
    rep = _replicator(uploads, never_skip=lambda step: step % 10 == 0)
    _run(tmp_path, uploads, rep, 5, [10, 11, 12])
    assert uploads.done == [5, 12, 10]
    assert rep.stats()["skipped"] == 1


def test_durable_step_stays_the_newest_after_a_history_upload(tmp_path, uploads):
    """Uploading a history step after a newer one does not set durable_step back."""
    rep = _replicator(uploads, never_skip=lambda step: step % 10 == 0)
    _run(tmp_path, uploads, rep, 5, [10, 12])
    assert rep.stats()["durable_step"] == 12


def test_queued_history_step_is_busy(tmp_path, uploads):
    """A history step waiting behind a newer one is reported busy (its local copy must stay)."""
    rep = _replicator(uploads, never_skip=lambda step: step % 10 == 0)
    try:
        rep.submit(5, _committed(tmp_path, 5))
        assert uploads.next_started() == 5
        rep.submit(10, _committed(tmp_path, 10))
        rep.submit(12, _committed(tmp_path, 12))
        assert rep.busy_steps() == {5, 10, 12}
    finally:
        uploads.release()
        rep.close(30)


@pytest.mark.parametrize(("history", "abandoned"), [(False, True), (True, False)])
def test_only_a_step_that_may_be_skipped_is_abandoned_for_a_newer_one(tmp_path, uploads, history, abandoned):
    """abandon() is True during an upload once a newer step is queued, unless the uploading step is kept."""
    rep = _replicator(uploads, never_skip=(lambda step: step == 10) if history else None)
    _run(tmp_path, uploads, rep, 10, [11])
    assert uploads.abandon_seen[10] is abandoned
