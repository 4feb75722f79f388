"""Run a test body on N CPU ranks (gloo) with a watchdog, failing with the first rank's traceback."""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rendezvous of the gloo ranks, a local server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTEXT: list = []


def _context():
    """A forkserver context whose server imported torch once: a rank starts in ~0.05 s instead of the
    2-5 s a spawned interpreter spends importing torch (this suite starts ranks ~200 times)."""
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _as_caller(env: dict, cwd: str) -> None:
    """Take the caller's environment and directory, as a spawned process would (not the fork server's at its start)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)


def _entry(rank: int, world_size: int, port: int, fn, args, errors, env: dict, cwd: str) -> None:
    _as_caller(env, cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    # The body passed: leave without interpreter teardown, where torch's C++ helper threads can
    # occasionally abort ("terminate called without an active exception") after the work is done.
    os._exit(0)


def _run(fn, args, env: dict, cwd: str) -> None:
    _as_caller(env, cwd)
    fn(*args)


def start_process(fn, *args):
    """Start ``fn(*args)`` in a process of its own, forked from the fork server (torch imported), with the
    caller's environment and directory: a trainer to SIGKILL (``proc.kill()``) at a random instant."""
    proc = _context().Process(target=_run, args=(fn, args, dict(os.environ), os.getcwd()))
    proc.start()
    return proc


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0, daemon: bool = True) -> None:
    """Spawn ``world_size`` ranks running ``fn(rank, world_size, *args)``; raise on any failure or hang.

    ``fn`` must be a module-level function (it is pickled for spawn). ``daemon=False`` lets the
    ranks start processes of their own (``persist="process"`` writers); the watchdog still kills them.
    """
    ctx = _context()
    errors = ctx.SimpleQueue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errors, env, cwd), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.daemon = daemon
        p.start()
    import time

    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, tb = sorted(failures)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s:.0f} s (hang)")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")
