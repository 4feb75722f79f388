"""In-place restore: live tensors read into directly, backed up in the idle staging arena, put back on failure."""

from __future__ import annotations

import copy
import signal
import threading
import time

import pytest
import torch

import torch_ckpt.restore._direct_read as direct_mod
import torch_ckpt.restore._restore as restore_mod
from tests.test_optim_state import assert_same
from tests.test_restore import _Loader, _tied
from torch_ckpt import CheckpointCorruptError, CheckpointManager, ConfigError, TrainState
from torch_ckpt.restore._targets import MIN_IN_PLACE_BYTES, Preparer, UndoLog, in_place_keys
from torch_ckpt.save._checkpointer import HostStager

BIG = MIN_IN_PLACE_BYTES // 4  # float32 elements of a tensor just large enough to be restored in place
OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def _wide(seed: int, optimizer: str = "adam"):
    """A model (MiB-sized weights, KiB-sized biases) and optimizer after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 768), torch.nn.Linear(768, 8))
    opt = OPTIMIZERS[optimizer](model.parameters())
    model(torch.randn(2, 1024)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _tensors(model, opt) -> list[torch.Tensor]:
    return [*model.parameters(), *(t for p in model.parameters() for t in opt.state[p].values()
                                   if isinstance(t, torch.Tensor) and t.dim())]


@pytest.fixture(params=list(OPTIMIZERS))
def saved(tmp_path, request):
    """``(step directory, source model, source optimizer, optimizer name)`` of a committed checkpoint."""
    model, opt = _wide(0, request.param)
    with CheckpointManager(tmp_path / "src", thread_count=2) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
    return next((tmp_path / "src").glob("step_*")), model, opt, request.param


def _restorer(tmp_path, model, opt) -> CheckpointManager:
    """A manager that has saved ``model``/``opt`` once, so its staging arena exists and is lent to restore()."""
    mgr = CheckpointManager(tmp_path / "live")
    mgr.save(1, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
    return mgr


def test_in_place_keys_leave_out_small_shared_odd_and_over_budget_tensors():
    """Only plain contiguous CPU tensors of the saved dtype/shape, big enough, alone in their bytes, and fitting."""
    base, other = torch.zeros(4 * BIG), torch.zeros(4 * BIG)
    live = {"ok": torch.zeros(BIG), "small": torch.zeros(16), "tied": torch.zeros(BIG), "view0": base[:BIG],
            "view1": base[BIG:2 * BIG], "over0": other[:BIG], "over1": other[BIG // 2:BIG // 2 + BIG],
            "nc": torch.zeros(BIG // 2, 2).t(), "grad": torch.zeros(BIG, requires_grad=True),
            "dtype": torch.zeros(BIG, dtype=torch.float64), "ok2": torch.zeros(BIG)}
    live["tied2"] = live["tied"]
    live["strided"] = other[::2]  # reaches over both "over" views
    saved = {k: (torch.float32, tuple(t.shape)) for k, t in live.items()}
    nbytes = BIG * 4
    assert in_place_keys(live, saved, 10 * nbytes) == ["ok", "view0", "view1", "ok2"]
    assert in_place_keys(live, saved, nbytes) == ["ok"]  # the budget is taken in order
    assert in_place_keys(live, {**saved, "ok": (torch.float32, (BIG + 1,))}, 10 * nbytes) == ["view0", "view1", "ok2"]


def test_undo_log_puts_back_the_exact_bytes():
    """Backed-up tensors written afterwards get their old bytes back; keys never backed up are not touched."""
    a, b = torch.randn(1000), torch.randn(300).double()
    old_a, old_b = a.clone(), b.clone()
    log = UndoLog(torch.empty(16 << 10, dtype=torch.uint8), {"a": a, "b": b})
    log.save("a")
    a.fill_(7.0)
    b.fill_(9.0)
    log.put_back()
    assert torch.equal(a, old_a) and torch.equal(b, torch.full_like(b, 9.0)) and not torch.equal(b, old_b)


def test_undo_log_refuses_tensors_that_do_not_fit():
    """More live bytes than scratch memory is an error, not an overrun."""
    with pytest.raises(ValueError, match="does not fit"):
        UndoLog(torch.empty(100, dtype=torch.uint8), {"a": torch.zeros(100)})


def _saved_then_zeroed(keys: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], UndoLog]:
    """Tensors backed up in an undo log and then overwritten: ``(live, their old values, the log)``."""
    ts = {k: torch.randn(64) for k in keys}
    old = {k: t.clone() for k, t in ts.items()}
    log = UndoLog(torch.empty(4096, dtype=torch.uint8), ts)
    for k, t in ts.items():
        log.save(k)
        t.zero_()
    return ts, old, log


def test_put_back_finishes_before_a_keyboard_interrupt_is_raised(monkeypatch):
    """An interrupt during the undo is re-raised only after every tensor has its old bytes again."""
    import torch_ckpt.restore._targets as rt

    ts, old, log = _saved_then_zeroed("abc")
    real, calls = rt.ctypes.memmove, []

    def interrupted_once(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(rt.ctypes, "memmove", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        log.put_back()
    assert all(torch.equal(ts[k], old[k]) for k in ts)


def test_put_back_interrupted_before_its_first_copy_still_undoes_everything():
    """A Ctrl-C while put_back() lists the saved tensors: it still copies every one back, then re-raises."""
    ts, old, log = _saved_then_zeroed("ab")

    class InterruptedOnce:
        def __init__(self):
            self.lock, self.fired = threading.Lock(), False

        def __enter__(self):
            if not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    log._lock = InterruptedOnce()
    with pytest.raises(KeyboardInterrupt):
        log.put_back()
    assert all(torch.equal(ts[k], old[k]) for k in ts)

def test_preparer_backs_a_tensor_up_before_ready_returns():
    """ready(i) returns only once item i's live bytes are in the undo log."""
    ts = {f"t{i}": torch.full((BIG,), float(i)) for i in range(4)}
    log = UndoLog(torch.empty(5 * BIG * 4, dtype=torch.uint8), ts)
    prep = Preparer([(t, k) for k, t in ts.items()], log)
    for i, t in enumerate(ts.values()):
        prep.ready(i)
        t.fill_(-1.0)
    prep.close()
    log.put_back()
    assert all(torch.equal(t, torch.full((BIG,), float(i))) for i, t in enumerate(ts.values()))


