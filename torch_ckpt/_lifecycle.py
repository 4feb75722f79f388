"""Interpreter exit: a bounded wait for work still in flight (daemon threads are frozen at finalization).

Objects' ``_finish_at_exit()`` run in phase order (checkpointers' saves, which may queue uploads, then
replicators). ``threading._register_atexit`` runs them before non-daemon threads are joined and before
any ``atexit`` handler (``multiprocessing`` stopping writer processes), so what a save needs is still
there. A failure is logged as an error; the exit goes on.
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
