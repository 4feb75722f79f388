"""The read side of :class:`~torch_ckpt.CheckpointManager`: listing, removal and restore (with fallback).

A mixin of the manager (it uses the manager's root, naming, tiers and engine); kept apart so each
module has one job: :mod:`torch_ckpt.manager._manager` saves and schedules, this module finds and loads.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
)
from torch_ckpt.policy._lineage import Lineage, head_of, new_segment, successor
from torch_ckpt.restore._resume import resume_plan, set_aside_superseded
from torch_ckpt.restore._resume_nodes import restore_node_local
from torch_ckpt.root._layout import read_manifest, remove_step_dir, scan_committed, scan_manifests
from torch_ckpt.root._temporaries import is_reservation
from torch_ckpt.save._persist import as_write_error
from torch_ckpt.storage._locations import waiting_for_coordinator
from torch_ckpt.tiers._durable import DurableUnavailableError

log = get_logger("torch_ckpt.manager._manager")

__all__ = ["ManagerReadMixin"]


class ManagerReadMixin:
    """Listing, :meth:`remove` and :meth:`restore` of :class:`~torch_ckpt.CheckpointManager`."""

    # -- listing and restoring -------------------------------------------------------------------
    def checkpoints(self) -> dict[int, Path]:
        """Committed checkpoints under the root, ``{step: directory}`` ascending (rank 0's view, agreed).

        Only directories the naming parses and whose manifest names the same step are listed;
        temporaries, hidden and foreign directories never are, nor steps superseded by a rollback
        (:mod:`torch_ckpt.policy._lineage`).
        """
        found = {s: str(p) for s, p in self._live_local().items()} if self._ctx.is_coordinator else None
        return {s: Path(p) for s, p in self._ctx.broadcast(found, what="list checkpoints").items()}

    def _live_local(self) -> dict[int, Path]:
        """This rank's live committed local checkpoints (superseded ones left out), ``{step: directory}``."""
        found = scan_manifests(self.root, self.naming)
        head = head_of(m.lineage for _, m in found.values())
        return {s: p for s, (p, m) in found.items() if head.holds(s, m.lineage)}

    def all_steps(self) -> list[int]:
        """Committed steps in ascending numeric order (rank 0's view, agreed by every rank)."""
        return list(self.checkpoints())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    @property
    def restored_step(self) -> int | None:
        """The step of the last successful :meth:`restore` until the next save, else None."""
        return self._restored_step

    def remove(self, target: int | str | os.PathLike) -> None:
        """Delete one committed checkpoint crash-safely (renamed aside, then deleted); rank 0 acts.

        Call on every rank or on rank 0 only (it is not collective); with node-local roots
        (``local_root_shared=False``) call it on every rank: each node's lowest rank removes its
        copy. An in-flight save of that checkpoint is waited for first. A missing target is a no-op.

        Args:
            target: a step (its ``naming`` directory under the root) or a checkpoint directory.

        Raises:
            ConfigError: a read-only manager, or ``target`` exists but is not a torch-ckpt checkpoint
                (never deleted).
            CheckpointWriteError: the directory could not be removed.
        """
        if self.read_only:
            raise ConfigError(f"this CheckpointManager was opened with read_only=True on {self.root}: remove() "
                              "is refused")
        if isinstance(target, int) and not isinstance(target, bool):
            if target < 0:
                raise ConfigError(f"remove(): a step must be an int >= 0, got {target}")
            path = self.root / self.naming.name(target)
        else:
            path = self._explicit_path(target)
        if not self._acts_on_root:
            return
        inflight = self._ckpt.in_flight
        if inflight is not None and not inflight.committed.done():
            self._ckpt.wait()
        if not os.path.lexists(path):
            return
        if is_reservation(path) and os.listdir(path):  # only partials of saves that never committed: ours
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            read_manifest(path)
        except CheckpointNotFoundError:
            raise ConfigError(f"{path} is not a torch-ckpt checkpoint (no manifest.json); not deleting it") from None
        except CheckpointCorruptError:
            pass  # ours but damaged: still ours to delete
        try:
            remove_step_dir(path)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot remove checkpoint {path}: {exc.strerror}") from exc
        log.info("removed checkpoint %s", path)

    def restore(self, state: Any, step: int | None = None, *, allow_cast: bool = False,
                path: str | os.PathLike | Sequence[str | os.PathLike] | None = None) -> int | None:
        """Load a committed checkpoint into ``state`` in place.

        Args:
            state: the live :class:`~torch_ckpt.TrainState`, ``Stateful`` or dict to load into.
            step: the step to load; None loads the newest committed checkpoint.
            allow_cast: cast tensors whose dtype differs from the live tensor's (each cast key is
                logged once); by default a dtype difference is a ``StateMismatchError``.
            path: load this checkpoint directory instead (absolute or relative to the root; it may
                lie outside the root); a damaged one raises. A sequence of directories, newest
                first, is tried in order: one that fails verification is skipped with a warning
                naming it (the last one's error is raised). Not together with ``step``.

        With a durable tier, the newest checkpoint complete in either tier is used; one that exists
        only in the durable tier is downloaded (verified) first. A local copy that fails
        verification is replaced by the durable copy of the same step when the durable tier has
        one (a warning names both). When ``step`` is None, a step no tier can provide intact is
        skipped with a warning in favour of the next older one; when the durable store cannot be
        reached (or does not answer for ``durable_timeout_seconds``), the newest intact local step
        is restored with a warning. Every call to the store gives up after
        ``durable_timeout_seconds`` without an answer.

        Memory: when this manager has saved in this process (a save within ``staging_budget_bytes``:
        one over it leaves no arena), large host tensors (256 KiB or more,
        alone in their bytes) are read in place, each first copied into the idle staging arena and
        copied back if the restore fails; otherwise, and for the other tensors, the restore reads
        into new host buffers of about the state's size and exchanges or copies them in at the end.

        When the restored step is older than the newest committed one (an explicit older ``step``, or
        a fallback), the newer checkpoints are moved aside at the next :meth:`save` (kept as hidden
        ``.superseded_step_N.<time>`` directories), so training can continue from the restored step.
        A ``StatefulDataLoader`` takes its restored position at the next ``iter(loader)``: a loop
        already iterating it goes on from its old position (a warning says so), so leave that loop
        and start a new one.

        Returns:
            The restored step (the manifest's), or None when neither ``step`` nor ``path`` is given
            and no tier holds a checkpoint.

        Raises:
            CheckpointNotFoundError: ``step`` was given but is not a committed checkpoint, or the
                root is not a directory.
            DurableUnavailableError: the durable tier is unreachable, does not answer, or its bucket
                does not exist, and no intact local checkpoint can stand in: nothing is restored, and
                the run does not silently start from scratch (catch it to start fresh deliberately);
                also for an explicit ``step`` absent locally while the store cannot be listed.
            StateMismatchError: keys, shapes or dtypes differ (missing and unexpected keys are listed).
                A failed restore leaves ``state`` as it was.
            CheckpointCorruptError: a file fails its size or checksum check.
        """
        if path is not None:
            return self._restore_paths(state, path, step, allow_cast)
        self._ckpt.wait()
        if self._roots.node_local:
            resumed = restore_node_local(
                self._roots, self._ctx, self._tier, self.root, self.naming, step=step, read_only=self.read_only,
                load=lambda local: self._ckpt.load(local, state, verify=self.verify_on_load, allow_cast=allow_cast,
                                                   on_world_size_change=self.on_world_size_change))
            if resumed is None:
                return None
            self.restore_source, self._restored_step, self._newest_known = resumed.source, resumed.step, None
            if resumed.lineage is not None:
                self._lineage = resumed.lineage
            return resumed.step
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint root {self.root} is not a directory")
        resume = waiting_for_coordinator(
            self._ctx, self._tier, "listing the checkpoints of the local root and the durable tier",
            lambda: self._ctx.broadcast(resume_plan(self.root, self._tier, step, self.naming)
                                        if self._ctx.is_coordinator else None, what="restore plan"))
        if isinstance(resume, BaseException):
            raise resume
        plan = resume.candidates
        if not plan:
            log.info("no committed checkpoint under %s%s; starting from scratch", self.root,
                     f" (the durable tier {self._tier.url} answered: no committed step)"
                     if self._tier is not None else "")
            return None
        outage: DurableUnavailableError | None = None
        for i, (cand, where) in enumerate(plan):
            if where == "durable" and outage is not None:
                continue  # the store is down: only local copies are left to try
            try:
                local = self._fetch(cand, where)
                t0 = time.monotonic()
                self._ckpt.load(local, state, verify=self.verify_on_load,
                                on_world_size_change=self.on_world_size_change, allow_cast=allow_cast)
            except (CheckpointCorruptError, DurableUnavailableError) as exc:
                if isinstance(exc, DurableUnavailableError):
                    outage = exc
                rest = [c for c in plan[i + 1:] if outage is None or c[1] == "local"]
                if not rest:
                    raise
                if rest[0][0] == cand:
                    log.warning("the local copy of step %d is not usable (%s); taking step %d from the durable "
                                "tier %s", cand, exc, cand, self._tier.describe(cand))
                else:
                    log.warning("step %d is not usable (%s); falling back to step %d (%s copy)", cand, exc,
                                rest[0][0], rest[0][1])
                continue
            log.info("[rank %d] restored step %d from %s in %.3f s", self._ctx.rank, cand, local,
                     time.monotonic() - t0)
            self._restored_step = cand
            self._newest_known = None
            if self._acts_on_root:
                self._lineage = resume.successor(cand, read_manifest(local).lineage)
            return cand
        return None  # unreachable: the loop returns or raises

    def _restore_paths(self, state: Any, path: Any, step: int | None, allow_cast: bool) -> int:
        if step is not None:
            raise ConfigError("restore(): pass either step or path, not both")
        if not isinstance(path, (str, os.PathLike, list, tuple)):
            raise ConfigError(f"restore(path=...) needs a directory or a list of them, got {path!r}")
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not paths or not all(isinstance(p, (str, os.PathLike)) and str(p) for p in paths):
            raise ConfigError(f"restore(path=...) needs a directory or a non-empty sequence of them, got {path!r}")
        self._ckpt.wait()
        resolved = [Path(p).expanduser() if Path(p).expanduser().is_absolute() else self.root / p for p in paths]
        for i, candidate in enumerate(resolved):
            try:
                manifest = read_manifest(candidate)
                self._ckpt.load(candidate, state, verify=self.verify_on_load,
                                on_world_size_change=self.on_world_size_change, allow_cast=allow_cast)
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                if i == len(resolved) - 1:
                    raise
                log.warning("checkpoint %s is not usable (%s); falling back to %s", candidate, exc, resolved[i + 1])
                continue
            log.info("[rank %d] restored step %d from %s", self._ctx.rank, manifest.step, candidate)
            self._restored_step = manifest.step
            self._newest_known = None
            if self._acts_on_root:
                self._lineage = self._path_successor(candidate, manifest)
            return manifest.step
        raise AssertionError("unreachable")  # the loop returns or raises

    def _path_successor(self, path: Path, manifest: Any) -> Lineage:
        """The segment of the saves after restoring the checkpoint directory ``path``: its own when it
        is the newest live step of the local root, else a new one forked from it."""
        found = scan_manifests(self.root, self.naming)
        seen = [*(m.lineage for _, m in found.values()), manifest.lineage]
        head = head_of(seen)
        live = [s for s, (_, m) in found.items() if head.holds(s, m.lineage)]
        newest = bool(live) and live[-1] == manifest.step and found[live[-1]][0].resolve() == path.resolve() \
            and manifest.lineage.run == head.run
        return successor(manifest.lineage, manifest.step, newest=newest, fork=new_segment(seen))

    def _fetch(self, step: int, where: str) -> Path:
        """Make ``step`` available locally (downloading it on the coordinator when needed); agreed by all ranks."""
        result: str | BaseException | None = None
        if self._ctx.is_coordinator:
            try:
                if where == "durable" and not self.read_only:
                    set_aside_superseded(self.root / self.naming.name(step))
                result = str(self._tier.fetch(step, self.root) if where == "durable"
                             else scan_committed(self.root, self.naming)[step])
                if where == "durable":
                    log.info("downloaded step %d from %s", step, self._tier.describe(step))
            except CheckpointError as exc:
                result = exc
            except OSError as exc:  # a local limit or disk error (EFBIG, ENOSPC, EIO): every rank raises it now
                result = as_write_error(exc, self.root / self.naming.name(step))
                result.__cause__ = exc
        doing = f"downloading step {step} from {self._tier.describe(step)}" if where == "durable" else \
            f"finding step {step} under {self.root}"
        result = waiting_for_coordinator(self._ctx, self._tier, doing,
                                         lambda: self._ctx.broadcast(result, what="fetch checkpoint"))
        if isinstance(result, BaseException):
            raise result
        return Path(result)

