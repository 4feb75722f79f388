"""``CheckpointManager``: one run root of step-numbered checkpoints, with retention, scheduling and resume.

The manager orchestrates objects built once: :class:`RunLineage` (where the saves stand in the run's
history), :class:`SaveGuard` (rank 0's checks before a save), :class:`CommitFollowUp` (callbacks,
replication, retention), :class:`HealthReport` and, with ``memory_root``, the memory tier
(:class:`~torch_ckpt.manager._memory.MemoryTier`). A save is one frozen
:class:`~torch_ckpt.save._persist.SaveRequest` submitted to :class:`~torch_ckpt.save._checkpointer.AsyncCheckpointer`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from torch_ckpt._logging import get_logger
from torch_ckpt.config import DEFAULT, ON_EXISTING_NEWER, CheckpointConfig, DefaultType
from torch_ckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, ConfigError
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.manager._memory import MemoryTier, is_memory_save, memory_health
from torch_ckpt.policy._lineage import BASE, Lineage, head_of
from torch_ckpt.policy._naming import Naming, StepNaming, check_step
from torch_ckpt.policy._preemption import PreemptionFlag
from torch_ckpt.policy._retention import RetentionPolicy, apply_retention
from torch_ckpt.policy._schedule import Cadence
from torch_ckpt.restore._resume import restore_checkpoint
from torch_ckpt.restore._resume_nodes import restore_node_local
from torch_ckpt.root._layout import (
    PARTIAL_PREFIX,
    SharedRoot,
    check_root,
    clean_stale_temporaries,
    is_committed,
    is_reservation,
    is_temporary_name,
    quarantine_step_dir,
    read_manifest,
    remove_step_dir,
    retire_step_dir,
    scan_committed,
    scan_manifests,
    update_manifest_tiers,
)
from torch_ckpt.root._lock import RootLock
from torch_ckpt.root._nodes import NodeLayout, choose_layout
from torch_ckpt.save._checkpointer import AsyncCheckpointer, close_on_exit
from torch_ckpt.save._persist import SaveRequest, check_extra_name
from torch_ckpt.save._persist_nodes import persist_node_local
from torch_ckpt.state._protocol import StateToRestore, StateToSave
from torch_ckpt.tiers._durable import DurableTier
from torch_ckpt.tiers._replicator import Replicator

__all__ = ["CheckpointManager", "ON_EXISTING_NEWER", "RunLineage", "SaveGuard", "CommitFollowUp", "HealthReport"]

log = get_logger(__name__)

_SETTINGS = frozenset(CheckpointConfig.field_names())


def _reserved_name(name: str) -> bool:
    """A name of the manager's own files (other hidden names, e.g. Lightning's ``.lr_find_<uuid>.ckpt``, are not)."""
    return is_temporary_name(name) or name.startswith(
        (PARTIAL_PREFIX, ".torch-ckpt.", ".trash_", ".superseded_", ".corrupt_", ".lock")) or \
        bool(re.match(r"^\..+\.replaced\.[0-9a-f]{1,64}$", name))


def _intact(path: Path, refusal: str) -> bool:
    """True: ``path`` holds an intact manifest; False: ours but damaged (any other CheckpointError).

    Raises:
        ConfigError: no manifest: not a torch-ckpt checkpoint (``refusal`` says what is not done to it).
    """
    try:
        read_manifest(path)
    except CheckpointNotFoundError:
        raise ConfigError(f"{path} exists but is not a torch-ckpt checkpoint (no manifest.json): {refusal}") from None
    except CheckpointError:
        return False
    return True


def _list_steps(steps: list[int]) -> str:
    """``[500, 600, 700]``, or the first and last few of a long list."""
    if len(steps) <= 8:
        return str(steps)
    return f"[{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}]"


class RunLineage:
    """Where this manager's saves stand in the run's history; its one owner (``acts_on_root``: this rank
    creates, commits and prunes the root)."""

    def __init__(self, root: Path, naming: Naming, acts_on_root: bool) -> None:
        self.root, self.naming, self.acts_on_root = root, naming, acts_on_root
        self.restored_step: int | None = None  # the last restore's step, until the next save
        self.newest_known: int | None = None  # newest step known to be under the root (None: scan)
        self.captured_at: dict[int, float] = {}  # step -> Unix time its state was captured (last 256)
        self._lineage: Lineage | None = None  # segment of the next saves; None: not known yet
        self._abandoned_pending = False  # a restore happened: the abandoned steps are not set aside yet

    def head(self) -> Lineage:
        """The segment of the next saves: the one a restore chose, else the head of the local root's history."""
        if self._lineage is None:
            self._lineage = head_of(m.lineage for _, m in scan_manifests(self.root, self.naming).values()) \
                if self.acts_on_root else BASE
        return self._lineage

    @property
    def known(self) -> Lineage | None:
        """The segment of the next saves when decided (None: not yet; the manifest then records the base)."""
        return self._lineage

    def live(self, head: Lineage | None = None) -> dict[int, Path]:
        """Committed local steps of the history whose head is ``head`` (default :meth:`head`), ``{step: dir}``."""
        head = self.head() if head is None else head
        return {s: p for s, (p, m) in scan_manifests(self.root, self.naming).items() if head.holds(s, m.lineage)}

    def begin_save(self, step: int) -> int | None:
        """A save of ``step`` captures its state now; returns (and forgets) the restored step."""
        self.captured_at[step] = time.time()
        while len(self.captured_at) > 256:
            self.captured_at.pop(next(iter(self.captured_at)))
        restored, self.restored_step = self.restored_step, None
        return restored

    def refused(self, restored: int | None) -> None:
        """The save :meth:`begin_save` began was refused: the restored step stands again."""
        self.restored_step = restored

    def restored(self, step: int | None, lineage: Lineage | None) -> None:
        """A restore loaded ``step`` (None: it found only steps no tier can complete, and starts from scratch);
        the next saves belong to ``lineage`` (on the rank acting on the root)."""
        self.restored_step, self.newest_known, self._abandoned_pending = step, None, True
        if lineage is not None:
            self._lineage = lineage

    def set_aside_abandoned(self) -> None:
        """After a rollback, before the new timeline's first save of any tier commits: move the local steps the
        head does not hold aside (``.superseded_*``), so no restart resumes them, whatever tier it finds."""
        if not self._abandoned_pending:  # once per restore, not at every memory save until the next disk save
            return
        head = self.head()
        for s, (s_path, s_manifest) in scan_manifests(self.root, self.naming).items():
            if not head.holds(s, s_manifest.lineage):
                quarantine_step_dir(s_path, reason="superseded")
        self._abandoned_pending = False


