"""``CheckpointManager``: save asynchronously, commit atomically, keep what retention says, resume.

The manager only orchestrates: staging lives in :mod:`torch_ckpt.staging`, writing and commit in
:mod:`torch_ckpt.persist`, loading in :mod:`torch_ckpt.restore`, retention in
:mod:`torch_ckpt.retention`, collectives in :mod:`torch_ckpt.dist`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_ckpt.cadence import Cadence
from torch_ckpt.codec import split_state
from torch_ckpt.dist import DistContext
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.layout import (
    check_root,
    clean_stale_temporaries,
    quarantine_step_dir,
    read_manifest,
    remove_step_dir,
    scan_committed,
    step_dir_name,
)
from torch_ckpt.persist import PersistRequest, persist_checkpoint
from torch_ckpt.restore import RANK_LOCAL_POLICIES, load_into
from torch_ckpt.retention import KeepAny, KeepEveryNSteps, KeepLatest, RetentionPolicy, apply_retention
from torch_ckpt.staging import HostStager
from torch_ckpt.writer_process import ProcessWriter

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _SaveJob:
    """One save on its way from the live state to a committed directory."""

    step: int
    tensors: dict[str, torch.Tensor]
    tree: Any
    fits: bool
    t0: float
    ready_event: Any = None
    to_write: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: tuple = ()
    deferred_keys: set[str] | None = None
    early_s: float = 0.0


def _cuda_ready_event(tensors: dict[str, torch.Tensor]) -> Any:
    """Event on the caller's CUDA stream marking the values to save (None without CUDA tensors)."""
    if not any(t.device.type == "cuda" for t in tensors.values()):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _lower_thread_priority(niceness: int) -> None:
    """Raise the nice value of the calling (writer) thread on Linux."""
    if niceness and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        except OSError as exc:
            log.warning("could not lower the checkpoint writer's priority: %s", exc)


