"""Health telemetry of the manager and rank-aware logging."""

import logging
import time
import uuid

import torch

from torch_ckpt import CheckpointManager, TrainState
from torch_ckpt._logging import _RankFilter, get_logger, log_all_ranks


class _WallClock:
    """The manager's ``time`` module with a wall clock (``time.time()``) the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_health_reports_ages_and_lost_work(tmp_path, monkeypatch):
    """health() gives the newest local/durable steps and the work a failure now would lose (42.5 s after the save)."""
    import torch_ckpt.manager._manager as manager_mod

    clock = _WallClock(1_000_000.0)
    monkeypatch.setattr(manager_mod, "time", clock)  # the capture time of a save and the health report's "now"
    state = TrainState(model=torch.nn.Linear(4, 4))
    with CheckpointManager(tmp_path, durable_url=f"memory://h-{uuid.uuid4().hex[:6]}/r") as mgr:
        assert mgr.health()["lost_work_if_failure_now_s"] is None
        mgr.save(1, state).wait()  # captured at the clock's 1_000_000.0
        assert mgr.wait_durable(30)
        clock.now += 42.5
        h = mgr.health()
    assert h["latest_step"] == 1 and h["durable_step"] == 1
    assert h["lost_work_if_failure_now_s"] == 42.5 and h["latest_age_s"] == 42.5
    assert h["replication"]["durable_step"] == 1 and h["failed_saves"] == 0


def test_health_lists_the_tiers_holding_each_step(tmp_path):
    """health() reports per step which tiers hold a complete copy, and the newest durable step's age."""
    import shutil

    url = f"memory://h-{uuid.uuid4().hex[:6]}/r"
    state = TrainState(model=torch.nn.Linear(4, 4))
    with CheckpointManager(tmp_path / "a", durable_url=url, keep_last=1) as mgr:
        mgr.save(1, state)
        mgr.save(2, state).wait()
        assert mgr.wait_durable(30)
    shutil.rmtree(tmp_path / "a")
    with CheckpointManager(tmp_path / "a", durable_url=url, keep_last=5, replicate_every_n_saves=2) as mgr:
        mgr.save(3, state).wait()  # the first save is not replicated (every second one is)
        deadline = time.monotonic() + 30
        while (h := mgr.health())["durable_newest_step"] is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the replicator lists the store in the background when the manager starts
    assert h["tiers"] == {1: {"local": None, "durable": True}, 2: {"local": None, "durable": True},
                          3: {"local": "complete", "durable": False}}
    assert h["durable_newest_step"] == 2 and h["durable_newest_age_s"] >= 0


def test_health_without_durable_tier_uses_local(tmp_path):
    """Without a durable tier the local tier is the reference for lost work."""
    state = TrainState(model=torch.nn.Linear(4, 4))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state).wait()
        h = mgr.health()
    assert h["durable_step"] == 3 and h["lost_work_if_failure_now_s"] >= 0


def test_non_zero_rank_records_are_filtered_unless_requested(monkeypatch):
    """Only rank 0's info records pass by default; errors and log_all_ranks() let others through."""
    import torch_ckpt._logging as lg

    monkeypatch.setattr(lg, "_rank", lambda: 1)
    f = _RankFilter()
    info = logging.LogRecord("torch_ckpt.x", logging.INFO, __file__, 1, "m", None, None)
    error = logging.LogRecord("torch_ckpt.x", logging.ERROR, __file__, 1, "m", None, None)
    assert not f.filter(info) and f.filter(error) and error.rank == 1
    log_all_ranks(True)
    try:
        assert f.filter(info)
    finally:
        log_all_ranks(False)


def test_importing_configures_no_handlers():
    """Importing torch_ckpt adds no handler to the root logger or its own logger."""
    import importlib

    before = list(logging.getLogger().handlers)
    importlib.import_module("torch_ckpt.manager._manager")
    assert logging.getLogger().handlers == before
    assert get_logger("torch_ckpt.manager._manager").handlers == []