def test_lent_arena_blocks_staging_until_returned():
    """While the arena is lent to a restore, a save's staging waits instead of overwriting it."""
    stager = HostStager(budget_bytes=1 << 20)
    stager.stage({"x": torch.ones(1000)})
    done = threading.Event()
    with stager.lend() as scratch:
        assert scratch is not None and scratch.numel() >= 4000
        t = threading.Thread(target=lambda: (stager.stage({"x": torch.zeros(1000)}), done.set()))
        t.start()
        assert not done.wait(0.2)
    t.join(5)
    assert done.is_set()


def test_restore_after_a_save_reads_into_the_live_tensors(tmp_path, saved):
    """With an arena, the large parameters and optimizer state keep their memory and get the saved values."""
    step_dir, src_model, src_opt, name = saved
    model, opt = _wide(1, name)
    ptrs = {id(t): t.data_ptr() for t in _tensors(model, opt) if t.numel() * t.element_size() >= MIN_IN_PLACE_BYTES}
    versions = {id(p): p._version for p in model.parameters()}
    with _restorer(tmp_path, model, opt) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert ptrs and all(t.data_ptr() == ptrs[id(t)] for t in _tensors(model, opt) if id(t) in ptrs)
    assert all(p._version > versions[id(p)] for p in model.parameters() if id(p) in ptrs)  # as copy_ would
    assert_same(model.state_dict(), src_model.state_dict())
    assert_same(opt.state_dict(), src_opt.state_dict())


