"""manager._memory: the memory tier: saves, cadence, restore from memory and its fallback, rollback, health."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

from torch_ckpt import CheckpointError, CheckpointManager, CheckpointWriteError, ConfigError, TrainState
from torch_ckpt.config import CheckpointConfig
from torch_ckpt.root._layout import MANIFEST_NAME, read_manifest
from torch_ckpt.tools.cli import main as cli

REPO = Path(__file__).resolve().parents[1]


def _state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState(model=model, optimizer=opt), model, opt


def _train(model, opt, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in root.glob("step_*") if (p / MANIFEST_NAME).is_file())


def _manager(tmp_path: Path, **kwargs) -> CheckpointManager:
    return CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), async_save=False, **kwargs)


def _data_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.glob("*.distcp")), key=lambda p: p.stat().st_size)


def test_memory_save_lands_in_memory_root_with_a_node_manifest(tmp_path):
    """save(tier="memory") commits into memory_root (a node copy with manifest), not into the disk root."""
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(3, state, tier="memory")
        assert mgr.all_steps() == []
    manifest = read_manifest(tmp_path / "mem" / "step_000000003")
    assert manifest.step == 3 and manifest.node == 0 and manifest.nodes["rank_node"] == [0]
    assert _steps(tmp_path / "disk") == []


def test_memory_checkpoints_are_listed_and_verified_by_the_cli(tmp_path, capsys):
    """``torch-ckpt ls`` and ``verify`` read memory_root like any run root."""
    state, _, _ = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(3, state, tier="memory")
    assert cli(["ls", str(tmp_path / "mem"), "--verify"]) == 0
    assert "step_000000003" in capsys.readouterr().out
    assert cli(["verify", str(tmp_path / "mem")]) == 0


def test_save_if_due_alternates_tiers_with_disk_first(tmp_path):
    """Disk saves at the disk cadence; the other steps the memory cadence picks go to memory."""
    state, model, opt = _state()
    where = {}
    with _manager(tmp_path, save_every_n_steps=4, memory_every_n_steps=1, memory_keep_last=10) as mgr:
        for step in range(1, 10):
            _train(model, opt, step)
            handle = mgr.save_if_due(step, state)
            where[step] = Path(handle.committed.result()).parent.name
    assert [s for s, w in where.items() if w == "disk"] == [4, 8]
    assert [s for s, w in where.items() if w == "mem"] == [1, 2, 3, 5, 6, 7, 9]


def test_save_due_answers_save_if_due_without_saving(tmp_path):
    """save_due(step) gives save_if_due's tier ("disk", "memory" or None) and writes nothing itself."""
    with _manager(tmp_path, save_every_n_steps=4, memory_every_n_steps=2) as mgr:
        answers = [mgr.save_due(step) for step in range(1, 6)]
    assert answers == [None, "memory", None, "disk", None]
    assert _steps(tmp_path / "disk") == [] and _steps(tmp_path / "mem") == []


@pytest.fixture
def disk_writes_held(monkeypatch):
    """Disk saves wait in their writer until the returned event is set (memory saves go through)."""
    import threading

    from torch_ckpt.save import _checkpointer

    release = threading.Event()
    real = _checkpointer.persist_checkpoint

    def held_back(req, ctx):
        if req.nodes is None or not req.nodes.node_local:  # the disk save: held until released
            assert release.wait(30)
        return real(req, ctx)

    monkeypatch.setattr(_checkpointer, "persist_checkpoint", held_back)
    yield release
    release.set()


def test_a_due_memory_save_is_put_off_while_a_disk_save_is_written(tmp_path, disk_writes_held):
    """save_if_due never waits for an in-flight disk write: the due memory save comes at the first step after it."""
    release = disk_writes_held
    state, model, opt = _state()
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), save_every_n_steps=2,
                           memory_every_n_steps=1, memory_keep_last=10) as mgr:
        disk = mgr.save_if_due(2, state)
        assert disk is not None and not disk.committed.done()
        assert mgr.save_if_due(3, state) is None  # due in memory, put off: the disk write is in flight
        assert not disk.committed.done()
        release.set()
        disk.wait()
        handle = mgr.save_if_due(5, state)
        assert handle is not None and Path(handle.committed.result(30)).parent.name == "mem"
    assert _steps(tmp_path / "mem") == [5]


def test_a_memory_save_put_off_comes_at_the_next_step_not_the_next_multiple(tmp_path, disk_writes_held):
    """memory_every_n_steps=3: step 3, due while a disk write is in flight, is saved at step 4 once it is done."""
    release = disk_writes_held
    state, _, _ = _state()
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), memory_every_n_steps=3,
                           memory_keep_last=10) as mgr:
        disk = mgr.save(2, state)
        assert mgr.save_if_due(3, state) is None  # due, put off: the disk write is in flight
        release.set()
        disk.wait()
        handle = mgr.save_if_due(4, state)
        assert handle is not None and Path(handle.committed.result(30)).parent.name == "mem"
        assert mgr.save_if_due(5, state) is None  # owed no more
    assert _steps(tmp_path / "mem") == [4]


def test_memory_saves_do_not_count_for_disk_retention(tmp_path):
    """keep_last on the disk root retires disk steps only; memory saves never push a disk step out."""
    state, model, opt = _state()
    with _manager(tmp_path, keep_last=2, save_every_n_steps=3, memory_every_n_steps=1) as mgr:
        for step in range(1, 10):
            _train(model, opt, step)
            mgr.save_if_due(step, state)
    assert _steps(tmp_path / "disk") == [6, 9]


