"""The writer process (persist="process") never outlives its trainer and never commits for a dead one.

Each test runs real trainers (``tests/_helpers/orphan_trainer.py``) as subprocesses and SIGKILLs them.
To pin "a save is being written", the trainer's writer process stops itself (SIGSTOP) right
before it writes the manifest of step 2: shards and per-rank JSON are on disk, nothing is committed.
``--no-death-signal`` stands in for platforms without a parent-death signal, where only the
writer's own liveness check protects the root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointManager, CheckpointWriteError, is_committed

pytestmark = pytest.mark.slow  # see pyproject's markers: left out by make test-fast

_HELPER = Path(__file__).parent / "_helpers" / "orphan_trainer.py"
_spec = importlib.util.spec_from_file_location("_orphan_trainer_helper", _HELPER)
trainer_helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trainer_helper)

_REPO = Path(__file__).resolve().parents[1]
_EXIT_BOUND_S = 30.0  # a hang guard, not a performance limit: an orphan that survives never exits


def _wait_for(predicate, what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {bound_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def _gone(proc: psutil.Process) -> bool:
    """True once ``proc`` exited (a zombie nobody reaped counts as exited)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class _Trainer:
    """One orphan_trainer.py subprocess and its writer process."""

    def __init__(self, root: Path, log: Path, *, steps: str, value: float = 0.0, death_signal: bool = True,
                 stop_at: int | None = None, thread_count: int = 2, hold: bool = False, session: bool = False) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(_REPO), PYTHONUNBUFFERED="1")
        env.pop(trainer_helper.STOP_ENV, None)
        if stop_at is not None:
            env[trainer_helper.STOP_ENV] = str(stop_at)
        cmd = [sys.executable, str(_HELPER), str(root), "--steps", steps, "--value", str(value),
               "--thread-count", str(thread_count)]
        cmd += ["--no-death-signal"] if not death_signal else []
        cmd += ["--hold"] if hold else []
        self.log = log
        self._err = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=env, start_new_session=session)
        info = self.expect("writer_pid")
        self.incarnation = info["incarnation"]
        self.writer = psutil.Process(info["writer_pid"])

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def expect(self, key: str) -> dict:
        """Read progress lines until one has ``key``."""
        while True:
            line = self.proc.stdout.readline()
            assert line, f"trainer exited (code {self.proc.poll()}) before reporting {key!r}:\n{self.stderr()}"
            msg = json.loads(line)
            if key in msg:
                return msg

    def kill(self) -> None:
        """SIGKILL the trainer and reap it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def cleanup(self) -> None:
        """Kill whatever of this trainer and its writer still runs (after a failed assertion)."""
        for p in (self.writer,):
            if not _gone(p):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        if self.proc.poll() is None:
            self.kill()
        self.proc.stdout.close()
        self.proc.stdin.close()
        self._err.close()


@pytest.fixture
def trainers(tmp_path):
    """Start trainers with ``trainers(root, ...)``; all of them and their writers are gone after the test."""
    started: list[_Trainer] = []

    def start(root: Path, **kwargs) -> _Trainer:
        t = _Trainer(root, tmp_path / f"trainer_{len(started)}.log", **kwargs)
        started.append(t)
        return t

    yield start
    for t in started:
        t.cleanup()


def _temporaries(root: Path) -> list[str]:
    """The partials of saves in progress (inside their reserved step directories) and commit sides."""
    return sorted([n for n in os.listdir(root) if n.startswith((".step_", ".torch-ckpt."))] +
                  [p.name for p in root.glob("step_*/.torch-ckpt.partial.*")])


def _uncommitted(path: Path) -> bool:
    """Not a checkpoint: missing, or a reserved name holding nothing but partials."""
    return not path.exists() or (not is_committed(path) and all(n.startswith(".torch-ckpt.partial.")
                                                                for n in os.listdir(path)))


def _stopped_mid_save(start, root: Path, **kwargs) -> _Trainer:
    """A trainer that committed step 1 and whose writer is stopped inside the save of step 2."""
    t = start(root, steps="1,2", stop_at=2, **kwargs)
    t.expect("saving")
    t.expect("saving")
    _wait_for(lambda: _stopped(t.writer), "the writer to stop inside the save of step 2")
    assert (root / "step_000000001").is_dir() and _uncommitted(root / "step_000000002")
    return t


@pytest.mark.timeout(240)
def test_sigkilled_trainer_takes_its_writer_down_mid_save(tmp_path, trainers):
    """SIGKILL of the trainer mid-save ends its (even stopped) writer through the parent-death signal."""
    root = tmp_path / "root"
    a = _stopped_mid_save(trainers, root)
    a.kill()
    _wait_for(lambda: _gone(a.writer), "the writer to die with its trainer (it is never resumed)", _EXIT_BOUND_S)
    assert _uncommitted(root / "step_000000002")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("thread_count", [1, 4])
def test_orphaned_writer_resumed_after_the_trainer_died_commits_nothing(tmp_path, trainers, thread_count):
    """Without a parent-death signal, an orphaned writer resumed mid-save exits and never commits."""
    root = tmp_path / "root"
    a = _stopped_mid_save(trainers, root, death_signal=False, thread_count=thread_count)
    a.kill()
    assert not _gone(a.writer), "the writer died with its trainer: the liveness check is not what is tested"
    a.writer.send_signal(signal.SIGCONT)
    _wait_for(lambda: _gone(a.writer), "the orphaned writer to exit", _EXIT_BOUND_S)
    assert not (root / "step_000000002").exists()  # it removed its own partial and the name it reserved
    assert _temporaries(root) == []


@pytest.mark.timeout(240)
def test_idle_orphaned_writer_exits(tmp_path, trainers):
    """Without a parent-death signal, a writer whose trainer died between saves exits by itself."""
    root = tmp_path / "root"
    a = trainers(root, steps="1", death_signal=False, hold=True)
    assert a.expect("committed")["committed"] == 1
    a.kill()
    _wait_for(lambda: _gone(a.writer), "the idle orphaned writer to exit", _EXIT_BOUND_S)
    assert sorted(n for n in os.listdir(root) if "step_" in n) == ["step_000000001"]


@pytest.mark.timeout(300)
def test_restart_while_the_orphan_is_stopped_never_shares_its_temporary(tmp_path, trainers):
    """SIGSTOP the orphan, restart, SIGCONT: the orphan never touches the restart's temporary; its save commits."""
    root = tmp_path / "root"
    a = _stopped_mid_save(trainers, root, death_signal=False, value=0.25)
    orphan_tmp = f".torch-ckpt.partial.{a.incarnation}"
    assert _temporaries(root) == [orphan_tmp]
    a.kill()
    assert not _gone(a.writer)

    b = trainers(root, steps="2", value=0.75, stop_at=2)
    assert b.expect("restored")["restored"] == 1
    _wait_for(lambda: _stopped(b.writer), "the restarted run's writer to stop inside its save of step 2")
    own_tmp = root / "step_000000002" / f".torch-ckpt.partial.{b.incarnation}"
    assert _temporaries(root) == [own_tmp.name]  # the orphan's temporary was removed on the restart
    before = {f.name: f.read_bytes() for f in own_tmp.iterdir()}

    a.writer.send_signal(signal.SIGCONT)
    _wait_for(lambda: _gone(a.writer), "the orphaned writer to exit", _EXIT_BOUND_S)
    assert {f.name: f.read_bytes() for f in own_tmp.iterdir()} == before
    assert not is_committed(root / "step_000000002")

    b.writer.send_signal(signal.SIGCONT)
    b.expect("done")
    assert b.proc.wait() == 0, b.stderr()
    state = trainer_helper.new_state()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 2
    assert state["value"] == 0.75
    assert torch.equal(state["w"], torch.full_like(state["w"], trainer_helper.expected_value(2, 0.75)))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP])