class SaveGuard:
    """Rank 0's checks before a save is agreed: step, ``path``, ``extra_dir``, newer steps of another run."""

    def __init__(self, root: Path, naming: Naming, config: CheckpointConfig, incarnation: str,
                 runs: RunLineage) -> None:
        self.root, self.naming, self.config, self.incarnation, self.runs = root, naming, config, incarnation, runs

    def explicit_path(self, path: str | os.PathLike) -> Path:
        """``path`` as an absolute checkpoint directory (relative ones under the root); ConfigError if unusable."""
        if not isinstance(path, (str, os.PathLike)) or str(path) == "":
            raise ConfigError(f"path must be a non-empty directory path, got {path!r}")
        final = Path(path).expanduser()
        final = (final if final.is_absolute() else self.root / final).absolute()
        if final == self.root or final in self.root.parents:
            raise ConfigError(f"path {final} is the checkpoint root or contains it; name a directory inside or "
                              "beside the root")
        if _reserved_name(final.name):
            raise ConfigError(f"path {final}: this name has the form of torch-ckpt's own temporary or set-aside "
                              "directories (.torch-ckpt.*, .NAME.tmp.<id>, .trash_*, .superseded_*, .corrupt_*, "
                              ".NAME.replaced.<id>, .lock); choose another name")
        return final

    def target(self, step: Any, path: str | os.PathLike | None) -> Path:
        """The directory a save of ``step`` writes: ``path`` (checked), else the naming's under the root."""
        if path is None:
            valid = not isinstance(step, bool) and isinstance(step, int) and step >= 0
            return self.root / (self.naming.name(step) if valid else ".invalid_step")
        final = self.explicit_path(path)
        named = self.naming.step_of(final.name) if final.parent == self.root else None
        if named is not None and named != step:
            raise ConfigError(f"path {final} is the directory of step {named} under this root's naming; saving step "
                              f"{step} there would hide it from listing and resume. Save step {named} there, or use "
                              "a name the naming does not parse")
        return final

    def check(self, step: Any, final: Path, *, explicit: bool, read_only: bool) -> bool:
        """Every rank: validate ``step``; rank 0 also checks ``final``. True (rank 0): the commit replaces one.
        After a rollback the first save moves the abandoned steps aside (and a damaged ``step`` directory)."""
        if read_only:
            raise ConfigError(f"this CheckpointManager was opened with read_only=True on {self.root}: it restores "
                              "and lists checkpoints but does not save; open a writable root without read_only "
                              "to save")
        check_step(step)
        if self.config.explicit_paths_only and not explicit:
            raise ConfigError(f"this CheckpointManager was opened with explicit_paths_only=True on {self.root}: "
                              "every save names its directory (save(step, state, path=...))")
        restored = self.runs.begin_save(step)  # the state is captured right after this call
        if not self.runs.acts_on_root:
            return False
        try:
            if not self.config.explicit_paths_only:
                self.runs.set_aside_abandoned()  # after a rollback: the steps of the abandoned timeline go aside
            if explicit:
                return self._check_explicit(final)
            if os.path.lexists(final) and not is_reservation(final):  # an empty directory is free to use
                if _intact(final, "it is never written into or deleted; move it away or use another directory"):
                    raise ConfigError(f"step {step} is already committed at {final}; save under a new step")
                quarantine_step_dir(final, reason="corrupt")
            self._check_no_newer_steps(step, restored)
            return False
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointWriteError(exc.errno, f"cannot prepare step {step} under {self.root}: {exc.strerror} "
                                       f"({exc.filename})") from exc

    def stage_extra(self, extra_dir: str | os.PathLike, final: Path) -> Path:
        """Rank 0: move ``extra_dir`` to a hidden sibling of ``final`` now (the commit moves it in), so the
        caller may refill it for the next save at once."""
        src = Path(extra_dir).expanduser()
        src = (src if src.is_absolute() else self.root / src).absolute()
        if src.is_symlink() or not src.is_dir():
            raise ConfigError(f"extra_dir {src} must be an existing directory (not a symlink) holding the files "
                              "to commit with the checkpoint")
        for guarded in (self.root, final):
            if src == guarded or src in guarded.parents:
                raise ConfigError(f"extra_dir {src} is or contains {guarded}: name a directory of its own that holds "
                                  "only the framework's files")
        if final in src.parents:
            raise ConfigError(f"extra_dir {src} lies inside the checkpoint {final}; use a separate directory")
        for entry in src.iterdir():
            check_extra_name(entry)
        staged = final.with_name(f".{final.name}.extra.tmp.{self.incarnation}")
        try:
            if staged.exists():
                shutil.rmtree(staged)
            shutil.move(str(src), str(staged))  # a rename on one file system
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot move extra_dir {src} to {staged}: {exc.strerror or exc}") \
                from exc
        return staged

    def _check_explicit(self, final: Path) -> bool:
        """Rank 0: may ``final`` be written? True when it holds a committed checkpoint to replace."""
        if not os.path.lexists(final):
            return False
        if final.is_symlink() or not final.is_dir():
            raise ConfigError(f"{final} exists and is not a directory written by torch-ckpt (a file or symlink): "
                              "it is never overwritten; remove it or save elsewhere")
        if is_reservation(final):  # an empty folder (or a save that died before committing): written into
            return False
        if _intact(final, "it is never written into or deleted; move it away or save elsewhere"):
            return True
        quarantine_step_dir(final, reason="corrupt")  # kept aside, never listed
        return False

    def _check_no_newer_steps(self, step: int, restored: int | None) -> None:
        """Rank 0: refuse (or move aside) committed steps newer than ``step`` that this run did not write."""
        runs = self.runs
        if runs.newest_known is not None and step > runs.newest_known:
            runs.newest_known = step
            return
        committed = runs.live()
        newer = [s for s in committed if s > step]
        if newer and self.config.on_existing_newer == "supersede":
            log.warning("step %d: moving the newer committed steps %s of an earlier run aside "
                        "(on_existing_newer='supersede')", step, _list_steps(newer))
            for s in newer:
                quarantine_step_dir(committed[s], reason="superseded")
        elif newer and restored is not None:
            raise ConfigError(
                f"this manager restored step {restored} and is now asked to save step {step}, below it; {self.root} "
                f"holds committed step(s) {_list_steps(newer)} newer than step {step}, so 'latest' would stay at step "
                f"{newer[-1]} and retention would delete this save first. Save a step above {restored} (the restored "
                f"state's step counts on from {restored}), or pass CheckpointManager(..., "
                "on_existing_newer='supersede') to move the newer steps aside (kept hidden, never listed)")
        elif newer:
            raise ConfigError(
                f"{self.root} already holds committed step(s) {_list_steps(newer)} newer than step {step}, which this "
                f"manager did not restore (an earlier run's?). Saving step {step} there would leave 'latest' at step "
                f"{newer[-1]} (a restart would resume it) and retention would delete this run's checkpoints first. "
                f"Call restore() to continue from step {newer[-1]}, save steps above {newer[-1]}, use a new directory, "
                "or pass CheckpointManager(..., on_existing_newer='supersede') to move the newer steps aside (kept as "
                "hidden .superseded_step_N.* directories, never listed)")
        runs.newest_known = step  # every other committed step is older now