def test_a_memory_save_is_left_out_of_the_disk_step_time(tmp_path):
    """The step interval holding a memory save's stall is not sampled by the disk cadence's step-time estimate."""
    state, _, _ = _state()
    with _manager(tmp_path, mtbf_seconds="1h", memory_every_n_steps=1) as mgr:
        mgr.save_if_due(1, state)
        time.sleep(0.05)
        mgr.save_if_due(2, state)  # a memory save of step 2 (step 1 gave the clock's start)
        estimator = mgr._cadence.step_time
        before = estimator.seconds
        time.sleep(0.3)
        mgr.save_if_due(3, state)
        assert estimator.seconds == before


def test_memory_saves_work_with_a_writer_process(tmp_path):
    """persist="process": a memory save commits through the writer process into memory_root."""
    state, _, _ = _state()
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), persist="process") as mgr:
        assert Path(mgr.save(4, state, tier="memory").committed.result(120)).parent == tmp_path / "mem"
    assert read_manifest(tmp_path / "mem" / "step_000000004").node == 0


def test_every_step_memory_saves_with_a_writer_process_and_overlap_restore_exactly(tmp_path):
    """persist="process" with overlap_staging (the every-step setting): each step's memory save holds that
    step's values, and the newest restores bitwise into a fresh state."""
    import copy

    state, model, opt = _state()
    snaps = {}
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), persist="process",
                           overlap_staging=True, memory_every_n_steps=1, memory_keep_last=2) as mgr:
        for step in range(1, 7):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory")  # the next _train overlaps its copy
            snaps[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        mgr.wait()
    for step in (5, 6):  # 5: saved while step 6 trained
        fresh, model2, opt2 = _state(seed=1)
        _train(model2, opt2, 0)
        with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem")) as mgr:
            assert mgr.restore(fresh, step=step) == step
        want_model, want_opt = snaps[step]
        assert all(torch.equal(v, want_model[k]) for k, v in model2.state_dict().items())
        got = opt2.state_dict()["state"]
        assert all(torch.equal(got[i][name], t) for i, st in want_opt["state"].items() for name, t in st.items())


def test_memory_retention_keeps_memory_keep_last_newest(tmp_path):
    """memory_keep_last newest steps stay in memory_root."""
    state, model, opt = _state()
    with _manager(tmp_path, memory_every_n_steps=1, memory_keep_last=3) as mgr:
        for step in range(1, 8):
            mgr.save_if_due(step, state)
    assert _steps(tmp_path / "mem") == [5, 6, 7]


def test_memory_saves_do_not_count_for_replication(tmp_path):
    """replicate_every_n_saves counts disk saves only, and memory steps never reach the durable tier."""
    state, model, opt = _state()
    url = f"file://{tmp_path / 'durable'}"
    with _manager(tmp_path, save_every_n_steps=2, memory_every_n_steps=1, durable_url=url,
                  replicate_every_n_saves=2, durable_create=True) as mgr:
        for step in range(1, 9):
            mgr.save_if_due(step, state)
        assert mgr.wait_durable(60)
    assert _steps(tmp_path / "durable") == [4, 8]


def test_restore_takes_the_newer_memory_step(tmp_path):
    """restore() loads a memory step newer than the newest disk step, exactly."""
    state, model, opt = _state()
    with _manager(tmp_path, save_every_n_steps=4, memory_every_n_steps=1) as mgr:
        for step in range(1, 7):
            _train(model, opt, step)
            mgr.save_if_due(step, state)
    fresh, model2, opt2 = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh) == 6
        assert mgr.restore_source == "memory"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_restore_prefers_disk_when_it_is_as_new(tmp_path):
    """A memory step not newer than the newest disk step is not used."""
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(5, state, tier="memory")
        mgr.save(5, state)
    fresh, _, _ = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh) == 5
        assert mgr.restore_source is None


def test_restore_prefers_a_newer_durable_step_over_memory(tmp_path):
    """A durable step newer than the memory step (the local disk lost it) wins over memory."""
    state, model, opt = _state()
    url = f"file://{tmp_path / 'durable'}"
    with _manager(tmp_path, durable_url=url, durable_create=True) as mgr:
        mgr.save(4, state)
        mgr.save(6, state, tier="memory")
        _train(model, opt, 8)
        mgr.save(8, state)
        assert mgr.wait_durable(60)
    shutil.rmtree(tmp_path / "disk" / "step_000000008")
    fresh, model2, _ = _state(seed=1)
    with _manager(tmp_path, durable_url=url) as mgr:
        assert mgr.restore(fresh) == 8
        assert mgr.restore_source is None
    assert torch.equal(model[0].weight, model2[0].weight)


def test_explicit_step_only_in_memory_is_loaded_from_memory(tmp_path):
    """restore(step=S) with S only in memory_root loads it from memory."""
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(2, state)
        _train(model, opt, 3)
        mgr.save(3, state, tier="memory")
        mgr.save(4, state, tier="memory")
    fresh, model2, _ = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh, step=3) == 3
        assert mgr.restore_source == "memory"
    assert torch.equal(model[0].weight, model2[0].weight)


