"""Tests of CheckpointManager: save/restore round trips, async semantics, errors, retention."""

import gc
import logging
import subprocess
import sys
import textwrap
import threading

import numpy as np
import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

import torch_ckpt.save._persist as persist_mod
from tests._dist import run_distributed
from tests.conftest import train_steps
from torch_ckpt import CheckpointManager, CheckpointNotFoundError, CheckpointWriteError, ConfigError, TrainState


def test_roundtrip_restores_everything_exactly(tmp_path, make_state):
    """Model, optimizer, scheduler, RNG, step and extras come back bit for bit."""
    state, model, opt, sched = make_state(seed=0, extras={"tokens": 123, "pair": (1, 2)})
    train_steps(model, opt, sched, 3)
    state.step = 3
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state).wait()
    expected_next = torch.rand(5)  # RNG stream right after the save
    ref_params = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = opt.state_dict()

    state2, model2, opt2, sched2 = make_state(seed=1)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(state2) == 3
    assert torch.equal(torch.rand(5), expected_next)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref_params[k]), k
    for pid, s in opt2.state_dict()["state"].items():
        for name, t in s.items():
            assert torch.equal(t, ref_opt["state"][pid][name]), (pid, name)
    assert sched2.state_dict() == sched.state_dict()
    assert state2.step == 3 and state2.extras == {"tokens": 123, "pair": (1, 2)}
    assert type(state2.extras["tokens"]) is int


def test_training_continues_identically_after_restore(tmp_path, make_state):
    """Losses after a restore equal those of the uninterrupted run (dropout RNG included)."""
    state, model, opt, sched = make_state(seed=0)
    train_steps(model, opt, sched, 2)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, state)
    torch.manual_seed(123)  # disturb the RNG: restore must bring it back
    ref = []
    state_b, model_b, opt_b, sched_b = make_state(seed=5)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(state_b)
    for _ in range(3):
        x = torch.randn(4, 8)
        ref.append(model_b(x).pow(2).mean().item())
    state_c, model_c, opt_c, sched_c = make_state(seed=7)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(state_c)
    got = [model_c(torch.randn(4, 8)).pow(2).mean().item() for _ in range(3)]
    assert got == ref


def test_plain_dcp_load_reads_our_tensors(tmp_path, make_state):
    """A plain torch.distributed.checkpoint load finds the model under its usual keys."""
    state, model, *_ = make_state()
    with CheckpointManager(tmp_path) as mgr:
        path = mgr.save(1, state).wait()
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v)


def test_restore_with_nothing_saved_returns_none_and_logs(tmp_path, make_state, caplog):
    """An empty root means start from scratch, logged at INFO with the location."""
    state, *_ = make_state()
    with caplog.at_level(logging.INFO, logger="torch_ckpt"), CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(state) is None
    assert str(tmp_path / "run") in caplog.text


def test_save_returns_after_staging_with_handle_stats(tmp_path, make_state):
    """save() returns a handle with two futures; stats are complete once committed."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path) as mgr:
        handle = mgr.save(5, state)
        assert handle.staged.done()
        path = handle.committed.result(timeout=60)
        assert path.endswith("step_000000005")
        s = handle.stats.as_dict()
        assert s["bytes"] > 0 and s["persist_s"] > 0 and s["total_s"] >= s["blocking_s"]
        assert s["mode"] == "async"
        assert mgr.all_steps() == [5]


def test_snapshot_is_taken_at_save_time(tmp_path, make_state, monkeypatch):
    """In-place changes after save() returns never reach the checkpoint, though the write is still pending."""
    release = threading.Event()
    real = persist_mod.persist_checkpoint

    def held_back(req, ctx):
        assert release.wait(30)
        return real(req, ctx)

    monkeypatch.setattr("torch_ckpt.save._checkpointer.persist_checkpoint", held_back)
    state, model, opt, sched = make_state()
    train_steps(model, opt, sched, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with CheckpointManager(tmp_path) as mgr:
        handle = mgr.save(1, state)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            model.bn.running_mean.add_(1.0)
            for p in model.parameters():
                opt.state[p]["exp_avg"].add_(1.0)
                opt.state[p]["step"].add_(1.0)
        assert not handle.committed.done()
        release.set()
        handle.wait()
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(changed[k], expected[k]) for k in expected)  # the test could see a difference
    state2, model2, opt2, _ = make_state(seed=9)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(state2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    for p, ref in zip(model2.parameters(), exp_avg):
        assert torch.equal(opt2.state[p]["exp_avg"], ref)
        assert opt2.state[p]["step"].item() == 1.0


def test_background_error_surfaces_once_and_step_not_listed(tmp_path, make_state, disk_full_once):
    """An injected ENOSPC is raised once at the next call; the step is never listed; later saves work."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        with pytest.raises(CheckpointWriteError, match="disk is full") as info:
            mgr.save(2, state)
        assert isinstance(info.value, OSError) and info.value.errno == 28
        mgr.wait()  # the error was reported once: nothing more to raise
        assert mgr.all_steps() == []
        mgr.save(2, state).wait()  # the next save works
        assert mgr.all_steps() == [2]
        assert not list(tmp_path.glob(".step_*"))


