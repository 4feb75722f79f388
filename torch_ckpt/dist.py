"""``DistContext``: every collective torch-ckpt performs, on its own gloo groups.

Checkpoint traffic never uses the training process group (sharing it with NCCL training
collectives or with a background thread deadlocks). Two gloo groups are created collectively when
the manager is built: ``fg`` for decisions taken on the caller's thread (which step to restore,
whether to save) and ``bg`` for the background writer (DCP plan exchange, commit agreement). Each
thread therefore issues its collectives on its own group in the same order on every rank. Without
an initialised process group every operation is a local no-op.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch.distributed as dist

from torch_ckpt.errors import CheckpointError, CheckpointTimeoutError

__all__ = ["DistContext", "quiet_single_process_warning", "rank_and_world"]


def quiet_single_process_warning() -> None:
    """Ignore DCP's "assuming the intent is to save (load) in a single process" warning, process-wide.

    ``dcp.save``/``dcp.load`` emit it on every call with ``no_dist=True``, which torch-ckpt passes on
    purpose when there is no process group (``not DistContext.enabled``); no argument avoids it. The
    filter matches that message only, attributed to DCP (or to torch-ckpt should DCP stop wrapping
    the call), and also quiets the same non-information for the process's other single-process DCP
    calls. The modules that call DCP (:mod:`torch_ckpt.dcp_io`, :mod:`torch_ckpt.dcp_read`) install
    it once when imported: unlike ``warnings.catch_warnings`` around each call, it never changes
    the process-wide filters from the writer thread. Installing it again adds no second filter.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
                r"(save|load) in a single process",
        category=UserWarning,
        module=r"(torch\.distributed\.checkpoint|torch_ckpt)\.",
    )


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process in the default process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DistContext:
    """Rank, world size and the checkpoint process groups.

    Args:
        timeout_seconds: how long a checkpoint collective may wait for the other ranks before
            failing with :class:`CheckpointTimeoutError` (seconds).
        process_group: the group whose ranks take part (default: the world).
        distributed: False makes this process act alone even when a process group exists (for
            saves that only one rank performs, e.g. Lightning's rank-0-only ``CheckpointIO`` calls).
    """

    def __init__(self, *, timeout_seconds: float = 600.0, process_group: Any = None,
                 distributed: bool = True) -> None:
        self.enabled = distributed and dist.is_available() and dist.is_initialized()
        self.timeout_seconds = float(timeout_seconds)
        self.fg = self.bg = None
        if self.enabled:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            timeout = datetime.timedelta(seconds=self.timeout_seconds)
            self.fg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self.bg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self.rank = dist.get_rank(self.fg)
            self.world_size = dist.get_world_size(self.fg)
        else:
            self.rank, self.world_size = 0, 1

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that writes the manifest and runs retention (rank 0)."""
        return self.rank == 0

    def _wrap(self, fn, what: str):
        try:
            return fn()
        except RuntimeError as exc:  # gloo reports timeouts and peer loss as RuntimeError
            msg = str(exc)
            if "timed out" in msg.lower() or "timeout" in msg.lower():
                raise CheckpointTimeoutError(
                    f"checkpoint {what} timed out after {self.timeout_seconds:.0f} s waiting for other ranks "
                    "(did every rank call the same checkpoint method?)") from exc
            raise CheckpointError(f"checkpoint {what} failed across ranks: {msg}") from exc

    def broadcast(self, obj: Any, *, background: bool = False, what: str = "broadcast") -> Any:
        """Return rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        group = self.bg if background else self.fg
        self._wrap(lambda: dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group), what)
        return box[0]

    def all_gather(self, obj: Any, *, background: bool = False, what: str = "all-gather") -> list[Any]:
        """Return ``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        group = self.bg if background else self.fg
        self._wrap(lambda: dist.all_gather_object(out, obj, group=group), what)
        return out

    def barrier(self, *, background: bool = False, what: str = "barrier") -> None:
        """Wait for every rank."""
        if self.enabled:
            group = self.bg if background else self.fg
            self._wrap(lambda: dist.barrier(group=group), what)

    def destroy(self) -> None:
        """Release the checkpoint groups."""
        if self.enabled and dist.is_initialized():
            for g in (self.fg, self.bg):
                if g is not None:
                    try:
                        dist.destroy_process_group(g)
                    except (RuntimeError, ValueError):
                        pass
        self.fg = self.bg = None
        self.enabled = False