def _corrupt_newest_memory_copy(tmp_path: Path, how: str) -> None:
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        _train(model, opt, 1)
        mgr.save(4, state)
        _train(model, opt, 2)
        mgr.save(5, state, tier="memory")
    data = _data_file(tmp_path / "mem" / "step_000000005")
    raw = bytearray(data.read_bytes())
    if how == "flip":
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    else:
        data.write_bytes(bytes(raw[: len(raw) // 2]))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_memory_copy_falls_back_to_disk_with_a_warning(tmp_path, caplog, how):
    """A bit-flipped or truncated memory file: restore() takes the disk step and warns naming the memory step."""
    _corrupt_newest_memory_copy(tmp_path, how)
    fresh, _, _ = _state(seed=1)
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), _manager(tmp_path) as mgr:
        assert mgr.restore(fresh) == 4
        assert mgr.restore_source is None
    assert any("memory tier: step 5" in r.getMessage() for r in caplog.records), caplog.text


def _disk_2_then_memory_3_to_5(tmp_path: Path) -> None:
    """Disk step 2, then memory steps 3, 4 and 5 (trained between saves), all kept."""
    state, model, opt = _state()
    with _manager(tmp_path, memory_keep_last=5) as mgr:
        mgr.save(2, state)
        for step in (3, 4, 5):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory")


def test_rollback_never_resumes_abandoned_memory_steps(tmp_path):
    """After restoring an older disk step and saving, the newer memory steps are gone for good."""
    _disk_2_then_memory_3_to_5(tmp_path)
    fresh, model2, opt2 = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh, step=2) == 2
        _train(model2, opt2, 30)
        mgr.save(3, fresh, tier="memory")  # the new timeline's step 3
    assert _steps(tmp_path / "mem") == [3]
    again, model3, _ = _state(seed=2)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(again) == 3
    assert torch.equal(model3[0].weight, model2[0].weight)


def test_a_disk_save_after_a_rollback_drops_newer_memory_steps(tmp_path):
    """A disk save after restoring an older step deletes the memory steps newer than the restored one."""
    state, model, opt = _state()
    with _manager(tmp_path, memory_keep_last=5) as mgr:
        mgr.save(2, state)
        mgr.save(3, state, tier="memory")
        mgr.save(9, state, tier="memory")
    fresh, _, _ = _state(seed=1)
    with _manager(tmp_path, on_existing_newer="supersede") as mgr:
        mgr.restore(fresh, step=2)
        mgr.save(5, fresh)
    assert _steps(tmp_path / "mem") == []


def _abandon_memory_steps_after(tmp_path: Path, monkeypatch, *, restore_kwargs) -> None:
    """Disk step 2, memory steps 3-5; a restart rolls back with ``restore_kwargs`` and saves disk step 3,
    then dies before the memory tier deletes the abandoned steps (the drop is disabled)."""
    from torch_ckpt.manager._memory import MemoryTier

    _disk_2_then_memory_3_to_5(tmp_path)
    monkeypatch.setattr(MemoryTier, "before_disk_save", lambda self, step: None)  # the crash window
    fresh, model2, opt2 = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh, **restore_kwargs) == 2
        _train(model2, opt2, 30)
        mgr.save(3, fresh)
    monkeypatch.undo()
    assert _steps(tmp_path / "mem") == [3, 4, 5]  # still there: only the lineage keeps them from being resumed
    again, model3, _ = _state(seed=2)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(again) == 3
        assert mgr.restore_source is None
    assert torch.equal(model3[0].weight, model2[0].weight)


def test_a_crash_before_the_memory_drop_never_resumes_abandoned_memory_steps(tmp_path, monkeypatch):
    """Restoring an older disk step while memory holds newer ones forks the lineage: a crash before the memory
    steps are deleted still resumes the new timeline's disk step."""
    _abandon_memory_steps_after(tmp_path, monkeypatch, restore_kwargs={"step": 2})


def test_a_path_restore_with_newer_memory_steps_forks_the_lineage(tmp_path, monkeypatch):
    """restore(path=...) of an older step while memory holds newer ones is a rollback, as restore(step=...) is."""
    _abandon_memory_steps_after(tmp_path, monkeypatch, restore_kwargs={"path": tmp_path / "disk" / "step_000000002"})


def test_a_damaged_newest_memory_step_restored_from_disk_forks_the_lineage(tmp_path, monkeypatch):
    """Falling back from a damaged memory step to an older disk step is a rollback: that memory step is never
    resumed later, even when the drop of abandoned memory steps never ran."""
    from torch_ckpt.manager._memory import MemoryTier

    state, model, opt = _state()
    with _manager(tmp_path, memory_keep_last=5) as mgr:
        mgr.save(2, state)
        _train(model, opt, 5)
        mgr.save(5, state, tier="memory")
    saved = _data_file(tmp_path / "mem" / "step_000000005").read_bytes()
    _data_file(tmp_path / "mem" / "step_000000005").write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    monkeypatch.setattr(MemoryTier, "before_disk_save", lambda self, step: None)
    fresh, model2, opt2 = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh) == 2
        _train(model2, opt2, 30)
        mgr.save(4, fresh)
    monkeypatch.undo()
    _data_file(tmp_path / "mem" / "step_000000005").write_bytes(saved)  # the copy reads intact again
    again, model3, _ = _state(seed=2)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(again) == 4
    assert torch.equal(model3[0].weight, model2[0].weight)


def test_a_memory_save_after_a_rollback_sets_abandoned_disk_steps_aside(tmp_path):
    """After a rollback, the first memory save moves the abandoned disk steps aside: losing the memory copy
    (a node reboot wipes /dev/shm) resumes the restored step, never the abandoned timeline."""
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        for step in (2, 4, 6):
            _train(model, opt, step)
            mgr.save(step, state)
    fresh, model2, opt2 = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh, step=2) == 2
        expected = model2[0].weight.detach().clone()
        _train(model2, opt2, 30)
        mgr.save(3, fresh, tier="memory")
    assert _steps(tmp_path / "disk") == [2]
    assert len(list((tmp_path / "disk").glob(".superseded_step_*"))) == 2
    shutil.rmtree(tmp_path / "mem")
    again, model3, _ = _state(seed=2)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(again) == 2
    assert torch.equal(model3[0].weight, expected)


