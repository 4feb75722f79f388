"""Resuming: restore the newest live checkpoint (not superseded by a rollback, :mod:`torch_ckpt.policy._lineage`)
of any reachable tier, falling back to the next candidate. The coordinator plans (:func:`resume_plan`)
and broadcasts the plan with the manifests it read; :func:`restore_checkpoint` is the entry point.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
)
from torch_ckpt.format._files import Manifest
from torch_ckpt.policy._lineage import Lineage, head_of, new_segment, successor
from torch_ckpt.policy._naming import Naming, StepNaming
from torch_ckpt.restore._restore import load_into
from torch_ckpt.root._layout import quarantine_step_dir, read_manifest, scan_manifests
from torch_ckpt.storage._locations import waiting_for_coordinator
from torch_ckpt.tiers._durable import DurableTier, DurableUnavailableError

__all__ = ["Restored", "ResumePlan", "first_usable", "restore_checkpoint", "resume_plan", "set_aside_superseded"]

log = get_logger(__name__)
mlog = get_logger("torch_ckpt.manager._manager")  # what CheckpointManager.restore did: its own log lines, as before
C = TypeVar("C")
R = TypeVar("R")


@dataclass(frozen=True)
class ResumePlan:
    """What a restore may load, decided on the coordinator and broadcast to every rank.

    Attributes:
        candidates: live ``(step, "local"|"durable")`` pairs, newest first.
        head: the head segment of the history seen.
        complete: every tier could be listed.
        newest: the newest live step of any tier (None: none).
        fork: ``(run, since)`` of the segment the next saves start when the restore is a rollback.
        local: ``{step: (directory, manifest)}`` of the local root as scanned (each manifest read once).
    """

    candidates: list[tuple[int, str]]
    head: Lineage
    complete: bool
    newest: int | None
    fork: tuple[str, float]
    local: dict[int, tuple[Path, Manifest]] = field(default_factory=dict)

    def successor(self, step: int, restored: Lineage) -> Lineage:
        """The segment of the saves after restoring ``step`` (of segment ``restored``) under this plan."""
        newest = self.complete and step == self.newest and restored.run == self.head.run
        return successor(restored, step, newest=newest, fork=self.fork)


def resume_plan(root: Path, tier: DurableTier | None, step: int | None, naming: Naming | None = None,
                memory: Mapping[int, Lineage] | None = None) -> ResumePlan | BaseException:
    """The live checkpoints to restore from, newest first, and the lineage they belong to; run on the coordinator.

    ``step`` None: the newest live one. ``memory``: ``{step: lineage}`` of the memory tier's checkpoints;
    they count for the head and the newest live step (restoring an older step is then a rollback), but
    are not candidates. A step held by both tiers is listed twice, local copy first,
    so a damaged local copy is taken from the durable tier before any older step. Returns an
    exception instead of raising it, so the coordinator can broadcast it to every rank.
    """
    naming = naming or StepNaming()
    try:
        found = scan_manifests(root, naming)
        local = {s: m.lineage for s, (_, m) in found.items()}
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
        memory = memory or {}
        seen = [*local.values(), *durable.values(), *memory.values()]
        head = head_of(seen)
        live_local = [s for s, lin in local.items() if head.holds(s, lin)]
        live_durable = [s for s, lin in durable.items() if head.holds(s, lin)]
        live = sorted({*live_local, *live_durable})
        newest = max([*live, *(s for s, lin in memory.items() if head.holds(s, lin))], default=None)
        for where, steps in (("local", local), ("durable", durable)):
            dropped = sorted(s for s, lin in steps.items() if not head.holds(s, lin))
            if dropped:
                log.info("%s steps %s are superseded (an abandoned timeline, see policy._lineage); not resumed",
                         where, dropped)
        plan = ResumePlan([], head, complete, newest, new_segment(seen),
                          {s: found[s] for s in live_local})
        if step is not None:
            if step in live_local:  # a damaged local copy is then taken from the durable tier
                return replace(plan, candidates=[(step, "local")] + ([(step, "durable")] if step in live_durable
                                                                     else []))
            if step in live_durable:
                return replace(plan, candidates=[(step, "durable")])
            if step in local or step in durable:
                lin = local.get(step, durable.get(step))
                assert lin is not None  # the step is in one of them
                left = head.left_at(lin)
                why = f"its timeline was left at step {left}" if left is not None else \
                    f"its timeline ({lin.describe()}) was abandoned"
                return CheckpointNotFoundError(
                    f"step {step} is superseded: {why} by a rollback, and the run continued from there "
                    f"({head.describe()}). Restore a live step (committed: {live[-10:]}), or pass restore(path=...) "
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
                    f"{live[-10:]}), or pass restore(path=...) to load "
                    "that directory explicitly")
            return CheckpointNotFoundError(f"step {step} is not a committed checkpoint under {where}; committed "
                                           f"steps: {live[-10:]}")
        return replace(plan, candidates=[(s, where) for s in reversed(live)
                                         for where, held in (("local", live_local), ("durable", live_durable))
                                         if s in held])
    except CheckpointError as exc:
        return exc


def set_aside_superseded(path: Path) -> None:
    """Before a live durable copy is downloaded to ``path``: move a committed local checkpoint there
    (superseded, or the plan would have chosen it) aside as ``.superseded_<name>.<time>``; a damaged one
    is left for the download to replace.

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


