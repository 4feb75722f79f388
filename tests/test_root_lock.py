"""The root lock (torch_ckpt.root._lock): a kernel flock on the root, at most one owner, freed when its owner dies."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch_ckpt import CheckpointManager, CheckpointWriteError
from torch_ckpt.root._lock import RootLock

TRIALS = 200


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _racer(index: int, roots: list[str], barrier, wins, racers: int) -> None:
    """Worker: for every trial, start together with the other worker and try to take that trial's lock."""
    for trial, root in enumerate(roots):
        barrier.wait(timeout=60)
        lock = RootLock(Path(root))
        try:
            lock.acquire()
            wins[trial * racers + index] = 1
        except CheckpointWriteError:
            wins[trial * racers + index] = 0
        barrier.wait(timeout=60)  # both tried before either releases
        lock.release()
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("racers", [2, 4])
def test_processes_racing_for_a_stale_lock_never_both_own_it(tmp_path, racers):
    """200 trials: 2 (4) processes start at the same instant on a root whose lock a dead pid left; exactly one wins."""
    stale = json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "since": 0})
    roots = []
    for trial in range(TRIALS):
        root = tmp_path / f"root{trial}"
        root.mkdir()
        (root / ".lock").write_text(stale)
        roots.append(str(root))
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(racers)
    wins = ctx.Array("i", [-1] * (racers * TRIALS))
    procs = [ctx.Process(target=_racer, args=(i, roots, barrier, wins, racers)) for i in range(racers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert [p.exitcode for p in procs] == [0] * racers
    owners = [sum(wins[racers * t:racers * (t + 1)]) for t in range(TRIALS)]
    assert owners == [1] * TRIALS, f"trials without exactly one owner: {[t for t, n in enumerate(owners) if n != 1]}"


_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from torch_ckpt.root._lock import RootLock
    lock = RootLock(Path(sys.argv[1]))
    lock.acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def _start_holder(root: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_root_held_by_another_process_names_its_host_and_pid(tmp_path):
    """A root locked by a live process is refused with that process's host and pid."""
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(CheckpointWriteError, match=f"host '{socket.gethostname()}', pid {holder.pid}"):
            CheckpointManager(tmp_path)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lock_of_a_killed_process_is_free_at_once(tmp_path):
    """SIGKILL of the owner frees the lock (the kernel drops it); a new manager opens the root at once."""
    holder = _start_holder(tmp_path)
    holder.kill()
    holder.wait()
    assert os.listdir(tmp_path) == []  # the lock is the directory's: no file in the folder
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() is None


def test_second_lock_object_in_the_same_process_is_refused(tmp_path):
    """Two managers of one process on one root: the second is refused (the lock is per open file, not per pid)."""
    first = RootLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(CheckpointWriteError, match=f"pid {os.getpid()}"):
            RootLock(tmp_path).acquire()
    finally:
        first.release()
    assert not (tmp_path / ".lock.owner").exists()
    second = RootLock(tmp_path)
    second.acquire()
    second.release()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lock_file_naming_a_dead_pid_does_not_free_a_held_lock(tmp_path):
    """Ownership is the kernel lock, not the file text: a held lock whose owner file names a dead pid is refused."""
    holder = _start_holder(tmp_path)
    try:
        (tmp_path / ".lock.owner").write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                                         "since": 0}))
        with pytest.raises(CheckpointWriteError, match="in use by another run"):
            RootLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_release_from_another_thread_frees_the_lock(tmp_path):
    """The lock is not thread-local: a manager closed from another thread really releases the root."""
    import threading

    first = RootLock(tmp_path)
    first.acquire()
    releaser = threading.Thread(target=first.release)
    releaser.start()
    releaser.join()
    second = RootLock(tmp_path)
    second.acquire()
    second.release()


def test_contender_does_not_erase_the_owner_record(tmp_path):
    """A refused contender leaves the holder's host and pid readable for the next one (the sidecar survives)."""
    first = RootLock(tmp_path)
    first.acquire()
    try:
        for _ in range(2):
            with pytest.raises(CheckpointWriteError, match=f"pid {os.getpid()}"):
                RootLock(tmp_path).acquire()
    finally:
        first.release()


def test_file_system_without_locks_is_refused_not_soft_locked(tmp_path, monkeypatch):
    """flock failing with ENOSYS (Lustre without -o flock) is a CheckpointWriteError naming the mount option."""
    import errno

    import torch_ckpt.root._lock as root_lock

    def no_flock(fd):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(root_lock, "_flock", no_flock)
    with pytest.raises(CheckpointWriteError, match="-o flock"):
        RootLock(tmp_path).acquire()