def _flip_last_file(step_dir):
    last = sorted(step_dir.glob("*.distcp"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-len(raw) // 3] ^= 0x04
    last.write_bytes(bytes(raw))


@pytest.mark.parametrize("readers", [1, 2])
@pytest.mark.parametrize("fault", ["crc", "after_read", "interrupt", "component"])
def test_failed_in_place_restore_leaves_the_live_state_exactly_as_it_was(tmp_path, saved, monkeypatch, fault, readers):
    """Whatever fails after bytes were read into live tensors, every one gets its old bytes back."""
    step_dir, _, _, name = saved
    monkeypatch.setattr(direct_mod, "_READERS", readers)
    model, opt = _wide(1, name)
    mgr = _restorer(tmp_path, model, opt)
    error: type[BaseException] = ValueError
    if fault == "crc":
        _flip_last_file(step_dir)
        error = CheckpointCorruptError
    elif fault == "after_read":
        real_load = restore_mod.load_direct

        def load_then_fail(*args, **kwargs):
            real_load(*args, **kwargs)
            raise OSError("disk went away mid-read")

        monkeypatch.setattr(restore_mod, "load_direct", load_then_fail)
        error = OSError
    elif fault == "interrupt":
        real_into, calls = direct_mod._FileReader.into, []

        def into_then_interrupt(self, view):
            real_into(self, view)
            calls.append(view.nbytes)
            if view.nbytes >= MIN_IN_PLACE_BYTES and len([n for n in calls if n >= MIN_IN_PLACE_BYTES]) == 2:
                raise KeyboardInterrupt

        monkeypatch.setattr(direct_mod._FileReader, "into", into_then_interrupt)
        error = KeyboardInterrupt
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    ptrs = [t.data_ptr() for t in _tensors(model, opt)]
    versions = [p._version for p in model.parameters()]
    with mgr, pytest.raises(error):
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader(fail=fault == "component")),
                    path=step_dir)
    assert_same(model.state_dict(), before[0])
    assert_same(opt.state_dict(), before[1])
    assert [t.data_ptr() for t in _tensors(model, opt)] == ptrs
    if fault != "component":  # nothing reached the live state's own load_state_dict
        assert [p._version for p in model.parameters()] == versions


def test_record_placed_then_refused_is_put_back_and_loaded_by_dcp(tmp_path, saved, monkeypatch):
    """A tensor whose bytes went in place but whose record trailer differs is put back, then loaded by DCP."""
    step_dir, src_model, src_opt, name = saved
    real = direct_mod.record_framing

    def odd_trailer(target):
        head, tail = real(target)
        if target.numel() * target.element_size() >= MIN_IN_PLACE_BYTES:
            tail = bytes([tail[0] ^ 1]) + tail[1:]
        return head, tail

    monkeypatch.setattr(direct_mod, "record_framing", odd_trailer)
    model, opt = _wide(1, name)
    with _restorer(tmp_path, model, opt) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert_same(model.state_dict(), src_model.state_dict())
    assert_same(opt.state_dict(), src_opt.state_dict())


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_save_after_an_in_place_restore_saves_the_restored_values(tmp_path, saved, persist):
    """The arena (shared memory for persist='process') lent to the restore is staged afresh by the next save."""
    step_dir, src_model, src_opt, name = saved
    model, opt = _wide(1, name)
    with CheckpointManager(tmp_path / "live", persist=persist) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
        ptr = model[0].weight.data_ptr()
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
        assert model[0].weight.data_ptr() == ptr  # read in place
        mgr.save(2, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
    fresh_model, fresh_opt = _wide(2, name)
    with CheckpointManager(tmp_path / "live") as mgr:
        assert mgr.restore(TrainState(model=fresh_model, optimizer=fresh_opt, dataloader=_Loader())) == 2
    assert_same(fresh_model.state_dict(), src_model.state_dict())
    assert_same(fresh_opt.state_dict(), src_opt.state_dict())


def test_arena_smaller_than_the_state_restores_part_in_place(tmp_path, saved):
    """An arena holding only the model's bytes: those go in place, optimizer state into new buffers, all exact."""
    step_dir, src_model, src_opt, name = saved
    model, opt = _wide(1, name)
    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, {"w": torch.zeros(768, 1024)}).wait()  # an arena the size of one weight matrix
        ptr = model[0].weight.data_ptr()
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert model[0].weight.data_ptr() == ptr
    assert_same(model.state_dict(), src_model.state_dict())
    assert_same(opt.state_dict(), src_opt.state_dict())