@dataclass(frozen=True)
class Restored:
    """What :func:`restore_checkpoint` restored: the step, and the segment of the saves that follow
    (None when this rank does not act on the root)."""

    step: int
    lineage: Lineage | None


def restore_checkpoint(state: Any, *, root: Path, naming: Naming, tier: DurableTier | None, ctx: DistContext,
                       step: int | None, path: str | os.PathLike | Sequence[str | os.PathLike] | None,
                       allow_cast: bool, verify: bool, on_world_size_change: str, read_only: bool,
                       acts_on_root: bool, memory: Mapping[int, Lineage] | None = None) -> Restored | None:
    """Restore ``state`` from the newest usable checkpoint (or ``step``, or ``path``), falling back as
    :meth:`torch_ckpt.CheckpointManager.restore` documents; collective. None: nothing to restore.
    ``memory``: the memory tier's ``{step: lineage}`` (see :func:`resume_plan`).

    Raises:
        See :meth:`torch_ckpt.CheckpointManager.restore`.
    """
    common: dict[str, Any] = dict(verify=verify, on_world_size_change=on_world_size_change, allow_cast=allow_cast)
    if path is not None:
        return _restore_paths(state, root, naming, ctx, path, step, acts_on_root, common, memory or {})
    if root.exists() and not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint root {root} is not a directory")
    resume = waiting_for_coordinator(
        ctx, tier, "listing the checkpoints of the local root and the durable tier",
        lambda: ctx.broadcast(resume_plan(root, tier, step, naming, memory) if ctx.is_coordinator else None,
                              what="restore plan")) if ctx.enabled else resume_plan(root, tier, step, naming, memory)
    if isinstance(resume, BaseException):
        raise resume
    plan = resume.candidates
    if not plan:
        plain = [p.parent for p in (root / ".metadata", *root.glob("*/.metadata"))
                 if p.is_file() and not (p.parent / "manifest.json").exists()]
        if plain:  # written by plain dcp.save: never start from scratch beside it unnoticed
            into = "ROOT" if plain[0] == root else str(root)  # the folder itself: a separate run root
            raise CheckpointNotFoundError(
                f"{root} holds no torch-ckpt checkpoint but a plain DCP checkpoint {plain[0]}; adopt it with "
                f"`torch-ckpt import {plain[0]} {into} --step N`, or remove it to start from scratch")
        mlog.info("no committed checkpoint under %s%s; starting from scratch", root,
                 f" (the durable tier {tier.url} answered: no committed step)" if tier is not None else "")
        return None

    def attempt(candidate: tuple[int, str]) -> tuple[int, Path, Manifest, float]:
        cand, where = candidate
        if where == "local":
            local, manifest = resume.local[cand]
        else:
            assert tier is not None  # durable candidates come from the tier
            local = _download(root, naming, tier, ctx, cand, read_only)
            manifest = read_manifest(local)
        t0 = time.monotonic()
        load_into(state, local, manifest, ctx, **common)
        return cand, local, manifest, t0

    def fall_back(failed: tuple[int, str], nxt: tuple[int, str], exc: BaseException) -> None:
        if nxt[0] == failed[0]:
            assert tier is not None  # the next candidate is the same step's durable copy
            mlog.warning("the local copy of step %d is not usable (%s); taking step %d from the durable "
                         "tier %s", failed[0], exc, failed[0], tier.describe(failed[0]))
        else:
            mlog.warning("step %d is not usable (%s); falling back to step %d (%s copy)", failed[0], exc,
                         nxt[0], nxt[1])

    cand, local, manifest, t0 = first_usable(plan, attempt, fall_back, durable=lambda c: c[1] == "durable")
    mlog.info("[rank %d] restored step %d from %s in %.3f s", ctx.rank, cand, local, time.monotonic() - t0)
    return Restored(cand, resume.successor(cand, manifest.lineage) if acts_on_root else None)


