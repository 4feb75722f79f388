"""A persistent writer process per rank: persisting without competing for the trainer's GIL.

The staging arena lives in shared memory; the writer process maps it once and, for each save,
receives the :class:`~torch_ckpt.save._persist.SaveRequest` (without tensors) and the arena's layout,
then runs :func:`~torch_ckpt.save._persist.persist_checkpoint` over its own gloo group among the
writer processes of all ranks, formed when the manager is built (the first save does not pay for it).
A writer that dies is detected within a second and reported as :class:`CheckpointWriteError`.

The writer never outlives its trainer. On Linux it asks for SIGKILL when the thread that started
it exits (``PR_SET_PDEATHSIG``; so it is requested only from the main thread), then compares
``getppid()`` with the trainer's pid (a trainer that died before the call). Everywhere it also
checks that its parent is alive and unchanged (pid and start time) while idle (every second), before
a save, before the ranks agree and right before the commit rename, so it never commits for a dead
trainer; it then exits. It ignores the signals meant for the trainer (:data:`IGNORED_SIGNALS`: a
terminal's Ctrl-C or hangup reaches the whole process group, SLURM signals every process of the step,
and the kernel sends SIGHUP to a stopped process group its trainer's death orphaned), on which the
trainer saves a last checkpoint through it, or the liveness check ends it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import torch
import torch.multiprocessing as mp

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointError, CheckpointWriteError

__all__ = ["ProcessWriter"]

log = get_logger(__name__)

_START_TIMEOUT_S = 120.0
_IDLE_POLL_S = 1.0  # how often an idle writer checks that its trainer is still alive
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
#: signals the writer ignores: they ask the trainer to stop or to save (sent to the whole group)
IGNORED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
                        if hasattr(signal, name))
# Signal the kernel sends the writer when its trainer dies (Linux). SIGKILL also ends a stopped or
# busy writer at once. None: do not request one (tests use it to stand in for other platforms).
_PARENT_DEATH_SIGNAL: int | None = signal.SIGKILL


def _process_start_time(pid: int) -> float | None:
    """Start time of process ``pid`` (seconds since the epoch), None when it does not exist."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _parent_alive(parent_pid: int, parent_started: float | None) -> bool:
    """True while this process's parent is still the trainer that started it. POSIX re-parents orphans, so a
    changed ``getppid()`` is exact and ``parent_started`` is None there (a start time read again later can
    differ by seconds: Linux derives it from a boot time that moves with clock adjustments). Elsewhere
    (Windows, whose start times are exact) the parent's pid is gone or belongs to a process started later."""
    if os.getppid() != parent_pid:
        return False
    if parent_started is None:
        return True
    started = _process_start_time(parent_pid)
    return started is not None and abs(started - parent_started) < 1.0


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _error(exc: BaseException) -> tuple[str, tuple[str, str, int | None]]:
    return "error", (type(exc).__name__, str(exc), getattr(exc, "errno", None))


