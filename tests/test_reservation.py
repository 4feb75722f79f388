"""Reserved final names, partials inside them, and a root lock that puts no file into the folder (issue 27)."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from torch_ckpt import CheckpointManager, CheckpointWriteError, is_committed
from torch_ckpt.root._layout import PARTIAL_PREFIX, side_path
from torch_ckpt.root._lock import RootLock


def _state(v: float = 1.0) -> dict:
    return {"w": torch.full((64,), v)}


@pytest.fixture
def held(monkeypatch):
    """Background writes wait for ``held.set()``; a failing write raises ``held.fail`` instead."""
    import torch_ckpt.save._checkpointer as checkpointer

    gate = threading.Event()
    gate.fail = None
    persist = checkpointer.persist_checkpoint

    def gated(req, ctx):
        assert gate.wait(30), "held write never released"
        if gate.fail is not None:  # the writer itself fails (a writer process that died, say)
            raise gate.fail
        return persist(req, ctx)

    monkeypatch.setattr(checkpointer, "persist_checkpoint", gated)
    yield gate
    gate.set()


def test_save_reserves_its_name_before_returning_and_nobody_lists_it(tmp_path, held, caplog):
    """While the write is held the name exists (empty), is not committed, not listed, and not warned about."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state())
        final = tmp_path / mgr.naming.name(1)
        assert os.listdir(tmp_path) == [final.name] and os.listdir(final) == []
        with caplog.at_level(logging.WARNING, logger="torch_ckpt"):
            assert not is_committed(final) and mgr.all_steps() == []
        assert "ignoring" not in caplog.text
        held.set()
        mgr.wait()
        assert mgr.all_steps() == [1] and is_committed(final)


def test_failed_save_removes_its_reservation_but_keeps_a_users_empty_folder(tmp_path, held):
    """A failed write leaves the root as before: its own reservation goes, an empty folder it was given stays."""
    held.fail = OSError(28, "No space left on device")
    (tmp_path / "mine").mkdir()
    with CheckpointManager(tmp_path) as mgr:
        for save in (lambda: mgr.save(1, _state()), lambda: mgr.save(2, _state(), path="mine")):
            save()
            held.set()
            with pytest.raises(OSError):
                mgr.wait()
        held.fail = None
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_replaced_checkpoint_stays_loadable_while_its_replacement_is_written(tmp_path, held):
    """Saving again to a committed path writes inside it; until the commit it loads the old values."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        held.set()
        mgr.save(1, _state(1.0), path="latest").wait()
        held.clear()
        mgr.save(2, _state(2.0), path="latest")
        assert os.listdir(tmp_path) == ["latest"] and is_committed(tmp_path / "latest")
        held.set()
        mgr.wait()
        assert sorted(os.listdir(tmp_path)) == ["latest"]
        target = _state(0.0)
        assert mgr.restore(target, path="latest") == 2 and torch.equal(target["w"], _state(2.0)["w"])


def test_a_crashed_saves_partial_and_reservation_are_removed_at_the_next_start(tmp_path):
    """A reservation holding another incarnation's partial (a kill mid-write) is gone after the next start."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state()).wait()
    crashed = tmp_path / "step_000000002" / (PARTIAL_PREFIX + "00000000000000aa")
    crashed.mkdir(parents=True)
    (crashed / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step_000000003").mkdir()  # killed before its write began
    with CheckpointManager(tmp_path) as mgr:
        assert os.listdir(tmp_path) == ["step_000000001"] and mgr.all_steps() == [1]


def test_temporary_names_carry_no_copy_of_the_final_name(tmp_path):
    """The commit's side directory and retention's trash never contain NAME (framework scans parse names)."""
    from torch_ckpt.root._layout import retire_step_dir

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(), path="hpc_ckpt_1.ckpt").wait()
    assert "hpc_ckpt" not in side_path(tmp_path / "hpc_ckpt_1.ckpt", "ab").name
    trash = retire_step_dir(tmp_path / "hpc_ckpt_1.ckpt")
    assert "hpc_ckpt" not in trash.name and trash.name.startswith(".")


def test_root_lock_writes_nothing_into_the_folder(tmp_path):
    """The lock is the directory's own flock: no entry while held or after; a second lock is refused."""
    lock = RootLock(tmp_path)
    lock.acquire()
    try:
        assert os.listdir(tmp_path) == []
        with pytest.raises(CheckpointWriteError, match="another CheckpointManager of this process"):
            RootLock(tmp_path).acquire()  # this process's registry names the open holder
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def test_the_directory_flock_of_this_process_is_told_apart_from_another_run(tmp_path, monkeypatch):
    """Past the in-process registry (the root reached another way), the kernel's flock still refuses, naming this
    process from /proc/locks."""
    import torch_ckpt.root._lock as root_lock

    lock = RootLock(tmp_path)
    lock.acquire()
    try:
        monkeypatch.setattr(root_lock, "_HELD", root_lock.weakref.WeakValueDictionary())
        with pytest.raises(CheckpointWriteError, match=f"locked by this same process \\(pid {os.getpid()}\\)"):
            RootLock(tmp_path).acquire()
    finally:
        lock.release()


def test_where_directories_cannot_be_locked_the_lock_file_is_removed_at_release(tmp_path, monkeypatch):
    """NFS-like (flock on a directory refused with EBADF): .lock holds the owner while held, gone after release."""
    import errno
    import json

    import torch_ckpt.root._lock as root_lock

    real = root_lock._flock

    def refuse_directories(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd)

    monkeypatch.setattr(root_lock, "_flock", refuse_directories)
    lock = RootLock(tmp_path)
    lock.acquire()
    try:
        assert os.listdir(tmp_path) == [".lock"]
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(CheckpointWriteError, match=f"pid {os.getpid()}"):
            RootLock(tmp_path).acquire()
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def _reserve_on_two_ranks(rank: int, world_size: int, root: str) -> None:
    import torch_ckpt.save._checkpointer as checkpointer

    release = threading.Event()
    persist = checkpointer.persist_checkpoint
    checkpointer.persist_checkpoint = lambda req, ctx: (release.wait(60), persist(req, ctx))[1]
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
        if rank == 0:  # the committing rank reserved the name before its save() returned
            assert os.listdir(root) == ["step_000000001"] and not is_committed(os.path.join(root, "step_000000001"))
        release.set()
        mgr.wait()
        assert mgr.all_steps() == [1]
    if rank == 0:
        assert os.listdir(root) == ["step_000000001"]


@pytest.mark.timeout(180)
def test_two_ranks_reserve_the_name_on_the_committing_rank_and_leave_only_the_checkpoint(tmp_path):
    """2 gloo ranks: rank 0 reserves the name when save() returns; afterwards the root holds only the checkpoint."""
    from tests._dist import run_distributed

    run_distributed(_reserve_on_two_ranks, 2, str(tmp_path))