def test_writer_survives_the_signals_a_terminal_or_scheduler_sends_the_whole_group(tmp_path, sig):
    """Ctrl-C or a hangup (SIGINT/SIGHUP to the process group) or SIGTERM/SIGUSR1 from SLURM: the writer lives, the
    next save commits."""
    state = {"w": torch.randn(1 << 16)}
    with CheckpointManager(tmp_path / "ck", persist="process") as mgr:
        mgr.save(1, state).wait()
        writer = mgr._ckpt._process_writer._proc
        os.kill(writer.pid, sig)
        time.sleep(0.5)
        assert writer.is_alive()
        mgr.save(2, state).wait()
    assert (tmp_path / "ck" / "step_000000002" / "manifest.json").exists()


def _shm_files(pid: int) -> set[str]:
    """The /dev/shm files process ``pid`` has mapped (POSIX semaphores and shared memory by name)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(maxsplit=5)[5].strip() for line in f if " /dev/shm/" in line}
    except OSError:
        return set()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_sigkill_of_the_whole_process_group_leaves_nothing_in_dev_shm(tmp_path, trainers):
    """killpg(SIGKILL) (SLURM after its grace period) also kills multiprocessing's tracker: no named files may leak."""
    t = trainers(tmp_path / "ck", steps="1", hold=True, session=True)
    t.expect("committed")
    mapped = set()
    for p in [psutil.Process(t.proc.pid), *psutil.Process(t.proc.pid).children(recursive=True)]:
        mapped |= _shm_files(p.pid)
    os.killpg(t.proc.pid, signal.SIGKILL)
    t.proc.wait()
    _wait_for(lambda: _gone(t.writer), "the writer to exit", _EXIT_BOUND_S)
    assert not [f for f in mapped if os.path.exists(f)]
    with CheckpointManager(tmp_path / "ck", persist="process") as mgr:  # the root lock is free
        assert mgr.restore(trainer_helper.new_state()) == 1


