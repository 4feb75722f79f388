"""``CheckpointManager``: one run root of step-numbered checkpoints, with retention, scheduling and resume.

The manager only orchestrates: saving and loading go through
:class:`~torch_ckpt.checkpointer.AsyncCheckpointer`; naming and commit live in
:mod:`torch_ckpt.layout`, retention in :mod:`torch_ckpt.retention`, the save decision in
:mod:`torch_ckpt.schedule` (fed by :mod:`torch_ckpt.cadence`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.cadence import Cadence
from torch_ckpt.checkpointer import AsyncCheckpointer, close_on_exit
from torch_ckpt.config import DEFAULT, ON_EXISTING_NEWER, CheckpointConfig, DefaultType
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
)
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.layout import (
    RootLock,
    check_root,
    clean_stale_temporaries,
    is_committed,
    quarantine_step_dir,
    read_manifest,
    remove_step_dir,
    scan_committed,
    update_manifest_tiers,
)
from torch_ckpt.naming import Naming, StepNaming
from torch_ckpt.nodes import NodeLayout
from torch_ckpt.preemption import PreemptionFlag
from torch_ckpt.replicator import Replicator
from torch_ckpt.resume import restore_candidates
from torch_ckpt.resume_nodes import check_private_roots, node_layout, restore_node_local
from torch_ckpt.retention import RetentionPolicy, apply_retention
from torch_ckpt.tiers import DurableTier, DurableUnavailableError

__all__ = ["CheckpointManager", "ON_EXISTING_NEWER"]

log = get_logger(__name__)

_SETTINGS = frozenset(CheckpointConfig.field_names())


def _list_steps(steps: list[int]) -> str:
    """``[500, 600, 700]``, or the first and last few of a long list."""
    if len(steps) <= 8:
        return str(steps)
    return f"[{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}]"


class CheckpointManager:
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
            ``on_write_error``, ``on_existing_newer``, ``read_only``, ``naming``,
            ``local_root_shared``, ``durable_upload_threads``. README.md
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
        naming: Naming | None | DefaultType = DEFAULT,
        local_root_shared: bool | None | DefaultType = DEFAULT,
        durable_upload_threads: int | DefaultType = DEFAULT,
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
                                 naming=naming, upload_threads=cfg.durable_upload_threads) \
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
        self._nodes: NodeLayout | None = None
        try:
            self._nodes = node_layout(self._ctx, cfg.local_root_shared)
        except CheckpointError:
            self._ckpt.close()
            raise
        self._ckpt.node_layout = self._nodes
        self._lock = RootLock(self.root)
        self._replicator: Replicator | None = None
        self._replicate_every = cfg.replicate_every_n_saves
        self._durable_flush_timeout = cfg.durable_flush_timeout_seconds
        self._saves = 0
        self._captured_at: dict[int, float] = {}
        self._restored_step: int | None = None
        self.restore_source: str | None = None  # node-local roots: where this rank's last restore read from
        error = None
        if self._acts_on_root:
            try:
                check_root(self.root, create=not self.read_only)
            except CheckpointError as exc:
                error = exc
        if self._nodes is not None and not self.read_only:  # before the lock, whose message would mislead
            shared = check_private_roots(self.root, self._nodes, self._ctx, ok=error is None)
            error = error or (ConfigError(shared) if shared else None)
        if self._acts_on_root and error is None:
            try:
                if not self.read_only:
                    self._lock.acquire()
                    clean_stale_temporaries(self.root, keep_incarnation=self._ckpt.incarnation, naming=self.naming)
                if self._tier is not None:
                    durable_retention = cfg.build_durable_retention()
                    self._replicator = self._make_replicator(durable_retention)
            except CheckpointError as exc:
                error = exc
        status = next((e for e in self._ctx.all_gather(None if error is None else str(error), what="init") if e), None)
        if error is not None or status is not None:
            if self._replicator is not None:
                self._replicator.close(0)
            self._preemption.restore()
            self._lock.release()
            self._ckpt.close()
            raise error or CheckpointError(f"rank 0 could not prepare {self.root}: {status}" if self._nodes is None
                                           else f"a node could not prepare its checkpoint root: {status}")

    @property
    def _acts_on_root(self) -> bool:
        """True on the rank that creates, commits, prunes and replicates this process's root: rank 0
        for a shared root, each node's lowest rank for node-local roots."""
        return self._nodes.is_leader if self._nodes is not None else self._ctx.is_coordinator

    def _make_replicator(self, retention: RetentionPolicy | None) -> Replicator:
        if self._nodes is None:
            return Replicator(self._tier, retention=retention, on_durable=self._record_durable)
        commit = self._nodes.node == 0

        def upload(local_dir: Path, manifest: Any, abandon: Callable[[], bool]) -> None:
            self._tier.upload_node(local_dir, manifest, commit=commit, abandon=abandon,
                                   wait_seconds=self._durable_flush_timeout)

        # every node uploads its own shards; node 0 commits and runs durable retention and cleanup
        return Replicator(self._tier, retention=retention if commit else None, upload=upload,
                          on_durable=self._record_durable if commit else None,
                          abandoned_after_seconds=24 * 3600.0 if commit else None)

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
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
                and plain values (the supported values are listed in :mod:`torch_ckpt.codec`).
            path: an explicit checkpoint directory instead (absolute, or relative to the root; it
                may lie outside the root, e.g. a framework's own file name). When it already holds
                a committed torch-ckpt checkpoint, that one is replaced atomically at commit and
                stays loadable until then (a rolling ``latest`` folder). ``step`` is only recorded.
            extra_dir: a directory (read on rank 0) whose files and folders, e.g. written by a
                framework's save hooks, are moved into the checkpoint before its manifest, so they
                are committed, replaced and removed atomically with it. Not listed in the manifest
                (not checksummed; restore never reads them). Names of checkpoint files are refused.

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
        valid = not isinstance(step, bool) and isinstance(step, int) and step >= 0
        replicate = path is None and self._replicator is not None and (self._saves + 1) % self._replicate_every == 0
        if path is not None:
            final = self._explicit_path(path)
        else:
            final = self.root / (self.naming.name(step) if valid else ".invalid_step")
        replace = [False]

        def prepare() -> None:
            replace[0] = self._prepare_step(step, final, explicit=path is not None)

        handle = self._ckpt.save(final, state, step=step,
                                 on_committed=lambda final: self._after_commit(step, final, replicate),
                                 started_at=t0, prepare=prepare, replace=lambda: replace[0], extra_dir=extra_dir)
        self._saves += 1
        if self._cadence is not None:
            self._cadence.record_save_started(handle, time.monotonic())
        return handle

    def _explicit_path(self, path: str | os.PathLike) -> Path:
        if not isinstance(path, (str, os.PathLike)) or str(path) == "":
            raise ConfigError(f"path must be a non-empty directory path, got {path!r}")
        final = Path(path).expanduser()
        final = (final if final.is_absolute() else self.root / final).absolute()
        if final == self.root or final in self.root.parents:
            raise ConfigError(f"path {final} is the checkpoint root or contains it; name a directory inside or "
                              "beside the root")
        if final.name.startswith("."):
            raise ConfigError(f"path {final}: hidden names (starting with '.') are reserved for temporaries")
        return final

    def _prepare_step(self, step: Any, final: Path, *, explicit: bool = False) -> bool:
        """Every rank, before the save agreement: validate ``step``; on rank 0 also check its directory.

        After :meth:`restore` loaded a step older than the newest committed one, the newer
        checkpoints belong to an abandoned run segment: the first save moves them aside
        (``.superseded_<name>.<time>``, kept, never listed) so that "latest" follows the run again.
        A damaged directory of ``step`` is moved aside too (``.corrupt_<name>.<time>``).

        Returns:
            True (on rank 0) when ``final`` holds a committed checkpoint that the commit replaces.

        Raises:
            ConfigError: read-only manager, invalid or already committed step, newer steps of
                another run (``on_existing_newer="error"``), or ``final`` is not a torch-ckpt
                checkpoint.
            CheckpointWriteError: a directory could not be moved aside.
        """
        if self.read_only:
            raise ConfigError(f"this CheckpointManager was opened with read_only=True on {self.root}: it restores "
                              "and lists checkpoints but does not save; open a writable root without read_only "
                              "to save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        self._captured_at[step] = time.time()  # the state is captured right after this call
        while len(self._captured_at) > 256:
            self._captured_at.pop(next(iter(self._captured_at)))
        restored, self._restored_step = self._restored_step, None
        if not self._acts_on_root:
            return False
        try:
            if restored is not None:
                for newer, newer_path in scan_committed(self.root, self.naming).items():
                    if newer > restored:
                        quarantine_step_dir(newer_path, reason="superseded")
            if explicit:
                return self._check_explicit(final)
            if os.path.lexists(final):
                try:
                    read_manifest(final)
                except CheckpointNotFoundError:
                    raise ConfigError(f"{final} exists but is not a torch-ckpt checkpoint (no manifest.json): it is "
                                      "never written into or deleted; move it away or use another directory") from None
                except CheckpointError:
                    quarantine_step_dir(final, reason="corrupt")
                else:
                    raise ConfigError(f"step {step} is already committed at {final}; save under a new step")
            self._check_no_newer_steps(step)
            return False
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointWriteError(exc.errno, f"cannot prepare step {step} under {self.root}: {exc.strerror} "
                                       f"({exc.filename})") from exc

    def _check_explicit(self, final: Path) -> bool:
        """Rank 0: may ``final`` be written? True when it holds a committed checkpoint to replace."""
        if not os.path.lexists(final):
            return False
        if final.is_symlink() or not final.is_dir():
            raise ConfigError(f"{final} exists and is not a directory written by torch-ckpt (a file or symlink): "
                              "it is never overwritten; remove it or save elsewhere")
        try:
            read_manifest(final)
        except CheckpointNotFoundError:
            raise ConfigError(f"{final} exists but is not a torch-ckpt checkpoint (no manifest.json): it is never "
                              "written into or deleted; move it away or save elsewhere") from None
        except CheckpointError:
            quarantine_step_dir(final, reason="corrupt")  # ours but damaged: kept aside, never listed
            return False
        return True

    def _check_no_newer_steps(self, step: int) -> None:
        """Rank 0: refuse (or move aside) committed steps newer than ``step`` that this run did not write."""
        if self._newest_known is not None and step > self._newest_known:
            self._newest_known = step
            return
        committed = scan_committed(self.root, self.naming)
        newer = [s for s in committed if s > step]
        if newer and self.on_existing_newer == "supersede":
            log.warning("step %d: moving the newer committed steps %s of an earlier run aside "
                        "(on_existing_newer='supersede')", step, _list_steps(newer))
            for s in newer:
                quarantine_step_dir(committed[s], reason="superseded")
        elif newer:
            raise ConfigError(
                f"{self.root} already holds committed step(s) {_list_steps(newer)} newer than step {step}, which this "
                f"manager did not restore (an earlier run's?). Saving step {step} there would leave 'latest' at step "
                f"{newer[-1]} (a restart would resume it) and retention would delete this run's checkpoints first. "
                f"Call restore() to continue from step {newer[-1]}, save steps above {newer[-1]}, use a new directory, "
                "or pass CheckpointManager(..., on_existing_newer='supersede') to move the newer steps aside (kept as "
                "hidden .superseded_step_N.* directories, never listed)")
        self._newest_known = step  # every other committed step is older now

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
        return (handle is not None and handle.step == step) or (self.root / self.naming.name(step)).is_dir()

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

    def add_commit_callback(self, callback: Callable[[int, Path], None]) -> None:
        """Call ``callback(step, directory)`` after each commit, on rank 0 only.

        It runs in the writer thread once every rank has finished with the committed directory
        (no rank reads it again), before replication and retention of that save. An exception it
        raises is logged and never changes the save's outcome. Use it for links and notifications.
        """
        if not callable(callback):
            raise ConfigError(f"commit callback must be callable, got {callback!r}")
        self._commit_callbacks.append(callback)

    def _after_commit(self, step: int, final: Path, replicate: bool) -> None:
        if not self._acts_on_root:
            return
        # committed: a failing callback is reported and never fails the save
        for callback in self._commit_callbacks if self._ctx.is_coordinator else ():
            try:
                callback(step, final)
            except Exception as exc:  # noqa: BLE001
                log.error("commit callback %r for step %d (%s) failed: %s: %s", callback, step, final,
                          type(exc).__name__, exc)
        if replicate and self._replicator is not None:
            self._replicator.submit(step, final)
        try:
            self._apply_retention()
        except Exception as exc:  # noqa: BLE001
            log.error("retention after committing step %d failed (the checkpoint at %s is committed; older "
                      "checkpoints may remain): %s: %s", step, final, type(exc).__name__, exc)

    def _record_durable(self, step: int, local_dir: Path) -> None:
        try:
            update_manifest_tiers(local_dir, {"durable": {"url": self._tier.url, "committed_at": time.time()}})
        except OSError as exc:  # the local copy may have been pruned meanwhile
            log.debug("could not record the durable copy of step %d in %s: %s", step, local_dir, exc)

    def _apply_retention(self) -> None:
        if not self._acts_on_root or self.retention is None:
            return
        committed = scan_committed(self.root, self.naming)
        busy = self._replicator.busy_steps() if self._replicator is not None else set()
        for step in apply_retention(self.retention, list(committed), protected=sorted(busy)):
            try:
                remove_step_dir(committed[step])
                log.info("retention removed step %d (%s)", step, committed[step])
            except OSError as exc:
                log.warning("retention could not remove %s: %s", committed[step], exc)

    # -- listing and restoring -------------------------------------------------------------------
    def checkpoints(self) -> dict[int, Path]:
        """Committed checkpoints under the root, ``{step: directory}`` ascending (rank 0's view, agreed).

        Only directories the naming parses and whose manifest names the same step are listed;
        temporaries, hidden and foreign directories never are.
        """
        found = {s: str(p) for s, p in scan_committed(self.root, self.naming).items()} \
            if self._ctx.is_coordinator else None
        return {s: Path(p) for s, p in self._ctx.broadcast(found, what="list checkpoints").items()}

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
        only in the durable tier is downloaded (verified) first. When ``step`` is None, a candidate
        that fails verification is skipped with a warning in favour of the next older one.

        When the restored step is older than the newest committed one (an explicit older ``step``, or
        a fallback), the newer checkpoints are moved aside at the next :meth:`save` (kept as hidden
        ``.superseded_step_N.<time>`` directories), so training can continue from the restored step.

        Returns:
            The restored step (the manifest's), or None when neither ``step`` nor ``path`` is given
            and no tier holds a checkpoint.

        Raises:
            CheckpointNotFoundError: ``step`` was given but is not a committed checkpoint, or the
                root is not a directory.
            DurableUnavailableError: the durable tier is unreachable and there is no local checkpoint.
            StateMismatchError: keys, shapes or dtypes differ (missing and unexpected keys are listed).
                A failed restore leaves ``state`` as it was.
            CheckpointCorruptError: a file fails its size or checksum check.
        """
        if path is not None:
            return self._restore_paths(state, path, step, allow_cast)
        self._ckpt.wait()
        if self._nodes is not None:
            return restore_node_local(self, state, step, allow_cast)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint root {self.root} is not a directory")
        plan = self._ctx.broadcast(restore_candidates(self.root, self._tier, step, self.naming)
                                   if self._ctx.is_coordinator else None,
                                   what="restore plan")
        if isinstance(plan, BaseException):
            raise plan
        if not plan:
            log.info("no committed checkpoint under %s%s; starting from scratch", self.root,
                     f" or {self._tier.url}" if self._tier is not None else "")
            return None
        for i, (cand, where) in enumerate(plan):
            try:
                local = self._fetch(cand, where)
                t0 = time.monotonic()
                self._ckpt.load(local, state, verify=self.verify_on_load,
                                on_world_size_change=self.on_world_size_change, allow_cast=allow_cast)
            except CheckpointCorruptError as exc:
                if step is not None or i == len(plan) - 1:
                    raise
                log.warning("step %d is not usable (%s); falling back to step %d", cand, exc, plan[i + 1][0])
                continue
            log.info("[rank %d] restored step %d from %s in %.3f s", self._ctx.rank, cand, local,
                     time.monotonic() - t0)
            self._restored_step = cand
            self._newest_known = None
            return cand
        return None  # unreachable: the loop returns or raises

    def _restore_paths(self, state: Any, path: Any, step: int | None, allow_cast: bool) -> int:
        if step is not None:
            raise ConfigError("restore(): pass either step or path, not both")
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
            return manifest.step
        raise AssertionError("unreachable")  # the loop returns or raises

    def _fetch(self, step: int, where: str) -> Path:
        """Make ``step`` available locally (downloading it on the coordinator when needed); agreed by all ranks."""
        result: str | BaseException | None = None
        if self._ctx.is_coordinator:
            try:
                result = str(self._tier.download(step, self.root) if where == "durable"
                             else scan_committed(self.root, self.naming)[step])
                if where == "durable":
                    log.info("downloaded step %d from %s", step, self._tier.describe(step))
            except CheckpointError as exc:
                result = exc
        result = self._ctx.broadcast(result, what="fetch checkpoint")
        if isinstance(result, BaseException):
            raise result
        return Path(result)

    # -- lifecycle -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the in-flight save is committed; raise any background error (once)."""
        self._ckpt.wait()

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
            durable None: the store could not be listed); ``durable_newest_step`` /
            ``durable_newest_age_s``: the newest step committed in the durable tier (listed there, so
            also after a restart) and the age of its state in seconds (the exposure window).
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
        try:
            durable = self._tier.list_steps()
        except DurableUnavailableError as exc:
            log.debug("health: %s", exc)
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

    def wait_durable(self, timeout_seconds: float | None = None) -> bool:
        """Block until every queued replication is done; False on timeout (or on non-coordinator ranks: True)."""
        self._ckpt.wait()
        return self._replicator.wait(timeout_seconds) if self._replicator is not None else True

    def close(self) -> None:
        """Wait for the in-flight save (and, up to ``durable_flush_timeout_seconds``, its replication),
        release everything; raise any pending error once."""
        try:
            self._ckpt.close()
        finally:
            if self._replicator is not None:
                self._replicator.close(self._durable_flush_timeout)
            self._preemption.restore()
            self._lock.release()
