"""Interpreter exit: a bounded wait for work still in flight (daemon threads are frozen at finalization).

Objects' ``_finish_at_exit()`` run in phase order (checkpointers' saves, which may queue uploads, then
replicators). ``threading._register_atexit`` runs them before non-daemon threads are joined and before
any ``atexit`` handler (``multiprocessing`` stopping writer processes), so what a save needs is still
there. A failure is logged as an error; the exit goes on.

Only the process that registered an object finishes its work: a child made by ``fork`` (a
``DataLoader`` worker, ``multiprocessing``'s default start method on Linux) inherits these hooks but
none of the threads doing that work, and must exit at once rather than wait for them.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any

from torch_ckpt._logging import get_logger

__all__ = ["finish_at_exit"]

log = get_logger(__name__)

#: phase 0: checkpointers (in-flight saves), phase 1: replicators (queued uploads)
_PHASES: tuple[weakref.WeakKeyDictionary, ...] = (weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary())
_GUARD = threading.Lock()
_registered = False


def finish_at_exit(obj: Any, phase: int) -> None:
    """Call ``obj._finish_at_exit()`` at interpreter exit while ``obj`` is alive (held weakly)."""
    global _registered
    with _GUARD:
        _PHASES[phase][obj] = os.getpid()
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
    pid = os.getpid()
    for phase in _PHASES:
        with _GUARD:
            objs = [obj for obj, owner in phase.items() if owner == pid]
        for obj in objs:
            try:
                obj._finish_at_exit()
            except BaseException as exc:  # noqa: BLE001 - one failure must not skip the others
                log.error("checkpoint work could not be finished at interpreter exit: %s: %s",
                          type(exc).__name__, exc)