def test_abandoned_disk_steps_are_set_aside_once_per_restore(tmp_path, monkeypatch):
    """After a rollback only the first memory save scans the disk root for abandoned steps; later ones do not."""
    import torch_ckpt.manager._manager as manager_mod

    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        for step in (2, 4):
            _train(model, opt, step)
            mgr.save(step, state)
    fresh, _, _ = _state(seed=1)
    with _manager(tmp_path, memory_keep_last=5) as mgr:
        assert mgr.restore(fresh, step=2) == 2
        mgr.save(3, fresh, tier="memory")
        scans: list[Path] = []
        real = manager_mod.scan_manifests

        def counted(root, naming):
            scans.append(root)
            return real(root, naming)

        monkeypatch.setattr(manager_mod, "scan_manifests", counted)
        mgr.save(4, fresh, tier="memory")
        mgr.save(5, fresh, tier="memory")
    assert scans == []
    assert _steps(tmp_path / "disk") == [2]


def test_health_reports_memory_step_age_and_restart_exposure(tmp_path):
    """health() gives memory_step, memory_age_s and lost_work_if_restart_now_s (newest of any tier)."""
    state, _, _ = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(1, state)
        time.sleep(0.2)
        mgr.save(2, state, tier="memory")
        report = mgr.health()
    assert report["memory_step"] == 2 and report["latest_step"] == 1
    assert 0 <= report["memory_age_s"] < report["latest_age_s"]
    assert report["lost_work_if_restart_now_s"] == report["memory_age_s"]


def test_health_without_a_memory_tier_has_the_keys(tmp_path):
    """Without memory_root the memory keys are None and the restart exposure is the disk step's age."""
    state, _, _ = _state()
    with CheckpointManager(tmp_path / "disk", async_save=False) as mgr:
        mgr.save(1, state)
        report = mgr.health()
    assert report["memory_step"] is None and report["memory_age_s"] is None
    assert report["lost_work_if_restart_now_s"] == pytest.approx(report["latest_age_s"], abs=1.0)


@pytest.mark.parametrize("settings, field", [
    ({"memory_root": "DISK"}, "memory_root"),
    ({"memory_root": "DISK/inner"}, "memory_root"),
    ({"memory_root": "mem", "memory_every_n_steps": 0}, "memory_every_n_steps"),
    ({"memory_root": "mem", "memory_every_seconds": -1}, "memory_every_seconds"),
    ({"memory_root": "mem", "memory_keep_last": 0}, "memory_keep_last"),
    ({"memory_every_n_steps": 2}, "memory_root"),
    ({"memory_root": ""}, "memory_root"),
    ({"memory_root": "mem", "memory_mtbf_seconds": 0}, "memory_mtbf_seconds"),
    ({"memory_root": "mem", "memory_mtbf_seconds": "soon"}, "memory_mtbf_seconds"),
    ({"memory_mtbf_seconds": "1h"}, "memory_root"),
])
def test_invalid_memory_settings_name_the_field(tmp_path, settings, field):
    """A bad memory setting is a ConfigError naming the field."""
    disk = tmp_path / "disk"
    values = {k: (str(disk) + v[4:] if isinstance(v, str) and v.startswith("DISK") else
                  str(tmp_path / v) if k == "memory_root" and v else v) for k, v in settings.items()}
    with pytest.raises(ConfigError, match=field):
        CheckpointManager(disk, **values)


def _slow_disk_persist(monkeypatch, seconds: float) -> None:
    """Make every disk save's persist take ``seconds`` longer (memory saves keep their speed)."""
    from torch_ckpt.save import _checkpointer

    real = _checkpointer.persist_checkpoint

    def slow(req, ctx):
        if req.nodes is None or not req.nodes.node_local:
            time.sleep(seconds)
        return real(req, ctx)

    monkeypatch.setattr(_checkpointer, "persist_checkpoint", slow)


def test_the_memory_interval_follows_the_memory_save_cost(tmp_path, monkeypatch):
    """Under the same MTBF a cheap memory save gets a shorter interval than a slow disk save."""
    _slow_disk_persist(monkeypatch, 0.5)
    state, _, _ = _state()
    with _manager(tmp_path, mtbf_seconds="1h", memory_mtbf_seconds="1h") as mgr:
        for step in range(1, 4):
            time.sleep(0.01)
            mgr.save_if_due(step, state)  # memory saves as soon as a step time is measured (no cost assumed)
        mgr.save(4, state)  # a disk save: 0.5 s more
        mgr.save_if_due(5, state)
        disk, memory = mgr.schedule_info(), mgr.schedule_info()["memory"]
    assert _steps(tmp_path / "mem") and _steps(tmp_path / "disk") == [4]
    assert disk["cost_s"] >= 0.5 > memory["cost_s"]
    assert memory["optimal_interval_s"] < disk["optimal_interval_s"]


def test_a_disk_save_restarts_the_memory_count_without_a_memory_cost_sample(tmp_path):
    """A disk save from save_if_due leaves the memory tier's measured cost as it was and restarts its count."""
    state, _, _ = _state()
    with _manager(tmp_path, save_every_n_steps=4, memory_mtbf_seconds="1h") as mgr:
        for step in range(1, 4):
            time.sleep(0.01)
            mgr.save_if_due(step, state)
        cost = mgr.schedule_info()["memory"]["cost_s"]
        assert cost > 0
        mgr.save_if_due(4, state)  # the disk save
        mgr.save_if_due(5, state)
        memory = mgr.schedule_info()["memory"]
    assert _steps(tmp_path / "disk") == [4]
    assert memory["cost_s"] == cost and memory["steps_since_save"] == 1


