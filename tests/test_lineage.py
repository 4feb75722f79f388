"""Checkpoint lineage across tiers: a rollback starts a new timeline, and nothing resumes the abandoned one.

The input of issue 26 item 1: steps 100-400 saved and replicated, ``restore(step=200)``, then 300
and 350 saved (the new timeline); a restart, with the local disk intact and after deleting it,
must resume the new 350, never the abandoned 400, on ``file://`` and S3 (moto), with thread and
process persist, with durable retention, after a second rollback, and in ``torch-ckpt ls``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointCorruptError, CheckpointManager, CheckpointNotFoundError, TrainState
from torch_ckpt.format._files import Manifest, parse_manifest
from torch_ckpt.policy._lineage import BASE, Lineage, head_of, lineage_from_doc, new_segment
from torch_ckpt.root._layout import read_manifest
from torch_ckpt.storage._locations import Location
from torch_ckpt.tiers._durable import DurableTier

A, B = "aa" * 8, "bb" * 8


def _state(value: float = 0.0):
    """A one-layer state whose weight is filled with ``value`` (tells the timelines' checkpoints apart)."""
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return TrainState(model=model), model


def _weight(model) -> float:
    return model.weight[0, 0].item()


def _save(mgr: CheckpointManager, step: int, value: float) -> None:
    mgr.save(step, _state(value)[0]).wait()
    if mgr.replication_stats():
        assert mgr.wait_durable(60)


def _rollback_run(root: Path, **kw) -> None:
    """The issue's input: 100-400 replicated, restore(step=200), then 300 and 350 of the new timeline."""
    with CheckpointManager(root, keep_last=10, **kw) as mgr:
        for step in (100, 200, 300, 400):
            _save(mgr, step, step)
        state, model = _state()
        assert mgr.restore(state, step=200) == 200 and _weight(model) == 200
        for step in (300, 350):
            _save(mgr, step, step + 0.5)


def _resume(root: Path, **kw) -> tuple[int | None, float, int | None]:
    """Restart: ``(restored step, its weight, latest_step())``."""
    with CheckpointManager(root, keep_last=10, **kw) as mgr:
        state, model = _state(-1.0)
        step = mgr.restore(state)
        return step, _weight(model), mgr.latest_step()


# -- the rule --------------------------------------------------------------------------------------

def test_a_fork_supersedes_the_abandoned_steps_and_keeps_its_ancestors():
    """Head B forked from A at 200: A's 100 and 200 are live, A's 300 and 400 superseded, B's steps live."""
    a = Lineage(run=A, since=1.0)
    b = a.fork(200, B, 2.0)
    assert head_of([a, b]) == b
    assert [s for s in (100, 200, 300, 400) if b.holds(s, a)] == [100, 200]
    assert b.holds(300, b) and b.holds(350, b)


def test_manifests_without_lineage_are_one_linear_history():
    """Old manifests (no lineage record) are the base segment: every step live, none superseded."""
    assert head_of([BASE, BASE]) == BASE and all(BASE.holds(s, BASE) for s in (1, 2, 3))
    doc = Manifest(step=5, world_size=1, files={}).to_json()
    assert "lineage" not in doc  # a run that never rolled back writes the format it always wrote
    assert parse_manifest(json.dumps(doc).encode(), "m").lineage == BASE


def test_new_segment_starts_after_every_segment_seen():
    """A fork is ordered after its parent even when the clock is behind (skew between restarts)."""
    _, since = new_segment([Lineage(run=A, since=5000.0)], now=100.0)
    assert since > 5000.0


def test_the_lineage_record_round_trips_through_the_manifest():
    """A fork's record is written and read back exactly."""
    lin = Lineage(run=A, since=12.5).fork(200, B, 13.25)
    doc = Manifest(step=300, world_size=1, files={}, lineage=lin).to_json()
    assert doc["lineage"] == {"run": B, "since": 13.25, "parents": [[A, 200]]}
    assert parse_manifest(json.dumps(doc).encode(), "m").lineage == lin


@pytest.mark.parametrize("bad", [{"run": "", "since": 1.0, "parents": []},
                                 {"run": A, "since": -1, "parents": []},
                                 {"run": A, "since": 1.0, "parents": [[A, 2]]},
                                 {"run": "XY", "since": 1, "parents": []},
                                 {"run": A, "since": 1.0, "parents": [["", "2"]]}, [1, 2]])
def test_a_malformed_lineage_record_is_corruption(bad):
    """A malformed lineage record makes the manifest corrupt (named), never a crash or a silent base."""
    doc = {**Manifest(step=1, world_size=1, files={}).to_json(), "lineage": bad}
    with pytest.raises(CheckpointCorruptError, match="lineage"):
        parse_manifest(json.dumps(doc).encode(), "somewhere/manifest.json")
    with pytest.raises(ValueError):
        lineage_from_doc(bad)


# -- the input, on both durable stores -------------------------------------------------------

@pytest.mark.parametrize("persist", ["thread", "process"])
def test_file_durable_restart_resumes_the_new_timeline(tmp_path, persist):
    """file:// durable: both restarts (local intact, local deleted) resume the new 350, not the abandoned 400."""
    kw = {"durable_url": f"file://{tmp_path / 'durable'}", "persist": persist}
    _rollback_run(tmp_path / "local", **kw)
    assert _resume(tmp_path / "local", **kw) == (350, 350.5, 350)
    shutil.rmtree(tmp_path / "local")
    assert _resume(tmp_path / "local", **kw) == (350, 350.5, 350)


def test_file_durable_moves_the_superseded_steps_aside(tmp_path):
    """The durable 300 and 400 of the abandoned timeline are moved aside (kept), never overwritten in place."""
    url = f"file://{tmp_path / 'durable'}"
    _rollback_run(tmp_path / "local", durable_url=url)
    tier = DurableTier(url)
    assert sorted(tier.list_steps()) == [100, 200, 300, 350]
    assert tier.read_manifest(300).lineage.parents[-1][1] == 200  # the new 300, forked from 200
    aside = sorted(p.name.split(".")[1] for p in (tmp_path / "durable").glob(".superseded_*"))
    assert aside == ["superseded_step_000000300", "superseded_step_000000400"]
    old300 = next((tmp_path / "durable").glob(".superseded_step_000000300.*"))
    assert read_manifest(old300).lineage == BASE  # the old timeline's 300, whole


def test_durable_retention_keeps_the_new_timeline(tmp_path):
    """durable_keep_last=2 keeps the new 300 and 350 (not the abandoned 400), and a restore after disk loss gets 350."""
    kw = {"durable_url": f"file://{tmp_path / 'durable'}", "durable_keep_last": 2}
    _rollback_run(tmp_path / "local", **kw)
    assert sorted(DurableTier(kw["durable_url"]).list_steps()) == [300, 350]
    shutil.rmtree(tmp_path / "local")
    assert _resume(tmp_path / "local", **kw) == (350, 350.5, 350)


def test_s3_durable_restart_resumes_the_new_timeline(tmp_path, s3):
    """S3 (moto): both restarts resume the new 350; the abandoned 300 and 400 are moved aside in the bucket."""
    kw = {"durable_url": f"s3://{s3.new_bucket()}/run", "storage_options": s3.options, "durable_keep_last": 3}
    _rollback_run(tmp_path / "local", **kw)
    tier = DurableTier(kw["durable_url"], storage_options=s3.options)
    assert sorted(tier.list_steps()) == [200, 300, 350]
    assert sorted(n.split(".")[1] for n in tier.list_names() if n.startswith(".superseded_")) == \
        ["superseded_step_000000300", "superseded_step_000000400"]
    old400 = next(n for n in tier.list_names() if n.startswith(".superseded_step_000000400."))
    moved = Location.on(tier.fs, f"{tier.root}/{old400}", f"{tier.url}/{old400}")
    old = read_manifest(moved)
    assert old.step == 400 and set(moved.entries()) == {*old.files, "manifest.json"}  # whole, manifest included
    assert _resume(tmp_path / "local", **kw) == (350, 350.5, 350)
    shutil.rmtree(tmp_path / "local")
    assert _resume(tmp_path / "local", **kw) == (350, 350.5, 350)


def test_a_new_local_timeline_beats_a_newer_durable_step_of_the_abandoned_one(tmp_path):
    """Before the new timeline is replicated, resume still takes it, and the durable 400 is not restorable."""
    kw = {"durable_url": f"file://{tmp_path / 'durable'}"}
    with CheckpointManager(tmp_path / "local", keep_last=10, **kw) as mgr:
        for step in (100, 200, 300, 400):
            _save(mgr, step, step)
    with CheckpointManager(tmp_path / "local", keep_last=10, replicate_every_n_saves=100, **kw) as mgr:
        assert mgr.restore(_state()[0], step=200) == 200
        _save(mgr, 300, 300.5)  # local only
        assert mgr.all_steps() == [100, 200, 300]
    assert sorted(DurableTier(kw["durable_url"]).list_steps()) == [100, 200, 300, 400]  # not replicated yet
    assert _resume(tmp_path / "local", **kw) == (300, 300.5, 300)
    with CheckpointManager(tmp_path / "local", **kw) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="superseded"):
            mgr.restore(_state()[0], step=400)


