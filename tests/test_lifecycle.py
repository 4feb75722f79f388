"""Lifecycle of the core (torch_ckpt._lifecycle, writer threads, in-process root ownership): threads exist
only while they have work, a second manager of one process takes over a root its previous owner no
longer uses, and interpreter exit finishes the save in flight."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch

from tests._threads import ckpt_threads
from torch_ckpt import CheckpointManager, CheckpointWriteError, ConfigError
from torch_ckpt.root._lock import _flock_holder


def test_no_thread_remains_once_a_save_is_committed(tmp_path):
    """After save() and wait() the manager, still open, runs no thread (the writer ended with its save)."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.wait()
        assert ckpt_threads() == []


def test_durable_replicator_thread_ends_when_nothing_is_queued(tmp_path):
    """With a durable tier the replicator thread starts with the first upload and ends once it is done."""
    with CheckpointManager(tmp_path / "local", durable_url=(tmp_path / "durable").as_uri()) as mgr:
        assert ckpt_threads(0) == []
        mgr.save(1, {"w": torch.ones(4)})
        assert mgr.wait_durable(30)
        assert ckpt_threads() == [] and mgr.replication_stats()["durable_step"] == 1


def test_second_manager_takes_over_from_an_unreferenced_one_after_its_save_in_flight(tmp_path, held_writes):
    """A manager dropped with a save in flight: a new one on its root waits for that save and lists it."""
    first = CheckpointManager(tmp_path)
    first.save(1, {"w": torch.ones(4)})
    del first
    threading.Timer(0.5, held_writes.set).start()
    with CheckpointManager(tmp_path) as second:
        assert second.all_steps() == [1]
        second.save(2, {"w": torch.ones(4)})
    assert ckpt_threads() == []


def test_second_manager_takes_over_from_one_only_a_reference_cycle_keeps(tmp_path):
    """An unclosed manager in a reference cycle (garbage, not yet collected) does not block a new one."""
    first = CheckpointManager(tmp_path)
    first.save(1, {"w": torch.ones(4)})
    first.cycle = first
    ref = weakref.ref(first)
    gc.disable()
    try:
        del first
        with CheckpointManager(tmp_path) as second:
            assert ref() is None and second.all_steps() == [1]
    finally:
        gc.enable()


def test_unreferenced_manager_is_freed_and_releases_its_root(tmp_path):
    """Dropping the last reference frees an unclosed manager (no thread or lock keeps it) and its lock."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.ones(4)})
    mgr.wait()
    ref = weakref.ref(mgr)
    del mgr
    assert ref() is None and _flock_holder(tmp_path) is None and os.listdir(tmp_path) == ["step_000000001"]


def test_unreferenced_manager_with_a_memory_tier_is_freed_and_releases_both_roots(tmp_path):
    """Dropping an unclosed manager with memory_root frees it and lets go of the disk and the memory root's locks."""
    mgr = CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"))
    mgr.save(1, {"w": torch.ones(4)}, tier="memory")
    mgr.wait()
    ref = weakref.ref(mgr)
    del mgr
    assert ref() is None and _flock_holder(tmp_path / "disk") is None and _flock_holder(tmp_path / "mem") is None


def test_a_construction_refused_after_it_took_the_root_releases_what_it_took(tmp_path):
    """A construction the memory tier refuses, once the root is locked and the handler installed, releases both."""
    before = signal.getsignal(signal.SIGUSR1)
    with CheckpointManager(tmp_path / "a", memory_root=str(tmp_path / "mem"), async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)}, tier="memory")
    with pytest.raises(ConfigError, match="memory_root"):
        CheckpointManager(tmp_path / "b", memory_root=str(tmp_path / "mem"), preemption_signals=("SIGUSR1",),
                          durable_url=(tmp_path / "durable").as_uri())
    assert signal.getsignal(signal.SIGUSR1) is before and ckpt_threads() == []
    assert _flock_holder(tmp_path / "b") is None and _flock_holder(tmp_path / "mem") is None


def test_a_collective_failing_during_construction_releases_the_root_and_the_handler(tmp_path, monkeypatch):
    """A construction whose agreement between ranks raises releases the root's lock and the signal handler."""
    from torch_ckpt.distributed._context import DistContext

    original = DistContext.all_gather

    def gather(self, obj, **kw):
        if kw.get("what") == "init":
            raise CheckpointWriteError("peer lost")
        return original(self, obj, **kw)

    monkeypatch.setattr(DistContext, "all_gather", gather)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(CheckpointWriteError, match="peer lost"):
        CheckpointManager(tmp_path, preemption_signals=("SIGUSR1",))
    assert signal.getsignal(signal.SIGUSR1) is before and _flock_holder(tmp_path) is None