@pytest.mark.skipif(os.name != "posix", reason="POSIX re-parents orphans; elsewhere the start time is needed")
@pytest.mark.timeout(120)
def test_a_posix_writer_knows_its_trainer_by_parent_pid_alone(tmp_path, monkeypatch):
    """On POSIX no start time is read for the liveness check (Linux lets a re-read one drift); a save commits."""
    from torch_ckpt.save import _writer_process

    def refuse(pid):
        raise AssertionError("a start time was read on POSIX")

    monkeypatch.setattr(_writer_process, "_process_start_time", refuse)
    assert _writer_process._parent_alive(os.getppid(), None)
    with CheckpointManager(tmp_path, persist="process") as mgr:
        mgr.save(1, {"w": torch.arange(3.0)}).wait()
    assert is_committed(tmp_path / "step_000000001")


def _writer_of(mgr) -> psutil.Process:
    return psutil.Process(mgr.checkpointer._process_writer.pid)


@pytest.mark.timeout(180)
def test_a_writer_process_killed_between_saves_is_replaced_and_the_next_save_commits(tmp_path):
    """SIGKILL of the idle writer (an OOM kill): the next save starts a new writer process and commits."""
    with CheckpointManager(tmp_path, persist="process") as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        old = _writer_of(mgr)
        old.kill()
        _wait_for(lambda: not mgr.checkpointer._process_writer.alive, "the writer to be reaped")
        assert mgr.save(2, {"w": torch.full((3,), 2.0)}).wait().endswith("step_000000002")
        assert _writer_of(mgr).pid != old.pid and mgr.all_steps() == [1, 2]


@pytest.mark.timeout(180)
def test_after_a_save_the_killed_writer_failed_the_following_saves_commit(tmp_path):
    """A writer killed mid-save fails that save (raised once by its handle); the saves after it commit."""
    with CheckpointManager(tmp_path, persist="process") as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        writer = _writer_of(mgr)
        writer.suspend()  # holds the next save mid-way
        handle = mgr.save(2, {"w": torch.ones(3)})
        writer.kill()
        with pytest.raises(CheckpointWriteError, match="writer process died"):
            handle.wait()
        for step in (3, 4):
            mgr.save(step, {"w": torch.ones(3)}).wait()
        assert mgr.all_steps() == [1, 3, 4]


def _kill_own_writer_then_save(rank, world_size, root):
    with CheckpointManager(root, persist="process") as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        if rank == 1:
            _writer_of(mgr).kill()
            _wait_for(lambda: not mgr.checkpointer._process_writer.alive, "rank 1's writer to be reaped")
        mgr.save(2, {"w": torch.ones(3)}).wait()  # every rank starts a new writer (their group is new)
        assert mgr.all_steps() == [1, 2]


@pytest.mark.timeout(240)
def test_one_ranks_dead_writer_is_replaced_on_every_rank(tmp_path):
    """2 gloo ranks: rank 1's writer is killed between saves; every rank starts a new one and step 2 commits."""
    run_distributed(_kill_own_writer_then_save, 2, tmp_path, daemon=False)
    assert is_committed(tmp_path / "step_000000002")