def test_a_rollback_of_a_rollback_follows_the_newest_timeline(tmp_path):
    """Restore the new 300, save 325; then restore 100, save 150: each restart resumes the newest timeline."""
    kw = {"durable_url": f"file://{tmp_path / 'durable'}"}
    _rollback_run(tmp_path / "local", **kw)
    with CheckpointManager(tmp_path / "local", keep_last=10, **kw) as mgr:
        state, model = _state()
        assert mgr.restore(state, step=300) == 300 and _weight(model) == 300.5
        _save(mgr, 325, 325.0)
    assert _resume(tmp_path / "local", **kw) == (325, 325.0, 325)
    assert sorted(DurableTier(kw["durable_url"]).list_steps()) == [100, 200, 300, 325]
    with CheckpointManager(tmp_path / "local", keep_last=10, **kw) as mgr:
        assert mgr.restore(_state()[0], step=100) == 100
        _save(mgr, 150, 150.0)
    assert _resume(tmp_path / "local", **kw) == (150, 150.0, 150)
    shutil.rmtree(tmp_path / "local")
    assert _resume(tmp_path / "local", **kw) == (150, 150.0, 150)
    assert sorted(DurableTier(kw["durable_url"]).list_steps()) == [100, 150]


def test_a_plain_resume_continues_the_timeline(tmp_path):
    """Resuming the newest step and saving on does not fork: nothing is superseded, one segment throughout."""
    kw = {"durable_url": f"file://{tmp_path / 'durable'}"}
    _rollback_run(tmp_path / "local", **kw)
    with CheckpointManager(tmp_path / "local", keep_last=10, **kw) as mgr:
        assert mgr.restore(_state()[0]) == 350
        _save(mgr, 400, 400.5)
        assert mgr.all_steps() == [100, 200, 300, 350, 400]
    lins = {s: read_manifest(tmp_path / "local" / f"step_{s:09d}").lineage for s in (300, 350, 400)}
    assert lins[300] == lins[350] == lins[400] and lins[300].parents == (("", 200),)


