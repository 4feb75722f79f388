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
from pathlib import Path
from typing import Any

from torch_ckpt.cadence import Cadence
from torch_ckpt.checkpointer import AsyncCheckpointer
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
from torch_ckpt.restore import RANK_LOCAL_POLICIES
from torch_ckpt.retention import KeepAny, KeepEveryNSteps, KeepLatest, RetentionPolicy, apply_retention

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


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
        if on_world_size_change not in RANK_LOCAL_POLICIES:
            raise ConfigError(f"on_world_size_change must be one of {RANK_LOCAL_POLICIES}, got {on_world_size_change!r}")
        if retention is None and keep_last is not None:
            parts: list[RetentionPolicy] = [KeepLatest(count=keep_last)]
            if keep_every_n_steps is not None:
                parts.append(KeepEveryNSteps(every_steps=keep_every_n_steps))
            retention = parts[0] if len(parts) == 1 else KeepAny(tuple(parts))
        self.root = Path(str(directory).removeprefix("file://")).expanduser().absolute()
        self.retention = retention
        self.verify_on_load = bool(verify_on_load)
        self.on_world_size_change = on_world_size_change
        self._cadence = Cadence(save_policy) if save_policy is not None else None
        self._ckpt = AsyncCheckpointer(async_save=async_save, persist=persist, overlap_staging=overlap_staging,
                                       writer_niceness=writer_niceness, staging_budget_bytes=staging_budget_bytes,
                                       thread_count=thread_count, timeout_seconds=timeout_seconds,
                                       process_group=process_group)
        self._ctx = self._ckpt.ctx
        error = None
        if self._ctx.is_coordinator:
            try:
                check_root(self.root, create=True)
                clean_stale_temporaries(self.root)
            except CheckpointError as exc:
                error = exc
        status = self._ctx.broadcast(None if error is None else str(error), what="init")
        if error is not None or status is not None:
            self._ckpt.close()
            raise error or CheckpointError(f"rank 0 could not prepare {self.root}: {status}")

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ckpt.__exit__(exc_type, exc, tb)

    @property
    def checkpointer(self) -> AsyncCheckpointer:
        """The engine doing the saves and loads."""
        return self._ckpt

    @property
    def last_stats(self) -> SaveStats | None:
        """Statistics of the last committed save on this rank."""
        return self._ckpt.last_stats

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, state: Any) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; returns once the state is staged (async) or committed (sync).

        Waits first for the previous save (at most one in flight) and raises, once, any error of an
        earlier background save.

        Args:
            step: training step (int >= 0), not yet committed under this root.
            state: a :class:`~torch_ckpt.TrainState`, any ``Stateful`` or a nested dict of tensors
                and JSON values.

        Returns:
            A :class:`SaveHandle` whose ``staged`` future completes when the live tensors may change
            and whose ``committed`` future completes when the checkpoint is durable and listed.

        Raises:
            ConfigError: bad or already committed step, or a state value that cannot be stored
                without pickling.
            CheckpointError: a previous background save failed (raised once).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        self._ckpt.wait()
        self._check_new_step(step)
        handle = self._ckpt.save(self.root / step_dir_name(step), state, step=step,
                                 on_committed=lambda _: self._apply_retention())
        if self._cadence is not None:
            self._cadence.record_save_started(handle, time.monotonic())
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
        self._ckpt.wait_staged()

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
        self._ckpt.wait()
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
        t0 = time.monotonic()
        self._ckpt.load(step_dir, state, verify=self.verify_on_load, on_world_size_change=self.on_world_size_change)
        log.info("[rank %d] restored step %d from %s in %.3f s", self._ctx.rank, step, step_dir,
                 time.monotonic() - t0)
        return step

    # -- lifecycle -------------------------------------------------------------------------------
    # -- lifecycle -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the in-flight save is committed; raise any background error (once)."""
        self._ckpt.wait()

    def close(self) -> None:
        """Wait for the in-flight save and release everything; raise any pending error once."""
        self._ckpt.close()
