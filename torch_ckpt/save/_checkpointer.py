"""``AsyncCheckpointer``: asynchronous, atomic DCP saves of a state to a given directory (the trainer's side).

The engine under :class:`~torch_ckpt.CheckpointManager` and the adapters: per save it waits for the
previous one (one in flight at most), captures the state, stages it into a reusable host arena
(:class:`HostStager`), lets the ranks agree and hands the request to a writer thread of its own or
to the writer process; background errors are raised on the caller's thread once. It knows nothing
of steps, naming or retention.

The arena is re-allocated only when keys, shapes or dtypes change: a copy into an existing buffer
runs at memory speed (9.5 GB/s on the reference VM), a fresh allocation per save is page-fault bound
(1.4-2.7 GB/s). Its default budget is half the memory this process may still allocate: psutil's
available RAM capped by every memory cgroup on its path (in a container psutil reports the host).
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import psutil
import torch
from torch.distributed.tensor import DTensor

from torch_ckpt import errors as errors_module
from torch_ckpt._lifecycle import finish_at_exit
from torch_ckpt._logging import get_logger
from torch_ckpt._values import check_bool, check_int, to_seconds
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointError, CheckpointWriteError, ConfigError
from torch_ckpt.format._files import is_per_rank_key, split_state, tensor_kind
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.restore._restore import load_into
from torch_ckpt.root._layout import SharedRoot, new_incarnation, partial_path, read_manifest, reserve, unreserve
from torch_ckpt.save._persist import ArenaLayout, SaveRequest, arena_views, nbytes_of, persist_checkpoint
from torch_ckpt.save._writer_process import ProcessWriter
from torch_ckpt.state._protocol import StateToRestore, StateToSave

__all__ = ["AsyncCheckpointer", "HostStager", "StagedState", "StagingMemoryError", "close_on_exit",
           "default_budget_bytes", "cgroup_memory_headroom", "CGROUP_ROOT", "PROC_SELF_CGROUP"]

log = get_logger(__name__)

_ALIGN_BYTES = 64

# -- memory limits -------------------------------------------------------------------------------


#: where the cgroup file systems are mounted
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: this process's cgroup membership
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: limits at or above this many bytes mean "no limit" (v1 writes 2**63 rounded down to a page)
_UNLIMITED = 1 << 60
#: per cgroup version: the limit files, the usage file, the memory.stat keys of inactive file pages
_CgroupFiles = tuple[tuple[str, ...], str, tuple[str, ...]]
_V2_FILES: _CgroupFiles = (("memory.max", "memory.high"), "memory.current", ("inactive_file",))
_V1_FILES: _CgroupFiles = (("memory.limit_in_bytes",), "memory.usage_in_bytes",
                            ("total_inactive_file", "inactive_file"))


def _read_int(path: Path) -> int | None:
    try:
        value = int(path.read_text().strip())  # "max" (no limit) is a ValueError too
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return None if value >= _UNLIMITED else value


def _stat_value(directory: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = (directory / "memory.stat").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return 0
    stats = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stats[parts[0]] = int(parts[1])
    return next((stats[k] for k in keys if k in stats), 0)


def _headroom(mount: Path, path: str, limit_files: tuple[str, ...], usage_file: str, inactive_keys: tuple[str, ...]
              ) -> int | None:
    """The least ``limit - working set`` of the cgroup ``path`` under ``mount`` and its ancestors up to ``mount``."""
    leaf = mount / path.strip("/") if path.strip("/") else mount
    if not leaf.is_dir():
        leaf = mount  # our cgroup is mounted as the root (container without a cgroup namespace)
    levels = [leaf]
    while levels[-1] != mount and mount in levels[-1].parents:
        levels.append(levels[-1].parent)
    rooms = []
    for d in levels:
        limits = [v for v in (_read_int(d / name) for name in limit_files) if v is not None]
        if limits:
            working_set = max(0, (_read_int(d / usage_file) or 0) - _stat_value(d, inactive_keys))
            rooms.append(max(0, min(limits) - working_set))
    return min(rooms, default=None)


def cgroup_memory_headroom(cgroup_root: Path | None = None, proc_self_cgroup: str | None = None) -> int | None:
    """Bytes this process's memory cgroups still allow it to allocate (None: no limit): the smallest
    ``limit - (usage - inactive file pages)`` (as ``docker stats``; >= 0) of every level up to the mount root,
    cgroup v2 (``0::/path`` at ``cgroup_root`` or its ``unified/``) and v1 (``N:memory:/path`` at ``memory/``).
    ``proc_self_cgroup``: the text of :data:`PROC_SELF_CGROUP` (default: read it)."""
    root = CGROUP_ROOT if cgroup_root is None else Path(cgroup_root)
    if proc_self_cgroup is None:
        try:
            proc_self_cgroup = PROC_SELF_CGROUP.read_text()
        except OSError:
            return None
    found: list[int] = []
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            mount = next((m for m in (root, root / "unified") if (m / "cgroup.controllers").is_file()), None)
            files = _V2_FILES
        elif "memory" in controllers.split(",") and (root / "memory").is_dir():
            mount, files = root / "memory", _V1_FILES
        else:
            continue
        room = None if mount is None else _headroom(mount, path, *files)
        if room is not None:
            found.append(room)
    return min(found, default=None)


# -- staging ------------------------------------------------------------------------------------

def default_budget_bytes(local_world_size: int | None = None, *, held_bytes: int = 0) -> int:
    """Host bytes this rank may keep for staging now: half of what a new allocation may take (psutil's available
    RAM capped by :func:`cgroup_memory_headroom`) plus ``held_bytes`` (this rank's arena, freed before a new one),
    split over ``local_world_size`` ranks (default ``$LOCAL_WORLD_SIZE``, else 1)."""
    if local_world_size is None:
        try:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            local_world_size = 1
    available = int(psutil.virtual_memory().available)
    room = cgroup_memory_headroom()
    available = available if room is None else min(available, room)
    return int((available + held_bytes) * 0.5 / max(1, local_world_size))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    loc = _local(t)
    return loc.numel() * loc.element_size()


def _arena_signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """``((key, shape, dtype), ...)`` of the local shards: what the arena's layout depends on (computed once a save,
    as :attr:`_Job.arena` and passed to :meth:`HostStager.holds`, ``reserve`` and ``stage``)."""
    return tuple((k, (loc := _local(t)).shape, loc.dtype) for k, t in tensors.items())


class StagingMemoryError(CheckpointWriteError):
    """The staging arena could not be allocated (errno ENOMEM); names the size, the budget and the fix."""


@dataclass
class StagedState:
    """Host copies of a flat tensor dict: ``tensors`` (views of the arena; DTensors keep their sharding spec),
    the ``layout`` of the arena, and the CUDA ``event`` after which device copies have landed (None: CPU only)."""

    tensors: dict[str, torch.Tensor]
    layout: ArenaLayout
    event: Any = None

    def synchronize(self) -> None:
        """Block until every copy has landed in host memory."""
        if self.event is not None:
            self.event.synchronize()


class HostStager:
    """A reusable host arena with a byte budget (``None``: :func:`default_budget_bytes`, evaluated at each
    :meth:`fits`), page-locked when ``pin_memory`` (``None``: when CUDA is available), in shared memory when
    ``share_memory`` (for a writer process).

    Raises:
        ConfigError: ``budget_bytes`` is not positive.
    """

    def __init__(self, *, budget_bytes: int | None = None, pin_memory: bool | None = None,
                 share_memory: bool = False) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ConfigError(f"staging budget_bytes must be > 0, got {budget_bytes!r}")
        self._budget = int(budget_bytes) if budget_bytes is not None else None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.share_memory = bool(share_memory)
        self.arena: torch.Tensor | None = None
        self._signature: tuple | None = None
        self._layout: ArenaLayout = ()
        self._views: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.RLock()
        self.allocations = 0

    @property
    def budget_bytes(self) -> int:
        """The staging budget now (bytes): the one given, else :func:`default_budget_bytes` at this moment."""
        return self._budget if self._budget is not None else default_budget_bytes(held_bytes=self.allocated_bytes)

    @property
    def allocated_bytes(self) -> int:
        """Bytes currently held by the arena."""
        return 0 if self.arena is None else self.arena.numel()

    def required_bytes(self, tensors: dict[str, torch.Tensor]) -> int:
        """Bytes needed to stage ``tensors`` (local shards only, before alignment)."""
        return sum(_nbytes(t) for t in tensors.values())

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """True when ``tensors`` fit in the staging budget."""
        return self.required_bytes(tensors) <= self.budget_bytes

    def holds(self, tensors: dict[str, torch.Tensor], signature: tuple | None = None) -> bool:
        """True when the arena is laid out for ``tensors`` already (keys, shapes, dtypes): staging them
        allocates nothing, whatever memory is left (so no budget applies). ``signature``: their
        :func:`_arena_signature`, if the caller has it."""
        signature = _arena_signature(tensors) if signature is None else signature
        with self._lock:
            return self.arena is not None and self._signature == signature

    def reserve(self, tensors: dict[str, torch.Tensor], signature: tuple | None = None) -> None:
        """Allocate (or keep) the arena for ``tensors`` (``signature``: as :meth:`holds`) without copying anything.

        Raises:
            StagingMemoryError: the allocation failed (the arena is released; nothing is staged).
        """
        signature = _arena_signature(tensors) if signature is None else signature
        with self._lock:
            if signature == self._signature and self.arena is not None:
                return
            layout, offset = [], 0
            for key, shape, dtype in signature:
                layout.append((key, tuple(shape), dtype, offset))
                offset += (nbytes_of(shape, dtype) + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
            self.release()  # the old arena goes before the new one is allocated (its views keep it alive too)
            try:
                arena = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
                if self.share_memory:
                    arena.share_memory_()
            except (RuntimeError, MemoryError, OSError) as exc:  # out of memory, ulimit -v, pinned or /dev/shm limits
                raise StagingMemoryError(
                    errno.ENOMEM, f"could not allocate the {offset}-byte staging arena "
                    f"({'shared memory' if self.share_memory else 'pinned' if self.pin_memory else 'host memory'}; "
                    f"staging budget {self.budget_bytes} bytes): {type(exc).__name__}: {exc}. Lower "
                    "staging_budget_bytes below the memory this process may allocate, or free memory") from exc
            self.arena, self._signature, self._layout = arena, signature, tuple(layout)
            self._views = arena_views(arena, self._layout)
            self.allocations += 1
            log.debug("allocated a %d-byte staging arena for %d tensors", offset, len(layout))

    def stage(self, tensors: dict[str, torch.Tensor], *, ready_event: Any = None,
              only: set[str] | None = None, signature: tuple | None = None) -> StagedState:
        """Copy ``tensors`` (any device; DTensors shard-locally) into the arena, valid until the next call.

        Device copies are asynchronous (:meth:`StagedState.synchronize`), after ``ready_event`` (default:
        the current stream's position); host copies are done on return. ``only``: copy just these keys
        (the arena covers all of ``tensors``): staging in two phases. ``signature``: as :meth:`holds`.
        """
        with self._lock:
            self.reserve(tensors, signature)
            out: dict[str, torch.Tensor] = {}
            device_pairs = []
            host_dst, host_src = [], []
            for key, t in tensors.items():
                buf = self._views[key]
                if only is None or key in only:
                    src = _local(t).detach()
                    if src.device.type == "cuda":
                        device_pairs.append((buf, src))
                    else:
                        host_dst.append(buf)
                        host_src.append(src)
                out[key] = DTensor(buf, t._spec, requires_grad=False) if isinstance(t, DTensor) else buf
            if host_dst:
                # one call for all host copies: per-tensor Python overhead matters for many small tensors
                torch._foreach_copy_(host_dst, host_src)
            event = None
            if device_pairs:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                if ready_event is not None:
                    self._stream.wait_event(ready_event)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._stream):
                    for buf, src in device_pairs:
                        buf.copy_(src, non_blocking=self.pin_memory)
                        src.record_stream(self._stream)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            return StagedState(tensors=out, layout=self._layout, event=event)

    def release(self) -> None:
        """Free the arena."""
        with self._lock:
            self.arena, self._signature, self._layout, self._views = None, None, (), {}


# -- the ranks' agreement --------------------------------------------------------------------

def _signature(tensors: dict[str, torch.Tensor], replicated_keys: tuple[str, ...]) -> dict[str, tuple]:
    """``{DCP key: (kind, global shape, dtype)}`` of the tensors this rank stores under keys other ranks may use too
    (all but its ``__rank<r>__.`` keys; rank 0's per-rank tensors keep their plain key): DCP keeps one entry per
    key for the whole job, so the ranks must agree on these."""
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


@dataclass(eq=False)
class _Job:
    """The engine's side of one save between capture and commit (the save itself is ``request``)."""

    request: SaveRequest
    handle: SaveHandle
    tensors: dict[str, torch.Tensor]  # the live tensors, until staged
    tree: Any
    fits: bool
    background: bool
    t0: float
    ready_event: Any = None
    signature: dict[str, tuple] | None = None  # the tensors this rank stores under job-wide DCP keys (_signature)
    arena: tuple | None = None  # _arena_signature of ``tensors``
    deferred_keys: set[str] | None = None  # overlap_staging: copied in the writer, before the next optimizer step
    early_s: float = 0.0
    to_write: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: ArenaLayout = ()
    reserved: bool = False  # this rank created ``final`` empty when the save was accepted
    changed: frozenset[str] = frozenset()  # keys whose tensors were written in place since the last capture


def _version_of(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's data pointer and version counter (of the local shard for a DTensor; ``state_dict()``
    detaches, which keeps both): the same pointer with another version means it was written in place, and
    an incremental save writes it again whatever its CRC-32 says."""
    local = getattr(t, "_local_tensor", t)
    return local.data_ptr(), local._version


def close_on_exit(close: Callable[[], None], exc_type: type | None) -> None:
    """``__exit__`` helper: close; when another exception is propagating, log a close error instead of masking it."""
    if exc_type is None:
        close()
        return
    try:
        close()
    except Exception:  # noqa: BLE001
        log.exception("checkpoint error while closing after another exception")


class AsyncCheckpointer:
    """Asynchronous, atomic DCP saves to explicit directories; collective over all ranks.

    ``async_save``, ``persist``, ``overlap_staging``, ``writer_niceness``, ``staging_budget_bytes``,
    ``thread_count``, ``timeout_seconds``, ``process_group``, ``on_write_error`` and ``incremental`` are the
    :class:`~torch_ckpt.CheckpointConfig` fields of the same names. A state over the staging budget
    (default: half the available memory at each save, cgroup-aware, over the local ranks), or whose
    arena cannot be allocated, is saved synchronously from the live tensors (logged);
    ``persist="process"`` takes plain tensors only; with ``on_write_error="warn"`` a failed
    background save is logged and counted in :attr:`failed_saves`.

    Args:
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
        incremental: bool = True,
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
        self.incremental = check_bool("incremental", incremental)
        self._versions: dict[str, tuple[int, int]] = {}  # {key: (data pointer, version)} at the previous capture
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
        self._pending_error: BaseException | None = None
        self._agreed_digests: tuple | None = None  # the ranks' tensor-signature digests last found consistent
        self._lock = threading.Lock()
        self._closed = False
        self.last_stats: SaveStats | None = None
        self._incarnation = new_incarnation()
        self._failed_names: list[str] = []  # final names of failed saves whose temporaries the next save removes
        # the root layout, set by the manager (root._layout.SharedRoot; root._nodes.NodeLayout: each node commits)
        self.layout: Any = SharedRoot(self._ctx.rank)
        self._new_writer = partial(ProcessWriter, self._ctx, timeout_seconds=timeout_seconds, niceness=writer_niceness)
        if persist == "process" and self.async_save:
            self._process_writer = self._new_writer()
        finish_at_exit(self, 0)

    @property
    def in_flight(self) -> SaveHandle | None:
        """The handle of the save not yet committed (or failed), if any."""
        handle = self._inflight
        return None if handle is None or handle.done() else handle

    @property
    def incarnation(self) -> str:
        """Random hex id of this checkpointer; rank 0's names a collective save's ``NAME/.torch-ckpt.partial.<id>``."""
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

    def _raised(self, exc: BaseException) -> None:
        """A save's error was raised to the caller by its handle: it is not raised again (raised once)."""
        with self._lock:
            if self._pending_error is exc:
                self._pending_error = None

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

    def wait_previous(self) -> float:
        """Wait for the save in flight (not for its cleanup); raise, once, an earlier background error.
        Returns the seconds waited."""
        self._ensure_open()
        waited = self._wait_inflight()
        self._raise_pending()
        return waited

    # -- saving ----------------------------------------------------------------------------------
    def save(self, final: str | os.PathLike, state: StateToSave, *, step: int = 0, replace: bool = False,
             extra_dir: str | os.PathLike | None = None, lineage: Any = None,
             after_commit: Callable[[Path], Callable[[], None] | None] | None = None) -> SaveHandle:
        """Checkpoint ``state`` into directory ``final``; returns once staged (async) or committed (sync).

        :meth:`submit` of the :class:`~torch_ckpt.save._persist.SaveRequest` these arguments
        describe (see its attributes): ``final`` is created empty by the committing rank before this
        returns (the name is taken at once), written inside it as a hidden
        ``.torch-ckpt.partial.<incarnation>`` and committed when complete
        (:mod:`torch_ckpt.root._layout`). ``state``: a :class:`~torch_ckpt.TrainState`, any
        ``Stateful`` or a nested dict of tensors and plain values (:mod:`torch_ckpt.format._files`).
        """
        return self.submit(SaveRequest(final=Path(final), step=step, replace=replace, lineage=lineage,
                                       extra_dir=None if extra_dir is None else Path(extra_dir),
                                       after_commit=after_commit), state)

    def submit(self, request: SaveRequest, state: Any, *, refused: Exception | None = None,
               started_at: float | None = None, waited_s: float = 0.0) -> SaveHandle:
        """Save ``state`` as ``request`` asks; returns once staged (async) or committed (sync).

        Collective: every rank calls it with the same ``request.final`` and ``request.step``. Waits
        first for the previous save (at most one in flight) and raises, once, any error of an
        earlier background save. Before anything is submitted the ranks agree (:meth:`_agree`): when
        any rank failed to prepare its part (``refused``: the caller's own checks failed; an
        unsupported value, a staging error, a previous error) or the ranks name different steps or
        directories, every rank raises for this step at once and nothing is written. ``started_at``
        (``time.monotonic()``) and ``waited_s`` (already waited for the previous save) are the
        caller's, for the stats.

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
        t0 = time.monotonic() if started_at is None else started_at
        error, job = refused, None
        if error is None:
            try:
                job = self._capture(request, state, waited_s, t0)
            except Exception as exc:  # noqa: BLE001 - reported to every rank by the agreement below
                error = exc
        layout = self.layout if request.nodes is None else request.nodes  # a request may name another root's layout
        writer_dead = self._process_writer is not None and not self._process_writer.alive
        try:
            restart = self._agree(request.step, request.final, error, None if job is None else job.signature,
                                  layout=layout, writer_dead=writer_dead)
            if restart:
                self._restart_writer(request.step)
        except BaseException as exc:
            if job is not None:
                self._abandon(job.handle, exc)
            raise
        assert job is not None  # _agree raised when this rank had no job (error set)
        if layout.acts:  # the name is taken once save() returns, as with a synchronous save
            try:
                job.reserved = reserve(request.final)
            except OSError as exc:  # the writer's prepare step fails on it and reports it on every rank
                log.debug("could not reserve %s: %s", request.final, exc)
        if job.background:
            job.handle.stats.blocking_s = time.monotonic() - t0  # the start below is the only remaining work
            self._start_writer(job)
        else:
            self._run_job(job, job.handle)
            job.handle.stats.blocking_s = time.monotonic() - t0
            self._raise_pending()
        return job.handle

    def _capture(self, request: SaveRequest, state: Any, waited_s: float, t0: float) -> _Job:
        """This rank's part of a save up to the agreement: wait, capture and staging (or its start)."""
        wait_prev = self._wait_inflight() + waited_s
        self._raise_pending()
        step = request.step
        stats = SaveStats(step=step, wait_for_previous_s=wait_prev)
        sd = state.state_dict() if hasattr(state, "state_dict") else state
        replicated = tuple(getattr(state, "replicated_keys", ()))
        tensors, tree = split_state(sd, rank_local_keys=tuple(getattr(state, "rank_local_keys", ())),
                                    replicated_keys=replicated, rank=self._ctx.rank)
        signature = _signature(tensors, replicated) if self._ctx.enabled and self._ctx.world_size > 1 else None
        changed: frozenset[str] = frozenset()
        if self.incremental:  # (about 0.35 us a tensor, on the training thread)
            versions = {k: _version_of(t) for k, t in tensors.items()}
            changed = frozenset(k for k, (ptr, version) in versions.items()
                                if (old := self._versions.get(k)) is not None and old[0] == ptr and old[1] != version)
            self._versions = versions
        if self._process_writer is not None and any(type(t) is not torch.Tensor for t in tensors.values()):
            raise ConfigError("persist='process' supports plain tensors only; this state holds DTensor/sharded "
                              "tensors (FSDP2/TP). Use persist='thread'.")
        arena = _arena_signature(tensors)
        held = self._stager.holds(tensors, arena)  # the last save's arena fits: nothing to allocate, no budget to ask
        need, budget = (0, 0) if held else (self._stager.required_bytes(tensors), self._stager.budget_bytes)
        fits = held or need <= budget
        if not fits:
            log.warning("state of %d bytes exceeds the staging budget of %d bytes: saving step %d synchronously "
                        "from the live tensors (raise staging_budget_bytes to save asynchronously)",
                        need, budget, step)
        elif not held:
            try:
                self._stager.reserve(tensors, arena)
            except StagingMemoryError as exc:  # the budget was not really there (ulimit -v, pinned or /dev/shm limits)
                fits = False
                log.warning("step %d is saved synchronously from the live tensors: %s", step, exc)
        background = self.async_save and fits
        stats.mode = "async" if background else ("sync" if fits else "sync-over-budget")
        handle = SaveHandle(step, Future(), Future(), stats, on_raised=self._raised)
        job = _Job(request=request, handle=handle, tensors=tensors, tree=tree, fits=fits, background=background, t0=t0,
                   signature=signature, changed=changed, arena=arena)
        self._inflight = handle
        try:
            if background and self.overlap_staging:
                if any(t.device.type == "cuda" for t in tensors.values()):
                    job.ready_event = torch.cuda.Event()  # marks the values to save on the caller's stream
                    job.ready_event.record()
                owned = state.optimizer_owned_keys(tensors) \
                    if callable(getattr(state, "optimizer_owned_keys", None)) else set()
                # what forward passes may change (buffers, plain dict values) is copied now; parameters and
                # optimizer state are copied in the background, before the next optimizer.step()
                t = time.monotonic()
                self._stager.stage(tensors, only=set(tensors) - owned, signature=arena)
                job.deferred_keys, job.early_s = owned, time.monotonic() - t
                self._install_step_hooks(state)
                self._staged_future = handle.staged
            else:
                self._stage(job, handle)
        except BaseException as exc:  # staging failed or was interrupted: nothing is in flight
            self._abandon(handle, exc)
            raise
        return job

    def _abandon(self, handle: SaveHandle, exc: BaseException) -> None:
        """Fail a save that will not be submitted: nothing is in flight afterwards."""
        if self._inflight is handle:
            self._inflight = None
        for fut in (handle.staged, handle.committed):
            if not fut.done():
                fut.set_exception(exc)

    def _restart_writer(self, step: int) -> None:
        """Every rank (collective: the writers form a group of their own): replace the writer processes after one
        died (OOM-killed, say), so the saves of the rest of the run are written again."""
        old = cast(ProcessWriter, self._process_writer)
        code = old.exitcode
        self._process_writer = None
        old.close()
        self._process_writer = self._new_writer()
        log.warning("[rank %d] a checkpoint writer process had died (here: exit code %s); started new ones before "
                    "step %d", self._ctx.rank, code, step)

    def _agree(self, step: Any, final: str | os.PathLike, error: Exception | None,
               signature: dict[str, tuple] | None = None, *, layout: Any = None, writer_dead: bool = False) -> bool:
        """The ranks' agreement before a submit (one all-gather on the caller-thread group): every rank raises
        when any failed or when they disagree; True when any rank's writer process died (``writer_dead``), so
        every rank starts a new one (:meth:`_restart_writer`). Digests of :func:`_signature` that differ (and
        differ from the set last agreed on: pipeline stages hold different keys) take a second all-gather of the
        signatures, to name the keys two ranks store differently (DCP would keep one rank's entry and drop the
        other's)."""
        if isinstance(error, OSError) and not isinstance(error, CheckpointError):
            where = f" ({error.filename})" if error.filename else ""
            typed = CheckpointWriteError(error.errno, f"checkpoint step {step} was not saved: "
                                         f"{error.strerror or error}{where}")
            typed.__cause__ = error
            error = typed
        mine = None if error is None else (type(error).__name__, str(error))
        # node-local roots are different directories on each node: the ranks agree on the name
        target = (self.layout if layout is None else layout).agreed_name(final)
        try:
            votes = self._ctx.all_gather((mine, step, target, _digest(signature), writer_dead), what="save agreement")
        except CheckpointError:
            if error is not None:
                raise error  # noqa: B904 - this rank's own failure says more than the failed agreement (its context)
            raise
        if error is not None:
            raise error
        failed = [(rank, vote[0]) for rank, vote in enumerate(votes) if vote[0] is not None]
        if failed:
            rank, (kind, msg) = failed[0]
            cls = getattr(errors_module, kind) if kind in errors_module.__all__ and kind != "StateMismatchError" \
                else CheckpointError
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
        return any(vote[4] for vote in votes)

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

    def _stage(self, job: _Job, handle: SaveHandle) -> None:
        t = time.monotonic()
        handle.stats.bytes = self._stager.required_bytes(job.tensors)
        job.to_write = job.tensors
        if job.fits:
            staged = self._stager.stage(job.tensors, ready_event=job.ready_event, only=job.deferred_keys,
                                        signature=job.arena)
            staged.synchronize()
            job.to_write, job.layout = staged.tensors, staged.layout
        job.tensors = {}
        handle.stats.staging_s = time.monotonic() - t + job.early_s
        handle.staged.set_result(None)

    def _start_writer(self, job: _Job) -> None:
        """Run the job in a new writer thread that ends with it (one save in flight at most): no idle writer
        outlives a save, and what the job references (the manager's commit callback) is released with it.
        The thread waits for ``go`` before its first line of Python: ``Thread.start`` returns to the caller
        as soon as the thread runs, not a GIL switch interval (5 ms) later, after the writer let it go."""
        niceness = self.writer_niceness
        go = threading.Event()

        def run() -> None:
            go.wait()
            if niceness and hasattr(os, "setpriority"):  # Linux: the nice value of this thread only
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
                except OSError as exc:
                    log.warning("could not lower the checkpoint writer's priority: %s", exc)
            self._run_job(job, job.handle)

        self._writer = threading.Thread(target=run, name="torch_ckpt_writer", daemon=True)  # exit: lifecycle waits
        self._writer.start()
        go.set()

    def _join_writer(self, timeout: float | None = None) -> None:
        """Wait until the writer thread of the last save, and so its follow-up work (deletions), has ended."""
        thread = self._writer
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if not thread.is_alive() and self._writer is thread:
                self._writer = None

    def _run_job(self, job: _Job, handle: SaveHandle) -> None:
        req = job.request
        try:
            failed = None
            if not handle.staged.done():
                try:
                    self._stage(job, handle)
                except BaseException as exc:
                    handle.staged.set_exception(exc)
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    # still join the persist collectives, so every rank fails this step at once
                    failed, job.to_write, job.layout = f"{type(exc).__name__}: {exc}", {}, ()
            t_start = time.monotonic()
            failed_names, self._failed_names = tuple(self._failed_names), []
            staged = replace(req, after_commit=None, tree=job.tree, tensor_bytes=handle.stats.bytes,
                             thread_count=self.thread_count, timings={"staging_s": handle.stats.staging_s},
                             incarnation=self._incarnation, failed=failed, incremental=self.incremental,
                             changed_keys=job.changed,
                             nodes=self.layout if req.nodes is None else req.nodes,
                             failed_names=failed_names, reserved=job.reserved)
            if self._process_writer is not None and (job.fits or failed is not None):
                final, files_bytes = self._process_writer.persist(
                    arena=None if failed else self._stager.arena, layout=job.layout, request=staged)
            else:
                with self._ctx.background_work():  # no rebuild of the groups under this persist
                    final, files_bytes = persist_checkpoint(replace(staged, tensors=job.to_write), self._ctx)
            stats = handle.stats
            stats.persist_s = time.monotonic() - t_start
            stats.total_s = time.monotonic() - job.t0
            stats.files_bytes = files_bytes  # no rank reads the committed directory again
            self.last_stats = stats
            log.info("[rank %d] committed step %d: %d bytes, blocking %.3f s, staging %.3f s, persist %.3f s",
                     self._ctx.rank, req.step, stats.bytes, stats.blocking_s, stats.staging_s, stats.persist_s)
            cleanup = req.after_commit(final) if req.after_commit is not None else None
            handle.committed.set_result(str(final))
            if callable(cleanup):  # work that need not delay `committed` (deleting retired checkpoints)
                try:
                    cleanup()
                except Exception as exc:  # noqa: BLE001 - the save is committed; never fail it now
                    log.warning("[rank %d] cleanup after committing step %d failed: %s: %s", self._ctx.rank,
                                req.step, type(exc).__name__, exc)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the caller's thread
            self._failed_names.append(req.final.name)  # a temporary may be left (a collective timed out)
            if job.reserved:  # the name this save reserved, unless it was committed after all
                unreserve(req.final, partial_path(req.final, self._incarnation), created=True)
            with self._lock:
                if self.on_write_error == "warn" and isinstance(exc, CheckpointError):
                    log.warning("[rank %d] checkpoint step %d failed, training continues (on_write_error='warn'): %s",
                                self._ctx.rank, req.step, exc)
                    self.failed_saves.append({"step": req.step, "error": str(exc), "time": time.time()})
                else:
                    log.error("[rank %d] checkpoint step %d failed: %s", self._ctx.rank, req.step, exc)
                    if self._pending_error is None:
                        self._pending_error = exc
            handle.committed.set_exception(exc)
        finally:
            job.to_write = {}

    # -- loading ---------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, state: StateToRestore, *, verify: bool = True,
             on_world_size_change: str = "error", allow_cast: bool = False,
             before_write: Callable[[], Any] | None = None) -> None:
        """Load the committed checkpoint directory ``path`` into ``state`` in place (collective).

        ``allow_cast=True`` casts tensors whose dtype differs from the live one (logged per key);
        by default that is a ``StateMismatchError``. A failed load leaves ``state`` unchanged. See
        :func:`torch_ckpt.restore._restore.load_into` for the checks, ``before_write`` and the errors.
        """
        self._ensure_open()
        self._wait_inflight()
        self._raise_pending()
        path = Path(path)
        load_into(state, path, read_manifest(path), self._ctx, verify=verify,
                  on_world_size_change=on_world_size_change, allow_cast=allow_cast, before_write=before_write)

    # -- lifecycle -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the in-flight save is committed and its follow-up work (deleting the checkpoints
        retention retired) is done, so a listing of the root right after it shows no hidden trash of a
        retired checkpoint (``save()`` only waits for ``committed``); raise any background error (once)."""
        self._wait_inflight()
        self._join_writer()
        self._raise_pending()

    def drain(self) -> None:
        """Wait for the save in flight, its cleanup and its writer thread to end; raise nothing (its error stays
        pending). Used before another owner in this process takes over the same root; safe from any thread."""
        handle = self._inflight
        if handle is not None:
            futures_wait([handle.committed])  # raises nothing: _run_job recorded the error as pending
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
        self._join_writer(timeout=30.0 if handle is None or handle.committed.done() else 0.0)  # the deletions
        with self._lock:
            err, self._pending_error = self._pending_error, None
        raised_by_handle = handle is not None and handle.committed.done() and handle.committed.exception() is err
        if err is not None and not raised_by_handle:  # (exception() of an undone future would block the exit)
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
            self._join_writer()  # and the deletions of the last save
            if self._process_writer is not None:
                self._process_writer.close()
            for hook in self._hooked.values():
                hook.remove()
            self._hooked.clear()
            self._stager.release()
            self._ctx.destroy()
        self._raise_pending()