def test_a_disk_save_waiting_for_a_memory_save_leaves_the_wait_out_of_the_disk_cost(tmp_path, monkeypatch):
    """The disk cost measures the disk save only: its wait for a memory save still being written is left out."""
    from torch_ckpt.save import _checkpointer

    real = _checkpointer.persist_checkpoint

    def slow_memory(req, ctx):
        if req.nodes is not None and req.nodes.node_local:
            time.sleep(1.0)
        return real(req, ctx)

    monkeypatch.setattr(_checkpointer, "persist_checkpoint", slow_memory)
    state, _, _ = _state()
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), mtbf_seconds="1h") as mgr:
        mgr.should_save(1)
        mgr.save(1, state, tier="memory")
        disk = mgr.save(2, state)  # waits for the memory save
        assert disk.stats.wait_for_previous_s > 0.5
        mgr.should_save(2)
        cost = mgr.schedule_info()["cost_s"]
    assert cost < disk.stats.blocking_s - 0.5


def test_schedule_info_and_health_show_each_tiers_interval(tmp_path):
    """schedule_info() (and health()["schedule"]) give the disk policy's keys and the memory plan under "memory"."""
    state, _, _ = _state()
    with _manager(tmp_path, save_every_n_steps=10, memory_mtbf_seconds="30m") as mgr:
        mgr.save_if_due(1, state)
        info, health = mgr.schedule_info(), mgr.health()
    assert info["policy"] == "EveryNSteps" and info["n"] == 10
    assert info["memory"]["policy"] == "YoungDaly" and info["memory"]["mtbf_s"] == 1800.0
    assert "interval_s" in info["memory"] and health["schedule"] == info


def test_memory_mtbf_seconds_combines_with_memory_every_n_steps():
    """memory_mtbf_seconds with memory_every_n_steps builds AnyOf(YoungDaly, EveryNSteps) for the memory tier."""
    from torch_ckpt.policy import AnyOf, EveryNSteps, YoungDaly

    policy = CheckpointConfig(memory_root="/dev/shm/run", memory_mtbf_seconds="1h",
                              memory_every_n_steps=5).build_memory_policy()
    assert isinstance(policy, AnyOf)
    young, every = policy.policies
    assert isinstance(young, YoungDaly) and young.mtbf_s == 3600.0 and young.initial_cost_s == 0.0
    assert isinstance(every, EveryNSteps) and every.n == 5


def test_memory_save_needs_memory_root(tmp_path):
    """save(tier="memory") without memory_root, or an unknown tier, is a ConfigError."""
    state, _, _ = _state()
    with CheckpointManager(tmp_path / "disk", async_save=False) as mgr:
        with pytest.raises(ConfigError, match="memory_root"):
            mgr.save(1, state, tier="memory")
        with pytest.raises(ConfigError, match="tier"):
            mgr.save(1, state, tier="tape")


def test_memory_settings_come_from_a_yaml_file(tmp_path):
    """The memory fields are settings a file may hold."""
    path = tmp_path / "ckpt.yaml"
    path.write_text("memory_root: /dev/shm/run\nmemory_every_n_steps: 5\nmemory_every_seconds: 30s\n"
                    "memory_keep_last: 1\n", encoding="utf-8")
    cfg = CheckpointConfig.from_yaml(path)
    assert (cfg.memory_root, cfg.memory_every_n_steps, cfg.memory_every_seconds, cfg.memory_keep_last) == \
        ("/dev/shm/run", 5, 30.0, 1)


# -- a process restart: the trainer is killed (SIGKILL) after a memory save ------------------------------
_TRAINER = textwrap.dedent("""
    import json, sys, time
    import torch
    sys.path.insert(0, sys.argv[3])
    from test_memory_tier import _state, _train
    from torch_ckpt import CheckpointManager
    state, model, opt = _state()
    mgr = CheckpointManager(sys.argv[1] + "/disk", memory_root=sys.argv[1] + "/mem", save_every_n_steps=5,
                            memory_every_n_steps=1)
    for step in range(1, 8):
        _train(model, opt, step)
        handle = mgr.save_if_due(step, state)
        handle.committed.result()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
               sys.argv[2])
    print("READY", flush=True)
    time.sleep(600)
""")


def test_process_restart_resumes_bitwise_from_memory(tmp_path):
    """A trainer killed with SIGKILL after a memory save resumes that step exactly (model, optimizer, RNG)."""
    expected = tmp_path / "expected.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(tmp_path), str(expected), str(REPO / "tests")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    fresh, model, opt = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert mgr.restore(fresh) == 7
        assert mgr.restore_source == "memory"
    want = torch.load(expected, weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(want["model"].values(), model.state_dict().values()))
    got_opt = opt.state_dict()["state"]
    for key, entry in want["opt"]["state"].items():
        assert all(torch.equal(entry[k], got_opt[key][k]) for k in entry)
    assert torch.equal(want["rng"], torch.get_rng_state())
    assert json.loads((tmp_path / "mem" / "step_000000007" / MANIFEST_NAME).read_text())["step"] == 7


