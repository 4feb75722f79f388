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
from pathlib import Path
from typing import Any

from torch_ckpt.codec import split_state
from torch_ckpt.dist import DistContext
from torch_ckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.layout import check_root, clean_stale_temporaries, read_manifest, remove_step_dir, scan_committed
from torch_ckpt.persist import PersistRequest, persist_checkpoint
from torch_ckpt.restore import RANK_LOCAL_POLICIES, load_into
from torch_ckpt.retention import KeepAny, KeepEveryNSteps, KeepLatest, RetentionPolicy, apply_retention
from torch_ckpt.staging import HostStager

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


def _done_future(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class CheckpointManager:
    """Asynchronous, atomic DCP checkpoints of one run root, with retention and resume.

    Every rank constructs the manager and calls :meth:`save`, :meth:`restore`,
    :meth:`latest_step` and :meth:`all_steps` collectively (same order on every rank).

    Args:
        directory: local run root; created if missing. One manager owns one root.
        keep_last: keep the ``keep_last`` newest committed checkpoints (>= 1; None keeps all).
        keep_every_n_steps: additionally keep every step that is a multiple of this.
        retention: a custom :class:`~torch_ckpt.retention.RetentionPolicy` (replaces the two above).
        async_save: persist in a background thread (default) or inside :meth:`save`.
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
        staging_budget_bytes: int | None = None,
        thread_count: int = 1,
        verify_on_load: bool = True,
        on_world_size_change: str = "error",
        timeout_seconds: float = 600.0,
        process_group: Any = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or str(directory) == "":
            raise ConfigError(f"directory must be a non-empty path, got {directory!r}")
        if "://" in str(directory) and not str(directory).startswith("file://"):
            raise ConfigError(f"directory {directory!r} must be a local path; remote URLs go to a durable tier")
        if thread_count < 1:
            raise ConfigError(f"thread_count must be >= 1, got {thread_count!r}")
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
        self._stager = HostStager(budget_bytes=staging_budget_bytes)
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
        stats = SaveStats(step=step, wait_for_previous_s=wait_prev)
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        tensors, tree = split_state(sd, rank_local_keys=tuple(getattr(state, "rank_local_keys", ())))
        fits = self._stager.fits(tensors)
        t_stage = time.monotonic()
        if fits:
            staged = self._stager.stage(tensors)
            staged.synchronize()
            to_write, nbytes = staged.tensors, staged.nbytes
            stats.mode = "async" if self.async_save else "sync"
        else:
            log.warning("state of %d bytes exceeds the staging budget of %d bytes: saving step %d synchronously "
                        "from the live tensors (raise staging_budget_bytes to save asynchronously)",
                        self._stager.required_bytes(tensors), self._stager.budget_bytes, step)
            to_write, nbytes = tensors, self._stager.required_bytes(tensors)
            stats.mode = "sync-over-budget"
        stats.staging_s = time.monotonic() - t_stage
        stats.bytes = nbytes
        req = PersistRequest(root=self.root, step=step, tensors=to_write, tree=tree, tensor_bytes=nbytes,
                             thread_count=self.thread_count, timings={"staging_s": stats.staging_s})
        committed: Future = Future()
        handle = SaveHandle(step, _done_future(), committed, stats)
        if self.async_save and fits:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch_ckpt_writer")
            self._inflight = handle
            stats.blocking_s = time.monotonic() - t0  # the submit below is the only remaining work
            self._executor.submit(self._run_persist, req, handle, t0)
        else:
            self._run_persist(req, handle, t0)
            stats.blocking_s = time.monotonic() - t0
            self._raise_pending()
        return handle

    def _run_persist(self, req: PersistRequest, handle: SaveHandle, t0: float) -> None:
        t_start = time.monotonic()
        try:
            final = persist_checkpoint(req, self._ctx)
            handle.stats.persist_s = time.monotonic() - t_start
            handle.stats.total_s = time.monotonic() - t0
            handle.stats.files_bytes = sum(f["bytes"] for f in read_manifest(final).files.values())
            self.last_stats = handle.stats
            log.info("[rank %d] committed step %d: %d bytes, blocking %.3f s, staging %.3f s, persist %.3f s",
                     self._ctx.rank, req.step, handle.stats.bytes, handle.stats.blocking_s,
                     handle.stats.staging_s, handle.stats.persist_s)
            self._apply_retention()
            handle.committed.set_result(str(final))
        except BaseException as exc:  # noqa: BLE001 - surfaced on the caller's thread
            log.error("[rank %d] checkpoint step %d failed: %s", self._ctx.rank, req.step, exc)
            with self._lock:
                if self._pending_error is None:
                    self._pending_error = exc
            handle.committed.set_exception(exc)

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
            self._stager.release()
            self._ctx.destroy()
        self._raise_pending()