def test_tied_weights_restored_with_an_arena_stay_tied_and_exact(tmp_path):
    """Two names for one weight are never written in place (their memory overlaps); the values are exact."""
    source, source_opt = _tied(0, 512, 256)
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(1, TrainState(model=source, optimizer=source_opt)).wait()
    model, opt = _tied(1, 512, 256)
    weight = model[0].weight
    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
        mgr.restore(TrainState(model=model, optimizer=opt), path=next((tmp_path / "src").glob("step_*")))
    assert model[0].weight is weight and model[1].weight is weight
    assert torch.equal(weight.detach(), source[0].weight.detach())
    assert_same(opt.state_dict(), source_opt.state_dict())


@pytest.mark.parametrize("corrupt", [False, True])
def test_plain_dict_with_views_of_one_buffer_restores_in_place_or_changes_nothing(tmp_path, corrupt):
    """Two disjoint views of one buffer in a plain dict: read in place (exact), or untouched when a file is bad."""
    saved = {"a": torch.randn(BIG), "b": torch.randn(BIG), "c": torch.randn(3 * BIG)}
    with CheckpointManager(tmp_path / "src", thread_count=2) as mgr:
        mgr.save(1, saved).wait()
    step_dir = next((tmp_path / "src").glob("step_*"))
    if corrupt:
        _flip_last_file(step_dir)
    base = torch.zeros(2 * BIG)
    live = {"a": base[:BIG], "b": base[BIG:], "c": torch.full((3 * BIG,), 5.0)}
    before = {k: v.clone() for k, v in live.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, live).wait()
        if corrupt:
            with pytest.raises(CheckpointCorruptError):
                mgr.restore(live, path=step_dir)
        else:
            mgr.restore(live, path=step_dir)
    expected = before if corrupt else saved
    assert all(torch.equal(live[k], expected[k]) for k in saved)
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs
    assert torch.equal(base, torch.cat([expected["a"], expected["b"]]))


class _OwnLoad:
    """A Stateful whose load_state_dict keeps its own "frozen" tensor (a user's choice the restore must respect)."""

    def __init__(self) -> None:
        self.frozen, self.trained = torch.zeros(BIG), torch.zeros(BIG)

    def state_dict(self):
        return {"frozen": self.frozen, "trained": self.trained}

    def load_state_dict(self, sd):
        self.trained.copy_(sd["trained"])


def test_a_stateful_without_load_in_place_is_never_written_in_place(tmp_path):
    """Only states that say so (TrainState, plain dicts) are read into directly: others decide in load_state_dict."""
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(1, {"frozen": torch.ones(BIG), "trained": torch.full((BIG,), 2.0)}).wait()
    state = _OwnLoad()
    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, state).wait()
        mgr.restore(state, path=next((tmp_path / "src").glob("step_*")))
    assert not state.frozen.any() and torch.equal(state.trained, torch.full((BIG,), 2.0))


