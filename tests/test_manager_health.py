"""manager._manager.HealthReport: the health report on stand-in collaborators, a fake durable tier, a fixed clock."""

from __future__ import annotations

import types

import pytest

from torch_ckpt.manager import _manager as manager_health
from torch_ckpt.manager._manager import HealthReport
from torch_ckpt.policy._naming import StepNaming
from torch_ckpt.root._layout import MANIFEST_NAME, Manifest, write_json_durable
from torch_ckpt.storage._locations import DurableUnavailableError

NOW = 10_000.0
NAMING = StepNaming()


class FakeTier:
    def __init__(self, steps: dict[int, float] | None = None, *, outage: bool = False) -> None:
        self.steps = steps or {}
        self.outage = outage

    def list_steps(self):
        if self.outage:
            raise DurableUnavailableError("store unreachable")
        return {s: Manifest(step=s, world_size=1, files={}, wall_time=t) for s, t in self.steps.items()}


def _listing(tier):
    """What the replicator's last listing of ``tier`` holds (None after a failed one)."""
    try:
        return None if tier is None else tier.list_steps()
    except DurableUnavailableError:
        return None


def Host(root, tier=None, replication=None, captured=None, in_flight=None, failed=0):
    """A HealthReport over stand-ins for exactly the collaborators it declares."""
    runs = types.SimpleNamespace(captured_at=dict(captured or {}))
    after = types.SimpleNamespace(replicator=None if replication is None else types.SimpleNamespace(
        stats=lambda: replication, durable_listing=lambda refresh=True: _listing(tier)))
    engine = types.SimpleNamespace(in_flight=in_flight, failed_saves=[object()] * failed)
    report = HealthReport(root, NAMING, tier, runs, engine, after)
    return types.SimpleNamespace(health=lambda: report.health({"policy": "fixed"}),
                                 replication_stats=report.replication_stats)


@pytest.fixture(autouse=True)
def _clock(monkeypatch):
    """The report's clock reads NOW."""
    monkeypatch.setattr(manager_health.time, "time", lambda: NOW)


def commit_local(root, step, wall_time, node=None):
    d = root / NAMING.name(step)
    d.mkdir(parents=True)
    nodes = {} if node is None else {"rank_node": [0], "file_node": {}}
    write_json_durable(d / MANIFEST_NAME, Manifest(step=step, world_size=1, files={}, wall_time=wall_time,
                                                   nodes=nodes, node=node).to_json())


def test_empty_root_reports_nothing(tmp_path):
    """A root without checkpoints reports no steps, no ages and no lost-work figure."""
    h = Host(tmp_path / "absent").health()
    assert h["latest_step"] is None and h["latest_age_s"] is None and h["lost_work_if_failure_now_s"] is None
    assert h["tiers"] == {} and h["durable_newest_step"] is None


def test_age_of_a_step_saved_this_run_uses_its_capture_time(tmp_path):
    """The age of a step saved by this process is measured from when its state was captured."""
    commit_local(tmp_path, 5, wall_time=NOW - 100)
    h = Host(tmp_path, captured={5: NOW - 130}).health()
    assert h["latest_step"] == 5 and h["latest_age_s"] == pytest.approx(130)


def test_age_of_a_step_from_an_earlier_run_uses_its_commit_time(tmp_path):
    """A step committed by an earlier run is aged from its manifest's wall_time."""
    commit_local(tmp_path, 5, wall_time=NOW - 100)
    assert Host(tmp_path).health()["latest_age_s"] == pytest.approx(100)


def test_without_durable_tier_the_local_tier_stands_in(tmp_path):
    """Without a durable tier, the newest local step is the durable step and bounds the lost work."""
    commit_local(tmp_path, 3, wall_time=NOW - 50)
    commit_local(tmp_path, 9, wall_time=NOW - 20)
    h = Host(tmp_path).health()
    assert h["durable_step"] == 9 and h["lost_work_if_failure_now_s"] == pytest.approx(20)
    assert h["tiers"] == {3: {"local": "complete", "durable": None}, 9: {"local": "complete", "durable": None}}


def test_with_durable_tier_lost_work_goes_back_to_the_replicated_step(tmp_path):
    """With a durable tier, the lost work is the age of the newest replicated step, not the newest local one."""
    commit_local(tmp_path, 3, wall_time=NOW - 50)
    commit_local(tmp_path, 9, wall_time=NOW - 20)
    h = Host(tmp_path, tier=FakeTier({3: NOW - 45}), replication={"durable_step": 3}).health()
    assert h["latest_step"] == 9 and h["durable_step"] == 3
    assert h["lost_work_if_failure_now_s"] == pytest.approx(50)


def test_tier_report_merges_local_and_durable_steps(tmp_path):
    """Each step reports which tiers hold it; the newest durable step and its age are given."""
    commit_local(tmp_path, 3, wall_time=NOW - 50)
    commit_local(tmp_path, 9, wall_time=NOW - 20)
    h = Host(tmp_path, tier=FakeTier({1: NOW - 90, 3: NOW - 45}), replication={}).health()
    assert h["tiers"] == {1: {"local": None, "durable": True}, 3: {"local": "complete", "durable": True},
                          9: {"local": "complete", "durable": False}}
    assert h["durable_newest_step"] == 3 and h["durable_newest_age_s"] == pytest.approx(45)


def test_durable_outage_reports_unknown_durable_state(tmp_path):
    """When the store cannot be listed, durable is None for every step and no newest durable step is given."""
    commit_local(tmp_path, 3, wall_time=NOW - 50)
    h = Host(tmp_path, tier=FakeTier(outage=True), replication={}).health()
    assert h["tiers"] == {3: {"local": "complete", "durable": None}}
    assert h["durable_newest_step"] is None and h["durable_newest_age_s"] is None


def test_node_copy_is_reported_partial(tmp_path):
    """One node's copy of a node-local checkpoint is reported as a partial local copy."""
    commit_local(tmp_path, 4, wall_time=NOW - 1, node=0)
    assert Host(tmp_path).health()["tiers"] == {4: {"local": "partial", "durable": None}}


def test_in_flight_failed_and_schedule_are_reported(tmp_path):
    """The in-flight step, the count of failed saves and the schedule decision are passed through."""
    h = Host(tmp_path, in_flight=types.SimpleNamespace(step=12), failed=2).health()
    assert h["in_flight_step"] == 12 and h["failed_saves"] == 2 and h["schedule"] == {"policy": "fixed"}


def test_replication_stats_empty_without_replicator(tmp_path):
    """replication_stats is {} without a durable tier and the replicator's stats otherwise."""
    assert Host(tmp_path).replication_stats() == {}
    assert Host(tmp_path, tier=FakeTier(), replication={"queued": 1}).replication_stats() == {"queued": 1}