def test_over_budget_state_saves_synchronously(tmp_path, make_state):
    """A state larger than the staging budget is saved synchronously and still restores."""
    state, model, *_ = make_state()
    with CheckpointManager(tmp_path, staging_budget_bytes=16) as mgr:
        handle = mgr.save(1, state)
        assert handle.committed.done() and handle.stats.mode == "sync-over-budget"
    state2, model2, *_ = make_state(seed=3)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(state2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_over_budget_conj_and_neg_views_restore(tmp_path, view):
    """Live conjugate and negative views saved over the staging budget restore (their records are plain)."""
    base = torch.randn(32, 32, dtype=torch.complex64)
    value = base.conj() if view == "conj" else base.real.clone()._neg_view()
    with CheckpointManager(tmp_path, staging_budget_bytes=16) as mgr:
        assert mgr.save(1, TrainState(extras={"v": value}, rng=False)).stats.mode == "sync-over-budget"
    target = TrainState(extras={"v": torch.zeros(value.shape, dtype=value.dtype)}, rng=False)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 1
    assert torch.equal(target.extras["v"], value.resolve_conj().resolve_neg())


def test_sync_mode_commits_before_returning(tmp_path, make_state):
    """async_save=False commits inside save()."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        handle = mgr.save(1, state)
        assert handle.committed.done() and handle.stats.mode == "sync"
        assert mgr.latest_step() == 1


def test_retention_keeps_numerically_newest(tmp_path, make_state):
    """With steps 9, 10, 11 and keep_last=2, steps 10 and 11 remain."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in (9, 10, 11):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.all_steps() == [10, 11]


def test_keep_every_n_steps_keeps_history(tmp_path, make_state):
    """keep_every_n_steps keeps multiples next to the newest ones."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path, keep_last=1, keep_every_n_steps=4) as mgr:
        for step in range(1, 10):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.all_steps() == [4, 8, 9]


def _twenty_saves_grow_rss_little(rank, world_size, root):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # ~67 MB fp32
    state = TrainState(model=model)
    proc = psutil.Process()
    with CheckpointManager(root, keep_last=1) as mgr:
        for step in range(3):
            mgr.save(step, state)
        mgr.wait()
        gc.collect()
        base = proc.memory_info().rss
        for step in range(3, 23):
            mgr.save(step, state)
        mgr.wait()
        gc.collect()
        growth = proc.memory_info().rss - base
    state_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert growth < 0.25 * state_bytes, f"RSS grew by {growth} bytes over 20 saves"


@pytest.mark.slow
def test_resident_memory_stays_flat_over_20_saves(tmp_path):
    """Twenty saves of a 64 MB state grow RSS by far less than one extra copy of it (in a fresh process)."""
    run_distributed(_twenty_saves_grow_rss_little, 1, tmp_path)  # not this worker: its RSS holds earlier tests'


@pytest.mark.slow
def test_exit_with_save_in_flight_commits_it(tmp_path):
    """A process that exits right after save() leaves a complete checkpoint, not a partial one."""
    script = textwrap.dedent(f"""
        import torch
        from torch_ckpt import CheckpointManager, TrainState
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.save(7, TrainState(model=model))
        # no wait(), no close(): interpreter exit must flush the in-flight save
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 7
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        assert mgr.restore(TrainState(model=model)) == 7
    assert not list(tmp_path.glob(".step_*"))


def test_save_if_due_follows_the_policy(tmp_path, make_state):
    """With EveryNSteps(3) the manager saves at steps 3, 6 and 9 only."""
    from torch_ckpt import EveryNSteps

    state, *_ = make_state()
    with CheckpointManager(tmp_path, save_policy=EveryNSteps(3), keep_last=None) as mgr:
        saved = [s for s in range(1, 11) if mgr.save_if_due(s, state) is not None]
        mgr.wait()
        assert saved == [3, 6, 9] and mgr.all_steps() == [3, 6, 9]


@pytest.fixture
def _sigusr1_sentinel():
    """A harmless SIGUSR1 handler under the manager's (the default action would end pytest); restored after."""
    import signal

    original = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGUSR1, original)