def test_train_state_extras_are_replaced_not_written_in_place(tmp_path):
    """TrainState replaces its extras on load: a tensor the caller holds from the old extras keeps its values."""
    src_model, src_opt = _wide(0)
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(1, TrainState(model=src_model, optimizer=src_opt, extras={"t": torch.ones(BIG)})).wait()
    model, opt = _wide(1)
    held = torch.zeros(BIG)
    state = TrainState(model=model, optimizer=opt, extras={"t": held})
    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, state).wait()
        mgr.restore(state, path=next((tmp_path / "src").glob("step_*")))
    assert not held.any() and torch.equal(state.extras["t"], torch.ones(BIG))
    assert_same(model.state_dict(), src_model.state_dict())


@pytest.mark.parametrize("after_a_save", [True, False])
def test_restore_logs_whether_it_read_in_place(tmp_path, saved, caplog, after_a_save):
    """An INFO line says how many tensors were read in place after a save, and why none were in a fresh manager."""
    import logging

    step_dir, _src_model, _src_opt, name = saved
    model, opt = _wide(1, name)
    caplog.set_level(logging.INFO, logger="torch_ckpt")
    with _restorer(tmp_path, model, opt) if after_a_save else CheckpointManager(tmp_path / "fresh") as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restore: ")]
    assert len(lines) == 1
    if after_a_save:
        assert " read in place, backed up in the staging arena" in lines[0] and not lines[0].startswith("restore: 0 ")
    else:
        assert "new buffers (no staging arena" in lines[0]


@pytest.mark.parametrize(("thread", "readers"), [("torch_ckpt_restore", 2), ("torch_ckpt_restore_prepare", 1)])
def test_interrupt_while_a_helper_thread_starts_changes_nothing(tmp_path, saved, monkeypatch, thread, readers):
    """A Ctrl-C inside Thread.start() of a reader or backup thread: no thread writes afterwards, nothing changed."""
    step_dir, _, _, name = saved
    monkeypatch.setattr(direct_mod, "_READERS", readers)
    real_start, real_save, fired = threading.Thread.start, UndoLog.save, []

    def start_then_interrupt(self):
        real_start(self)  # the thread runs: the Ctrl-C lands in start()'s wait for it
        if self.name == thread and not fired:
            fired.append(self)
            raise KeyboardInterrupt

    def slow_save(self, key):
        time.sleep(0.02)  # a backup still running when restore() has raised
        real_save(self, key)

    model, opt = _wide(1, name)
    mgr = _restorer(tmp_path, model, opt)
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    ptrs = [t.data_ptr() for t in _tensors(model, opt)]
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    monkeypatch.setattr(UndoLog, "save", slow_save)
    with mgr, pytest.raises(KeyboardInterrupt):
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert fired
    # the started threads exit by themselves (their gate opens with nothing to do), not necessarily before
    # restore() raised: wait for that; one that ran its target would have written the state (compared below)
    deadline = time.monotonic() + 5.0
    while any(t.is_alive() for t in threading.enumerate() if t.name.startswith("torch_ckpt_restore")):
        assert time.monotonic() < deadline, "a restore helper thread still runs 5 s after restore() raised"
        time.sleep(0.001)
    assert_same(model.state_dict(), before[0])
    assert_same(opt.state_dict(), before[1])
    assert [t.data_ptr() for t in _tensors(model, opt)] == ptrs