class CommitFollowUp:
    """What follows a commit on the root (callbacks on rank 0, durable replication, local retention), in the writer
    thread of the rank acting on the root; failures are logged and never change the save's outcome."""

    def __init__(self, root: Path, naming: Naming, config: CheckpointConfig, runs: RunLineage,
                 is_coordinator: bool) -> None:
        self.root, self.naming, self.config, self.runs = root, naming, config, runs
        self.is_coordinator = is_coordinator
        self.retention = config.build_retention()
        self.callbacks: list[Callable[[int, Path], None]] = []
        self.replicator: Replicator | None = None

    def start_replicator(self, tier: DurableTier, roots: SharedRoot | NodeLayout) -> Replicator:
        """Build the durable tier's replicator (its thread references nothing of the manager)."""
        cfg = self.config
        # the config's durations are floats after its __post_init__
        every, wait_seconds = cfg.durable_keep_every_n_steps, cast(float, cfg.durable_flush_timeout_seconds)
        retention = cfg.build_durable_retention()
        history = None if every is None else (lambda step: step % every == 0)  # never coalesced away
        url = tier.url

        def record(step: int, local_dir: Path) -> None:  # the durable copy, in the local manifest
            try:
                update_manifest_tiers(local_dir, {"durable": {"url": url, "committed_at": time.time()}})
            except OSError as exc:  # the local copy may have been pruned meanwhile
                log.debug("could not record the durable copy of step %d in %s: %s", step, local_dir, exc)

        # the layout's upload (node-local roots: every node uploads its own shards); the committing rank runs
        # durable retention and cleanup
        commit, upload = roots.commits, roots.uploader(tier, wait_seconds)
        self.replicator = Replicator(tier, retention=retention if commit else None, upload=upload,
                                     on_durable=record if commit else None,
                                     abandoned_after_seconds=24 * 3600.0 if commit else None, never_skip=history,
                                     arranges=commit, commits=commit, exit_flush_seconds=wait_seconds)
        return self.replicator

    def run(self, step: int, final: Path, replicate: bool = False) -> Callable[[], None] | None:
        """After the commit of ``step``; returns the deletion of the retired checkpoints (or None)."""
        if not self.runs.acts_on_root:
            return None
        for callback in self.callbacks if self.is_coordinator else ():
            try:
                callback(step, final)
            except Exception as exc:  # noqa: BLE001 - committed: a failing callback never fails the save
                log.error("commit callback %r for step %d (%s) failed: %s: %s", callback, step, final,
                          type(exc).__name__, exc)
        if replicate and self.replicator is not None:
            self.replicator.submit(step, final)
        try:
            retired = self.apply_retention()
        except Exception as exc:  # noqa: BLE001
            log.error("retention after committing step %d failed (the checkpoint at %s is committed; older "
                      "checkpoints may remain): %s: %s", step, final, type(exc).__name__, exc)
            return None
        # retired checkpoints are hidden already; their bytes are deleted once `committed` resolved
        return functools.partial(_delete, retired) if retired else None

    def catch_up(self, tier: DurableTier | None, roots: SharedRoot | NodeLayout) -> None:
        """At start, the replication and retention a commit's writer may not have lived to do; failures are
        logged, the start goes on."""
        try:
            committed = scan_committed(self.root, self.naming)
            if self.replicator is not None and not roots.node_local and committed:
                step = max(committed)
                assert tier is not None  # a replicator exists only with a durable tier
                if read_manifest(committed[step]).tiers.get("durable", {}).get("url") != tier.url:
                    log.info("step %d has no durable copy in %s yet: replicating it now", step, tier.url)
                    self.replicator.submit(step, committed[step])
            _delete(self.apply_retention())
        except Exception as exc:  # noqa: BLE001 - the checkpoints stay as they are; the next commit tries again
            log.warning("replication and retention of the checkpoints found at start failed: %s: %s",
                        type(exc).__name__, exc)

    def apply_retention(self) -> list[Path]:
        """Hide (rename) the checkpoints the retention policy retires; returns them, still to delete."""
        if not self.runs.acts_on_root or self.retention is None or self.config.explicit_paths_only:
            return []
        # a superseded step is neither kept nor counted
        committed = self.runs.live(self.runs.known or BASE)
        busy = self.replicator.busy_steps() if self.replicator is not None else set()
        retired: list[Path] = []
        for step in apply_retention(self.retention, list(committed), protected=sorted(busy)):
            try:
                retired.append(retire_step_dir(committed[step]))
                log.info("retention removed step %d (%s)", step, committed[step])
            except OSError as exc:
                log.warning("retention could not remove %s: %s", committed[step], exc)
        return retired