# -- two ranks as two nodes over gloo, each with its own memory_root ---------------------------------------
def _two_nodes(rank, world, base, drop_node):
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    node = Path(base) / f"node{rank}"
    state, model, opt = _state()
    kwargs = dict(memory_root=str(node / "mem"), async_save=False, memory_replicas=0 if drop_node is not None else 1)
    with CheckpointManager(node / "disk", save_every_n_steps=2, memory_every_n_steps=1, **kwargs) as mgr:
        for step in range(1, 4):
            _train(model, opt, step)
            mgr.save_if_due(step, state)
    assert _steps(node / "mem") == [1, 3] and _steps(node / "disk") == [2]
    if drop_node is not None and rank == drop_node:
        os.rename(node / "mem" / "step_000000003", node / "mem" / "gone")
    torch.distributed.barrier()
    fresh, model2, _ = _state(seed=1)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        got = mgr.restore(fresh)
        source = mgr.restore_source
    if drop_node is None:
        assert (got, source) == (3, "memory")
        assert torch.equal(model[0].weight, model2[0].weight)
    else:
        assert (got, source) == (2, "local")


def _two_nodes_rollback(rank, world, base):
    from torch_ckpt.manager._memory import MemoryTier

    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    node = Path(base) / f"node{rank}"
    state, model, opt = _state()
    kwargs = dict(memory_root=str(node / "mem"), async_save=False, memory_keep_last=5)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        mgr.save(2, state)
        for step in (3, 4, 5):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory")
    MemoryTier.before_disk_save = lambda self, step: None  # die before the abandoned memory steps go
    fresh, model2, opt2 = _state(seed=1)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        assert mgr.restore(fresh, step=2) == 2 and mgr.restore_source == "local"
        _train(model2, opt2, 30)
        mgr.save(3, fresh)
    assert _steps(node / "mem") == [3, 4, 5]
    again, model3, _ = _state(seed=2)
    with CheckpointManager(node / "disk", **kwargs) as mgr:
        assert (mgr.restore(again), mgr.restore_source) == (3, "local")
    assert torch.equal(model3[0].weight, model2[0].weight)


@pytest.mark.slow
def test_two_nodes_never_resume_abandoned_memory_steps_after_a_rollback(tmp_path):
    """Node-local roots: a rollback while every node's memory holds newer steps forks the lineage, so a crash
    before those steps are deleted resumes the new timeline's disk step."""
    run_distributed(_two_nodes_rollback, 2, str(tmp_path), timeout_s=240)


def _shared_memory_root(rank, world, base):
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    with pytest.raises(CheckpointError, match="memory_root|more than one node"):
        CheckpointManager(Path(base) / f"node{rank}" / "disk", memory_root=str(Path(base) / "mem"))


@pytest.mark.slow
def test_a_memory_root_two_nodes_share_is_refused(tmp_path):
    """A memory_root that two nodes see is refused at start, naming memory_root."""
    run_distributed(_shared_memory_root, 2, str(tmp_path), timeout_s=240)


@pytest.mark.slow
def test_two_nodes_restore_from_their_own_memory_roots(tmp_path):
    """Two nodes (gloo ranks), each with its own memory_root, resume the newest memory step together."""
    run_distributed(_two_nodes, 2, str(tmp_path), None, timeout_s=240)


@pytest.mark.slow
def test_a_node_missing_its_memory_copy_falls_back_to_disk(tmp_path):
    """Without peer replicas (memory_replicas=0), when one node lacks its memory copy of the newest step, both
    nodes restore the disk step."""
    run_distributed(_two_nodes, 2, str(tmp_path), 1, timeout_s=240)


def test_a_memory_root_of_another_run_root_is_refused(tmp_path):
    """A new run root on a memory_root that holds another run root's steps raises, naming both; nothing is resumed."""
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(5, state, tier="memory")
    with pytest.raises(ConfigError, match="memory_root .*holds the memory checkpoints of the run root .*disk"):
        CheckpointManager(tmp_path / "other", memory_root=str(tmp_path / "mem"), async_save=False)
    assert _steps(tmp_path / "mem") == [5]


def test_the_same_run_root_reopens_its_memory_root(tmp_path):
    """A restart of the same run root resumes from the memory_root it wrote."""
    state, model, opt = _state()
    with _manager(tmp_path) as mgr:
        mgr.save(5, state, tier="memory")
    with _manager(tmp_path) as mgr:
        assert mgr.restore(_state(1)[0]) == 5 and mgr.restore_source == "memory"


def test_a_memory_root_linked_into_the_run_root_is_refused(tmp_path):
    """A memory_root that is a symbolic link into the run root is refused like the root itself."""
    (tmp_path / "disk" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "disk" / "inner")
    with pytest.raises(ConfigError, match="memory_root"):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "link"), async_save=False)


