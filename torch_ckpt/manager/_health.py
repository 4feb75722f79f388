"""The health report of :class:`~torch_ckpt.CheckpointManager`: ages, tiers and the exposure window.

A mixin of the manager (it reads the manager's root, tiers, replicator and engine state).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointError,
)
from torch_ckpt.root._layout import is_committed, read_manifest, scan_committed

log = get_logger("torch_ckpt.manager._manager")

__all__ = ["ManagerHealthMixin"]


class ManagerHealthMixin:
    """:meth:`health` and :meth:`replication_stats` of :class:`~torch_ckpt.CheckpointManager`."""

    def health(self) -> dict[str, Any]:
        """Checkpoint health on this rank, for dashboards and periodic logs.

        Returns:
            ``latest_step`` / ``latest_age_s``: newest local committed checkpoint and the age (seconds)
            of the state it holds; ``durable_step`` / ``durable_age_s``: the same for the durable tier
            (the local tier stands in when there is none); ``lost_work_if_failure_now_s``: training
            time that a failure right now would lose (back to the newest durable checkpoint; None
            before the first one); ``in_flight_step``; ``failed_saves``; ``replication`` (see
            :meth:`replication_stats`); ``schedule`` (the save policy's last decision, if any);
            ``tiers``: per step, which tiers hold a copy, ``{step: {"local": "complete" | "partial" |
            None, "durable": bool | None}}`` ("partial": this node's copy of a node-local checkpoint;
            durable None: not known, see below); ``durable_newest_step`` /
            ``durable_newest_age_s``: the newest step committed in the durable tier (listed there, so
            also after a restart) and the age of its state in seconds (the exposure window).

        Never does network I/O: the durable side is the replicator's last known listing of the
        store (listed in the background when ``health()`` asks, at most every 10 s, and by the
        durable retention; updated by the replicator's own commits and deletions), so a store
        that does not answer never blocks this call: the first call after the manager starts
        asks for a listing and reports durable entries as None. Durable entries are None (and ``durable_newest_step``
        None) until a listing has succeeded, while the last one fails (``replication["last_error"]``
        says why), and on ranks that do not replicate (every rank but rank 0, or but each node's
        lowest rank with node-local roots).
        """
        now = time.time()
        local = scan_committed(self.root, self.naming) if self.root.is_dir() else {}
        latest = max(local) if local else None

        def age(step: int | None) -> float | None:
            if step is None:
                return None
            captured = self._captured_at.get(step)
            if captured is None and step in local:
                captured = read_manifest(local[step]).wall_time  # saved by an earlier run: commit time
            return None if captured is None else now - captured

        replication = self.replication_stats()
        durable = replication.get("durable_step") if self._tier is not None else latest
        inflight = self._ckpt.in_flight
        tiers, newest_durable = self._tier_report(local, now)
        return {
            "tiers": tiers, "durable_newest_step": newest_durable[0], "durable_newest_age_s": newest_durable[1],
            "latest_step": latest, "latest_age_s": age(latest),
            "durable_step": durable, "durable_age_s": age(durable),
            "lost_work_if_failure_now_s": age(durable),
            "in_flight_step": None if inflight is None else inflight.step,
            "failed_saves": len(self._ckpt.failed_saves),
            "replication": replication,
            "schedule": self.schedule_info(),
        }

    def _tier_report(self, local: dict[int, Path], now: float) -> tuple[dict[int, dict[str, Any]],
                                                                          tuple[int | None, float | None]]:
        """Per step, the tiers holding a copy; and the newest durable step with its age (seconds)."""
        report: dict[int, dict[str, Any]] = {}
        for step, path in local.items():
            try:
                partial = read_manifest(path).partial
            except CheckpointError:
                continue
            if is_committed(path):
                report[step] = {"local": "partial" if partial else "complete", "durable": None}
        if self._tier is None:
            return report, (None, None)
        durable = self._replicator.durable_listing() if self._replicator is not None else None
        if durable is None:  # not listed yet, the last listing failed, or a rank that does not replicate
            return report, (None, None)
        for step in durable:
            report.setdefault(step, {"local": None, "durable": None})
        for step, entry in report.items():
            entry["durable"] = step in durable
        if not durable:
            return dict(sorted(report.items())), (None, None)
        newest = max(durable)
        return dict(sorted(report.items())), (newest, now - durable[newest].wall_time)

    def replication_stats(self) -> dict[str, Any]:
        """State of the durable replication (see :meth:`Replicator.stats`); {} without a durable tier."""
        return self._replicator.stats() if self._replicator is not None else {}