@pytest.mark.parametrize("polled", [False, True])
def test_a_preemption_signal_no_step_boundary_polls_is_logged_at_save(tmp_path, make_state, caplog, polled,
                                                                      _sigusr1_sentinel):
    """A signal a loop calling only save() would swallow is logged once at save(); a polling loop is not warned."""
    import os
    import signal

    state, *_ = make_state()
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), CheckpointManager(
            tmp_path, preemption_signals=("SIGUSR1",)) as mgr:
        if polled:
            mgr.should_save(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        mgr.save(1, state)
        mgr.save(2, state)
    warned = caplog.text.count("SIGUSR1 received, but preemption_signals act only at should_save()")
    assert warned == (0 if polled else 1)


def test_should_save_without_policy_is_a_config_error(tmp_path):
    """should_save() with neither a policy nor preemption signals explains what to configure."""
    from torch_ckpt import ConfigError

    with CheckpointManager(tmp_path) as mgr, pytest.raises(ConfigError, match="save_policy"):
        mgr.should_save(1)


def test_wait_for_previous_is_reported(tmp_path, make_state, monkeypatch):
    """A save that waited for the previous one reports that wait (5 s on a shifted clock) inside its blocking time."""
    import time as _time

    real_monotonic, offset = _time.monotonic, [0.0]
    monkeypatch.setattr(_time, "monotonic", lambda: real_monotonic() + offset[0])
    waiting = threading.Event()  # set once the second save blocks on the first one's commit
    real = persist_mod.persist_checkpoint

    def held_until_waited_for(req, ctx):
        if req.step == 1:
            assert waiting.wait(60), "save(2) never waited for step 1"
            offset[0] += 5.0  # the clock moves 5 s while save(2) is blocked
        return real(req, ctx)

    monkeypatch.setattr("torch_ckpt.save._checkpointer.persist_checkpoint", held_until_waited_for)
    state, *_ = make_state()
    with CheckpointManager(tmp_path) as mgr:
        first = mgr.save(1, state)
        result = first.committed.result

        def result_after_signalling(*args, **kwargs):
            waiting.set()
            return result(*args, **kwargs)

        first.committed.result = result_after_signalling  # what waiting for the previous save blocks on
        handle = mgr.save(2, state)
        assert handle.stats.wait_for_previous_s >= 5.0
        assert handle.stats.blocking_s >= handle.stats.wait_for_previous_s


def test_training_on_after_restoring_an_older_step(tmp_path, make_state):
    """After restoring step 2 of 1..4, saving step 3 works and newer steps are moved aside, not deleted."""
    state, *_ = make_state()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state)
        mgr.wait()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.restore(make_state(seed=2)[0], step=2) == 2
        mgr.save(3, state).wait()
        assert mgr.all_steps() == [1, 2, 3] and mgr.latest_step() == 3
    assert len(list(tmp_path.glob(".superseded_step_*"))) == 2


