"""Interpreter exit: finish the work still in flight, within a bound, before the process goes.

torch-ckpt's background threads (the writer of each save, the durable replicator) are daemon
threads that exist only while they have work, so a process never waits at exit for an idle one.
A daemon thread is frozen when the interpreter finalizes, though, so work still in flight at exit
gets an explicit, bounded wait: :func:`finish_at_exit` registers an object whose
``_finish_at_exit()`` runs then, in registration phase order (every checkpointer's in-flight save
first, which may queue an upload, then every replicator's uploads).

The wait runs from ``threading._register_atexit`` when Python has it (3.9+): before the interpreter
joins its non-daemon threads and before any ``atexit`` handler (``multiprocessing`` stopping its
children, other libraries' teardown), so the process groups and writer processes a save needs are
still there. Without it, an ``atexit`` handler is used. A save that fails or does not finish within
its bound is logged as an error naming the step (never lost silently); the exit goes on.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from torch_ckpt._logging import get_logger

__all__ = ["finish_at_exit"]

log = get_logger(__name__)

#: phase 0: checkpointers (in-flight saves), phase 1: replicators (queued uploads)
_PHASES: tuple[weakref.WeakSet, ...] = (weakref.WeakSet(), weakref.WeakSet())
_GUARD = threading.Lock()
_registered = False


def finish_at_exit(obj: Any, phase: int) -> None:
    """Call ``obj._finish_at_exit()`` at interpreter exit while ``obj`` is alive (held weakly)."""
    global _registered
    with _GUARD:
        _PHASES[phase].add(obj)
        if _registered:
            return
        _registered = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(_run)
    except RuntimeError:  # missing, or the interpreter is already shutting down
        atexit.register(_run)


def _run() -> None:
    for phase in _PHASES:
        with _GUARD:
            objs = list(phase)
        for obj in objs:
            try:
                obj._finish_at_exit()
            except BaseException as exc:  # noqa: BLE001 - one failure must not skip the others
                log.error("checkpoint work could not be finished at interpreter exit: %s: %s",
                          type(exc).__name__, exc)
