"""A save of :class:`~torch_ckpt.save._checkpointer.AsyncCheckpointer` up to its submit: capture, staging, agreement.

A mixin of the checkpointer (it uses its stager, writer and process groups): this rank waits for
the previous save, captures the state, decides how it is staged (now, overlapped with the next
steps, or pipelined with the writer) and copies it; then the ranks agree, so that a failure on any
rank fails the step on every rank before anything is written. :mod:`torch_ckpt.save._checkpointer`
submits the agreed save to the writer and surfaces its outcome.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_ckpt import errors as errors_module
from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointError, CheckpointWriteError, ConfigError
from torch_ckpt.format._codec import is_per_rank_key, split_state, tensor_kind
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.save._staging import StagingMemoryError, StagingProgress

__all__ = ["CheckpointerPrepareMixin", "SaveJob", "PIPELINE_STAGING"]

log = get_logger("torch_ckpt.save._checkpointer")


@dataclass(eq=False)
class SaveJob:
    """One save on its way from the live state to a committed directory."""

    step: int
    final: Path
    tensors: dict[str, torch.Tensor]
    tree: Any
    fits: bool
    t0: float
    ready_event: Any = None
    to_write: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: tuple = ()
    deferred_keys: set[str] | None = None
    early_s: float = 0.0
    on_committed: Callable[[Path], None] | None = None
    replace: bool = False
    extra_dir: Path | None = None
    lineage: Any = None  # the torch_ckpt.policy._lineage.Lineage its manifest records (None: the base segment)
    progress: StagingProgress | None = None  # pipelined staging: the copy runs while the writer starts
    timings: dict[str, float] = field(default_factory=dict)
    copy_failed: bool = False
    reserved: bool = False  # this rank created ``final`` empty when the save was accepted
    signature: dict[str, tuple] | None = None  # the tensors this rank stores under job-wide DCP keys (_signature)


#: Pipelined staging of host tensors (the writer starts while ``save()`` still copies): None decides
#: by the cores available, True/False forces it. On a machine with fewer cores than the copy's
#: torch threads plus the writer threads plus one, the writer would take CPU from the copy (on the
#: reference 2-core VM the blocking time of a 1 GiB save grew from 0.13 s to 0.9-1.5 s), so the copy
#: then finishes before the writer starts.
PIPELINE_STAGING: bool | None = None


def _signature(tensors: dict[str, torch.Tensor], replicated_keys: tuple[str, ...]) -> dict[str, tuple]:
    """``{DCP key: (kind, global shape, dtype)}`` of the tensors this rank stores under keys other ranks may use too.

    That is every key but the ``__rank<r>__.`` keys of this rank's own tensors: replicated and
    sharded tensors, and rank 0's per-rank tensors (which keep their plain key). DCP keeps one
    entry per key for the whole job, so ranks must agree on these (:meth:`CheckpointerPrepareMixin._agree`).
    """
    return {k: (tensor_kind(k, t, replicated_keys), tuple(t.size()), str(t.dtype)) for k, t in tensors.items()
            if not is_per_rank_key(k)}


def _digest(signature: dict[str, tuple] | None) -> str | None:
    if signature is None:
        return None
    text = "\n".join(f"{k}|{kind}|{shape}|{dtype}" for k, (kind, shape, dtype) in sorted(signature.items()))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _conflicts(signatures: list[dict[str, tuple]]) -> list[str]:
    """One line per DCP key that two ranks store differently (kind, shape or dtype), naming the ranks."""
    seen: dict[str, list[tuple[int, tuple]]] = {}
    for rank, sig in enumerate(signatures):
        for key, entry in sig.items():
            seen.setdefault(key, []).append((rank, entry))
    lines = []
    for key in sorted(seen):
        entries = seen[key]
        per_rank = any(entry[0] == "rank" for _, entry in entries)
        if len(entries) > 1 and (per_rank or len({entry for _, entry in entries}) > 1):
            listing = ", ".join(f"rank {r}: {kind} {list(shape)} {dtype.removeprefix('torch.')}"
                                for r, (kind, shape, dtype) in entries)
            lines.append(f"{key!r} ({listing})")
    return lines


def _cuda_ready_event(tensors: dict[str, torch.Tensor]) -> Any:
    """Event on the caller's CUDA stream marking the values to save (None without CUDA tensors)."""
    if not any(t.device.type == "cuda" for t in tensors.values()):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class CheckpointerPrepareMixin:
    """This rank's capture and staging of a save, the ranks' agreement, and :meth:`wait_staged`."""

    _agreed_digests: tuple | None = None  # the ranks' tensor-signature digests last found consistent (_agree)

    def _prepare_save(self, final: str | os.PathLike, state: Any, step: int,
                      on_committed: Callable[[Path], None] | None, t0: float, waited_s: float,
                      prepare: Callable[[], None] | None) -> tuple[SaveJob, SaveHandle, bool]:
        """This rank's part of a save up to the submit: wait, checks, capture and staging."""
        wait_prev = self._wait_inflight() + waited_s
        self._raise_pending()
        if prepare is not None:
            prepare()
        stats = SaveStats(step=step, wait_for_previous_s=wait_prev)
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        replicated = tuple(getattr(state, "replicated_keys", ()))
        tensors, tree = split_state(sd, rank_local_keys=tuple(getattr(state, "rank_local_keys", ())),
                                    replicated_keys=replicated, rank=self._ctx.rank)
        signature = _signature(tensors, replicated) if self._ctx.enabled and self._ctx.world_size > 1 else None
        if self._process_writer is not None and any(type(t) is not torch.Tensor for t in tensors.values()):
            raise ConfigError("persist='process' supports plain tensors only; this state holds DTensor/sharded "
                              "tensors (FSDP2/TP). Use persist='thread'.")
        need, budget = self._stager.required_bytes(tensors), self._stager.budget_bytes
        fits = need <= budget
        if not fits:
            log.warning("state of %d bytes exceeds the staging budget of %d bytes: saving step %d synchronously "
                        "from the live tensors (raise staging_budget_bytes to save asynchronously)",
                        need, budget, step)
        else:
            try:
                self._stager.reserve(tensors)
            except StagingMemoryError as exc:  # the budget was not really there (ulimit -v, pinned or /dev/shm limits)
                fits = False
                log.warning("step %d is saved synchronously from the live tensors: %s", step, exc)
        background = self.async_save and fits
        stats.mode = "async" if background else ("sync" if fits else "sync-over-budget")
        job = SaveJob(step=step, final=Path(final), tensors=tensors, tree=tree, fits=fits, t0=t0,
                       ready_event=_cuda_ready_event(tensors) if self.overlap_staging else None,
                       on_committed=on_committed, signature=signature)
        handle = SaveHandle(step, Future(), Future(), stats)
        self._inflight = handle
        try:
            if background and self.overlap_staging:
                owned = state.optimizer_owned_keys(tensors) \
                    if callable(getattr(state, "optimizer_owned_keys", None)) else set()
                # what forward passes may change (buffers, plain dict values) is copied now; parameters and
                # optimizer state are copied in the background, before the next optimizer.step()
                t = time.monotonic()
                self._stager.stage(tensors, only=set(tensors) - owned)
                job.deferred_keys, job.early_s = owned, time.monotonic() - t
                self._install_step_hooks(state)
                self._staged_future = handle.staged
            elif background and self._process_writer is None and job.fits and self._pipelining_pays() and \
                    not any(t.device.type == "cuda" for t in tensors.values()):
                # the copy itself runs in save() after the agreement, overlapping the writer (_copy_pipelined)
                staged = self._stager.prepare(tensors)
                job.to_write, job.layout, stats.bytes = staged.tensors, staged.layout, staged.nbytes
                job.progress = StagingProgress()
            else:
                self._stage(job, handle)
        except BaseException as exc:  # staging failed or was interrupted: nothing is in flight
            self._abandon(handle, exc)
            raise
        return job, handle, background

    def _abandon(self, handle: SaveHandle, exc: BaseException) -> None:
        """Fail a save that will not be submitted: nothing is in flight afterwards."""
        if self._inflight is handle:
            self._inflight = None
        for fut in (handle.staged, handle.committed):
            if not fut.done():
                fut.set_exception(exc)

    def _agree(self, step: Any, final: str | os.PathLike, error: Exception | None,
               signature: dict[str, tuple] | None = None) -> None:
        """The ranks' agreement before a submit: every rank raises when any failed or when they disagree.

        One all-gather on the caller-thread checkpoint group (the group of every other decision
        taken on this thread, in the same order on every rank), so a failed step leaves no
        collective half-done behind. It carries a digest of the tensors each rank stores under
        job-wide DCP keys (:func:`_signature`); when the digests differ from each other (and from
        the last set agreed on: pipeline stages hold different keys on every save), a second
        all-gather of the signatures finds the keys two ranks store differently, and every rank
        raises a ``ConfigError`` naming them and the ranks (DCP would keep one rank's entry and
        drop the other's).
        """
        if isinstance(error, OSError) and not isinstance(error, CheckpointError):
            where = f" ({error.filename})" if error.filename else ""
            typed = CheckpointWriteError(error.errno, f"checkpoint step {step} was not saved: "
                                         f"{error.strerror or error}{where}")
            typed.__cause__ = error
            error = typed
        mine = None if error is None else (type(error).__name__, str(error))
        # node-local roots are different directories on each node: the ranks agree on the name
        target = self.layout.agreed_name(final)
        try:
            votes = self._ctx.all_gather((mine, step, target, _digest(signature)), what="save agreement")
        except CheckpointError:
            if error is not None:
                raise error  # noqa: B904 - this rank's own failure says more than the failed agreement (its context)
            raise
        if error is not None:
            raise error
        failed = [(rank, vote[0]) for rank, vote in enumerate(votes) if vote[0] is not None]
        if failed:
            rank, (kind, msg) = failed[0]
            cls = getattr(errors_module, kind, None) if kind in errors_module.__all__ else None
            cls = cls if cls is not None and kind != "StateMismatchError" else CheckpointError
            others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise cls(f"checkpoint step {step} was not saved: rank {rank}{others} could not prepare it: {msg}")
        if len({(vote[1], vote[2]) for vote in votes}) > 1:
            listing = "; ".join(f"rank {r}: step {vote[1]} into {vote[2]}" for r, vote in enumerate(votes))
            raise ConfigError(f"ranks disagree on the checkpoint to save ({listing}); every rank must save the "
                              "same step into the same directory")
        digests = tuple(vote[3] for vote in votes)
        if len(set(digests)) > 1 and digests != self._agreed_digests:
            lines = _conflicts(self._ctx.all_gather(signature, what="save structure agreement"))
            if lines:
                raise ConfigError(
                    f"checkpoint step {step} was not saved: ranks disagree on tensors stored once for all ranks: "
                    f"{'; '.join(lines[:10])}{' ...' if len(lines) > 10 else ''}. A replicated or sharded tensor "
                    "(model, optimizer, keys the state lists in replicated_keys) needs the same shape and dtype on "
                    "every rank, and a key stored per rank must not be replicated on another rank; values that "
                    "differ per rank belong outside replicated_keys")
            self._agreed_digests = digests

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

    def _stage(self, job: SaveJob, handle: SaveHandle) -> None:
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

    def _pipelining_pays(self) -> bool:
        """Whether the writer threads can run beside the copy without slowing it (``PIPELINE_STAGING``)."""
        if PIPELINE_STAGING is not None:
            return PIPELINE_STAGING
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cores >= torch.get_num_threads() + self.thread_count + 1

    def _copy_pipelined(self, job: SaveJob, handle: SaveHandle) -> None:
        """The copy of a pipelined save, on the caller's thread, while the writer writes what is copied.

        A failed copy fails the save in the writer too (nothing is committed) and is raised here,
        once: the writer does not record it as a pending error.
        """
        t = time.monotonic()
        try:
            self._stager.stage(job.tensors, progress=job.progress)
        except BaseException as exc:
            job.copy_failed = True
            job.progress.fail(exc)
            handle.staged.set_exception(exc)
            raise
        finally:
            job.tensors = {}  # no reference to the live tensors outlives the copy
        handle.stats.staging_s = job.timings["staging_s"] = time.monotonic() - t
