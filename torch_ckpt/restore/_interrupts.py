"""Keeping a Ctrl-C from splitting a restore's work: thread starts, and the final write of the live state.

``Thread.start()`` waits (interruptibly) until the new thread runs. A reader thread that starts
at once and holds the GIL keeps the main thread in that wait for milliseconds, so a
``KeyboardInterrupt`` often lands there: ``start()`` raises while the thread it started goes on
working, and the caller, believing nothing runs, cleans up (puts back the live tensors a restore
wrote in place) while that thread still writes. :class:`Launch` closes that gap: its threads
first wait for a gate, which opens only once every ``start()`` returned; when a start is
interrupted the gate opens with the work cancelled, so every thread exits without doing anything.

Once every check of a restore has passed, the loaded values are written into the live state
(tensors exchanged or copied, components' ``load_state_dict``); a ``KeyboardInterrupt`` in the
middle of that would leave part of the state new and part old. :class:`InterruptHold` holds a
Ctrl-C (``SIGINT`` with Python's default handler, on the main thread) during that step and
raises it once the step is done.

:func:`run_all` runs jobs on a few such threads and returns only once none of them works any
more, even when the caller is interrupted while it waits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Launch", "InterruptHold", "Stopped", "run_all"]


class Launch:
    """Threads (daemons) running ``targets``, none of which runs its target until all have started.

    Args:
        targets: one callable per thread (no arguments).
        name: the threads' name.
    """

    def __init__(self, targets: Sequence[Callable[[], None]], name: str) -> None:
        self._gate = threading.Event()
        self.working = False  # True once every thread started: they run their targets (join them)
        self.threads = [threading.Thread(target=self._gated, args=(fn,), name=name, daemon=True) for fn in targets]

    def _gated(self, fn: Callable[[], None]) -> None:
        self._gate.wait()
        if self.working:
            fn()

    def start(self) -> None:
        """Start every thread, then open the gate.

        When this raises (e.g. a ``KeyboardInterrupt`` while a thread was starting), check
        :attr:`working`: False means no target runs or ever will (the threads exit by themselves);
        True means all of them run (join :attr:`threads`).
        """
        interrupted: BaseException | None = None
        try:
            for t in self.threads:
                t.start()
            self.working = True
        finally:
            while not self._gate.is_set():  # opened in any case, or started threads would wait forever
                try:
                    self._gate.set()
                except KeyboardInterrupt as exc:
                    interrupted = exc
        if interrupted is not None:
            raise interrupted


class InterruptHold:
    """Holds a Ctrl-C from :meth:`start` to :meth:`release`, then raises it (``KeyboardInterrupt``).

    Only on the main thread and only while ``SIGINT`` has Python's default handler (which raises
    ``KeyboardInterrupt``; another handler, e.g. a framework's, is left alone); otherwise both
    methods do nothing. Other signals are not affected. A second Ctrl-C while one is held is
    raised at once, so a write that hangs can still be interrupted.
    """

    def __init__(self) -> None:
        self._previous: object = None
        self.held = False

    def _handler(self, signum: int, frame: object) -> None:
        if self.held:  # a second Ctrl-C: the user insists (e.g. a component's load_state_dict hangs)
            raise KeyboardInterrupt
        self.held = True

    def start(self) -> None:
        """From now on a Ctrl-C is recorded instead of raised."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handler)

    def release(self) -> None:
        """Put the default handler back; raise ``KeyboardInterrupt`` if a Ctrl-C came meanwhile."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self.held:
            self.held = False
            raise KeyboardInterrupt


class Stopped(Exception):
    """A worker of :func:`run_all` gave up because the caller was interrupted."""


def run_all(work: Callable[[Any], Any], jobs: Sequence[Any], stop: threading.Event, workers: int, *,
            abandon: Callable[[Any], None], name: str) -> list[Any]:
    """Run ``work(job)`` for every job on ``workers`` threads; returns each result or exception, in order.

    Returns only once every thread has finished, even if the caller is interrupted meanwhile:
    ``stop`` is then set (``work`` should raise :class:`Stopped` at its next step when it sees it),
    and the interrupt is re-raised once no thread works. A job not begun once ``stop`` is set, or
    when the threads' start was interrupted (:class:`Launch`: then none runs), is handed to
    ``abandon`` instead (e.g. to close its file).

    Raises:
        KeyboardInterrupt: (or any exception) raised in the calling thread while it waited.
    """
    results: list[Any] = [None] * len(jobs)
    todo = list(range(len(jobs)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                if stop.is_set():
                    abandon(jobs[i])
                    raise Stopped()
                results[i] = work(jobs[i])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                results[i] = exc

    launch = Launch([worker] * workers, name)
    interrupted: BaseException | None = None
    try:
        launch.start()
    except BaseException as exc:  # noqa: BLE001 - re-raised once no worker runs
        interrupted = exc
        stop.set()
    if not launch.working:  # no worker ever ran: every job is abandoned
        for job in jobs:
            abandon(job)
        assert interrupted is not None  # working is False only when start() raised
        raise interrupted
    for t in launch.threads:
        while t.is_alive():
            try:
                t.join()
            except BaseException as exc:  # noqa: BLE001 - re-raised once the workers have stopped
                interrupted = interrupted or exc
                stop.set()
    if interrupted is not None:
        raise interrupted
    return results
