"""Bounded calls to a durable store from the caller's thread (``durable_timeout_seconds``).

A store that accepts connections but never answers must not block ``restore()`` for minutes.
:func:`bounded` runs one durable operation (a listing, a download) on a worker thread and waits
for it while the store keeps answering: the operation calls :meth:`Watch.tick` after every answer
(a manifest read, a chunk of a file), and when no answer came for ``timeout_seconds`` the caller
gets a :class:`~torch_ckpt.storage._locations.DurableUnavailableError` naming the store and the setting. A
large download that keeps making progress is never cut short; a silent store is given up on after
``timeout_seconds``.

The abandoned worker stops at its next answer (``tick`` raises once the caller gave up) or when
the backend's own socket timeouts fire; whatever it would publish goes through :meth:`Watch.publish`,
which refuses once the caller gave up, so a late download never appears in the local root after
the caller moved on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch_ckpt.errors import CheckpointTimeoutError
from torch_ckpt.storage._locations import DurableUnavailableError

__all__ = ["Watch", "bounded", "waiting_for_coordinator"]

T = TypeVar("T")


class Watch:
    """Progress of one bounded call, shared by the caller and the worker doing it."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._abandoned = False
        self._published = False
        self._local = 0  # workers now busy with local work (writing, fsync, checksums): not waiting on the store

    def tick(self) -> None:
        """Record an answer from the store.

        Raises:
            DurableUnavailableError: the caller gave up waiting (stops the abandoned worker).
        """
        self._last = time.monotonic()
        if self._abandoned:
            raise DurableUnavailableError("abandoned: the caller stopped waiting for the store")

    def idle_seconds(self) -> float:
        """Seconds since the last answer (or since the call started); 0 during local work."""
        return 0.0 if self._local else time.monotonic() - self._last

    @contextmanager
    def local_work(self) -> Iterator[None]:
        """Mark local work (a disk write, an fsync, a checksum of a fetched file): the store's
        silence is not counted while it runs, however long it takes."""
        with self._lock:
            self._local += 1
        try:
            yield
        finally:
            with self._lock:
                self._local -= 1
            self.tick()

    def publish(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a local commit) unless the caller gave up; after it, the caller takes the result.

        Raises:
            DurableUnavailableError: the caller gave up waiting.
        """
        with self._lock:
            if self._abandoned:
                raise DurableUnavailableError("abandoned: the caller stopped waiting for the store")
            result = fn()
            self._published = True
            return result

    def _abandon(self) -> bool:
        """Give up unless the worker already published; True when given up."""
        with self._lock:
            if self._published:
                return False
            self._abandoned = True
            return True


def bounded(fn: Callable[[Watch], T], *, timeout_seconds: float, what: str) -> T:
    """Run ``fn(watch)`` on a worker thread; wait while the store answers at least every ``timeout_seconds``.

    Args:
        fn: the durable operation; it calls ``watch.tick()`` after each answer of the store and
            commits anything local through ``watch.publish``.
        timeout_seconds: longest silence of the store accepted (seconds, > 0).
        what: the operation and the store, for the message (e.g. "listing s3://bucket/run").

    Returns:
        What ``fn`` returned.

    Raises:
        DurableUnavailableError: the store did not answer for ``timeout_seconds``.
        Exception: whatever ``fn`` raised.
    """
    done = threading.Event()
    box: dict[str, Any] = {}
    watch = Watch()

    def run() -> None:
        try:
            box["value"] = fn(watch)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="torch_ckpt_durable_call", daemon=True).start()
    try:
        while not done.wait(max(0.0, timeout_seconds - watch.idle_seconds())):
            if watch.idle_seconds() >= timeout_seconds and watch._abandon():
                raise DurableUnavailableError(
                    f"{what}: the store did not answer for {timeout_seconds:g} s (durable_timeout_seconds); "
                    "it accepts connections but does not respond, or is very slow")
            if watch._published:
                done.wait()
    except BaseException:
        watch._abandon()  # an interrupt of the caller: the worker publishes nothing after it
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def waiting_for_coordinator(ctx: Any, tier: Any, doing: str, collective: Callable[[], T], *,
                            whom: str | None = None) -> T:
    """Run ``collective`` (a broadcast of rank 0's answer); a timeout on another rank says what rank 0
    was doing (``doing``, e.g. "listing the durable tier s3://b/run") instead of suggesting that the
    ranks called different methods. ``whom``: who is waited for, when not rank 0 (e.g. "the node
    leaders"); then every rank's timeout gets the message.

    Raises:
        CheckpointTimeoutError: rank 0 did not answer within ``timeout_seconds``.
    """
    try:
        return collective()
    except CheckpointTimeoutError as exc:
        if whom is None and ctx.is_coordinator:
            raise
        bound = "" if tier is None else (
            f"; each call to the store gives up after durable_timeout_seconds={tier.timeout_seconds:g} s "
            "without an answer, but a download that keeps receiving bytes may take longer: raise timeout_seconds "
            "above the time it needs")
        raise CheckpointTimeoutError(
            f"rank {ctx.rank} waited {ctx.timeout_seconds:g} s (timeout_seconds) for {whom or 'rank 0'}, which "
            f"{'were' if whom else 'was'} {doing}"
            f"{bound}") from exc
