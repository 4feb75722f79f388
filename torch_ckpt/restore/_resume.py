"""Choosing what to resume from: the newest live checkpoint complete in any reachable tier.

Live means not superseded by a rollback (:mod:`torch_ckpt.policy._lineage`): the lineage records of every
tier's manifests decide it together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from torch_ckpt.policy._lineage import Lineage, head_of, new_segment, successor
from torch_ckpt.policy._naming import Naming, StepNaming
from torch_ckpt.root._layout import quarantine_step_dir, read_manifest, scan_manifests
from torch_ckpt.tiers._durable import DurableTier, DurableUnavailableError

__all__ = ["ResumePlan", "restore_candidates", "resume_plan", "set_aside_superseded"]

log = get_logger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """What a restore may load, decided on the coordinator and broadcast to every rank.

    Attributes:
        candidates: live ``(step, "local"|"durable")`` pairs, newest first (superseded steps of
            abandoned timelines are left out, see :mod:`torch_ckpt.policy._lineage`).
        head: the head segment of the history seen.
        complete: every tier could be listed.
        newest: the newest live step of any tier (None: none).
        fork: ``(run, since)`` of the segment the next saves start when the restore is a rollback.
    """

    candidates: list[tuple[int, str]]
    head: Lineage
    complete: bool
    newest: int | None
    fork: tuple[str, float]

    def successor(self, step: int, restored: Lineage) -> Lineage:
        """The segment of the saves after restoring ``step`` (of segment ``restored``) under this plan."""
        newest = self.complete and step == self.newest and restored.run == self.head.run
        return successor(restored, step, newest=newest, fork=self.fork)


def restore_candidates(root: Path, tier: DurableTier | None, step: int | None,
                       naming: Naming | None = None) -> list[tuple[int, str]] | BaseException:
    """Candidate ``(step, "local"|"durable")`` pairs to restore, newest first; run on the coordinator.

    A step held by both tiers is listed twice, local copy first: when the local copy fails
    verification, the same step is taken from the durable tier before any older step. The durable
    tier is listed with its timeout (:meth:`DurableTier.listed`).

    Returns an exception instead of raising it, so the coordinator can broadcast it to every rank.
    See :func:`resume_plan` (these are its ``candidates``).
    """
    plan = resume_plan(root, tier, step, naming)
    return plan if isinstance(plan, BaseException) else plan.candidates


def resume_plan(root: Path, tier: DurableTier | None, step: int | None,
                naming: Naming | None = None) -> ResumePlan | BaseException:
    """The live checkpoints to restore from, newest first, and the lineage they belong to; run on the coordinator.

    Args:
        root: the local root.
        tier: the durable tier, if any.
        step: the step asked for; None: the newest live one.
        naming: the step naming of both tiers.

    Returns an exception instead of raising it, so the coordinator can broadcast it to every rank.
    """
    naming = naming or StepNaming()
    try:
        local = {s: m.lineage for s, (_, m) in scan_manifests(root, naming).items()}
        durable: dict[int, Lineage] = {}
        complete = True
        outage: DurableUnavailableError | None = None
        if tier is not None:
            try:
                durable = {s: m.lineage for s, m in tier.listed().items()}
            except DurableUnavailableError as exc:
                complete = False
                if not local:
                    return DurableUnavailableError(
                        f"{exc}. No local checkpoint under {root} either: refusing to start from scratch "
                        "while the durable tier cannot be read. Retry when the store is reachable, or remove "
                        "durable_url (or catch DurableUnavailableError) to start from scratch deliberately.")
                outage = exc
                if step is None:
                    log.warning("%s; resuming from the local tier only", exc)
        seen = [*local.values(), *durable.values()]
        head = head_of(seen)
        live_local = [s for s, lin in local.items() if head.holds(s, lin)]
        live_durable = [s for s, lin in durable.items() if head.holds(s, lin)]
        for where, steps in (("local", local), ("durable", durable)):
            dropped = sorted(s for s, lin in steps.items() if not head.holds(s, lin))
            if dropped:
                log.info("%s steps %s are superseded (an abandoned timeline, see policy._lineage); not resumed",
                         where, dropped)
        plan = ResumePlan([], head, complete, max([*live_local, *live_durable], default=None), new_segment(seen))
        if step is not None:
            if step in live_local:  # a damaged local copy is then taken from the durable tier
                return replace(plan, candidates=[(step, "local")] + ([(step, "durable")] if step in live_durable
                                                                     else []))
            if step in live_durable:
                return replace(plan, candidates=[(step, "durable")])
            if step in local or step in durable:
                lin = local.get(step, durable.get(step))
                left, live = head.left_at(lin), sorted(set(live_local) | set(live_durable))[-10:]
                why = f"its timeline was left at step {left}" if left is not None else \
                    f"its timeline ({lin.describe()}) was abandoned"
                return CheckpointNotFoundError(
                    f"step {step} is superseded: {why} by a rollback, and the run continued from there "
                    f"({head.describe()}). Restore a live step (committed: {live}), or pass restore(path=...) "
                    "to load that checkpoint directory explicitly")
            if outage is not None:  # it may be there: say why it cannot be known
                return DurableUnavailableError(f"step {step} is not under {root}, and {outage}")
            candidate = root / naming.name(step)
            if candidate.is_dir():  # present but not listed: say what is wrong with it
                manifest = read_manifest(candidate)
                return CheckpointCorruptError(f"{candidate}: manifest says step {manifest.step}, not {step}")
            where = f"{root}" + (f" or {tier.url}" if tier is not None else "")
            aside = sorted(p.name for p in root.glob(f".superseded_{naming.name(step)}.*")) if root.is_dir() else []
            if aside:  # moved aside by a rollback's new timeline: say so rather than "not committed"
                return CheckpointNotFoundError(
                    f"step {step} is superseded: a rollback started a new timeline ({head.describe()}) and its "
                    f"copy was moved aside as {root / aside[-1]}. Restore a live step (committed: "
                    f"{sorted(set(live_local) | set(live_durable))[-10:]}), or pass restore(path=...) to load "
                    "that directory explicitly")
            return CheckpointNotFoundError(f"step {step} is not a committed checkpoint under {where}; committed "
                                           f"steps: {sorted(set(live_local) | set(live_durable))[-10:]}")
        # a step held by both tiers is listed twice, local copy first (a damaged local copy heals from durable)
        return replace(plan, candidates=[(s, where) for s in sorted(set(live_local) | set(live_durable), reverse=True)
                                         for where in ("local", "durable")
                                         if s in (live_local if where == "local" else live_durable)])
    except CheckpointError as exc:
        return exc


def set_aside_superseded(path: Path) -> None:
    """Before the live durable copy of a step is downloaded to ``path``: move a committed local
    checkpoint there (superseded, or the plan would have chosen it) aside as
    ``.superseded_<name>.<time>`` instead of letting the download replace it.

    A damaged directory there is left for the download to replace, as before.

    Raises:
        CheckpointWriteError: it could not be moved.
    """
    if not path.is_dir() or path.is_symlink():
        return
    try:
        read_manifest(path)
    except CheckpointError:
        return
    quarantine_step_dir(path, reason="superseded")