class CheckpointManager:
    """Asynchronous, atomic DCP checkpoints of one run root, with retention and resume.

    Every rank constructs the manager and calls :meth:`save`, :meth:`restore`,
    :meth:`latest_step` and :meth:`all_steps` collectively (same order on every rank).

    Args:
        directory: local run root; created if missing. One manager owns one root.
        keep_last: keep the ``keep_last`` newest committed checkpoints (>= 1; None keeps all).
        keep_every_n_steps: additionally keep every step that is a multiple of this.
        retention: a custom :class:`~torch_ckpt.retention.RetentionPolicy` (replaces the two above).
        async_save: persist in the background (default) or inside :meth:`save`.
        persist: where background writes run: "thread" (default; lowest latency to durable) or
            "process" (a writer process per rank reading a shared-memory arena; keeps the write's
            Python work off the trainer's GIL; not for DTensor/FSDP2 states).
        overlap_staging: copy parameters and optimizer state in the background, overlapping the
            next forward/backward; the manager waits for the copy before any optimizer of the state
            takes its next ``step()``. Everything else (buffers such as BatchNorm statistics, RNG,
            dataloader) is still copied inside :meth:`save`. Code that mutates parameters or
            optimizer state outside ``optimizer.step()`` must call :meth:`wait_staged` first. For
            states without ``optimizer_owned_keys`` (plain dicts) everything is copied in ``save()``.
        writer_niceness: nice increment of the writer thread/process (Linux; 0 = unchanged). On a
            2-core machine 19 cuts the writer's slowdown of training from about 2x to about 1.2x at
            the price of a slower write.
        staging_budget_bytes: host bytes for the reusable staging buffers; default half of the
            available RAM (psutil). A state that does not fit is saved synchronously straight from
            the live tensors (bounded memory, logged), never by over-allocating.
        thread_count: DCP writer threads per rank.
        verify_on_load: check CRC-32 of every file before loading (sizes are always checked).
        on_world_size_change: what :meth:`restore` does with rank-local state (RNG, dataloader
            position) when the world size differs from the saved one: "error" (default) or
            "keep_live" (keep this run's own values).
        timeout_seconds: limit for checkpoint collectives between ranks (seconds).
        process_group: ranks taking part (default: all); checkpoint traffic always uses private
            gloo groups created from it.
        save_policy: when :meth:`should_save` says yes: a :class:`~torch_ckpt.schedule.SavePolicy`
            such as ``YoungDaly(mtbf_seconds="8h")`` (MTBF-optimal), ``EveryNSteps(100)``,
            ``EveryNSeconds("15m")`` or ``AnyOf(...)``. Rank 0 decides; every rank gets its answer.

    Raises:
        ConfigError: invalid arguments.
        CheckpointWriteError: ``directory`` is a file or cannot be created.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        keep_every_n_steps: int | None = None,
        retention: RetentionPolicy | None = None,
        async_save: bool = True,
        persist: str = "thread",
        overlap_staging: bool = False,
        writer_niceness: int = 0,
        staging_budget_bytes: int | None = None,
        thread_count: int = 1,
        verify_on_load: bool = True,
        on_world_size_change: str = "error",
        timeout_seconds: float = 600.0,
        process_group: Any = None,
        save_policy: Any = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or str(directory) == "":
            raise ConfigError(f"directory must be a non-empty path, got {directory!r}")
        if "://" in str(directory) and not str(directory).startswith("file://"):
            raise ConfigError(f"directory {directory!r} must be a local path; remote URLs go to a durable tier")
        if thread_count < 1:
            raise ConfigError(f"thread_count must be >= 1, got {thread_count!r}")
        if persist not in ("thread", "process"):
            raise ConfigError(f"persist must be 'thread' or 'process', got {persist!r}")
        if not isinstance(writer_niceness, int) or not 0 <= writer_niceness <= 19:
            raise ConfigError(f"writer_niceness must be an int in [0, 19], got {writer_niceness!r}")
        if timeout_seconds <= 0:
            raise ConfigError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if on_world_size_change not in RANK_LOCAL_POLICIES:
            raise ConfigError(f"on_world_size_change must be one of {RANK_LOCAL_POLICIES}, got {on_world_size_change!r}")
        if retention is None:
            parts: list[RetentionPolicy] = []
            if keep_last is not None:
                parts.append(KeepLatest(count=keep_last))
            if keep_every_n_steps is not None:
                parts.append(KeepEveryNSteps(every_steps=keep_every_n_steps))
            retention = None if keep_last is None else (parts[0] if len(parts) == 1 else KeepAny(tuple(parts)))
        self.root = Path(str(directory).removeprefix("file://")).expanduser().absolute()
        self.retention = retention
        self.async_save = bool(async_save)
        self.thread_count = int(thread_count)
        self.verify_on_load = bool(verify_on_load)
        self.on_world_size_change = on_world_size_change
        self._ctx = DistContext(timeout_seconds=timeout_seconds, process_group=process_group)
        self.persist_mode = persist
        self.overlap_staging = bool(overlap_staging)
        self.writer_niceness = writer_niceness
        self._stager = HostStager(budget_bytes=staging_budget_bytes, share_memory=persist == "process")
        self._process_writer: ProcessWriter | None = None
        self._hooked: dict[int, Any] = {}
        self._staged_future: Future | None = None
        self._cadence = Cadence(save_policy) if save_policy is not None else None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
        self._pending_error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.last_stats: SaveStats | None = None
        error = None
        if self._ctx.is_coordinator:
            try:
                check_root(self.root, create=True)
                clean_stale_temporaries(self.root)
            except CheckpointError as exc:
                error = exc
        status = self._ctx.broadcast(None if error is None else str(error), what="init")
        if error is not None:
            raise error
        if status is not None:
            raise CheckpointError(f"rank 0 could not prepare {self.root}: {status}")
        if persist == "process" and self.async_save:
            self._process_writer = ProcessWriter(self._ctx, timeout_seconds=timeout_seconds, niceness=writer_niceness)

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception; still flush and log any save error
            try:
                self.close()
            except Exception:  # noqa: BLE001
                log.exception("checkpoint error while closing after another exception")

    # -- errors ----------------------------------------------------------------------------------
    def _raise_pending(self) -> None:
        with self._lock:
            err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err

    def _ensure_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for {self.root} is closed")

    def _wait_inflight(self) -> float:
        handle = self._inflight
        if handle is None:
            return 0.0
        t0 = time.monotonic()
        try:
            handle.committed.result()
        except BaseException:  # noqa: BLE001 - already recorded as the pending error
            pass
        self._inflight = None
        return time.monotonic() - t0

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: Any) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; returns once the state is staged (async) or committed (sync).

        Waits first for the previous save (at most one in flight) and raises, once, any error of an
        earlier background save.

        Args:
            step: training step (int >= 0), unique within this root.
            state: a :class:`~torch_ckpt.TrainState`, any ``Stateful`` or a nested dict of tensors
                and JSON values.

        Returns:
            A :class:`SaveHandle` whose ``staged`` future is done and whose ``committed`` future
            completes when the checkpoint is durable and listed.

        Raises:
            ConfigError: bad step, or a state value that cannot be stored without pickling.
            CheckpointError: a previous background save failed (raised once).
        """
        self._ensure_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        t0 = time.monotonic()
        wait_prev = self._wait_inflight()
        self._raise_pending()
        self._check_new_step(step)
        stats = SaveStats(step=step, wait_for_previous_s=wait_prev)
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        tensors, tree = split_state(sd, rank_local_keys=tuple(getattr(state, "rank_local_keys", ())))
        if self._process_writer is not None and any(type(t) is not torch.Tensor for t in tensors.values()):
            raise ConfigError("persist='process' supports plain tensors only; this state holds DTensor/sharded "
                              "tensors (FSDP2/TP). Use persist='thread'.")
        fits = self._stager.fits(tensors)
        background = self.async_save and fits
        stats.mode = "async" if background else ("sync" if fits else "sync-over-budget")
        if not fits:
            log.warning("state of %d bytes exceeds the staging budget of %d bytes: saving step %d synchronously "
                        "from the live tensors (raise staging_budget_bytes to save asynchronously)",
                        self._stager.required_bytes(tensors), self._stager.budget_bytes, step)
        job = _SaveJob(step=step, tensors=tensors, tree=tree, fits=fits, t0=t0,
                       ready_event=_cuda_ready_event(tensors) if self.overlap_staging else None)
        handle = SaveHandle(step, Future(), Future(), stats)
        self._inflight = handle
        if background and self.overlap_staging:
            owned = state.optimizer_owned_keys(tensors) if callable(getattr(state, "optimizer_owned_keys", None)) \
                else set()
            # what forward passes may change (buffers, plain dict values) is copied now; parameters and
            # optimizer state are copied in the background, before the next optimizer.step()
            t = time.monotonic()
            self._stager.stage(tensors, only=set(tensors) - owned)
            job.deferred_keys, job.early_s = owned, time.monotonic() - t
            self._install_step_hooks(state)
            self._staged_future = handle.staged
        else:
            self._stage(job, handle)
        if self._cadence is not None:
            stats.blocking_s = time.monotonic() - t0
            self._cadence.record_save_started(handle, time.monotonic())
        if background:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch_ckpt_writer",
                                                    initializer=_lower_thread_priority,
                                                    initargs=(self.writer_niceness,))
            stats.blocking_s = time.monotonic() - t0  # the submit below is the only remaining work
            self._executor.submit(self._run_job, job, handle)
        else:
            self._run_job(job, handle)
            stats.blocking_s = time.monotonic() - t0
            self._raise_pending()
        return handle

    def _check_new_step(self, step: int) -> None:
        """Refuse a step that is already committed; move a damaged directory of that step aside."""
        problem = None
        if self._ctx.is_coordinator:
            final = self.root / step_dir_name(step)
            if final.exists():
                try:
                    read_manifest(final)
                    problem = f"step {step} is already committed at {final}; save under a new step"
                except CheckpointError:
                    quarantine_step_dir(final)
        problem = self._ctx.broadcast(problem, what="step check")
        if problem:
            raise ConfigError(problem)

    def should_save(self, step: int) -> bool:
        """Record that training step ``step`` finished and ask the save policy; same answer on every rank.

        Call once per step, on every rank. Without a ``save_policy`` this raises ConfigError.
        """
        if self._cadence is None:
            raise ConfigError("should_save() needs CheckpointManager(save_policy=...), e.g. YoungDaly(mtbf_seconds='8h')")
        now = time.monotonic()
        self._cadence.record_step(step, now)
        decision = self._cadence.decide(step, now) if self._ctx.is_coordinator else None
        return bool(self._ctx.broadcast(decision, what="save decision"))

    def save_if_due(self, step: int, state: Any) -> SaveHandle | None:
        """:meth:`save` when :meth:`should_save` says so; returns the handle or None."""
        return self.save(step, state) if self.should_save(step) else None

    def schedule_info(self) -> dict[str, Any]:
        """The save policy's last decision inputs and outputs (``describe()``), or {} without a policy."""
        return self._cadence.policy.describe() if self._cadence is not None else {}

    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads the live tensors (see ``overlap_staging``)."""
        fut = self._staged_future
        if fut is not None:
            futures_wait([fut])

    def _install_step_hooks(self, state: Any) -> None:
        optimizers = state.optimizers() if callable(getattr(state, "optimizers", None)) else []
        for opt in optimizers:
            if id(opt) not in self._hooked:
                self._hooked[id(opt)] = opt.register_step_pre_hook(lambda *_: self.wait_staged())

    def _stage(self, job: _SaveJob, handle: SaveHandle) -> None:
        t = time.monotonic()
        if job.fits:
            staged = self._stager.stage(job.tensors, ready_event=job.ready_event, only=job.deferred_keys)
            staged.synchronize()
            job.to_write, job.layout, handle.stats.bytes = staged.tensors, staged.layout, staged.nbytes
        else:
            job.to_write, handle.stats.bytes = job.tensors, self._stager.required_bytes(job.tensors)
        job.tensors = {}
        handle.stats.staging_s = time.monotonic() - t + job.early_s
        handle.staged.set_result(None)

    def _run_job(self, job: _SaveJob, handle: SaveHandle) -> None:
        try:
            if not handle.staged.done():
                try:
                    self._stage(job, handle)
                except BaseException as exc:
                    handle.staged.set_exception(exc)
                    raise
            t_start = time.monotonic()
            timings = {"staging_s": handle.stats.staging_s}
            if self._process_writer is not None and job.fits:
                fields = dict(root=self.root, step=job.step, tree=job.tree, tensor_bytes=handle.stats.bytes,
                              thread_count=self.thread_count, timings=timings)
                final = self._process_writer.persist(arena=self._stager.arena, layout=job.layout, fields=fields)
            else:
                req = PersistRequest(root=self.root, step=job.step, tensors=job.to_write, tree=job.tree,
                                     tensor_bytes=handle.stats.bytes, thread_count=self.thread_count,
                                     timings=timings)
                final = persist_checkpoint(req, self._ctx)
            stats = handle.stats
            stats.persist_s = time.monotonic() - t_start
            stats.total_s = time.monotonic() - job.t0
            stats.files_bytes = sum(f["bytes"] for f in read_manifest(final).files.values())
            self.last_stats = stats
            log.info("[rank %d] committed step %d: %d bytes, blocking %.3f s, staging %.3f s, persist %.3f s",
                     self._ctx.rank, job.step, stats.bytes, stats.blocking_s, stats.staging_s, stats.persist_s)
            self._apply_retention()
            handle.committed.set_result(str(final))
        except BaseException as exc:  # noqa: BLE001 - surfaced on the caller's thread
            log.error("[rank %d] checkpoint step %d failed: %s", self._ctx.rank, job.step, exc)
            with self._lock:
                if self._pending_error is None:
                    self._pending_error = exc
            handle.committed.set_exception(exc)
        finally:
            job.to_write = {}

    def _apply_retention(self) -> None:
        if not self._ctx.is_coordinator or self.retention is None:
            return
        committed = scan_committed(self.root)
        for step in apply_retention(self.retention, list(committed)):
            try:
                remove_step_dir(committed[step])
                log.info("retention removed step %d (%s)", step, committed[step])
            except OSError as exc:
                log.warning("retention could not remove %s: %s", committed[step], exc)

    # -- listing and restoring -------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps in ascending numeric order (rank 0's view, agreed by every rank)."""
        steps = list(scan_committed(self.root)) if self._ctx.is_coordinator else None
        return self._ctx.broadcast(steps, what="list steps")

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, state: Any, step: int | None = None) -> int | None:
        """Load a committed checkpoint into ``state`` in place.

        Args:
            state: the live :class:`~torch_ckpt.TrainState`, ``Stateful`` or dict to load into.
            step: the step to load; None loads the newest committed checkpoint.

        Returns:
            The restored step, or None when ``step`` is None and the root holds no checkpoint.

        Raises:
            CheckpointNotFoundError: ``step`` was given but is not a committed checkpoint, or the
                root is not a directory.
            StateMismatchError: keys or shapes differ (missing and unexpected keys are listed).
            CheckpointCorruptError: a file fails its size or checksum check.
        """
        self._ensure_open()
        self._wait_inflight()
        self._raise_pending()
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint root {self.root} is not a directory")
        steps = self.all_steps()
        if step is None:
            if not steps:
                log.info("no committed checkpoint under %s; starting from scratch", self.root)
                return None
            step = steps[-1]
        elif step not in steps:
            candidate = self.root / step_dir_name(step)
            if candidate.is_dir():  # present but not listed: say what is wrong with it
                manifest = read_manifest(candidate)
                raise CheckpointCorruptError(f"{candidate}: manifest says step {manifest.step}, not {step}")
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint under {self.root}; committed steps: {steps[-10:]}")
        step_dir = scan_committed(self.root).get(step) if self._ctx.is_coordinator else None
        step_dir = Path(self._ctx.broadcast(None if step_dir is None else str(step_dir), what="restore path"))
        manifest = read_manifest(step_dir)
        t0 = time.monotonic()
        load_into(state, step_dir, manifest, self._ctx, verify=self.verify_on_load,
                  on_world_size_change=self.on_world_size_change)
        log.info("[rank %d] restored step %d from %s in %.3f s", self._ctx.rank, step, step_dir,
                 time.monotonic() - t0)
        return step

    # -- lifecycle -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the in-flight save is committed; raise any background error (once)."""
        self._wait_inflight()
        self._raise_pending()

    def close(self) -> None:
        """Wait for the in-flight save, release buffers and groups; raise any pending error once."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._process_writer is not None:
                self._process_writer.close()
            for hook in self._hooked.values():
                hook.remove()
            self._hooked.clear()
            self._stager.release()
            self._ctx.destroy()
        self._raise_pending()