def test_ctrl_c_while_waiting_propagates_and_the_save_still_commits(tmp_path, monkeypatch):
    """SIGINT during wait() raises KeyboardInterrupt at once; the in-flight save still commits its own data."""
    import signal as _signal

    real = persist_mod.persist_checkpoint
    release = threading.Event()  # the persist of step 1 is held until after the interrupt

    def held(req, ctx):
        assert release.wait(60), "the test never released the persist"
        return real(req, ctx)

    monkeypatch.setattr("torch_ckpt.save._checkpointer.persist_checkpoint", held)
    interrupted = threading.Event()

    def ctrl_c_once(signum, frame):  # Python's own Ctrl-C behaviour, for the first SIGINT only
        if not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    previous = _signal.signal(_signal.SIGINT, ctrl_c_once)
    mgr = CheckpointManager(tmp_path)
    first = mgr.save(1, {"w": torch.ones(4)})
    waiting = threading.Event()
    result = first.committed.result

    def result_after_signalling(*args, **kwargs):
        waiting.set()
        return result(*args, **kwargs)

    first.committed.result = result_after_signalling  # what wait() blocks on

    def interrupt() -> None:
        # to the main thread itself (a process-directed kill() may land on another thread), and again until it
        # is handled: a signal that lands just before the main thread blocks only runs after the wait returns
        assert waiting.wait(60)
        while not interrupted.wait(0.01):
            _signal.pthread_kill(threading.main_thread().ident, _signal.SIGINT)

    interrupter = threading.Thread(target=interrupt)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()  # blocked on step 1's commit, which cannot happen before release
        assert not first.done()
    finally:
        release.set()
        interrupter.join()
        _signal.signal(_signal.SIGINT, previous)
    mgr.save(2, {"w": torch.full((4,), 2.0)})  # must wait for step 1, not overwrite its staged copy
    mgr.close()
    for step, value in ((1, 1.0), (2, 2.0)):
        target = {"w": torch.zeros(4)}
        with CheckpointManager(tmp_path) as check:
            check.restore(target, step=step)
        assert torch.equal(target["w"], torch.full((4,), value))


def test_exception_during_staging_does_not_hang_close(tmp_path, monkeypatch):
    """An error raised while staging propagates and leaves nothing in flight."""
    import torch_ckpt.save._checkpointer as staging_mod

    def broken(self, tensors, **kwargs):
        raise RuntimeError("copy failed")

    with CheckpointManager(tmp_path) as mgr:
        monkeypatch.setattr(staging_mod.HostStager, "stage", broken)
        with pytest.raises(RuntimeError, match="copy failed"):
            mgr.save(1, {"w": torch.ones(2)})
        monkeypatch.undo()
        mgr.save(2, {"w": torch.ones(2)}).wait()
        assert mgr.all_steps() == [2]


# -- a new run below an earlier run's steps (issue 13 item 6) ---------------------------------------
def _tiny(fill: float = 1.0) -> dict:
    return {"w": torch.full((4,), fill), "meta": {"epoch": 1}}


def _earlier_run(root, steps=(500, 600, 700)) -> None:
    with CheckpointManager(root, keep_last=None) as mgr:
        for step in steps:
            mgr.save(step, _tiny())
        mgr.wait()


def test_first_save_below_an_earlier_runs_steps_is_refused_naming_them(tmp_path):
    """A new run saving step 100 next to committed 500/600/700 it did not restore: ConfigError, nothing deleted."""
    _earlier_run(tmp_path)
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        with pytest.raises(ConfigError, match=r"\[500, 600, 700\]") as info:
            mgr.save(100, _tiny())
        assert "restore()" in str(info.value) and "on_existing_newer='supersede'" in str(info.value)
        assert mgr.all_steps() == [500, 600, 700]
        mgr.save(800, _tiny()).wait()  # the refusal leaves the manager usable
        assert mgr.all_steps() == [600, 700, 800]
    assert not list(tmp_path.glob(".step_*"))


def test_on_existing_newer_supersede_moves_the_earlier_runs_steps_aside(tmp_path):
    """on_existing_newer='supersede': newer steps are kept as hidden .superseded_* dirs; step 100 stays listed."""
    _earlier_run(tmp_path)
    with CheckpointManager(tmp_path, keep_last=3, on_existing_newer="supersede") as mgr:
        mgr.save(100, _tiny()).wait()
        mgr.save(200, _tiny()).wait()
        assert mgr.all_steps() == [100, 200] and mgr.latest_step() == 200
    assert sorted(p.name.split(".")[1] for p in tmp_path.glob(".superseded_step_*")) == \
        ["superseded_step_000000500", "superseded_step_000000600", "superseded_step_000000700"]