def test_ls_labels_the_superseded_steps(tmp_path, capsys):
    """torch-ckpt ls lists the abandoned timeline's checkpoints as superseded, locally and on the durable tier."""
    from torch_ckpt.tools.cli import main

    url = f"file://{tmp_path / 'durable'}"
    _rollback_run(tmp_path / "local", durable_url=url)
    for root in (str(tmp_path / "local"), url):
        assert main(["ls", root, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        rows = [(r["step"], r["superseded"]) for r in out["steps"]]
        assert sorted(rows) == [(100, False), (200, False), (300, False), (300, True), (350, False), (400, True)]
        assert out["counts"]["committed"] == 4 and out["superseded"] == 2
    assert main(["ls", str(tmp_path / "local")]) == 0
    text = capsys.readouterr().out
    assert "committed, superseded" in text and "2 superseded" in text
    assert main(["verify", str(tmp_path / "local"), "--json"]) == 0  # verify ROOT skips them, naming why
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["step"] for r in out["checkpoints"]) == [100, 200, 300, 350]
    assert sorted(r["step"] for r in out["skipped"] if r["reason"].startswith("superseded")) == [300, 400]


def test_a_restore_abandons_nothing_until_the_next_save(tmp_path):
    """restore(step=200) then restore(): without a save in between, the newest step 400 is still live."""
    with CheckpointManager(tmp_path, keep_last=10) as mgr:
        for step in (100, 200, 300, 400):
            _save(mgr, step, step)
        assert mgr.restore(_state()[0], step=200) == 200
        assert mgr.all_steps() == [100, 200, 300, 400]
        assert mgr.restore(_state()[0]) == 400


def _stale_copy_and_rollback(tmp_path, kw) -> Path:
    """100-400 replicated from root ``local``; a copy of it as ``stale`` (another machine's disk); then
    the rollback to 200 with 300 and 350 on ``local``. Returns the stale root."""
    with CheckpointManager(tmp_path / "local", keep_last=10, **kw) as mgr:
        for step in (100, 200, 300, 400):
            _save(mgr, step, step)
    shutil.copytree(tmp_path / "local", tmp_path / "stale", ignore=shutil.ignore_patterns(".lock*"))
    with CheckpointManager(tmp_path / "local", keep_last=10, **kw) as mgr:
        assert mgr.restore(_state()[0], step=200) == 200
        for step in (300, 350):
            _save(mgr, step, step + 0.5)
    return tmp_path / "stale"


def test_a_stale_root_resumes_the_durable_new_timeline(tmp_path):
    """A stale disk resumes the durable 350; restore(step=300) downloads the new 300 and keeps the old one aside."""
    kw = {"durable_url": f"file://{tmp_path / 'durable'}"}
    stale = _stale_copy_and_rollback(tmp_path, kw)
    assert _resume(stale, **kw)[:2] == (350, 350.5)
    with CheckpointManager(stale, keep_last=10, **kw) as mgr:
        state, model = _state()
        assert mgr.restore(state, step=300) == 300 and _weight(model) == 300.5
    assert read_manifest(next(stale.glob(".superseded_step_000000300.*"))).lineage == BASE


def test_an_upload_of_the_abandoned_timeline_is_skipped(tmp_path, caplog):
    """A stale root saving on its old timeline (no restore) never uploads over the durable new timeline."""
    import logging

    kw = {"durable_url": f"file://{tmp_path / 'durable'}"}
    stale = _stale_copy_and_rollback(tmp_path, kw)
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    with CheckpointManager(stale, keep_last=10, **kw) as mgr:
        _save(mgr, 500, 500.0)
    assert sorted(DurableTier(kw["durable_url"]).list_steps()) == [100, 200, 300, 350]
    assert any("step 500 is not replicated" in r.getMessage() for r in caplog.records)
    shutil.rmtree(tmp_path / "local")
    assert _resume(tmp_path / "local", **kw) == (350, 350.5, 350)