def test_a_memory_root_that_is_a_file_is_refused(tmp_path):
    """A memory_root naming a file is a ConfigError naming memory_root."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="memory_root .*not a directory"):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "afile"), async_save=False)


def test_a_durable_url_inside_memory_root_is_refused(tmp_path):
    """durable_url equal to memory_root is a ConfigError: memory saves never become durable checkpoints."""
    with pytest.raises(ConfigError, match="memory_root"):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), async_save=False,
                          durable_url=(tmp_path / "mem").as_uri())


def test_a_memory_root_that_cannot_be_created_is_named_memory_root(tmp_path):
    """A memory_root that cannot be created (its parent is a file) is refused naming memory_root."""
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(CheckpointWriteError, match=r"cannot create memory_root .*afile/mem"):
        CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "afile" / "mem"), async_save=False)


def test_a_newest_disk_step_that_fails_to_load_gives_way_to_a_newer_memory_step(tmp_path):
    """Disk 4 and 6, memory 5, disk 6 flipped: the disk path falls back to 4, then memory 5 is loaded, not 4."""
    state, model, opt = _state()
    with _manager(tmp_path, save_every_n_steps=2, memory_every_n_steps=1, memory_keep_last=3) as mgr:
        for step in range(1, 7):
            _train(model, opt, step)
            if step == 5:
                want = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save_if_due(step, state)
    data = _data_file(tmp_path / "disk" / "step_000000006")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    fresh, model2, _ = _state(seed=1)
    with _manager(tmp_path) as mgr:
        assert (mgr.restore(fresh), mgr.restore_source) == (5, "memory")
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


@pytest.mark.parametrize(("fstype", "warns"), [("ext4", True), ("tmpfs", False)])
def test_a_memory_root_not_in_ram_is_warned_about(tmp_path, monkeypatch, caplog, fstype, warns):
    """A memory_root on a file system not held in RAM gets a warning naming it; one on a tmpfs does not."""
    import collections

    import psutil

    part = collections.namedtuple("part", "device mountpoint fstype opts")
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: [
        part("/dev/vda", "/", "ext4", "rw"), part("none", str(tmp_path.resolve()), fstype, "rw")])
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), _manager(tmp_path, memory_replicas=0):
        pass
    said = [r.getMessage() for r in caplog.records if "not in RAM" in r.getMessage()]
    assert bool(said) == warns and all(str(tmp_path / "mem") in m and fstype in m for m in said)


@pytest.mark.parametrize("persist", ["thread", "process"])
def test_a_memory_save_writes_over_the_files_of_a_retired_step(tmp_path, monkeypatch, persist):
    """With memory_keep_last=1 a memory save writes into the data files of a step retention retired (their
    tmpfs pages reused, not freed and allocated again), and the newest step restores bitwise."""
    from torch_ckpt.manager import _memory

    monkeypatch.setattr(_memory, "SPARE_MIN_BYTES", 1)
    state, model, opt = _state()
    mem = tmp_path / "mem"
    with CheckpointManager(tmp_path / "disk", memory_root=str(mem), memory_keep_last=1, async_save=True,
                           persist=persist) as mgr:
        held = []  # open descriptors of step 1's data files: their inodes cannot be reused by other files
        for step in range(1, 5):
            _train(model, opt, step)
            mgr.save(step, state, tier="memory").wait()
            if step == 1:
                held = [os.open(p, os.O_RDONLY) for p in (mem / "step_000000001").glob("*.distcp")]
            if step == 3:
                now = {(p.stat().st_dev, p.stat().st_ino) for p in (mem / "step_000000003").glob("*.distcp")}
                reused = [fd for fd in held if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) in now]
                assert reused and all(os.fstat(fd).st_nlink == 1 for fd in reused)  # renamed into step 3, not deleted
        for fd in held:
            os.close(fd)
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert not (mem / ".spare").exists()  # close hands the recycled files' RAM back
    fresh, model2, _ = _state(seed=1)
    with CheckpointManager(tmp_path / "disk", memory_root=str(mem)) as mgr:
        assert mgr.restore(fresh) == 4 and mgr.restore_source == "memory"
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


def test_a_recycled_file_with_another_link_or_a_symlink_is_never_written_in_place(tmp_path, monkeypatch):
    """A file in the spare directory with a second hard link, or a symlink there, is removed, not written through:
    the other name's bytes stay, and the save commits intact files of its own."""
    from torch_ckpt.manager import _memory

    monkeypatch.setattr(_memory, "SPARE_MIN_BYTES", 1)
    monkeypatch.setattr(_memory, "_recycle", lambda paths, spare, kept: _memory._delete(paths))  # fill it by hand
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me" * 1000)
    linked = tmp_path / "linked.bin"
    linked.write_bytes(b"linked" * 1000)
    state, model, opt = _state()
    mem = tmp_path / "mem"
    with CheckpointManager(tmp_path / "disk", memory_root=str(mem), memory_keep_last=1, async_save=False) as mgr:
        mgr.save(1, state, tier="memory")
        spare = mem / ".spare"
        spare.mkdir()
        (spare / "a").symlink_to(outside)
        os.link(linked, spare / "b")
        _train(model, opt, 2)
        mgr.save(2, state, tier="memory")
        assert outside.read_bytes() == b"keep me" * 1000 and linked.read_bytes() == b"linked" * 1000
        assert list(spare.iterdir()) == []
        assert all(p.stat().st_nlink == 1 and not p.is_symlink() for p in (mem / "step_000000002").iterdir())
    assert verify_tree(mem / "step_000000002")


def verify_tree(step_dir: Path) -> bool:
    from torch_ckpt.tools.listing import verify_checkpoint

    return bool(verify_checkpoint(step_dir)["ok"])