def _delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class HealthReport:
    """:meth:`CheckpointManager.health` and :meth:`~CheckpointManager.replication_stats`."""

    def __init__(self, root: Path, naming: Naming, tier: DurableTier | None, runs: RunLineage,
                 engine: AsyncCheckpointer, after: CommitFollowUp) -> None:
        self.root, self.naming, self.tier, self.runs, self.engine, self.after = root, naming, tier, runs, engine, after

    def health(self, schedule: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`CheckpointManager.health`; ``schedule``: the save policy's last decision."""
        now = time.time()
        local = scan_committed(self.root, self.naming) if self.root.is_dir() else {}
        latest = max(local) if local else None

        def age(step: int | None) -> float | None:
            if step is None:
                return None
            captured = self.runs.captured_at.get(step)
            if captured is None and step in local:
                captured = read_manifest(local[step]).wall_time  # saved by an earlier run: commit time
            return None if captured is None else now - captured

        replication = self.replication_stats()
        durable = replication.get("durable_step") if self.tier is not None else latest
        inflight = self.engine.in_flight
        tiers, newest_durable = self._tier_report(local, now)
        return {
            "tiers": tiers, "durable_newest_step": newest_durable[0], "durable_newest_age_s": newest_durable[1],
            "latest_step": latest, "latest_age_s": age(latest),
            "durable_step": durable, "durable_age_s": age(durable),
            "lost_work_if_failure_now_s": age(durable),
            "in_flight_step": None if inflight is None else inflight.step,
            "failed_saves": len(self.engine.failed_saves),
            "replication": replication,
            "schedule": schedule,
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
        replicator = self.after.replicator
        durable = replicator.durable_listing() if self.tier is not None and replicator is not None else None
        if durable is None:  # no tier, not listed yet, the last listing failed, or a rank that does not replicate
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
        return self.after.replicator.stats() if self.after.replicator is not None else {}


class CheckpointManager:
    """Asynchronous, atomic DCP checkpoints of one run root, with retention and resume.

    Every rank constructs the manager and calls :meth:`save`, :meth:`restore`,
    :meth:`latest_step` and :meth:`all_steps` collectively (same order on every rank).

    Args:
        directory: local run root; created if missing. One manager owns one root.
        config: a :class:`~torch_ckpt.config.CheckpointConfig` holding the settings (default: the
            defaults). Keyword arguments given next to it override its fields.
        **settings: any field of :class:`~torch_ckpt.config.CheckpointConfig` (the keywords below),
            by name, with the same meaning, units and defaults; docs/configuration.md lists
            each with its default and unit.

    Raises:
        ConfigError: invalid arguments (an unknown setting, a bad value, a remote ``directory``, a
            ``durable_url`` inside the root).
        CheckpointWriteError: ``directory`` is a file or cannot be created, or another run holds its lock.
        CheckpointNotFoundError: ``read_only`` and ``directory`` does not exist.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        config: CheckpointConfig | None = None,
        keep_last: int | None | DefaultType = DEFAULT,
        keep_every_n_steps: int | None | DefaultType = DEFAULT,
        retention: RetentionPolicy | None | DefaultType = DEFAULT,
        async_save: bool | DefaultType = DEFAULT,
        persist: str | DefaultType = DEFAULT,
        overlap_staging: bool | DefaultType = DEFAULT,
        writer_niceness: int | DefaultType = DEFAULT,
        staging_budget_bytes: int | str | None | DefaultType = DEFAULT,
        thread_count: int | DefaultType = DEFAULT,
        incremental: bool | DefaultType = DEFAULT,
        verify_on_load: bool | DefaultType = DEFAULT,
        on_world_size_change: str | DefaultType = DEFAULT,
        timeout_seconds: float | str | DefaultType = DEFAULT,
        process_group: Any | DefaultType = DEFAULT,
        save_policy: Any | DefaultType = DEFAULT,
        mtbf_seconds: float | str | None | DefaultType = DEFAULT,
        save_every_n_steps: int | None | DefaultType = DEFAULT,
        save_every_seconds: float | str | None | DefaultType = DEFAULT,
        initial_cost_seconds: float | str | DefaultType = DEFAULT,
        formula: str | DefaultType = DEFAULT,
        min_interval_steps: int | DefaultType = DEFAULT,
        durable_url: str | None | DefaultType = DEFAULT,
        storage_options: dict[str, Any] | None | DefaultType = DEFAULT,
        replicate_every_n_saves: int | DefaultType = DEFAULT,
        durable_keep_last: int | None | DefaultType = DEFAULT,
        durable_keep_every_n_steps: int | None | DefaultType = DEFAULT,
        durable_verify: str | DefaultType = DEFAULT,
        durable_flush_timeout_seconds: float | str | DefaultType = DEFAULT,
        preemption_signals: tuple[str, ...] | DefaultType = DEFAULT,
        preemption_timeout_seconds: float | str | DefaultType = DEFAULT,
        on_write_error: str | DefaultType = DEFAULT,
        on_existing_newer: str | DefaultType = DEFAULT,
        read_only: bool | DefaultType = DEFAULT,
        explicit_paths_only: bool | DefaultType = DEFAULT,
        naming: Naming | None | DefaultType = DEFAULT,
        local_root_shared: bool | None | DefaultType = DEFAULT,
        durable_upload_threads: int | DefaultType = DEFAULT,
        durable_timeout_seconds: float | str | DefaultType = DEFAULT,
        durable_create: bool | DefaultType = DEFAULT,
        memory_root: str | None | DefaultType = DEFAULT,
        memory_every_n_steps: int | None | DefaultType = DEFAULT,
        memory_every_seconds: float | str | None | DefaultType = DEFAULT,
        memory_mtbf_seconds: float | str | None | DefaultType = DEFAULT,
        memory_keep_last: int | DefaultType = DEFAULT,
        memory_replicas: int | DefaultType = DEFAULT,
        memory_partner_stride: int | DefaultType = DEFAULT,
        memory_replication_bytes_per_second: int | str | None | DefaultType = DEFAULT,
    ) -> None:
        settings = {k: v for k, v in locals().items() if k in _SETTINGS and v is not DEFAULT}  # what was passed
        if not isinstance(directory, (str, os.PathLike)) or str(directory) == "":
            raise ConfigError(f"directory must be a non-empty path, got {directory!r}")
        if "://" in str(directory) and not str(directory).startswith("file://"):
            raise ConfigError(f"directory {directory!r} must be a local path; remote URLs go to a durable tier")
        if config is not None and not isinstance(config, CheckpointConfig):
            raise ConfigError(f"config must be a CheckpointConfig, got {type(config).__name__}: {config!r}")
        base = CheckpointConfig() if config is None else config
        cfg = base.replace(**settings) if settings else base
        self.config = cfg
        self.root = root = Path(str(directory).removeprefix("file://")).expanduser().absolute()
        self.naming = naming = StepNaming() if cfg.naming is None else cfg.naming
        self.verify_on_load = cfg.verify_on_load
        self.on_world_size_change = cfg.on_world_size_change
        self.on_existing_newer = cfg.on_existing_newer
        self.read_only = cfg.read_only
        save_policy = cfg.build_save_policy()
        self._cadence = Cadence(save_policy) if save_policy is not None else None
        self._preemption_timeout = cast(float, cfg.preemption_timeout_seconds)
        self._tier = DurableTier(cfg.durable_url, storage_options=cfg.storage_options, verify=cfg.durable_verify,
                                 naming=naming, upload_threads=cfg.durable_upload_threads,
                                 timeout_seconds=cast(float, cfg.durable_timeout_seconds), create=cfg.durable_create) \
            if cfg.durable_url is not None else None
        memory_dir = cfg.check_memory_root(root)  # before anything starts: a ConfigError naming memory_root
        if self._tier is not None and memory_dir is not None and self._tier.is_inside(memory_dir):
            raise ConfigError(f"durable_url {cfg.durable_url!r} points into memory_root {memory_dir}; the durable "
                              "tier must be another location than the memory tier")
        if self._tier is not None and self._tier.is_inside(root):
            raise ConfigError(f"durable_url {cfg.durable_url!r} points into the local root {root}; the durable "
                              "tier must be another location (another disk, a file server, an object store)")
        self._ckpt = AsyncCheckpointer(async_save=cfg.async_save, persist=cfg.persist,
                                       overlap_staging=cfg.overlap_staging, writer_niceness=cfg.writer_niceness,
                                       staging_budget_bytes=cast(int | None, cfg.staging_budget_bytes),
                                       thread_count=cfg.thread_count, timeout_seconds=cast(float, cfg.timeout_seconds),
                                       process_group=cfg.process_group,
                                       on_write_error=cfg.on_write_error, incremental=cfg.incremental)
        self._ctx = ctx = self._ckpt.ctx
        try:  # the root layout (root._layout.SharedRoot, or root._nodes.NodeLayout for node-local roots): chosen once
            self._roots = choose_layout(ctx, cfg.local_root_shared, persist=persist_node_local)
        except CheckpointError:
            self._ckpt.close()
            raise
        self._ckpt.layout = self._roots
        # the rank that creates, commits, prunes and replicates this process's root: rank 0 for a shared
        # root, each node's lowest rank for node-local roots
        acts_on_root = self._roots.acts
        self._runs = RunLineage(root, naming, acts_on_root)
        self._guard = SaveGuard(root, naming, cfg, self._ckpt.incarnation, self._runs)
        self._after = CommitFollowUp(root, naming, cfg, self._runs, ctx.is_coordinator)
        self._health = HealthReport(root, naming, self._tier, self._runs, self._ckpt, self._after)
        self.restore_source: str | None = None  # node-local roots or memory: where this rank's last restore read from
        self._lock = RootLock(root, drain=self._ckpt.drain)
        # the signal handlers go in only now: a construction refused above leaves the process's handlers as they were
        self._preemption = PreemptionFlag(cfg.preemption_signals)
        self._replicate_every = cfg.replicate_every_n_saves
        if cfg.durable_url and cfg.incremental and cfg.keep_last is not None and \
                cfg.keep_last < cfg.replicate_every_n_saves and ctx.is_coordinator:
            log.warning("keep_last=%d < replicate_every_n_saves=%d: an uploaded save's unchanged files come from "
                        "local checkpoints that retention has removed, so they are uploaded again instead of "
                        "referenced (keep_last >= replicate_every_n_saves keeps the uploads incremental)",
                        cfg.keep_last, cfg.replicate_every_n_saves)
        self._saves = 0
        self._memory: MemoryTier | None = None
        try:  # whatever raises from here on (a refusal, a failed collective) releases what was taken, like close()
            error = None
            if acts_on_root:
                try:
                    check_root(root, create=not self.read_only)
                except CheckpointError as exc:
                    error = exc
            if not self.read_only:  # before the lock, whose message would mislead
                shared = self._roots.check(root, ctx, ok=error is None)
                error = error or (ConfigError(shared) if shared else None)
            if acts_on_root and error is None:
                try:
                    if not self.read_only and not cfg.explicit_paths_only:  # a root of its own: exclusive, cleaned
                        self._lock.acquire()
                        clean_stale_temporaries(root, keep_incarnation=self._ckpt.incarnation, naming=naming)
                    if self._tier is not None:
                        self._after.start_replicator(self._tier, self._roots)
                    if not self.read_only:
                        self._after.catch_up(self._tier, self._roots)
                except CheckpointError as exc:
                    error = exc
            # the memory tier (manager._memory): collective, so built on every rank whatever failed above
            self._memory = MemoryTier(memory_dir, cfg, self._ckpt, naming, self._runs, root) if memory_dir else None
            error = error or (self._memory.error if self._memory is not None else None)
            status = next((e for e in ctx.all_gather(None if error is None else str(error), what="init") if e), None)
            if error is not None or status is not None:
                what = "a node could not prepare its checkpoint root" if self._roots.node_local else \
                    f"rank 0 could not prepare {root}"
                raise error or CheckpointError(f"{what}: {status}")
        except BaseException:
            _release(*self._holdings(), flush_timeout=0)
            raise
        # a manager nobody references any more (never closed) releases its root and threads like close()
        self._finalizer = weakref.finalize(self, _close_unreachable, str(root), self._holdings(),
                                           cast(float, cfg.durable_flush_timeout_seconds), os.getpid())
        self._finalizer.atexit = False  # exit: torch_ckpt._lifecycle finishes in-flight work; the kernel drops the lock

    @property
    def _replicator(self) -> Replicator | None:
        return self._after.replicator

    def _holdings(self) -> tuple[AsyncCheckpointer, Replicator | None, PreemptionFlag, RootLock, MemoryTier | None]:
        return self._ckpt, self._replicator, self._preemption, self._lock, self._memory  # what _release lets go of

    @property
    def retention(self) -> RetentionPolicy | None:
        """The local retention policy (None: keep every checkpoint)."""
        return self._after.retention

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        inflight = self._ckpt.in_flight if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) else None
        if inflight is not None:  # else a Ctrl-C seems to hang for as long as the write takes
            log.warning("interrupted: waiting for the save of step %d to commit before exiting (another Ctrl-C "
                        "does not cancel it; kill -9 does, and leaves the committed checkpoints as they are)",
                        inflight.step)
        close_on_exit(self.close, exc_type)

    @property
    def checkpointer(self) -> AsyncCheckpointer:
        """The engine doing the saves and loads."""
        return self._ckpt

    @property
    def last_stats(self) -> SaveStats | None:
        """Statistics of the last committed save on this rank."""
        return self._ckpt.last_stats

    @property
    def restored_step(self) -> int | None:
        """The step of the last successful :meth:`restore` until the next save, else None."""
        return self._runs.restored_step

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: StateToSave, *, path: str | os.PathLike | None = None,
             extra_dir: str | os.PathLike | None = None, tier: str = "disk") -> SaveHandle:
        """Checkpoint ``state`` as ``step``; returns once the state is staged (async) or committed (sync).

        Waits first for the previous save (at most one in flight) and raises, once, any error of an
        earlier background save. The ranks agree before anything is submitted: when any rank fails
        here (or they pass different steps or paths), every rank raises for this step and nothing
        is written.

        Args:
            step: training step, an int from 0 to 2**63 - 1 (what a manifest holds). Without ``path`` it names
                the directory (``naming.name(step)`` under the root) and must not be committed yet.
            state: a :class:`~torch_ckpt.TrainState`, any ``Stateful`` or a nested dict of tensors
                and plain values (the supported values are listed in :mod:`torch_ckpt.format._files`).
            path: an explicit checkpoint directory instead (absolute, or relative to the root; it
                may lie outside the root, e.g. a framework's own file name). When it already holds
                a committed torch-ckpt checkpoint, that one is replaced atomically at commit and
                stays loadable until then (a rolling ``latest`` folder). ``step`` is only recorded.
            extra_dir: a directory (rank 0's; relative to the root when relative) whose files and
                folders, e.g. written by a framework's save hooks, are committed, replaced and
                removed atomically with the checkpoint. It is taken (moved away) inside ``save()``,
                so it may be refilled for the next save at once. Not listed in the manifest (not
                checksummed; restore never reads them). Names of checkpoint files are refused.
            tier: ``"disk"`` (default) or ``"memory"``: a checkpoint of ``step`` into ``memory_root``
                (each node its own copy; no ``path`` or ``extra_dir``). A memory save never counts as a
                persistent one: the disk cadence, ``replicate_every_n_saves``, durable replication and disk
                retention ignore it; ``memory_keep_last`` newest steps stay in ``memory_root``.

        Returns:
            A :class:`SaveHandle` whose ``staged`` future completes when the live tensors may change
            and whose ``committed`` future completes when the checkpoint is durable and listed.

        Raises:
            ConfigError: an unknown ``tier``, or ``"memory"`` without ``memory_root``; bad or already
                committed step; committed steps newer than ``step`` from a
                run this manager did not restore (see ``on_existing_newer``); ``path`` exists and is
                not a torch-ckpt checkpoint (it is never written into or deleted); a state value
                that cannot be stored exactly without pickling; a ``read_only`` manager; any of
                these on another rank.
            CheckpointWriteError: an OS error while preparing the save (e.g. moving a directory aside).
            CheckpointError: a previous background save failed (raised once), or another rank
                failed to prepare this save.
        """
        t0 = time.monotonic()
        if tier != "disk" and is_memory_save(tier, self._memory, path=path, extra_dir=extra_dir):
            handle = cast(MemoryTier, self._memory).save(step, state, started_at=t0)
            if self._cadence is not None:
                self._cadence.step_time.skip_next()  # the memory save's stall is no training step time
            return handle
        if self._preemption.received is not None:
            self._preemption.warn_if_unheeded()
        replicate = path is None and self._replicator is not None and (
            (self._saves + 1) % self._replicate_every == 0 or (isinstance(step, int) and not isinstance(step, bool)
                                                               and step >= 0 and self._replicator.keeps(step)))
        final = self._guard.target(step, path)
        request, refused, waited = SaveRequest(final=final, step=step if isinstance(step, int) else 0), None, 0.0
        restored = self._runs.restored_step
        try:
            waited = self._ckpt.wait_previous()
            replace = self._guard.check(step, final, explicit=path is not None, read_only=self.read_only)
            extra = self._guard.stage_extra(extra_dir, final) \
                if extra_dir is not None and self._ctx.is_coordinator else None
            request = SaveRequest(final=final, step=step, replace=replace, extra_dir=extra, lineage=self._runs.known,
                                  after_commit=functools.partial(self._committed, step, replicate=replicate))
        except Exception as exc:  # noqa: BLE001 - every rank raises it at the engine's agreement
            refused = exc
        try:
            handle = self._ckpt.submit(request, state, refused=refused, started_at=t0, waited_s=waited)
        except BaseException:
            self._runs.refused(restored)  # a refused (or failed synchronous) save leaves restored_step as it was
            raise
        self._saves += 1
        if self._cadence is not None:
            self._cadence.record_save_started(handle, time.monotonic())
        if self._memory is not None and path is None:
            self._memory.before_disk_save(step)
        return handle

    def _committed(self, step: int, final: Path, replicate: bool) -> Callable[[], None] | None:
        # the writer thread holds this bound method: a manager dropped with a save in flight stays alive
        # until that save ended, so its finalizer (close) never blocks the code that dropped it
        return self._after.run(step, final, replicate)

    def should_save(self, step: int) -> bool:
        """Record that training step ``step`` finished and ask the save policy; same answer on every rank.

        Call once per step, on every rank. True also when a preemption signal arrived on any rank.

        Raises:
            ConfigError: neither a ``save_policy`` nor ``preemption_signals`` was configured.
        """
        if self._cadence is None and not self._preemption.signals:
            raise ConfigError("should_save() needs CheckpointManager(save_policy=...) (or mtbf_seconds=, "
                              "save_every_n_steps=...), e.g. YoungDaly(mtbf_seconds='8h'), or "
                              "preemption_signals=('SIGTERM',)")
        now = time.monotonic()
        self._preemption.polled = True
        decision = False
        if self._cadence is not None:
            self._cadence.record_step(step, now, busy=self._ckpt.in_flight is not None)
            decision = self._cadence.decide(step, now) if self._ctx.is_coordinator else False
        votes = self._ctx.all_gather((decision, self._preemption.received), what="save decision")
        if self._preemption.received is None:
            self._preemption.received = next((sig for _, sig in votes if sig is not None), None)
        return bool(votes[0][0]) or self._preemption.requested

    def save_if_due(self, step: int, state: StateToSave) -> SaveHandle | None:
        """:meth:`save` when :meth:`should_save` says so; returns the handle or None.

        After a preemption signal this is the emergency save: it waits until the checkpoint is
        committed locally (up to ``preemption_timeout_seconds``), logs one line and raises
        ``SystemExit(128 + signum)``. With ``memory_root``, the step is first saved into memory (committed
        in RAM before the disk save starts; a failure there is logged and the disk save goes on), so a
        restart on the same nodes resumes it even when the disk save does not commit in time.

        With a memory tier (``memory_root`` and ``memory_every_n_steps``/``memory_every_seconds``/
        ``memory_mtbf_seconds``), a step at which no disk save is due is saved into ``memory_root`` when the
        memory cadence says so (``save(step, state, tier="memory")``); a disk save takes precedence. Without
        a disk save policy (nor ``preemption_signals``) only the memory cadence is asked.
        """
        tier = self.save_due(step)
        if tier != "disk":
            return None if tier is None else self.save(step, state, tier="memory")
        memory = self._memory
        handle, in_memory = None, False
        if not self._step_committed_or_pending(step):
            if memory is not None and self._preemption.requested:
                in_memory = self._save_to_memory_first(step, state)
            handle = self.save(step, state)
        if self._preemption.requested:
            self._exit_for_preemption(step, handle, in_memory)
        return handle

    def save_due(self, step: int) -> str | None:
        """Collective: :meth:`save_if_due`'s decision for ``step``, without saving (for adapters saving through
        their framework): ``"disk"`` (the memory clock restarts), ``"memory"`` or None.

        Raises:
            ConfigError: neither a ``save_policy``, ``preemption_signals`` nor a ``memory_root`` was configured.
        """
        memory = self._memory
        if memory is not None and self._cadence is None and not self._preemption.signals:  # memory cadence only
            return "memory" if memory.due(step) else None
        if not self.should_save(step):
            return "memory" if memory is not None and memory.due(step) else None
        if memory is not None:
            memory.disk_saved(step)
        return "disk"

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption signal arrived on this rank (agreed across ranks at ``should_save``)."""
        return self._preemption.requested

    def _step_committed_or_pending(self, step: int) -> bool:
        handle = self._ckpt.in_flight
        return (handle is not None and handle.step == step) or is_committed(self.root / self.naming.name(step))

    def _save_to_memory_first(self, step: int, state: StateToSave) -> bool:
        """Preempted: save ``step`` into memory and wait for its commit (fast, RAM), before the disk save;
        True once committed (a failure is logged: the disk save goes on)."""
        try:
            self.save(step, state, tier="memory")
            self._ckpt.wait_previous()  # committed before the disk save starts; its error is raised here, once
        except Exception as exc:  # noqa: BLE001 - whatever the memory save raised, the disk save must still run
            log.warning("preempted: the memory save of step %d failed (%s: %s); saving it to disk only", step,
                        type(exc).__name__, exc)
            return False
        return True

    def _exit_for_preemption(self, step: int, handle: SaveHandle | None, in_memory: bool = False) -> None:
        sig = self._preemption.received
        assert sig is not None  # called once a preemption signal arrived
        try:
            if handle is not None:
                path = handle.committed.result(timeout=self._preemption_timeout)
                log.warning("preempted by %s: checkpoint of step %d committed at %s; exiting", sig.name, step, path)
        except TimeoutError:
            log.error("preempted by %s: checkpoint of step %d not committed within %.0f s; exiting without it "
                      "(it stays an invisible temporary, removed on the next start)%s", sig.name, step,
                      self._preemption_timeout, "; a restart on these nodes resumes its memory copy" if in_memory
                      else "")
            logging.shutdown()  # flush log handlers: the hard exit below skips interpreter teardown
            os._exit(128 + int(sig))  # do not wait for the writer thread at interpreter exit
        raise SystemExit(128 + int(sig))

    def schedule_info(self) -> dict[str, Any]:
        """The save policy's last decision inputs and outputs (``describe()``), or {} without a policy; with a
        memory cadence, also ``"memory"``: the memory tier's policy's ``describe()`` (its own interval)."""
        info = self._cadence.policy.describe() if self._cadence is not None else {}
        cadence = self._memory.cadence if self._memory is not None else None
        return info if cadence is None else {**info, "memory": cadence.policy.describe()}

    def add_commit_callback(self, callback: Callable[[int, Path], None]) -> None:
        """Call ``callback(step, directory)`` after each commit, on rank 0 only.

        It runs in the writer thread once every rank has finished with the committed directory
        (no rank reads it again), before replication and retention of that save. An exception it
        raises is logged and never changes the save's outcome. Use it for links and notifications.
        """
        if not callable(callback):
            raise ConfigError(f"commit callback must be callable, got {callback!r}")
        self._after.callbacks.append(callback)

    def health(self) -> dict[str, Any]:
        """Checkpoint health on this rank, for dashboards and periodic logs.

        Returns:
            ``latest_step`` / ``latest_age_s``: newest local committed checkpoint and the age (seconds)
            of the state it holds; ``durable_step`` / ``durable_age_s``: the same for the durable tier
            (the local tier stands in when there is none); ``lost_work_if_failure_now_s``: training
            time that a failure right now would lose (back to the newest durable checkpoint; None
            before the first one); ``in_flight_step``; ``failed_saves``; ``replication`` (see
            :meth:`replication_stats`); ``schedule`` (:meth:`schedule_info`: the save policy's last decision, if
            any, and the memory tier's under ``"memory"``);
            ``tiers``: per step, which tiers hold a copy, ``{step: {"local": "complete" | "partial" |
            None, "durable": bool | None}}`` ("partial": this node's copy of a node-local checkpoint;
            durable None: not known, see below); ``durable_newest_step`` /
            ``durable_newest_age_s``: the newest step committed in the durable tier (listed there, so
            also after a restart) and the age of its state in seconds (the exposure window);
            ``memory_step`` / ``memory_age_s``: the newest step in this node's ``memory_root`` and the
            age (seconds) of its state (None without a memory tier); ``lost_work_if_restart_now_s``:
            seconds since the state of the newest checkpoint of any tier (what a process restart on the
            same nodes loses now); ``memory_safe_step``: the newest memory step this node's partners hold
            (peer replication), ``lost_work_if_node_lost_s`` / ``lost_steps_if_node_lost``: seconds and
            steps a loss of this node costs now (back to that step or the newest durable one; node-local
            roots without a durable tier: the disk steps go with the node and do not count),
            ``lost_work_if_job_lost_s`` / ``lost_steps_if_job_lost``: the same for the loss of every node
            (back to the newest durable one; None / every step seen when nothing outlives the nodes);
            ``memory_replication``: the replication's counters
            (docs/memory-tier.md; {} without replication).

        Never does network I/O: the durable side is the replicator's last known listing of the
        store (listed in the background when ``health()`` asks, at most every 10 s, and by the
        durable retention; updated by the replicator's own commits and deletions), so a store
        that does not answer never blocks this call: the first call after the manager starts
        asks for a listing and reports durable entries as None. Durable entries are None (and
        ``durable_newest_step`` None) until a listing has succeeded, while the last one fails
        (``replication["last_error"]`` says why), and on ranks that do not replicate (every rank but
        rank 0, or but each node's lowest rank with node-local roots).
        """
        return memory_health(self._health.health(self.schedule_info()), self._memory,
                             lost_with_node=self._roots.node_local and self._tier is None)

    def replication_stats(self) -> dict[str, Any]:
        """State of the durable replication (see :meth:`Replicator.stats`); {} without a durable tier."""
        return self._health.replication_stats()

    # -- listing, removal and restore -----------------------------------------------------------
    def checkpoints(self) -> dict[int, Path]:
        """Committed checkpoints under the root, ``{step: directory}`` ascending (rank 0's view, agreed).

        Only directories the naming parses and whose manifest names the same step are listed;
        temporaries, hidden and foreign directories never are, nor steps superseded by a rollback
        (:mod:`torch_ckpt.policy._lineage`).
        """
        found = None
        if self._ctx.is_coordinator:
            scanned = scan_manifests(self.root, self.naming)
            head = head_of(m.lineage for _, m in scanned.values())
            found = {s: str(p) for s, (p, m) in scanned.items() if head.holds(s, m.lineage)}
        return {s: Path(p) for s, p in self._ctx.broadcast(found, what="list checkpoints").items()}

    def all_steps(self) -> list[int]:
        """Committed steps in ascending numeric order (rank 0's view, agreed by every rank)."""
        return list(self.checkpoints())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

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
            check_step(target, "remove(): a step")
            path = self.root / self.naming.name(target)
        else:
            path = self._guard.explicit_path(cast(str | os.PathLike, target))  # it refuses a bool
        if not self._runs.acts_on_root:
            return
        inflight = self._ckpt.in_flight
        if inflight is not None and not inflight.committed.done():
            self._ckpt.wait()
        if not os.path.lexists(path):
            return
        if is_reservation(path) and os.listdir(path):  # only partials of saves that never committed: ours
            shutil.rmtree(path, ignore_errors=True)
            return
        _intact(path, "not deleting it")  # a damaged one is still ours to delete
        try:
            remove_step_dir(path)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot remove checkpoint {path}: {exc.strerror}") from exc
        log.info("removed checkpoint %s", path)

    def restore(self, state: StateToRestore, step: int | None = None, *, allow_cast: bool = False,
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

        With a memory tier (``memory_root``), a step that every node holds intact in its
        ``memory_root`` (or gets back from a partner's replica, checked by CRC-32: ``memory_replicas``)
        and that is newer than every live disk and durable step is loaded from memory (always
        CRC-checked; ``restore_source`` is then ``"memory"``, ``"memory-peer"`` on a node whose copy
        came from a partner), as is an explicit ``step`` that only the memory tier holds. A memory copy
        missing on some node (with no intact replica) or failing verification is passed over with a
        warning naming the step and the reason, for the disk and durable tiers.
        After a restore of step S from any tier, the memory steps newer than S are deleted at the next
        save: they are never resumed.

        Memory: the restore reads into new host buffers of about the state's size and, once every
        check passed, exchanges or copies them into the live tensors; a Ctrl-C meanwhile is raised
        once the live state is fully written, so an interrupted restore leaves it fully old or new.

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
        self._ckpt.wait()
        listed: dict[int, Lineage] = {}  # the memory tier's steps: restoring an older one elsewhere is a rollback
        if self._memory is not None:  # a newer step in every node's memory_root, verified
            self.restore_source = None
            def from_memory(local: Path, verify: bool, before_write: Callable[[], Any] | None) -> None:
                self._ckpt.load(local, state, verify=verify, allow_cast=allow_cast,
                                on_world_size_change=self.on_world_size_change, before_write=before_write)

            memory = self._memory.restore(step=step, disk_root=self.root, tier=self._tier, choose=path is None,
                                          load=from_memory, disk_per_node=self._roots.node_local)
            if memory is not None:
                return self._restored_memory(memory)
            listed = self._memory.listed
        if self._roots.node_local and path is None:
            resumed = restore_node_local(
                cast(NodeLayout, self._roots), self._ctx, self._tier, self.root, self.naming, step=step,
                read_only=self.read_only, memory=listed,
                load=lambda local: self._ckpt.load(local, state, verify=self.verify_on_load, allow_cast=allow_cast,
                                                   on_world_size_change=self.on_world_size_change))
            if resumed is None:
                return None
            self.restore_source = resumed.source if resumed.step is not None else None
            self._runs.restored(resumed.step, resumed.lineage)
            if self._memory is not None:
                self._memory.restored(-1 if resumed.step is None else resumed.step)
                newer = self._memory.restore_newer(resumed.step, from_memory) if resumed.step is not None else None
                if newer is not None:  # the newest disk/durable step failed to load: a newer memory step did not
                    return self._restored_memory(newer)
            return resumed.step
        done = restore_checkpoint(state, root=self.root, naming=self.naming, tier=self._tier, ctx=self._ctx, step=step,
                                  path=path, allow_cast=allow_cast, verify=self.verify_on_load,
                                  on_world_size_change=self.on_world_size_change, read_only=self.read_only,
                                  acts_on_root=self._runs.acts_on_root, memory=listed)
        if done is None:
            return None
        self._runs.restored(done.step, done.lineage)
        if self._memory is not None:
            self._memory.restored(done.step)
            newer = self._memory.restore_newer(done.step, from_memory) if path is None else None
            if newer is not None:  # the newest disk/durable step failed to load: a newer memory step did not
                return self._restored_memory(newer)
        return done.step

    def _restored_memory(self, memory: tuple[int, Lineage]) -> int:
        """A memory step was loaded: the restore's bookkeeping; returns the step."""
        self.restore_source = cast(MemoryTier, self._memory).source
        self._runs.restored(memory[0], memory[1] if self._runs.acts_on_root else None)
        return memory[0]

    # -- lifecycle -------------------------------------------------------------------------------
    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads the live tensors (see ``overlap_staging``)."""
        self._ckpt.wait_staged()

    def wait(self) -> None:
        """Block until the in-flight save is committed and the checkpoints it retired are deleted;
        raise any background error (once)."""
        self._ckpt.wait()

    def wait_durable(self, timeout_seconds: float | None = None) -> bool:
        """Block until every queued replication is done; False on timeout (or on non-coordinator ranks: True)."""
        self._ckpt.wait()
        return self._replicator.wait(timeout_seconds) if self._replicator is not None else True

    def close(self) -> None:
        """Wait for the in-flight save (and, up to ``durable_flush_timeout_seconds``, its replication),
        release everything; raise any pending error once."""
        self._finalizer.detach()
        _release(*self._holdings(), flush_timeout=cast(float, self.config.durable_flush_timeout_seconds))


def _release(ckpt: AsyncCheckpointer, replicator: Replicator | None, preemption: PreemptionFlag, lock: RootLock,
             memory: MemoryTier | None, *, flush_timeout: float) -> None:
    """The one teardown of a manager (close(), a refused construction, the finalizer), in this order: the
    in-flight save commits or fails, its replication gets up to ``flush_timeout`` seconds, then the signal
    handlers, the root's lock and the memory tier's root go back. Each step runs even when one before it raised."""
    try:
        ckpt.close()
    finally:
        try:
            if replicator is not None:
                replicator.close(flush_timeout)
        finally:
            preemption.restore()
            lock.release()
            if memory is not None:
                memory.close()


def _close_unreachable(root: str, held: tuple, flush_timeout: float, pid: int) -> None:
    """Finalizer of a manager never closed (not at exit: :mod:`torch_ckpt._lifecycle`); errors are logged.
    Nothing in a forked child (``pid`` is the manager's process): its threads and lock are the parent's."""
    if os.getpid() != pid:
        return
    log.info("a CheckpointManager of %s was garbage collected without close(): closing it", root)
    try:
        _release(*held, flush_timeout=flush_timeout)
    except BaseException as exc:  # noqa: BLE001 - nobody to raise it to
        log.error("checkpoint error of the unclosed CheckpointManager of %s: %s: %s", root, type(exc).__name__, exc)
