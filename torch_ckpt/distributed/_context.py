"""``DistContext``: every collective torch-ckpt performs, on its own gloo groups.

Checkpoint traffic never uses the training process group (sharing it with NCCL collectives or with
a background thread deadlocks): two gloo groups are created collectively with the manager, ``fg``
for decisions on the caller's thread and ``bg`` for the background writer, so each thread issues
its collectives on its own group in the same order on every rank. Without an initialised process
group every operation is a local no-op.

After a rank fault: a failed gloo collective leaves its group unusable for good. The context then
counts as *broken* and says so in the job's key-value store (which does not depend on the broken
connections). Before its next operation on the caller's thread every rank rebuilds both groups: a
rank that saw the failure, or finds another rank's announcement, joins a store barrier for the next
*generation*, then creates two gloo groups named after it (not through ``new_group``'s
process-wide counter, so the job's own later groups keep their names). A rank that waits longer
than ``timeout_seconds`` raises :class:`CheckpointTimeoutError` and joins again at its next
operation. No rebuild runs while this process's writer thread persists
(:meth:`DistContext.background_work`); a writer *process* calls :meth:`DistContext.heal` before each save.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch.distributed as dist

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointError, CheckpointTimeoutError

__all__ = ["DistContext", "quiet_single_process_warning", "rank_and_world"]

log = get_logger(__name__)


def quiet_single_process_warning() -> None:
    """Ignore DCP's "assuming the intent is to save (load) in a single process" warning, process-wide.

    DCP emits it on every call with ``no_dist=True``, which torch-ckpt passes on purpose without a
    process group. Installed at import (``warnings.catch_warnings`` in the writer thread is not
    thread-safe); installing it again adds none.
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
        timeout_seconds: how long a collective waits for the other ranks before
            :class:`CheckpointTimeoutError` (seconds).
        process_group: the group whose ranks take part (default: the world).
        distributed: False: act alone even with a process group (e.g. Lightning's rank-0-only saves).
    """

    def __init__(self, *, timeout_seconds: float = 600.0, process_group: Any = None,
                 distributed: bool = True) -> None:
        self.enabled = distributed and dist.is_available() and dist.is_initialized()
        self.timeout_seconds = float(timeout_seconds)
        self.fg = self.bg = None
        self.generation = 0  # how many times the groups were rebuilt (same on every rank once rebuilt)
        self._broken: str | None = None  # why the groups are unusable (a failed collective), None when healthy
        self._arrived: int | None = None  # the generation whose rebuild barrier this rank has joined
        self._background = threading.RLock()  # held by the writer thread while it persists (no rebuild then)
        self._store: Any = None
        self._ns = ""
        if self.enabled:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            timeout = datetime.timedelta(seconds=self.timeout_seconds)
            self.fg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self.bg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self.rank = dist.get_rank(self.fg)
            self.world_size = dist.get_world_size(self.fg)
            self._ranks = list(range(dist.get_world_size())) if ranks is None else sorted(ranks)
            try:  # the job's rendezvous store: unaffected by broken gloo connections
                self._store = dist.distributed_c10d._get_default_store()
                self._ns = f"torch_ckpt/dist/{self.fg.group_name}"  # the same on every rank (created collectively)
            except (AttributeError, RuntimeError, ValueError) as exc:
                log.warning("no key-value store for rebuilding checkpoint groups after a fault: %s", exc)
        else:
            self.rank, self.world_size = 0, 1

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that writes the manifest and runs retention (rank 0)."""
        return self.rank == 0

    # -- recovery after a failed collective --------------------------------------------------------
    @contextmanager
    def background_work(self) -> Iterator[None]:
        """Hold off :meth:`heal` while this block runs (the writer thread's persist of one save)."""
        with self._background:
            yield

    def _key(self, kind: str, generation: int) -> str:
        return f"{self._ns}/{kind}/{generation}"

    def _mark_broken(self, reason: str) -> None:
        """Record that the groups are unusable and tell the other ranks (best effort: the store may be gone)."""
        if self._broken is None:
            self._broken = reason
        if self._store is not None:
            with suppress(Exception):  # the store itself is unreachable: the next rebuild says so
                self._store.set(self._key("want", self.generation + 1), str(self.rank))

    def heal(self) -> None:
        """Rebuild the checkpoint groups when a collective failed on this or another rank (collective).

        One store look-up while healthy; otherwise it waits for this process's writer thread, then
        every rank joins a store barrier and forms two new groups.

        Raises:
            CheckpointTimeoutError: not every rank joined within ``timeout_seconds``, or the new groups
                could not be formed (tried again at the next operation).
            CheckpointError: the groups are broken and there is no key-value store to rebuild them.
        """
        if not self.enabled:
            return
        if self._broken is None:
            if self._store is None:
                return
            try:
                wanted = self._store.check([self._key("want", self.generation + 1)])
            except Exception:  # noqa: BLE001 - store unreachable: nothing to learn from it now
                return
            if not wanted:
                return
            self._broken = "a checkpoint collective failed on another rank"
        if self._store is None:
            raise CheckpointError(f"the checkpoint process groups are unusable ({self._broken}) and cannot be rebuilt: "
                                  "this process group has no key-value store; restart the job")
        with self._background:  # reentrant: a writer thread's own call does not wait for itself
            self._rebuild()

    def _rebuild(self) -> None:
        target = self.generation + 1
        store, n = self._store, self.world_size
        count, done = self._key("count", target), self._key("done", target)
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        try:
            store.set(self._key("want", target), str(self.rank))
            if self._arrived != target:
                joined = store.add(count, 1)
                self._arrived = target
                if joined == n:
                    store.set(done, "1")
            try:
                store.wait([done], timeout)
            except Exception:  # noqa: BLE001 - the others did not join in time: leave the barrier again
                others = store.add(count, -1)
                if others < n - 1 and not store.check([done]):
                    self._arrived = None
                    raise CheckpointTimeoutError(
                        f"the checkpoint process groups broke ({self._broken}) and could not be rebuilt: only "
                        f"{others + 1} of {n} ranks joined within {self.timeout_seconds:.0f} s; the next "
                        "checkpoint call tries again") from None
                # every other rank had joined: the last of them completed the barrier with this rank counted
                store.add(count, 1)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is unreachable (rank 0's host is gone)
            raise CheckpointError(f"the checkpoint process groups broke ({self._broken}) and could not be rebuilt: "
                                  f"the job's key-value store failed: {type(exc).__name__}: {exc}") from exc
        old = (self.fg, self.bg)
        fg = None
        try:
            fg = self._new_group(f"{self._ns}/g{target}/fg")
            bg = self._new_group(f"{self._ns}/g{target}/bg")
        except Exception as exc:  # noqa: BLE001 - not every rank formed the groups: try the next generation
            if fg is not None:
                with suppress(Exception):
                    dist.destroy_process_group(fg)
            reason = self._broken
            self.generation = target
            self._mark_broken(f"{reason}; rebuilding generation {target} failed")
            raise CheckpointTimeoutError(
                f"the checkpoint process groups broke ({reason}) and rebuilding them failed: "
                f"{type(exc).__name__}: {exc}; the next checkpoint call tries again") from exc
        self.fg, self.bg = fg, bg
        log.warning("[rank %d] rebuilt the checkpoint process groups (generation %d) after: %s", self.rank, target,
                    self._broken)
        self.generation, self._broken, self._arrived = target, None, None
        for g in old:
            with suppress(Exception):  # a broken group may refuse a clean shutdown
                dist.destroy_process_group(g)

    def new_group(self) -> Any:
        """Collective: one more gloo group over the checkpoint ranks, for a background protocol of its own."""
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        return dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)

    def _new_group(self, name: str) -> Any:
        """A gloo group over this context's ranks with an explicit name (``new_group`` would use its counter)."""
        c10d = dist.distributed_c10d
        ranks = self._ranks
        pg, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(dist.get_rank()), ranks, c10d.Backend("gloo"), self._store, group_name=name,  # type: ignore[arg-type]
            timeout=datetime.timedelta(seconds=self.timeout_seconds))
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
        return pg

    def _wrap(self, fn, what: str, background: bool = False):
        """``fn(group)`` on the background or caller-thread group (rebuilt first if needed), errors typed."""
        if not background:
            self.heal()
        try:
            return fn(self.bg if background else self.fg)
        except RuntimeError as exc:  # gloo reports timeouts and peer loss as RuntimeError
            msg = str(exc)
            self._mark_broken(f"checkpoint {what} failed: {msg.splitlines()[0] if msg else type(exc).__name__}")
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
        self._wrap(lambda g: dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0), group=g), what, background)
        return box[0]

    def all_gather(self, obj: Any, *, background: bool = False, what: str = "all-gather") -> list[Any]:
        """Return ``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._wrap(lambda g: dist.all_gather_object(out, obj, group=g), what, background)
        return out

    def barrier(self, *, background: bool = False, what: str = "barrier") -> None:
        """Wait for every rank."""
        if self.enabled:
            self._wrap(lambda g: dist.barrier(group=g), what, background)

    def destroy(self) -> None:
        """Release the checkpoint groups."""
        if self.enabled and dist.is_initialized():
            for g in (self.fg, self.bg):
                if g is not None:
                    with suppress(RuntimeError, ValueError):
                        dist.destroy_process_group(g)
        self.fg = self.bg = None
        self.enabled = False
