"""Staging: copy the live state into reusable host buffers so training can go on.

Buffers are allocated once per tensor key and reused for every save (page-locked when CUDA is
available, plain host memory otherwise); they are re-allocated only when a tensor's shape or dtype
changes. Copying into existing buffers runs at memory-copy speed (about 9.5 GB/s on the reference
2-core machine) whereas allocating fresh memory per save is page-fault bound (1.4-2.7 GB/s).

CUDA tensors are copied on a side stream with ``non_blocking=True``; a CUDA event marks the end of
the copy. CPU tensors are copied with ``Tensor.copy_`` (which releases the GIL). Every tensor is
copied, whatever its device, so nothing handed to the writer shares storage with a live tensor.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from torch_ckpt.errors import ConfigError

__all__ = ["HostStager", "StagedState", "default_budget_bytes"]

log = logging.getLogger(__name__)


def default_budget_bytes(local_world_size: int = 1) -> int:
    """Host bytes this rank may keep for staging: half the available RAM, split over local ranks."""
    return int(psutil.virtual_memory().available * 0.5 / max(1, local_world_size))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    loc = _local(t)
    return loc.numel() * loc.element_size()


@dataclass
class StagedState:
    """Host copies of a flat tensor dict.

    Attributes:
        tensors: ``{key: host tensor}`` (DTensors keep their sharding spec around a host local shard).
        nbytes: bytes copied.
        event: CUDA event that completes when device copies are done (None for CPU-only states).
    """

    tensors: dict[str, torch.Tensor]
    nbytes: int
    event: Any = None

    def synchronize(self) -> None:
        """Block until every copy has landed in host memory."""
        if self.event is not None:
            self.event.synchronize()


class HostStager:
    """Reusable host staging buffers with a byte budget.

    Args:
        budget_bytes: most host bytes the buffers may occupy; ``None`` uses
            :func:`default_budget_bytes`.
        pin_memory: page-lock buffers; ``None`` means "when CUDA is available".

    Raises:
        ConfigError: ``budget_bytes`` is not positive.
    """

    def __init__(self, *, budget_bytes: int | None = None, pin_memory: bool | None = None) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ConfigError(f"staging budget_bytes must be > 0, got {budget_bytes!r}")
        self.budget_bytes = int(budget_bytes) if budget_bytes is not None else default_budget_bytes()
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = None
        self._lock = threading.Lock()
        self.allocations = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes currently held by staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def required_bytes(self, tensors: dict[str, torch.Tensor]) -> int:
        """Bytes needed to stage ``tensors`` (local shards only)."""
        return sum(_nbytes(t) for t in tensors.values())

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """True when ``tensors`` fit in the staging budget."""
        return self.required_bytes(tensors) <= self.budget_bytes

    def _buffer(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def stage(self, tensors: dict[str, torch.Tensor]) -> StagedState:
        """Copy ``tensors`` into the reusable buffers.

        Device copies are asynchronous (call :meth:`StagedState.synchronize` before reading the
        buffers); host copies are complete on return. Buffers of keys that disappeared are freed.

        Args:
            tensors: flat ``{key: tensor}``; tensors may live on any device; DTensors are staged
                shard-locally.

        Returns:
            The staged host tensors; valid until the next call to :meth:`stage`.
        """
        from torch.distributed.tensor import DTensor

        with self._lock:
            for stale in set(self._buffers) - set(tensors):
                del self._buffers[stale]
            out: dict[str, torch.Tensor] = {}
            nbytes = 0
            event = None
            device_pairs = []
            for key, t in tensors.items():
                src = _local(t).detach()
                buf = self._buffer(key, src)
                if src.device.type == "cuda":
                    device_pairs.append((buf, src))
                else:
                    buf.copy_(src)
                nbytes += buf.numel() * buf.element_size()
                out[key] = DTensor(buf, t._spec, requires_grad=False) if isinstance(t, DTensor) else buf
            if device_pairs:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                self._stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._stream):
                    for buf, src in device_pairs:
                        buf.copy_(src, non_blocking=self.pin_memory)
                        src.record_stream(self._stream)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            return StagedState(tensors=out, nbytes=nbytes, event=event)

    def release(self) -> None:
        """Free every staging buffer."""
        with self._lock:
            self._buffers.clear()