def test_saving_below_the_run_own_newer_step_is_refused_too(tmp_path):
    """Within one run, saving step 5 after step 10 is refused the same way (retention would delete it)."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(10, _tiny()).wait()
        with pytest.raises(ConfigError, match=r"newer than step 5"):
            mgr.save(5, _tiny())


def test_on_existing_newer_must_be_a_known_choice(tmp_path):
    """An unknown on_existing_newer value is a ConfigError naming the choices."""
    with pytest.raises(ConfigError, match="supersede"):
        CheckpointManager(tmp_path, on_existing_newer="delete")


def test_superseding_the_same_step_twice_within_one_second_keeps_both(tmp_path, monkeypatch):
    """Two supersessions of step 2 in the same second get distinct hidden names instead of an OSError."""
    import types

    import torch_ckpt.root._layout as layout

    monkeypatch.setattr(layout, "time", types.SimpleNamespace(time=lambda: 1_000_000_000.0))
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, _tiny())
        mgr.wait()
    for _ in range(2):
        with CheckpointManager(tmp_path, keep_last=None) as mgr:
            mgr.restore(_tiny(0.0), step=1)
            mgr.save(2, _tiny()).wait()
    assert len(list(tmp_path.glob(".superseded_step_000000002.*"))) == 2
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000001", "step_000000002"]


def test_os_error_while_moving_a_damaged_step_aside_is_typed(tmp_path, monkeypatch):
    """An OSError from moving a damaged step directory aside surfaces as CheckpointWriteError; later saves work."""
    import errno

    import torch_ckpt.root._layout as layout

    (tmp_path / "step_000000005").mkdir()  # a damaged directory of the step to save: unreadable manifest
    (tmp_path / "step_000000005" / "manifest.json").write_text("{not json")
    real = layout.os.rename

    def refuse(src, dst):
        if ".corrupt_" in str(dst):
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real(src, dst)

    with CheckpointManager(tmp_path) as mgr:
        monkeypatch.setattr(layout.os, "rename", refuse)
        with pytest.raises(CheckpointWriteError, match="step_000000005") as info:
            mgr.save(5, _tiny())
        assert info.value.errno == errno.EACCES
        monkeypatch.setattr(layout.os, "rename", real)
        mgr.save(6, _tiny()).wait()
        assert mgr.all_steps() == [6]


# -- read-only use (issue 14 item 5) ------------------------------------------------------------------
def test_read_only_manager_restores_and_lists_while_a_writer_holds_the_lock(tmp_path):
    """read_only=True needs no lock: it lists and restores a root that a live run has locked, and refuses save()."""
    with CheckpointManager(tmp_path) as writer:
        writer.save(1, _tiny(3.0)).wait()
        with CheckpointManager(tmp_path, read_only=True) as reader:
            target = _tiny(0.0)
            assert reader.all_steps() == [1] and reader.restore(target) == 1
            assert torch.equal(target["w"], torch.full((4,), 3.0))
            with pytest.raises(ConfigError, match="read_only=True"):
                reader.save(2, target)
        writer.save(2, _tiny()).wait()  # the reader left the writer's lock alone
        assert writer.all_steps() == [1, 2]


def test_read_only_manager_of_a_missing_root_is_not_found(tmp_path):
    """read_only=True never creates the root: a missing one raises CheckpointNotFoundError naming it."""
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        CheckpointManager(tmp_path / "nowhere", read_only=True)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", ["dict", "list", "tuple", "int_keyed_dict", "int_keyed_tuple"])
def test_state_nested_to_the_codec_limit_restores(tmp_path, kind):
    """Every container kind nested MAX_DEPTH deep (the most save() accepts) passes restore's bounded parsing."""
    from torch_ckpt.format._files import MAX_DEPTH

    wrap = {"dict": lambda v: {"k": v}, "list": lambda v: [v], "tuple": lambda v: (v,),
            "int_keyed_dict": lambda v: {1: v}, "int_keyed_tuple": lambda v: {2: (v,)}}[kind]

    def nest(leaf):
        for _ in range((MAX_DEPTH - 2) // (2 if kind == "int_keyed_tuple" else 1)):
            leaf = wrap(leaf)
        return leaf

    value = nest(1)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2), "x": value}).wait()
    live = {"w": torch.zeros(2), "x": nest(0)}
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.restore(live) == 1
    assert live["x"] == value and torch.equal(live["w"], torch.ones(2))