def test_second_manager_while_the_first_is_open_names_this_process_not_another_run(tmp_path):
    """Two open managers of one process on one root: the second is refused naming this process, not a run."""
    with CheckpointManager(tmp_path):
        with pytest.raises(CheckpointWriteError, match="another CheckpointManager of this process") as info:
            CheckpointManager(tmp_path)
    assert "another run" not in str(info.value) and f"pid {os.getpid()}" in str(info.value)


def _run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def test_interpreter_exit_commits_a_slow_save_in_flight(tmp_path):
    """A script that ends right after save(), while the write still takes a second, exits with it committed."""
    proc = _run(f"""
        import time, torch
        import torch_ckpt.save._checkpointer as c
        from torch_ckpt import CheckpointManager
        persist = c.persist_checkpoint
        c.persist_checkpoint = lambda req, ctx: (time.sleep(1.0), persist(req, ctx))[1]
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.save(3, {{"w": torch.ones(4)}})
    """)
    assert proc.returncode == 0, proc.stderr
    assert "waiting for the checkpoint of step 3 to commit" in proc.stderr
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [3]


def test_interpreter_exit_logs_a_save_that_fails_in_flight(tmp_path):
    """A save failing while the interpreter exits is logged as an error naming the step, never dropped silently."""
    proc = _run(f"""
        import time, torch
        import torch_ckpt.save._checkpointer as c
        from torch_ckpt import CheckpointManager, CheckpointWriteError
        def fail(req, ctx):
            time.sleep(0.5)
            raise CheckpointWriteError(28, "No space left on device")
        c.persist_checkpoint = fail
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.save(3, {{"w": torch.ones(4)}})
    """)
    assert "checkpoint of step 3 failed at the interpreter's exit" in proc.stderr, proc.stderr
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == []


def test_interpreter_exit_waits_at_most_timeout_seconds_for_a_hung_save(tmp_path):
    """A save still writing timeout_seconds after exit began is logged as not committed; the exit is not held."""
    proc = _run(f"""
        import time, torch
        import torch_ckpt.save._checkpointer as c
        from torch_ckpt import CheckpointManager
        c.persist_checkpoint = lambda req, ctx: time.sleep(60)
        mgr = CheckpointManager({str(tmp_path)!r}, timeout_seconds=1)
        mgr.save(3, {{"w": torch.ones(4)}})
        mgr._ckpt._pending_error = OSError("an earlier background failure nobody raised")
    """, timeout=45)
    assert "did not commit within 1 s" in proc.stderr, proc.stderr
    assert "an earlier background failure nobody raised" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interpreter_exit_does_not_wait_for_an_idle_writer_process(tmp_path):
    """persist='process', never closed: the script exits (the writer process used to block exit forever)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from torch_ckpt import CheckpointManager
        if __name__ == "__main__":
            mgr = CheckpointManager({str(tmp_path / "root")!r}, persist="process")
            mgr.save(1, {{"w": torch.ones(4)}})
            mgr.wait()
    """), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dropped_process_writer_manager_is_taken_over_and_its_writer_process_stopped(tmp_path):
    """persist='process', dropped unclosed: a new manager takes the root over and the old writer process ends."""
    import multiprocessing

    first = CheckpointManager(tmp_path, persist="process")
    first.save(1, {"w": torch.ones(4)})
    writer = first.checkpointer._process_writer._proc
    del first
    with CheckpointManager(tmp_path) as second:
        assert second.all_steps() == [1]
    assert not writer.is_alive() and writer not in multiprocessing.active_children()


def _child_exit_code(target=None) -> int | None:
    """Fork a child (as DataLoader workers are made) running ``target``, wait up to 60 s; its exit code or None."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=target or (lambda: None))
    child.start()
    child.join(60)
    code = child.exitcode
    if code is None:
        child.kill()
        child.join()
    return code


def test_a_forked_child_exits_at_once_while_a_save_is_in_flight(tmp_path, held_writes):
    """A forked child (a DataLoader worker) does not wait at its exit for the parent's save, which still commits."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        assert _child_exit_code() == 0
        held_writes.set()
        mgr.wait()
        assert mgr.all_steps() == [1]


def test_a_forked_child_leaves_the_parents_lock_file_in_place(tmp_path, monkeypatch):
    """Where the root is locked through a lock file, a forked child's exit hooks do not remove the parent's file."""
    from torch_ckpt.root import _lock

    monkeypatch.setattr(_lock, "_lock_directory", lambda root: None)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        assert (tmp_path / _lock.LOCK_FILE_NAME).exists()
        assert _child_exit_code(_lock._release_all) == 0
        assert (tmp_path / _lock.LOCK_FILE_NAME).exists()