@pytest.mark.parametrize("when", ["at_start", "meanwhile"])
def test_a_symlink_in_place_of_the_spare_directory_is_never_followed(tmp_path, monkeypatch, when):
    """A symlink put where memory_root/.spare belongs (before the manager opens, or while it runs) is removed,
    never followed: the files of the directory it points to stay, and none of the memory tier's land there."""
    from torch_ckpt.manager import _memory

    monkeypatch.setattr(_memory, "SPARE_MIN_BYTES", 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.distcp").write_bytes(b"mine" * 1000)
    mem = tmp_path / "mem"
    mem.mkdir()
    if when == "at_start":
        (mem / ".spare").symlink_to(outside, target_is_directory=True)
    state, model, opt = _state()
    with CheckpointManager(tmp_path / "disk", memory_root=str(mem), memory_keep_last=1, async_save=False) as mgr:
        for step in range(1, 5):
            if when == "meanwhile" and step == 3:
                shutil.rmtree(mem / ".spare")
                (mem / ".spare").symlink_to(outside, target_is_directory=True)
            _train(model, opt, step)
            mgr.save(step, state, tier="memory")
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert sorted(p.name for p in outside.iterdir()) == ["precious.distcp"]
    assert (outside / "precious.distcp").read_bytes() == b"mine" * 1000
    assert not os.path.lexists(mem / ".spare")
    fresh, model2, _ = _state(seed=1)
    with CheckpointManager(tmp_path / "disk", memory_root=str(mem)) as mgr:
        assert mgr.restore(fresh) == 4
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


def _two_ranks_a_node(rank, world, base, flip):
    """4 ranks as 2 nodes of 2: memory saves of a replicated model plus a per-rank tensor, restored into fresh
    objects; ``flip``: a byte of node 0's biggest data file is flipped before the restore."""
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    node = Path(base) / f"node{rank // 2}"

    def build(seed):
        torch.manual_seed(seed)  # the same on every rank: the model is replicated, as with DDP
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mine = torch.full((1000,), float(rank if seed == 0 else -1))  # differs per rank
        return TrainState(model=model, optimizer=opt, extras={"mine": mine}), model, opt, mine

    state, model, opt, mine = build(0)
    mgr = CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_replicas=0, async_save=False)
    with mgr:
        for step in (1, 2, 3):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            mgr.save(step, state, tier="memory" if step > 1 else "disk")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.distributed.barrier()
    if flip and rank == 0:
        data = max((node / "mem" / "step_000000003").glob("*.distcp"), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        data.write_bytes(bytes(raw))
    torch.distributed.barrier()
    fresh, model2, _, _ = build(1)
    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_replicas=0) as mgr:
        got, source = mgr.restore(fresh), mgr.restore_source
    if flip:  # one rank of node 0 checked that file; its vote sends every rank to step 2, together
        assert (got, source) == (2, "memory"), (rank, got, source)
        return
    assert (got, source) == (3, "memory"), (rank, got, source)
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    assert torch.equal(fresh.extras["mine"], torch.full((1000,), float(rank))), fresh.extras["mine"][:3]


@pytest.mark.slow
@pytest.mark.parametrize("flip", [False, True], ids=["intact", "flipped"])
def test_two_ranks_of_a_node_read_its_memory_copy_side_by_side(tmp_path, flip):
    """2 nodes of 2 ranks restore bitwise from their nodes' memory copies; a byte flipped in a file that one
    rank of the node checks sends every rank back to the older memory step."""
    run_distributed(_two_ranks_a_node, 4, str(tmp_path), flip, timeout_s=240)


def _a_node_rank_without_tensors(rank, world, base, flip):
    """2 ranks as one node, rank 1's state without tensors; ``flip``: the index of the node's data file whose
    middle byte is flipped before the restore."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    node = Path(base)

    def build(v):
        return {"a": torch.full((5000,), float(v)), "b": torch.full((5000,), v + 0.5)} if rank == 0 else \
            {"meta": {"x": v}}

    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_replicas=0, async_save=False) as mgr:
        mgr.save(1, build(1), tier="disk")
        mgr.save(2, build(2), tier="memory")
    torch.distributed.barrier()
    files = sorted((node / "mem" / "step_000000002").glob("*.distcp"))
    assert len(files) > flip, files
    if rank == 0:
        raw = bytearray(files[flip].read_bytes())
        raw[len(raw) // 2] ^= 0x04
        files[flip].write_bytes(bytes(raw))
    torch.distributed.barrier()
    fresh = build(-1)
    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_replicas=0) as mgr:
        assert mgr.restore(fresh) == 1  # every rank falls back, whichever rank's share the file was
    assert fresh == {"meta": {"x": 1}} if rank else torch.equal(fresh["a"], torch.full((5000,), 1.0))


@pytest.mark.slow
@pytest.mark.parametrize("flip", [0, 1])
def test_a_node_rank_without_tensors_still_checks_its_share_of_the_files(tmp_path, flip):
    """A rank of the node with no tensors of its own still checks its share of the node's CRC-32s: a flipped
    byte in any data file sends both ranks to the older step."""
    run_distributed(_a_node_rank_without_tensors, 2, str(tmp_path), flip, timeout_s=120)


def _ranks_that_would_read_differently(rank, world, base):
    """2 ranks as one node; rank 1 made to take the collective read path: both raise, no rank waits."""
    from torch_ckpt.restore import _restore

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    node = Path(base)
    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_replicas=0, async_save=False) as mgr:
        mgr.save(1, {"a": torch.full((5000,), 1.0)}, tier="memory")
    if rank == 1:
        _restore._one_pass = lambda manifest, ctx: (False, (0, 1))
    fresh = {"a": torch.zeros(5000)}
    with CheckpointManager(node / "disk", memory_root=str(node / "mem"), memory_replicas=0) as mgr:
        assert mgr.restore(fresh) is None  # the only copy cannot be read by this layout: nothing restored
    assert torch.equal(fresh["a"], torch.zeros(5000))


@pytest.mark.slow
def test_ranks_that_would_read_a_copy_in_different_ways_refuse_it_instead_of_waiting(tmp_path):
    """A rank on the collective read path beside one-pass ranks: every rank refuses that copy, none hangs."""
    run_distributed(_ranks_that_would_read_differently, 2, str(tmp_path), timeout_s=120)