@pytest.mark.parametrize("key", [1, None, (1, "a"), 1.5, b"k", np.str_("s"), np.int64(3), False, frozenset({2, 3}),
                                 complex(1, 2), ((1, 2), (b"x",))], ids=repr)
def test_dict_with_any_supported_key_type_restores_through_the_manager(tmp_path, key):
    """A dict keyed by any key type save() accepts passes restore's validation and comes back exactly."""
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, TrainState(model=torch.nn.Linear(2, 2), extras={"counts": {key: 5, "plain": 1}})).wait()
    live = TrainState(model=torch.nn.Linear(2, 2), extras={})
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.restore(live) == 1
    (got,) = [k for k in live.extras["counts"] if k != "plain"]
    assert got == key and type(got) is type(key)


def test_leaving_the_block_on_ctrl_c_says_it_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    """A KeyboardInterrupt leaving the block with a save in flight logs that it waits for that step; it commits."""
    import logging

    real = persist_mod.persist_checkpoint
    release = threading.Event()  # the persist is held until the warning has been logged

    def held(req, ctx):
        assert release.wait(30), "no warning was logged while the save was in flight"
        return real(req, ctx)

    class Release(logging.Handler):
        def emit(self, record):
            if "waiting for the save of step 1" in record.getMessage():
                release.set()

    monkeypatch.setattr("torch_ckpt.save._checkpointer.persist_checkpoint", held)
    handler = Release(level=logging.WARNING)
    logging.getLogger("torch_ckpt.manager._manager").addHandler(handler)
    try:
        with pytest.raises(KeyboardInterrupt), CheckpointManager(tmp_path) as mgr:
            mgr.save(1, {"w": torch.ones(4)})
            raise KeyboardInterrupt
    finally:
        logging.getLogger("torch_ckpt.manager._manager").removeHandler(handler)
        release.set()
    assert mgr.all_steps() == [1]


def test_leaving_the_block_normally_or_with_nothing_in_flight_does_not_warn(tmp_path, caplog):
    """No interrupt, or an interrupt once the save has committed: no 'waiting for the save' line."""
    import logging

    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    with CheckpointManager(tmp_path / "a") as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    with pytest.raises(KeyboardInterrupt), CheckpointManager(tmp_path / "b") as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        raise KeyboardInterrupt
    assert not [r for r in caplog.records if "waiting for the save" in r.getMessage()]


def test_a_checkpoint_directory_given_as_the_root_is_refused(tmp_path):
    """A step directory passed as the run root is refused, naming its parent, instead of a silent fresh start."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)}).committed.result()
        step_dir = mgr.checkpoints()[1]
    with pytest.raises(ConfigError, match=r"is a checkpoint directory .* not a run root") as info:
        CheckpointManager(step_dir)
    assert str(step_dir.parent) in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"durable_url": "nosuchprotocol://bucket/run"},  # the durable tier refuses its URL
    {"memory_root": "{root}.file"},  # the memory tier refuses its root (a file)
    {"durable_url": "file://{root}/inside"},  # the durable tier inside the local root
])
def test_a_refused_construction_leaves_the_signal_handlers_as_they_were(tmp_path, kwargs):
    """A CheckpointManager whose construction is refused installs no preemption handler."""
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    root = tmp_path / "run"
    (tmp_path / "run.file").write_text("not a directory")
    kwargs = {k: v.format(root=root) for k, v in kwargs.items()}
    with pytest.raises(ConfigError):
        CheckpointManager(root, preemption_signals=("SIGUSR1",), **kwargs)
    assert signal.getsignal(signal.SIGUSR1) is before
