"""``CheckpointManager``: one run root of step-numbered checkpoints, with retention, scheduling and resume.

The manager only orchestrates: saving and loading go through
:class:`~torch_ckpt.save._checkpointer.AsyncCheckpointer`; naming and commit live in
:mod:`torch_ckpt.root._layout`, retention in :mod:`torch_ckpt.policy._retention`, the save decision in
:mod:`torch_ckpt.policy._schedule` (fed by :mod:`torch_ckpt.policy._cadence`). This module builds the manager,
submits saves, asks the save policy and handles preemption; its mixins hold the rest: the checks
before a save (:mod:`torch_ckpt.manager._prepare`), what follows a commit
(:mod:`torch_ckpt.manager._commit`), listing and restore (:mod:`torch_ckpt.manager._read`) and the
health report (:mod:`torch_ckpt.manager._health`).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.config import DEFAULT, ON_EXISTING_NEWER, CheckpointConfig, DefaultType
from torch_ckpt.errors import CheckpointError, ConfigError
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.manager._commit import ManagerCommitMixin
from torch_ckpt.manager._health import ManagerHealthMixin
from torch_ckpt.manager._prepare import ManagerPrepareMixin
from torch_ckpt.manager._read import ManagerReadMixin
from torch_ckpt.policy._cadence import Cadence
from torch_ckpt.policy._lineage import Lineage
from torch_ckpt.policy._naming import Naming, StepNaming
from torch_ckpt.policy._preemption import PreemptionFlag
from torch_ckpt.policy._retention import RetentionPolicy
from torch_ckpt.root._layout import check_root, is_committed
from torch_ckpt.root._lock import RootLock
from torch_ckpt.root._nodes import choose_layout
from torch_ckpt.root._temporaries import clean_stale_temporaries
from torch_ckpt.save._checkpointer import AsyncCheckpointer, close_on_exit
from torch_ckpt.save._persist_nodes import persist_node_local
from torch_ckpt.tiers._durable import DurableTier
from torch_ckpt.tiers._replicator import Replicator

__all__ = ["CheckpointManager", "ON_EXISTING_NEWER"]

log = get_logger(__name__)

_SETTINGS = frozenset(CheckpointConfig.field_names())


class CheckpointManager(ManagerPrepareMixin, ManagerCommitMixin, ManagerReadMixin, ManagerHealthMixin):
    """Asynchronous, atomic DCP checkpoints of one run root, with retention and resume.

    Every rank constructs the manager and calls :meth:`save`, :meth:`restore`,
    :meth:`latest_step` and :meth:`all_steps` collectively (same order on every rank).

    Args:
        directory: local run root; created if missing. One manager owns one root.
        config: a :class:`~torch_ckpt.config.CheckpointConfig` holding the settings (default: the
            defaults). Keyword arguments given next to it override its fields.
        **settings: any field of :class:`~torch_ckpt.config.CheckpointConfig`, by name, with the
            same meaning, units and defaults: ``keep_last``, ``keep_every_n_steps``, ``retention``,
            ``async_save``, ``persist``, ``overlap_staging``, ``writer_niceness``,
            ``staging_budget_bytes``, ``thread_count``, ``verify_on_load``, ``on_world_size_change``,
            ``timeout_seconds``, ``process_group``, ``save_policy``, ``mtbf_seconds``,
            ``save_every_n_steps``, ``save_every_seconds``, ``initial_cost_seconds``, ``formula``,
            ``min_interval_steps``, ``durable_url``, ``storage_options``, ``replicate_every_n_saves``,
            ``durable_keep_last``, ``durable_keep_every_n_steps``, ``durable_verify``,
            ``durable_flush_timeout_seconds``, ``preemption_signals``, ``preemption_timeout_seconds``,
            ``on_write_error``, ``on_existing_newer``, ``read_only``, ``explicit_paths_only``, ``naming``,
            ``local_root_shared``, ``durable_upload_threads``, ``durable_timeout_seconds``,
            ``durable_create``. README.md
            ("Configuration") lists each with its default and unit.

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
        naming = StepNaming() if cfg.naming is None else cfg.naming
        self.root = Path(str(directory).removeprefix("file://")).expanduser().absolute()
        self.naming = naming
        self._commit_callbacks: list[Callable[[int, Path], None]] = []
        self.retention = cfg.build_retention()
        self.verify_on_load = cfg.verify_on_load
        self.on_world_size_change = cfg.on_world_size_change
        self.on_existing_newer = cfg.on_existing_newer
        self.read_only = cfg.read_only
        self._newest_known: int | None = None  # rank 0: newest step known to be under the root (None: scan)
        save_policy = cfg.build_save_policy()
        self._cadence = Cadence(save_policy) if save_policy is not None else None
        self._preemption = PreemptionFlag(cfg.preemption_signals)
        self._preemption_timeout = cfg.preemption_timeout_seconds
        self._tier = DurableTier(cfg.durable_url, storage_options=cfg.storage_options, verify=cfg.durable_verify,
                                 naming=naming, upload_threads=cfg.durable_upload_threads,
                                 timeout_seconds=cfg.durable_timeout_seconds, create=cfg.durable_create) \
            if cfg.durable_url is not None else None
        if self._tier is not None and self._tier.is_inside(self.root):
            raise ConfigError(f"durable_url {cfg.durable_url!r} points into the local root {self.root}; the durable "
                              "tier must be another location (another disk, a file server, an object store)")
        self._ckpt = AsyncCheckpointer(async_save=cfg.async_save, persist=cfg.persist,
                                       overlap_staging=cfg.overlap_staging, writer_niceness=cfg.writer_niceness,
                                       staging_budget_bytes=cfg.staging_budget_bytes, thread_count=cfg.thread_count,
                                       timeout_seconds=cfg.timeout_seconds, process_group=cfg.process_group,
                                       on_write_error=cfg.on_write_error)
        self._ctx = self._ckpt.ctx
        try:  # the root layout (torch_ckpt.root._layout.SharedRoot, or NodeLayout for node-local roots): chosen once
            self._roots = choose_layout(self._ctx, cfg.local_root_shared, persist=persist_node_local)
        except CheckpointError:
            self._ckpt.close()
            raise
        self._ckpt.layout = self._roots
        self._lock = RootLock(self.root, drain=self._ckpt.drain)
        self._replicator: Replicator | None = None
        self._replicate_every = cfg.replicate_every_n_saves
        self._durable_flush_timeout = cfg.durable_flush_timeout_seconds
        self._saves = 0
        self._captured_at: dict[int, float] = {}
        self._restored_step: int | None = None
        self._lineage: Lineage | None = None  # run segment of the next saves (policy._lineage); None: not known yet
        self.restore_source: str | None = None  # node-local roots: where this rank's last restore read from
        error = None
        if self._acts_on_root:
            try:
                check_root(self.root, create=not self.read_only)
            except CheckpointError as exc:
                error = exc
        if not self.read_only:  # before the lock, whose message would mislead
            shared = self._roots.check(self.root, self._ctx, ok=error is None)
            error = error or (ConfigError(shared) if shared else None)
        if self._acts_on_root and error is None:
            try:
                if not self.read_only and not cfg.explicit_paths_only:  # a root of its own: exclusive, cleaned
                    self._lock.acquire()
                    clean_stale_temporaries(self.root, keep_incarnation=self._ckpt.incarnation, naming=self.naming)
                if self._tier is not None:
                    durable_retention = cfg.build_durable_retention()
                    self._replicator = self._make_replicator(durable_retention)
                if not self.read_only:
                    self._catch_up_at_start()
            except CheckpointError as exc:
                error = exc
        status = next((e for e in self._ctx.all_gather(None if error is None else str(error), what="init") if e), None)
        if error is not None or status is not None:
            if self._replicator is not None:
                self._replicator.close(0)
            self._preemption.restore()
            self._lock.release()
            self._ckpt.close()
            what = "a node could not prepare its checkpoint root" if self._roots.node_local else \
                f"rank 0 could not prepare {self.root}"
            raise error or CheckpointError(f"{what}: {status}")
        # a manager nobody references any more (never closed) releases its root and threads like close()
        self._finalizer = weakref.finalize(self, _close_unreachable, str(self.root), self._ckpt, self._replicator,
                                           self._preemption, self._lock, self._durable_flush_timeout)
        self._finalizer.atexit = False  # exit: torch_ckpt._lifecycle finishes in-flight work; the kernel drops the lock

    @property
    def _acts_on_root(self) -> bool:
        """True on the rank that creates, commits, prunes and replicates this process's root: rank 0
        for a shared root, each node's lowest rank for node-local roots."""
        return self._roots.acts

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

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, path: str | os.PathLike | None = None,
             extra_dir: str | os.PathLike | None = None) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; returns once the state is staged (async) or committed (sync).

        Waits first for the previous save (at most one in flight) and raises, once, any error of an
        earlier background save. The ranks agree before anything is submitted: when any rank fails
        here (or they pass different steps or paths), every rank raises for this step and nothing
        is written.

        Args:
            step: training step (int >= 0). Without ``path`` it names the directory
                (``naming.name(step)`` under the root) and must not be committed yet.
            state: a :class:`~torch_ckpt.TrainState`, any ``Stateful`` or a nested dict of tensors
                and plain values (the supported values are listed in :mod:`torch_ckpt.format._codec`).
            path: an explicit checkpoint directory instead (absolute, or relative to the root; it
                may lie outside the root, e.g. a framework's own file name). When it already holds
                a committed torch-ckpt checkpoint, that one is replaced atomically at commit and
                stays loadable until then (a rolling ``latest`` folder). ``step`` is only recorded.
            extra_dir: a directory (rank 0's; relative to the root when relative) whose files and
                folders, e.g. written by a framework's save hooks, are committed, replaced and
                removed atomically with the checkpoint. It is taken (moved away) inside ``save()``,
                so it may be refilled for the next save at once. Not listed in the manifest (not
                checksummed; restore never reads them). Names of checkpoint files are refused.

        Returns:
            A :class:`SaveHandle` whose ``staged`` future completes when the live tensors may change
            and whose ``committed`` future completes when the checkpoint is durable and listed.

        Raises:
            ConfigError: bad or already committed step; committed steps newer than ``step`` from a
                run this manager did not restore (see ``on_existing_newer``); ``path`` exists and is
                not a torch-ckpt checkpoint (it is never written into or deleted); a state value
                that cannot be stored exactly without pickling; a ``read_only`` manager; any of
                these on another rank.
            CheckpointWriteError: an OS error while preparing the save (e.g. moving a directory aside).
            CheckpointError: a previous background save failed (raised once), or another rank
                failed to prepare this save.
        """
        t0 = time.monotonic()
        self._preemption.warn_if_unheeded()
        valid = not isinstance(step, bool) and isinstance(step, int) and step >= 0
        replicate = path is None and self._replicator is not None and (
            (self._saves + 1) % self._replicate_every == 0 or (valid and self._replicator.keeps(step)))
        if path is not None:
            final = self._explicit_path(path)
            named = self.naming.step_of(final.name) if final.parent == self.root else None
            if named is not None and named != step:
                raise ConfigError(f"path {final} is the directory of step {named} under this root's naming; "
                                  f"saving step {step} there would hide it from listing and resume. Save step "
                                  f"{named} there, or use a name the naming does not parse")
        else:
            final = self.root / (self.naming.name(step) if valid else ".invalid_step")
        replace = [False]
        staged_extra: list[Path | None] = [None]

        def prepare() -> None:
            replace[0] = self._prepare_step(step, final, explicit=path is not None)
            if extra_dir is not None and self._ctx.is_coordinator:
                staged_extra[0] = self._stage_extra(extra_dir, final)

        restored = self._restored_step
        try:
            handle = self._ckpt.save(final, state, step=step,
                                     on_committed=lambda final: self._after_commit(step, final, replicate),
                                     started_at=t0, prepare=prepare, replace=lambda: replace[0],
                                     extra_dir=lambda: staged_extra[0], lineage=lambda: self._lineage)
        except BaseException:
            self._restored_step = restored  # a refused (or failed synchronous) save leaves restored_step as it was
            raise
        self._saves += 1
        if self._cadence is not None:
            self._cadence.record_save_started(handle, time.monotonic())
        return handle

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
            self._cadence.record_step(step, now)
            decision = self._cadence.decide(step, now) if self._ctx.is_coordinator else False
        votes = self._ctx.all_gather((decision, self._preemption.received), what="save decision")
        if self._preemption.received is None:
            self._preemption.received = next((sig for _, sig in votes if sig is not None), None)
        return bool(votes[0][0]) or self._preemption.requested

    def save_if_due(self, step: int, state: Any) -> SaveHandle | None:
        """:meth:`save` when :meth:`should_save` says so; returns the handle or None.

        After a preemption signal this is the emergency save: it waits until the checkpoint is
        committed locally (up to ``preemption_timeout_seconds``), logs one line and raises
        ``SystemExit(128 + signum)``.
        """
        if not self.should_save(step):
            return None
        handle = None
        if not self._step_committed_or_pending(step):
            handle = self.save(step, state)
        if self._preemption.requested:
            self._exit_for_preemption(step, handle)
        return handle

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption signal arrived on this rank (agreed across ranks at ``should_save``)."""
        return self._preemption.requested

    def _step_committed_or_pending(self, step: int) -> bool:
        handle = self._ckpt.in_flight
        return (handle is not None and handle.step == step) or is_committed(self.root / self.naming.name(step))

    def _exit_for_preemption(self, step: int, handle: SaveHandle | None) -> None:
        sig = self._preemption.received
        try:
            if handle is not None:
                path = handle.committed.result(timeout=self._preemption_timeout)
                log.warning("preempted by %s: checkpoint of step %d committed at %s; exiting", sig.name, step, path)
        except TimeoutError:
            log.error("preempted by %s: checkpoint of step %d not committed within %.0f s; exiting without it "
                      "(it stays an invisible temporary, removed on the next start)", sig.name, step,
                      self._preemption_timeout)
            logging.shutdown()  # flush log handlers: the hard exit below skips interpreter teardown
            os._exit(128 + int(sig))  # do not wait for the writer thread at interpreter exit
        raise SystemExit(128 + int(sig))

    def schedule_info(self) -> dict[str, Any]:
        """The save policy's last decision inputs and outputs (``describe()``), or {} without a policy."""
        return self._cadence.policy.describe() if self._cadence is not None else {}

    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads the live tensors (see ``overlap_staging``)."""
        self._ckpt.wait_staged()

    # -- lifecycle -------------------------------------------------------------------------------
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
        try:
            self._ckpt.close()
        finally:
            if self._replicator is not None:
                self._replicator.close(self._durable_flush_timeout)
            self._preemption.restore()
            self._lock.release()


def _close_unreachable(root: str, ckpt: AsyncCheckpointer, replicator: Replicator | None, preemption: PreemptionFlag,
                       lock: RootLock, flush_timeout: float) -> None:
    """Finalizer of a manager that was never closed: close what it owned; log (there is no caller) any error.

    Runs when the manager is garbage collected: after its in-flight save (whose writer thread
    references it), or when a new manager of this process on the same root collects garbage. Not at
    interpreter exit, where :mod:`torch_ckpt._lifecycle` finishes the in-flight work.
    """
    log.info("a CheckpointManager of %s was garbage collected without close(): closing it", root)
    try:
        ckpt.close()
    except BaseException as exc:  # noqa: BLE001 - nobody to raise it to
        log.error("checkpoint error of the unclosed CheckpointManager of %s: %s: %s", root, type(exc).__name__, exc)
    finally:
        try:
            if replicator is not None:
                replicator.close(flush_timeout)
        finally:
            preemption.restore()
            lock.release()
