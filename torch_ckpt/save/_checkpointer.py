"""``AsyncCheckpointer``: asynchronous, atomic DCP saves of a state to a given directory.

This is the engine under :class:`~torch_ckpt.CheckpointManager` and the framework adapters: it
stages the state into a reusable host arena (:mod:`torch_ckpt.save._staging`), persists it in a writer
thread or process (:mod:`torch_ckpt.save._persist`, :mod:`torch_ckpt.save._writer_process`) with an atomic
commit, keeps at most one save in flight, and raises background errors on the caller's thread
exactly once. It knows nothing about steps, naming or retention. A save's part up to the submit
(capture, staging, the ranks' agreement) is in :mod:`torch_ckpt.save._prepare`; this module
submits it, runs it in the writer, surfaces its outcome, loads, and owns the engine's lifecycle:
each background save runs in a writer thread of its own that ends with it (no idle thread), and
interpreter exit waits for a save still in flight (:mod:`torch_ckpt._lifecycle`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from torch_ckpt._lifecycle import finish_at_exit
from torch_ckpt._logging import get_logger
from torch_ckpt._values import check_int, to_seconds
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointError, ConfigError
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.restore._restore import RANK_LOCAL_POLICIES, load_into
from torch_ckpt.root._layout import SharedRoot, read_manifest
from torch_ckpt.root._temporaries import new_incarnation, partial_path, reserve, unreserve
from torch_ckpt.save._persist import PersistRequest, persist_checkpoint
from torch_ckpt.save._prepare import CheckpointerPrepareMixin, SaveJob
from torch_ckpt.save._staging import HostStager
from torch_ckpt.save._writer_process import ProcessWriter

__all__ = ["AsyncCheckpointer", "close_on_exit"]

log = get_logger(__name__)


def _lower_thread_priority(niceness: int) -> None:
    """Raise the nice value of the calling (writer) thread on Linux."""
    if niceness and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        except OSError as exc:
            log.warning("could not lower the checkpoint writer's priority: %s", exc)


def close_on_exit(close: Callable[[], None], exc_type: type | None) -> None:
    """``__exit__`` helper: close; when another exception is propagating, log a close error instead of masking it."""
    if exc_type is None:
        close()
        return
    try:
        close()
    except Exception:  # noqa: BLE001
        log.exception("checkpoint error while closing after another exception")


class AsyncCheckpointer(CheckpointerPrepareMixin):
    """Asynchronous, atomic DCP saves to explicit directories; collective over all ranks.

    Args:
        async_save: persist in the background (default) or inside :meth:`save`.
        persist: "thread" (default; lowest latency to durable) or "process" (a writer process per
            rank reading a shared-memory arena; keeps the write's Python work off the trainer's
            GIL; plain tensors only, not DTensor/FSDP2 states).
        overlap_staging: copy parameters and optimizer state in the background, overlapping the
            next forward/backward; the checkpointer waits for the copy before any optimizer of the
            state takes its next ``step()``. Everything else (buffers such as BatchNorm statistics,
            RNG, dataloader) is still copied inside :meth:`save`. Code that mutates parameters or
            optimizer state outside ``optimizer.step()`` must call :meth:`wait_staged` first. For
            states without ``optimizer_owned_keys`` (plain dicts) everything is copied in ``save()``.
        writer_niceness: nice increment of the writer thread/process (Linux; 0 = unchanged). On a
            2-core machine 19 cuts the writer's slowdown of training from about 2x to about 1.2x at
            the price of a slower write.
        staging_budget_bytes: host bytes for the staging arena; default half of the available memory
            at each save (psutil, capped by the memory cgroup; see :mod:`torch_ckpt.save._memory_limits`),
            split over the local ranks. A state that does not fit, or whose arena cannot be
            allocated, is saved synchronously straight from the live tensors (bounded memory,
            logged), never by over-allocating.
        thread_count: DCP writer threads (and files) per rank. The default 2 overlaps one thread's
            CRC-32 and fsync with the other's writes. An error in any writer thread fails the save.
        timeout_seconds: limit for checkpoint collectives between ranks (seconds, or a duration such as "10m").
        process_group: ranks taking part (default: all); checkpoint traffic always uses private
            gloo groups created from it.
        on_write_error: "raise" (default): a failed background save is raised on the caller's
            thread at the next call; "warn": it is logged as a warning and counted in
            :attr:`failed_saves` so training continues (the step is never committed either way).
        distributed: True (default): saves and loads are collective over all ranks of
            ``process_group``; False: this process saves and loads alone (non-collective), even in a
            distributed job.

    Raises:
        ConfigError: invalid arguments.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        persist: str = "thread",
        overlap_staging: bool = False,
        writer_niceness: int = 0,
        staging_budget_bytes: int | None = None,
        thread_count: int = 2,
        timeout_seconds: float = 600.0,
        process_group: Any = None,
        on_write_error: str = "raise",
        distributed: bool = True,
    ) -> None:
        if on_write_error not in ("raise", "warn"):
            raise ConfigError(f"on_write_error must be 'raise' or 'warn', got {on_write_error!r}")
        check_int("thread_count", thread_count, 1, 256)  # the bound CheckpointConfig sets
        if persist not in ("thread", "process"):
            raise ConfigError(f"persist must be 'thread' or 'process', got {persist!r}")
        check_int("writer_niceness", writer_niceness, 0, 19)
        timeout_seconds = to_seconds("timeout_seconds", timeout_seconds, positive=True)
        self.async_save = bool(async_save)
        self.on_write_error = on_write_error
        self.failed_saves: list[dict[str, Any]] = []
        self.thread_count = thread_count
        self.persist_mode = persist
        self.overlap_staging = bool(overlap_staging)
        self.writer_niceness = writer_niceness
        self._ctx = DistContext(timeout_seconds=timeout_seconds, process_group=process_group,
                                distributed=distributed)
        self._stager = HostStager(budget_bytes=staging_budget_bytes, share_memory=persist == "process")
        self._process_writer: ProcessWriter | None = None
        self._hooked: dict[int, Any] = {}
        self._staged_future: Future | None = None
        self._writer: threading.Thread | None = None  # the thread of the save in flight; it ends with the save
        self._inflight: SaveHandle | None = None
        self._job: Future | None = None  # the writer's last job, done once its cleanup (deletions) is too
        self._pending_error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.last_stats: SaveStats | None = None
        self._incarnation = new_incarnation()
        self._failed_names: list[str] = []  # final names of failed saves whose temporaries the next save removes
        # the root layout, set by the manager (root._layout.SharedRoot; root._nodes.NodeLayout: each node commits)
        self.layout: Any = SharedRoot(self._ctx.rank)
        if persist == "process" and self.async_save:
            self._process_writer = ProcessWriter(self._ctx, timeout_seconds=timeout_seconds, niceness=writer_niceness)
        finish_at_exit(self, 0)

    @property
    def in_flight(self) -> SaveHandle | None:
        """The handle of the save not yet committed (or failed), if any."""
        handle = self._inflight
        return None if handle is None or handle.done() else handle

    @property
    def incarnation(self) -> str:
        """Random hex id of this checkpointer; its temporaries are named ``.NAME.tmp.<incarnation>``.

        Rank 0's id names the temporaries of a collective save; other ranks' ids are not used.
        """
        return self._incarnation

    @property
    def ctx(self) -> DistContext:
        """Rank, world size and the checkpoint process groups."""
        return self._ctx

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        close_on_exit(self.close, exc_type)

    # -- errors ----------------------------------------------------------------------------------
    def _raise_pending(self) -> None:
        with self._lock:
            err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err

    def _ensure_open(self) -> None:
        if self._closed:
            raise CheckpointError("this checkpointer is closed; create a new one")

    def _wait_inflight(self) -> float:
        handle = self._inflight
        if handle is None:
            return 0.0
        t0 = time.monotonic()
        try:
            handle.committed.result()
        except BaseException as exc:  # noqa: BLE001
            if not (handle.committed.done() and handle.committed.exception() is exc):
                raise  # interrupted while waiting (Ctrl-C), not the save's own error: propagate
            # the save's own error, already recorded as the pending error
        self._inflight = None
        return time.monotonic() - t0

    # -- saving ----------------------------------------------------------------------------------
    def save(self, final: str | os.PathLike, state: Any, *, step: int = 0,
             on_committed: Callable[[Path], None] | None = None, started_at: float | None = None,
             waited_s: float = 0.0, prepare: Callable[[], None] | None = None,
             replace: bool | Callable[[], bool] = False,
             extra_dir: str | os.PathLike | Callable[[], Any] | None = None,
             lineage: Any = None) -> SaveHandle:
        """Checkpoint ``state`` into directory ``final``; returns once staged (async) or committed (sync).

        Collective: every rank calls it with the same ``final`` and ``step``. Waits first for the
        previous save (at most one in flight) and raises, once, any error of an earlier background
        save. Before anything is submitted the ranks agree (one small all-gather on the checkpoint
        group): when any rank failed to prepare its part (an unsupported value, a staging error, a
        previous error) or the ranks name different steps or directories, every rank raises for
        this step at once and nothing is written; later saves work normally.

        Args:
            final: the directory to create (missing, or empty: a reservation); created empty by the
                committing rank before this returns (the name is taken at once), written inside it as
                a hidden ``.torch-ckpt.partial.<incarnation>`` and committed when complete (see
                :mod:`torch_ckpt.root._temporaries`).
            state: a :class:`~torch_ckpt.TrainState`, any ``Stateful`` or a nested dict of tensors
                and plain values (see :mod:`torch_ckpt.format._codec` for the supported values).
            step: recorded in the manifest.
            on_committed: called on every rank with the committed directory, in the writer thread,
                after the commit and before ``committed`` resolves (used for retention). It may
                return a callable, run in the writer thread right after ``committed`` resolves
                (work that must not delay durability, e.g. deleting retired checkpoints; an
                exception it raises is logged).
            started_at: ``time.monotonic()`` when the caller's save began (for ``blocking_s``), if
                the caller did work before this call (e.g. waited for the previous save).
            waited_s: seconds the caller already waited for the previous save.
            prepare: called on every rank after the previous save finished and before the state
                is captured; an exception it raises is part of the agreement (used by the manager
                for its step checks).
            replace: ``final`` may hold a committed checkpoint, replaced atomically at commit (the
                old one stays loadable until then); a callable is asked after ``prepare``.
            extra_dir: rank 0's directory of framework files (e.g. written by save hooks) moved
                into the checkpoint before its manifest, so they commit atomically with it.
            lineage: the run segment (:class:`~torch_ckpt.policy._lineage.Lineage`) rank 0 records in the
                manifest, or a callable asked after ``prepare``; None: the base segment.

        Returns:
            A :class:`SaveHandle` whose ``committed`` future completes when the checkpoint is durable.

        Raises:
            ConfigError: a state value that cannot be stored exactly (on this or another rank), or
                ranks that name different steps or directories.
            CheckpointWriteError: an OS error while preparing the save (on this rank).
            CheckpointError: another rank could not prepare the save (the rank and its error are
                named; the class follows that rank's error), or a previous background save failed
                (raised once).
        """
        self._ensure_open()
        if self._stager.lent_here():  # a save from a load_state_dict called by this checkpointer's load()
            raise ConfigError("save() was called while a restore of the same manager writes the state (from a "
                              "load_state_dict or a hook it calls); its staging memory is the restore's undo log. "
                              "Save after restore() returned")
        t0 = time.monotonic() if started_at is None else started_at
        error: Exception | None = None
        prepared = None
        try:
            prepared = self._prepare_save(final, state, step, on_committed, t0, waited_s, prepare)
            prepared[0].replace = bool(replace() if callable(replace) else replace)
            extra = extra_dir() if callable(extra_dir) else extra_dir
            prepared[0].extra_dir = None if extra is None else Path(extra)
            prepared[0].lineage = lineage() if callable(lineage) else lineage
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the agreement below
            error = exc
        try:
            self._agree(step, final, error, None if prepared is None else prepared[0].signature)
        except BaseException as exc:
            if prepared is not None:
                self._abandon(prepared[1], exc)
            raise
        job, handle, background = prepared
        self._reserve(job)
        stats = handle.stats
        if background:
            if job.progress is not None:
                # pipelined staging: the writer starts now and writes each tensor as soon as it is copied
                self._job = self._start_writer(job, handle)
                self._copy_pipelined(job, handle)
                stats.blocking_s = time.monotonic() - t0
                job.progress.finish()
                handle.staged.set_result(None)
                return handle
            stats.blocking_s = time.monotonic() - t0  # the start below is the only remaining work
            self._job = self._start_writer(job, handle)
        else:
            self._run_job(job, handle)
            stats.blocking_s = time.monotonic() - t0
            self._raise_pending()
        return handle

    def _start_writer(self, job: SaveJob, handle: SaveHandle) -> Future:
        """Run the job in a new writer thread, which ends with it; the future is done once its cleanup is.

        One thread per save (at most one in flight): no idle writer outlives a save, and what the job
        references (the manager's commit callback) is released with the thread.
        """
        done: Future = Future()
        niceness = self.writer_niceness

        def run() -> None:
            _lower_thread_priority(niceness)
            try:
                self._run_job(job, handle)
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - _run_job reports its own errors; this only ends the wait
                done.set_exception(exc)

        thread = threading.Thread(target=run, name="torch_ckpt_writer", daemon=True)  # exit: lifecycle waits
        self._writer = thread
        thread.start()
        return done

    def _join_writer(self, timeout: float | None = None) -> None:
        """Wait until the writer thread of the last save has ended (not from that thread itself)."""
        thread = self._writer
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if not thread.is_alive() and self._writer is thread:
                self._writer = None

    def _reserve(self, job: SaveJob) -> None:
        """The rank that commits ``job.final`` creates it empty now, so its name is taken once ``save()``
        returns (a framework checking whether the name exists sees it as with a synchronous save)."""
        if not self.layout.acts:
            return
        try:
            job.reserved = reserve(job.final)
        except OSError as exc:  # the writer's prepare step fails on it and reports it on every rank
            log.debug("could not reserve %s: %s", job.final, exc)

    def _run_job(self, job: SaveJob, handle: SaveHandle) -> None:
        try:
            failed = None
            if job.progress is None and not handle.staged.done():
                try:
                    self._stage(job, handle)
                except BaseException as exc:
                    handle.staged.set_exception(exc)
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    # still join the persist collectives, so every rank fails this step at once
                    failed, job.to_write, job.layout = f"{type(exc).__name__}: {exc}", {}, ()
            t_start = time.monotonic()
            # a pipelined copy fills job.timings before it marks the last tensors staged
            timings = job.timings if job.progress is not None else {"staging_s": handle.stats.staging_s}
            failed_names, self._failed_names = tuple(self._failed_names), []
            if self._process_writer is not None and (job.fits or failed is not None):
                fields = dict(final=job.final, step=job.step, tree=job.tree, tensor_bytes=handle.stats.bytes,
                              replace=job.replace, extra_dir=job.extra_dir, lineage=job.lineage,
                              thread_count=self.thread_count, timings=timings, incarnation=self._incarnation,
                              failed=failed, nodes=self.layout, failed_names=failed_names,
                              reserved=job.reserved)
                final, files_bytes = self._process_writer.persist(arena=None if failed else self._stager.arena,
                                                                  layout=job.layout, fields=fields)
            else:
                req = PersistRequest(final=job.final, step=job.step, tensors=job.to_write, tree=job.tree,
                                     tensor_bytes=handle.stats.bytes, thread_count=self.thread_count,
                                     timings=timings, incarnation=self._incarnation, failed=failed,
                                     replace=job.replace, extra_dir=job.extra_dir, nodes=self.layout,
                                     progress=job.progress, failed_names=failed_names,
                                     lineage=job.lineage, reserved=job.reserved)
                with self._ctx.background_work():  # no rebuild of the groups under this persist
                    final = persist_checkpoint(req, self._ctx)
                files_bytes = req.committed_bytes
            stats = handle.stats
            stats.persist_s = time.monotonic() - t_start
            stats.total_s = time.monotonic() - job.t0
            stats.files_bytes = files_bytes  # no rank reads the committed directory again
            self.last_stats = stats
            log.info("[rank %d] committed step %d: %d bytes, blocking %.3f s, staging %.3f s, persist %.3f s",
                     self._ctx.rank, job.step, stats.bytes, stats.blocking_s, stats.staging_s, stats.persist_s)
            cleanup = job.on_committed(final) if job.on_committed is not None else None
            handle.committed.set_result(str(final))
            if callable(cleanup):  # work that need not delay `committed` (deleting retired checkpoints)
                try:
                    cleanup()
                except Exception as exc:  # noqa: BLE001 - the save is committed; never fail it now
                    log.warning("[rank %d] cleanup after committing step %d failed: %s: %s", self._ctx.rank,
                                job.step, type(exc).__name__, exc)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the caller's thread
            self._failed_names.append(job.final.name)  # a temporary may be left (a collective timed out)
            if job.reserved:  # the name this save reserved, unless it was committed after all
                unreserve(job.final, partial_path(job.final, self._incarnation), created=True)
            with self._lock:
                if job.copy_failed:
                    pass  # save() already raised the copy's error on the caller's thread
                elif self.on_write_error == "warn" and isinstance(exc, CheckpointError):
                    log.warning("[rank %d] checkpoint step %d failed, training continues (on_write_error='warn'): %s",
                                self._ctx.rank, job.step, exc)
                    self.failed_saves.append({"step": job.step, "error": str(exc), "time": time.time()})
                else:
                    log.error("[rank %d] checkpoint step %d failed: %s", self._ctx.rank, job.step, exc)
                    if self._pending_error is None:
                        self._pending_error = exc
            handle.committed.set_exception(exc)
        finally:
            job.to_write = {}

    # -- loading ---------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, state: Any, *, verify: bool = True,
             on_world_size_change: str = "error", allow_cast: bool = False) -> None:
        """Load the committed checkpoint directory ``path`` into ``state`` in place (collective).

        ``allow_cast=True`` casts tensors whose dtype differs from the live one (logged per key);
        by default that is a ``StateMismatchError``. A failed load leaves ``state`` unchanged. See
        :func:`torch_ckpt.restore._restore.load_into` for the checks and errors.
        """
        self._ensure_open()
        self._wait_inflight()
        self._raise_pending()
        if on_world_size_change not in RANK_LOCAL_POLICIES:
            raise ConfigError(f"on_world_size_change must be one of {RANK_LOCAL_POLICIES}, "
                              f"got {on_world_size_change!r}")
        path = Path(path)
        with self._stager.lend() as scratch:  # the idle arena: live tensors are read in place, backed up there
            load_into(state, path, read_manifest(path), self._ctx, verify=verify,
                      on_world_size_change=on_world_size_change, allow_cast=allow_cast, scratch=scratch)

    # -- lifecycle -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the in-flight save is committed and its follow-up work (deleting the checkpoints
        retention retired) is done; raise any background error (once).

        ``save()`` itself only waits for ``committed``; ``wait()`` also waits for the deletions, so a
        listing of the root right after it shows no hidden trash of a retired checkpoint.
        """
        self._wait_inflight()
        job = self._job
        if job is not None:
            job.result()  # _run_job reports its own errors; this only waits for the deletions
            self._job = None
        self._join_writer()
        self._raise_pending()

    def drain(self) -> None:
        """Wait for the save in flight, its cleanup and its writer thread to end; raise nothing.

        Its error, if any, stays pending for the next call of this checkpointer's owner (or is logged
        if the owner is closed by its finalizer). Used before another owner in this process takes
        over the same root; safe from any thread.
        """
        handle, job = self._inflight, self._job
        for future in (None if handle is None else handle.committed, job):
            if future is not None:
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - recorded as the pending error by _run_job
                    pass
        self._join_writer()

    def _finish_at_exit(self) -> None:
        """Interpreter exit (:mod:`torch_ckpt._lifecycle`): commit the save in flight, within a bound; stop the
        writer process."""
        handle = self.in_flight
        if handle is not None:
            log.warning("[rank %d] waiting for the checkpoint of step %d to commit before the interpreter exits "
                        "(at most %.0f s)", self._ctx.rank, handle.step, self._ctx.timeout_seconds)
            try:
                handle.committed.result(timeout=self._ctx.timeout_seconds)
            except FutureTimeout:
                log.error("[rank %d] the checkpoint of step %d did not commit within %.0f s of the interpreter's "
                          "exit; it is not listed (the previous checkpoint stays the latest)", self._ctx.rank,
                          handle.step, self._ctx.timeout_seconds)
            except BaseException:  # noqa: BLE001 - logged by _run_job as the save's failure
                log.error("[rank %d] the checkpoint of step %d failed at the interpreter's exit and is not listed "
                          "(the previous checkpoint stays the latest); see the error above", self._ctx.rank,
                          handle.step)
        job = self._job
        if job is not None and handle is not None and handle.committed.done():
            try:
                job.result(timeout=60.0)  # the deletions retention asked for
            except BaseException:  # noqa: BLE001 - logged by the writer
                pass
        self._join_writer(timeout=5.0)
        with self._lock:
            err, self._pending_error = self._pending_error, None
        if err is not None and (handle is None or handle.committed.exception() is not err):
            log.error("[rank %d] a background checkpoint error was never raised to the training code before the "
                      "interpreter's exit: %s: %s", self._ctx.rank, type(err).__name__, err)
        if self._process_writer is not None:  # else multiprocessing's exit handler waits for it forever
            self._process_writer.close()
            self._process_writer = None

    def close(self) -> None:
        """Wait for the in-flight save, release buffers, hooks, writer and groups; raise a pending error once."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            job = self._job
            if job is not None and self._writer is not threading.current_thread():
                try:
                    job.result()  # the deletions of the last save
                except BaseException:  # noqa: BLE001 - _run_job reported it
                    pass
            self._join_writer()
            if self._process_writer is not None:
                self._process_writer.close()
            for hook in self._hooked.values():
                hook.remove()
            self._hooked.clear()
            self._stager.release()
            self._ctx.destroy()
        self._raise_pending()