def test_ctrl_c_while_the_live_state_is_written_is_raised_once_it_is_written(tmp_path, monkeypatch):
    """SIGINT after part of the state is written: the write finishes, then KeyboardInterrupt; never half old."""
    saved = {"big": torch.randn(4 * BIG), "small": torch.randn(10), "view": torch.randn(2 * BIG)[BIG:]}
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(1, saved).wait()
    live = {"big": torch.zeros(4 * BIG), "small": torch.zeros(10), "view": torch.zeros(2 * BIG)[BIG:]}
    real = restore_mod.copy_into_live

    def write_then_ctrl_c(*args, **kwargs):
        real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, after the first part of the write

    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, live).wait()
        monkeypatch.setattr(restore_mod, "copy_into_live", write_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            mgr.restore(live, path=next((tmp_path / "src").glob("step_*")))
    assert all(torch.equal(live[k], saved[k]) for k in saved)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _Restoring:
    """A Stateful whose load_state_dict calls ``inner()`` (a restore or a save of the same manager)."""

    def __init__(self, inner) -> None:
        self.t = torch.zeros(MIN_IN_PLACE_BYTES // 4)
        self.inner = inner
        self.result = None

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t.copy_(sd["t"])
        self.result = self.inner()

    def load_in_place(self, key: str) -> bool:
        return True


def _in_thread(fn, bound_s: float = 20.0):
    """Run ``fn`` on a daemon thread; fail (instead of hanging the suite) if it does not return in time."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    t.start()
    t.join(bound_s)
    assert out, f"still running after {bound_s:.0f} s (deadlock)"
    return out[0]


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - compared by the test
        return exc


def test_restore_inside_a_restore_of_the_same_manager_does_not_deadlock(tmp_path):
    """A load_state_dict that restores again (same manager): the inner restore reads into new buffers, both succeed."""
    plain = {"w": torch.arange(MIN_IN_PLACE_BYTES // 4, dtype=torch.float32)}
    mgr = CheckpointManager(tmp_path / "ck")  # not closed after a deadlock (close() would wait for it too)
    mgr.save(1, plain).wait()
    outer = _Restoring(lambda: mgr.restore(plain, step=1))
    mgr.save(2, {"t": torch.full_like(outer.t, 7.0)}).wait()
    plain["w"].zero_()
    assert _in_thread(lambda: mgr.restore(outer, step=2)) == 2
    mgr.close()
    assert outer.result == 1 and torch.equal(plain["w"], torch.arange(plain["w"].numel(), dtype=torch.float32))
    assert torch.equal(outer.t, torch.full_like(outer.t, 7.0))


def test_save_inside_a_restore_of_the_same_manager_is_refused(tmp_path):
    """A load_state_dict that saves through the restoring manager gets a ConfigError, not a deadlock."""
    mgr = CheckpointManager(tmp_path / "ck")  # not closed after a deadlock (close() would wait for it too)
    outer = _Restoring(lambda: mgr.save(3, {"x": torch.ones(4)}))
    mgr.save(2, outer.state_dict()).wait()
    err = _in_thread(lambda: mgr.restore(outer, step=2))
    mgr.close()
    assert isinstance(err, ConfigError) and "Save after restore() returned" in str(err)


@pytest.mark.parametrize("where", ["bump_versions", "put_back"])
def test_a_second_ctrl_c_at_the_end_of_a_restore_leaves_the_default_sigint_handler(tmp_path, monkeypatch, where):
    """Two Ctrl-C while the undo log is applied or dropped: KeyboardInterrupt, and Python's SIGINT handler is back."""
    live = {"t": torch.zeros(MIN_IN_PLACE_BYTES // 4)}
    real = getattr(UndoLog, where)

    def then_two_ctrl_c(self, *args):
        real(self, *args)
        signal.raise_signal(signal.SIGINT)  # held
        signal.raise_signal(signal.SIGINT)  # raised at once

    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"t": torch.ones_like(live["t"])}).wait()
        target = live if where == "bump_versions" else _Restoring(lambda: 1 / 0)  # put_back: a load that fails
        monkeypatch.setattr(UndoLog, where, then_two_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            mgr.restore(target, step=1)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # (reset for the next tests either way)
    assert handler is signal.default_int_handler


def test_a_wrong_load_in_place_leaves_the_loaded_bytes_in_a_key_load_state_dict_ignores(tmp_path):
    """load_in_place() is the state's promise: a marked key load_state_dict ignores still gets the loaded bytes."""
    liar = _Restoring(lambda: None)
    liar.load_state_dict = lambda sd: None  # ignores every key, yet load_in_place says True
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"t": torch.ones_like(liar.t)}).wait()
        mgr.restore(liar, step=1)
    assert torch.equal(liar.t, torch.ones_like(liar.t))  # as documented in load_into and the README
