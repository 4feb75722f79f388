"""Staging: copy the live state into one reusable host arena so training can go on.

All tensors of a save are copied into views of a single flat host buffer (the *arena*), allocated
once and reused for every save; it is re-allocated only when the set of keys, shapes or dtypes
changes. The arena is page-locked (pinned) when CUDA is available, and can live in shared memory so
a writer process can read it without a copy. Copying into an existing buffer runs at memory-copy
speed (about 9.5 GB/s on the reference 2-core machine) whereas allocating fresh memory per save is
page-fault bound (1.4-2.7 GB/s), and one allocation avoids thousands of pinned or shared-memory
handles.

CUDA tensors are copied on a side stream with ``non_blocking=True`` after an event recorded on the
caller's stream; a CUDA event marks the end of the copy. CPU tensors are copied with
one ``torch._foreach_copy_`` call (which releases the GIL). Every tensor is copied, whatever its device, so nothing
handed to the writer shares storage with a live tensor.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointWriteError, ConfigError
from torch_ckpt.save._memory_limits import available_memory_bytes

__all__ = ["HostStager", "StagedState", "StagingMemoryError", "StagingProgress", "default_budget_bytes", "ArenaLayout"]

log = get_logger(__name__)

_ALIGN_BYTES = 64
#: bytes per ``torch._foreach_copy_`` call when the copy reports its progress (pipelined staging)
_CHUNK_BYTES = 64 << 20

#: ``((key, shape, dtype, offset_bytes), ...)``: where each tensor lives in the arena.
ArenaLayout = tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]


def default_budget_bytes(local_world_size: int | None = None, *, held_bytes: int = 0) -> int:
    """Host bytes this rank may keep for staging now: half the available memory, split over local ranks.

    Available memory is psutil's available RAM capped by the headroom of this process's memory
    cgroup (:func:`torch_ckpt.save._memory_limits.available_memory_bytes`), so a trainer in a container
    stays inside the container's limit.

    Args:
        local_world_size: ranks sharing this host's memory (default: ``$LOCAL_WORLD_SIZE``, else 1).
        held_bytes: bytes of staging memory this rank already holds (they are freed before a new
            arena is allocated, so they count as available).
    """
    if local_world_size is None:
        try:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            local_world_size = 1
    return int((available_memory_bytes() + held_bytes) * 0.5 / max(1, local_world_size))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    loc = _local(t)
    return loc.numel() * loc.element_size()


def arena_views(arena: torch.Tensor, layout: ArenaLayout) -> dict[str, torch.Tensor]:
    """Return ``{key: tensor aliasing its slice of the arena}`` (used by the writer process too).

    Each tensor gets a storage of exactly its own size that aliases the arena's memory (built with
    ``torch.frombuffer``), so writers that copy "views of larger storages" (DCP does, to avoid
    serialising the whole storage) see plain tensors and write them without an extra copy.
    """
    base = arena.numpy()
    out = {}
    for key, shape, dtype, offset in layout:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if n == 0:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(memoryview(base[offset:offset + n]), dtype=torch.uint8)
        out[key] = flat.view(dtype).view(shape)
    return out


class StagingMemoryError(CheckpointWriteError):
    """The staging arena could not be allocated (errno ENOMEM); names the size, the budget and the fix."""


@dataclass
class StagedState:
    """Host copies of a flat tensor dict.

    Attributes:
        tensors: ``{key: host tensor}`` (views of the arena; DTensors keep their sharding spec).
        nbytes: bytes copied.
        layout: where each tensor lives in the arena.
        event: CUDA event that completes when device copies are done (None for CPU-only states).
    """

    tensors: dict[str, torch.Tensor]
    nbytes: int
    layout: ArenaLayout
    event: Any = None

    def synchronize(self) -> None:
        """Block until every copy has landed in host memory."""
        if self.event is not None:
            self.event.synchronize()


class StagingProgress:
    """Which arena tensors hold their staged values yet: marked by the copy, awaited by the writer.

    Lets a writer start on the first tensors while the rest are still being copied (pipelined
    staging: time to durable approaches max(copy, write) instead of their sum).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: set[str] = set()
        self._all = False
        self._error: str | None = None

    def mark(self, keys: list[str]) -> None:
        """Record that ``keys`` are staged."""
        with self._cond:
            self._ready.update(keys)
            self._cond.notify_all()

    def finish(self) -> None:
        """Record that every tensor is staged."""
        with self._cond:
            self._all = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Record that the copy stopped: waiters of tensors not staged yet raise."""
        with self._cond:
            self._error = f"{type(exc).__name__}: {exc}"
            self._cond.notify_all()

    def wait(self, key: str) -> None:
        """Block until ``key`` is staged.

        Raises:
            CheckpointWriteError: the copy failed before staging ``key``.
        """
        with self._cond:
            while not (self._all or key in self._ready or self._error is not None):
                self._cond.wait()
            if not (self._all or key in self._ready):
                raise CheckpointWriteError(f"staging failed before tensor {key!r} was copied ({self._error}); "
                                           "this checkpoint is not written")


class HostStager:
    """A reusable host arena with a byte budget.

    Args:
        budget_bytes: most host bytes the arena may occupy; ``None`` uses
            :func:`default_budget_bytes`, evaluated at each :meth:`fits` (memory in use changes).
        pin_memory: page-lock the arena; ``None`` means "when CUDA is available".
        share_memory: place the arena in shared memory (for a writer process).

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
        self._nbytes = 0
        self._stream = None
        self._lock = threading.Lock()
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

    def _ensure_arena(self, tensors: dict[str, torch.Tensor]) -> bool:
        signature = tuple((k, tuple(_local(t).shape), _local(t).dtype) for k, t in tensors.items())
        if signature == self._signature and self.arena is not None:
            return False
        layout, offset = [], 0
        for key, shape, dtype in signature:
            layout.append((key, shape, dtype, offset))
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            offset += (n + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES
        # free the old arena before allocating the new one (its views keep its memory alive too)
        self.arena, self._signature, self._layout, self._views = None, None, (), {}
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
        self._nbytes = sum(v.numel() * v.element_size() for v in self._views.values())
        self.allocations += 1
        log.debug("allocated a %d-byte staging arena for %d tensors", offset, len(layout))
        return True

    def reserve(self, tensors: dict[str, torch.Tensor]) -> None:
        """Allocate (or keep) the arena for ``tensors`` without copying anything.

        Raises:
            StagingMemoryError: the allocation failed (the arena is released; nothing is staged).
        """
        with self._lock:
            self._ensure_arena(tensors)

    def prepare(self, tensors: dict[str, torch.Tensor]) -> StagedState:
        """The arena views ``tensors`` will be staged into, without copying anything yet.

        Used with :meth:`stage`'s ``progress`` so a writer can be handed the views before the copy.
        """
        with self._lock:
            self._ensure_arena(tensors)
            views = self._views
            out = {key: DTensor(views[key], t._spec, requires_grad=False) if isinstance(t, DTensor) else views[key]
                   for key, t in tensors.items()}
            return StagedState(tensors=out, nbytes=self._nbytes, layout=self._layout)

    def stage(self, tensors: dict[str, torch.Tensor], *, ready_event: Any = None,
              only: set[str] | None = None, progress: StagingProgress | None = None) -> StagedState:
        """Copy ``tensors`` into the arena.

        Device copies are asynchronous (call :meth:`StagedState.synchronize` before reading the
        buffers); host copies are complete on return.

        Args:
            tensors: flat ``{key: tensor}``; tensors may live on any device; DTensors are staged
                shard-locally.
            ready_event: CUDA event after which the device tensors hold the values to save
                (default: the current stream's position at this call).
            only: copy just these keys (the arena still covers all of ``tensors``); used to stage
                in two phases.
            progress: host tensors are then copied largest first, in chunks of about 64 MiB, each
                chunk's keys but the last marked on ``progress`` as soon as it is copied (device
                tensors are not supported with it); the caller's :meth:`StagingProgress.finish`
                releases the rest.

        Returns:
            The staged host tensors; valid until the next call to :meth:`stage`.
        """
        with self._lock:
            self._ensure_arena(tensors)
            views = self._views
            out: dict[str, torch.Tensor] = {}
            device_pairs = []
            host_keys, host_dst, host_src = [], [], []
            for key, t in tensors.items():
                src, buf = _local(t).detach(), views[key]
                if only is not None and key not in only:
                    pass
                elif src.device.type == "cuda":
                    device_pairs.append((buf, src))
                else:
                    host_keys.append(key)
                    host_dst.append(buf)
                    host_src.append(src)
                out[key] = DTensor(buf, t._spec, requires_grad=False) if isinstance(t, DTensor) else buf
            if device_pairs and progress is not None:
                raise ConfigError("staging with progress reporting supports host tensors only")
            if host_dst and progress is not None:
                self._copy_reporting(host_keys, host_dst, host_src, progress)
            elif host_dst:
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
            return StagedState(tensors=out, nbytes=self._nbytes, layout=self._layout, event=event)

    @staticmethod
    def _copy_reporting(keys: list[str], dst: list[torch.Tensor], src: list[torch.Tensor],
                        progress: StagingProgress) -> None:
        """Copy largest first in chunks of about ``_CHUNK_BYTES``, marking each chunk's keys when done.

        The last chunk is not marked: the caller's :meth:`StagingProgress.finish` releases it, after
        the caller has recorded what the writer may read at the end (the staging time).
        """
        order = sorted(range(len(keys)), key=lambda i: dst[i].numel() * dst[i].element_size(), reverse=True)
        chunk: list[int] = []
        size = 0
        for n, i in enumerate(order):
            chunk.append(i)
            size += dst[i].numel() * dst[i].element_size()
            if size >= _CHUNK_BYTES or n == len(order) - 1:
                torch._foreach_copy_([dst[j] for j in chunk], [src[j] for j in chunk])
                if n < len(order) - 1:
                    progress.mark([keys[j] for j in chunk])
                chunk, size = [], 0

    def release(self) -> None:
        """Free the arena."""
        with self._lock:
            self.arena, self._signature, self._layout, self._views = None, None, (), {}