def first_usable(candidates: Sequence[C], try_one: Callable[[C], R],
                 fall_back: Callable[[C, C, BaseException], None], *,
                 errors: tuple[type[BaseException], ...] = (CheckpointCorruptError, DurableUnavailableError),
                 durable: Callable[[C], bool] | None = None) -> R:
    """``try_one`` of the first candidate that does not raise one of ``errors``.

    ``fall_back(failed, next, error)`` logs each move on. After a DurableUnavailableError the
    candidates that need the store (``durable``) are skipped: only local copies can still work.
    When every candidate fails, the last one's error is raised; after more than one, as an error of
    its type whose message gives every candidate's error, newest first (each names its path).
    """
    left = list(candidates)
    failed: list[BaseException] = []
    while True:
        candidate = left.pop(0)
        try:
            return try_one(candidate)
        except errors as exc:
            failed.append(exc)
            if isinstance(exc, DurableUnavailableError) and durable is not None:
                left = [c for c in left if not durable(c)]
            if not left:
                if len(failed) == 1:
                    raise
                raise type(exc)(f"none of the {len(failed)} checkpoints tried could be restored (newest first): "
                                + "; ".join(f"{i}) {e}" for i, e in enumerate(failed, 1))) from exc
            fall_back(candidate, left[0], exc)


def _restore_paths(state: Any, root: Path, naming: Naming, ctx: DistContext, path: Any, step: int | None,
                   acts_on_root: bool, common: dict[str, Any], memory: Mapping[int, Lineage]) -> Restored:
    """``restore(path=...)``: the directories given, newest first, each tried in turn."""
    if step is not None:
        raise ConfigError("restore(): pass either step or path, not both")
    if not isinstance(path, (str, os.PathLike, list, tuple)):
        raise ConfigError(f"restore(path=...) needs a directory or a list of them, got {path!r}")
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths or not all(isinstance(p, (str, os.PathLike)) and str(p) for p in paths):
        raise ConfigError(f"restore(path=...) needs a directory or a non-empty sequence of them, got {path!r}")
    resolved = [Path(p).expanduser() if Path(p).expanduser().is_absolute() else root / p for p in paths]

    def attempt(candidate: Path) -> tuple[Path, Manifest]:
        manifest = read_manifest(candidate)
        load_into(state, candidate, manifest, ctx, **common)
        return candidate, manifest

    candidate, manifest = first_usable(
        resolved, attempt, lambda failed, nxt, exc: mlog.warning(
            "checkpoint %s is not usable (%s); falling back to %s", failed, exc, nxt),
        errors=(CheckpointCorruptError, CheckpointNotFoundError))
    mlog.info("[rank %d] restored step %d from %s", ctx.rank, manifest.step, candidate)
    if not acts_on_root:
        return Restored(manifest.step, None)
    # the saves that follow continue its segment when it is the newest live step of the root (and of the
    # memory tier), else fork
    found = scan_manifests(root, naming)
    seen = [*(m.lineage for _, m in found.values()), manifest.lineage, *memory.values()]
    head = head_of(seen)
    live = [s for s, (_, m) in found.items() if head.holds(s, m.lineage)]
    newer_in_memory = any(s > manifest.step and head.holds(s, lin) for s, lin in memory.items())
    newest = bool(live) and live[-1] == manifest.step and found[live[-1]][0].resolve() == candidate.resolve() \
        and manifest.lineage.run == head.run and not newer_in_memory
    return Restored(manifest.step, successor(manifest.lineage, manifest.step, newest=newest,
                                             fork=new_segment(seen)))


def _download(root: Path, naming: Naming, tier: DurableTier, ctx: DistContext, step: int, read_only: bool) -> Path:
    """Download ``step`` from the durable tier on the coordinator (verified); agreed by all ranks."""
    result: str | BaseException | None = None
    if ctx.is_coordinator:
        try:
            if not read_only:
                set_aside_superseded(root / naming.name(step))
            result = str(tier.fetch(step, root))
            mlog.info("downloaded step %d from %s", step, tier.describe(step))
        except CheckpointError as exc:
            result = exc
        except OSError as exc:  # a local limit or disk error (EFBIG, ENOSPC, EIO): every rank raises it now
            result = CheckpointWriteError(exc.errno, f"cannot download step {step} to {root}: {exc.strerror or exc}")
            result.__cause__ = exc
    result = waiting_for_coordinator(ctx, tier, f"downloading step {step} from {tier.describe(step)}",
                                     lambda: ctx.broadcast(result, what="fetch checkpoint"))
    if isinstance(result, BaseException):
        raise result
    return Path(result)