def _writer_main(requests: Connection, replies: Connection, rank: int, world_size: int, init: tuple[str, int] | None,
                 timeout_s: float, niceness: int, parent: tuple[int, float | None], death_signal: int | None) -> None:
    """Entry point of the writer process (spawned; imports torch afresh). ``requests`` and ``replies`` are pipes
    (no named semaphores, which a SIGKILL of the whole group would leave in ``/dev/shm``); ``parent`` is the
    trainer's ``(pid, start time)``; ``death_signal`` the signal requested for its death (None: none)."""
    parent_pid, parent_started = parent
    for sig in IGNORED_SIGNALS:  # the trainer's to handle (Ctrl-C, preemption): the writer must survive them
        signal.signal(sig, signal.SIG_IGN)

    def trainer_alive() -> bool:
        return _parent_alive(parent_pid, parent_started)

    try:
        if death_signal is not None and sys.platform.startswith("linux"):  # first thing: see the module doc
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
        if os.getppid() != parent_pid:  # the trainer died before the request took effect
            os._exit(1)
        from dataclasses import replace

        import torch.distributed as dist

        from torch_ckpt.save._persist import arena_views, persist_checkpoint

        if niceness:
            os.nice(niceness)
        torch.set_num_threads(1)
        if init is not None:
            dist.init_process_group("gloo", init_method=f"tcp://{init[0]}:{init[1]}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        ctx = DistContext(timeout_seconds=timeout_s)
        replies.send(("ready", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a failed start
        replies.send(_error(exc))
        return
    arena = None
    while True:
        try:
            if not requests.poll(_IDLE_POLL_S):
                if trainer_alive():
                    continue
                os._exit(1)  # orphaned while idle: nothing to finish, nothing to report to
            msg = requests.recv()
        except (EOFError, OSError):  # the trainer's end closed: it exited or died
            os._exit(1)
        if msg is None:
            break
        request, layout, new_arena = msg  # the arena comes with the first save that uses it
        arena = arena if new_arena is None else new_arena
        try:
            tensors = arena_views(cast(torch.Tensor, arena), layout) if layout else {}
            ctx.heal()  # the writers' groups, when a collective of an earlier save broke them
            final, files_bytes = persist_checkpoint(replace(request, tensors=tensors, owner_alive=trainer_alive), ctx)
            replies.send(("ok", (str(final), files_bytes)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            replies.send(_error(exc))
        if not trainer_alive():
            os._exit(1)  # the save above was not committed (owner_alive); nobody waits for more
    ctx.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessWriter:
    """Owns the writer process of this rank; ``ctx`` agrees once on a rendezvous port, ``timeout_seconds`` bounds
    the writer's collectives and its start, ``niceness`` is added to its nice value.

    Raises:
        CheckpointError: the writer process could not start or form its process group.
    """

    def __init__(self, ctx: DistContext, *, timeout_seconds: float, niceness: int = 0) -> None:
        init = None
        if ctx.enabled:
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            init = ctx.broadcast((addr, _free_port(addr) if ctx.is_coordinator else None), what="writer rendezvous")
        spawn = mp.get_context("spawn")
        # pipes, not queues: a Queue's semaphores are named files in /dev/shm, which leak when a SIGKILL
        # of the whole process group (SLURM after its grace period) also kills multiprocessing's tracker
        child_requests, self._requests = spawn.Pipe(duplex=False)
        self._replies, child_replies = spawn.Pipe(duplex=False)
        # Linux delivers the parent-death signal when the *thread* that started the child exits: only
        # request it when that thread is the main thread (lives as long as the process)
        death_signal = _PARENT_DEATH_SIGNAL if threading.current_thread() is threading.main_thread() else None
        if _PARENT_DEATH_SIGNAL is not None and death_signal is None:
            log.info("checkpoint writer process started from a non-main thread: it stops through its liveness "
                     "check (within %.0f s), not through a parent-death signal, if the trainer dies", _IDLE_POLL_S)
        parent = (os.getpid(), None if os.name == "posix" else _process_start_time(os.getpid()))
        self._proc = spawn.Process(target=_writer_main, name=f"torch_ckpt_writer_rank{ctx.rank}", daemon=True,
                                   args=(child_requests, child_replies, ctx.rank, ctx.world_size, init,
                                         timeout_seconds, niceness, parent, death_signal))
        try:
            self._proc.start()
        finally:  # the child has its own copies now; ours would hide its death from recv()
            child_requests.close()
            child_replies.close()
        self._arena_ptr: int | None = None
        try:
            kind, payload = self._reply(deadline_s=max(_START_TIMEOUT_S, float(timeout_seconds)))
        except CheckpointWriteError as exc:
            self.close()
            raise CheckpointError(
                f"the checkpoint writer process died while starting (exit code {self._proc.exitcode}). With "
                "persist='process' the script that creates the manager is re-imported by the writer (spawn): "
                "guard its training code with `if __name__ == \"__main__\":`. Otherwise the host may be out of "
                "memory.") from exc
        if kind != "ready":
            self.close()
            raise CheckpointError(f"the checkpoint writer process failed to start: {payload[0]}: {payload[1]}")

    def _reply(self, deadline_s: float | None = None) -> tuple[str, Any]:
        start = time.monotonic()
        while True:
            try:
                if self._replies.poll(1.0):
                    return self._replies.recv()
                died = not self._proc.is_alive()
            except (EOFError, OSError):  # the writer's end closed: it died
                died = True
            if died:
                self._proc.join(timeout=5)  # reaped, for its exit code
                raise CheckpointWriteError(
                    f"the checkpoint writer process died (exit code {self._proc.exitcode}); the save was not "
                    "committed. Check host memory (it may have been OOM-killed).") from None
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                raise CheckpointError(
                    f"the checkpoint writer process did not answer within {deadline_s:.0f} s") from None

    @property
    def alive(self) -> bool:
        """True while the writer process runs (False once it died, e.g. OOM-killed, or was closed)."""
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        """Exit code of the writer process once it ended (negative: the signal that killed it), else None."""
        return self._proc.exitcode

    @property
    def pid(self) -> int | None:
        """Process id of the writer process (None before it started)."""
        return self._proc.pid

    def persist(self, *, arena: torch.Tensor | None, layout: tuple, request: Any) -> tuple[Path, int]:
        """Persist one staged :class:`~torch_ckpt.save._persist.SaveRequest` (no tensors) in the writer process;
        returns the committed directory and the bytes of its files.

        Raises:
            CheckpointWriteError: the write or commit failed (this or another rank), or the writer died.
        """
        try:
            new = arena if arena is not None and arena.data_ptr() != self._arena_ptr else None
            self._requests.send((request, layout, new))
            if new is not None:
                self._arena_ptr = new.data_ptr()
        except OSError:  # the writer's end is closed (BrokenPipeError): _reply reports its death
            pass
        kind, payload = self._reply()
        if kind == "ok":
            return Path(payload[0]), int(payload[1])
        name, message, errno = payload
        if errno is not None:
            prefix = f"[Errno {errno}] "  # str() of an OSError already carries it; CheckpointWriteError adds it again
            raise CheckpointWriteError(errno, message[len(prefix):] if message.startswith(prefix) else message)
        raise CheckpointWriteError(f"{name}: {message}")

    def close(self) -> None:
        """Stop the writer process (after the request in flight, if any)."""
        if self._proc.is_alive():
            try:
                with contextlib.suppress(OSError):  # the writer exited meanwhile
                    self._requests.send(None)
                self._proc.join(timeout=30)
            finally:
                if self._proc.is_alive():
                    self._proc.kill()  # (it ignores SIGTERM: IGNORED_SIGNALS)
                    self._proc.join(timeout=5)
