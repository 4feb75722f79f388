"""A restore is complete or changes nothing: new buffers, every check first, the live state written last.

Whatever fails or interrupts a restore before the live state is written (a bad checksum, a read
error, a Ctrl-C in a reader or while one of its threads starts, a component that refuses its
state) leaves every live tensor with its old bytes, memory and version; a Ctrl-C while the live
state is written is raised once it is fully written.
"""

from __future__ import annotations

import copy
import signal
import threading
import time

import pytest
import torch

import torch_ckpt.restore._restore as restore_mod
from tests.test_optim_state import assert_same
from tests.test_restore import _Loader, _tied
from torch_ckpt import CheckpointCorruptError, CheckpointManager, TrainState

LARGE_BYTES = 256 << 10
BIG = LARGE_BYTES // 4  # float32 elements of a tensor read straight from its record in 8 MiB chunks or less
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
    """A manager that has saved ``model``/``opt`` once in this process (a restore after a save)."""
    mgr = CheckpointManager(tmp_path / "live")
    mgr.save(1, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
    return mgr


@pytest.mark.parametrize("after_a_save", [True, False])
def test_restore_gives_the_saved_values_and_keeps_every_parameter_object(tmp_path, saved, after_a_save):
    """Parameters stay the same objects, with the saved values and optimizer state."""
    step_dir, src_model, src_opt, name = saved
    model, opt = _wide(1, name)
    params = list(model.parameters())
    with _restorer(tmp_path, model, opt) if after_a_save else CheckpointManager(tmp_path / "fresh") as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert_same(model.state_dict(), src_model.state_dict())
    assert_same(opt.state_dict(), src_opt.state_dict())


def _flip_last_file(step_dir):
    last = sorted(step_dir.glob("*.distcp"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-len(raw) // 3] ^= 0x04
    last.write_bytes(bytes(raw))


@pytest.mark.parametrize("readers", [1, 2])
@pytest.mark.parametrize("fault", ["crc", "after_read", "interrupt", "component"])
def test_failed_restore_leaves_the_live_state_exactly_as_it_was(tmp_path, saved, monkeypatch, fault, readers):
    """Whatever fails or interrupts a restore, every live tensor keeps its bytes, memory and version."""
    step_dir, _, _, name = saved
    monkeypatch.setattr(restore_mod, "_READERS", readers)
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
        real_into, calls = restore_mod._FileReader.into, []

        def into_then_interrupt(self, view):
            real_into(self, view)
            calls.append(view.nbytes)
            if view.nbytes >= LARGE_BYTES and len([n for n in calls if n >= LARGE_BYTES]) == 2:
                raise KeyboardInterrupt

        monkeypatch.setattr(restore_mod._FileReader, "into", into_then_interrupt)
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


def test_record_whose_trailer_differs_is_loaded_by_dcp_exactly(tmp_path, saved, monkeypatch):
    """A record read into its buffer whose trailer then differs from torch.save's is loaded again by DCP's reader."""
    step_dir, src_model, src_opt, name = saved
    real = restore_mod.record_framing

    def odd_trailer(target):
        head, tail = real(target)
        if target.numel() * target.element_size() >= LARGE_BYTES:
            tail = bytes([tail[0] ^ 1]) + tail[1:]
        return head, tail

    monkeypatch.setattr(restore_mod, "record_framing", odd_trailer)
    model, opt = _wide(1, name)
    with _restorer(tmp_path, model, opt) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert_same(model.state_dict(), src_model.state_dict())
    assert_same(opt.state_dict(), src_opt.state_dict())


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_save_after_a_restore_saves_the_restored_values(tmp_path, saved, persist):
    """The staging memory of the saves before a restore is staged afresh by the next save."""
    step_dir, src_model, src_opt, name = saved
    model, opt = _wide(1, name)
    with CheckpointManager(tmp_path / "live", persist=persist) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
        mgr.save(2, TrainState(model=model, optimizer=opt, dataloader=_Loader())).wait()
    fresh_model, fresh_opt = _wide(2, name)
    with CheckpointManager(tmp_path / "live") as mgr:
        assert mgr.restore(TrainState(model=fresh_model, optimizer=fresh_opt, dataloader=_Loader())) == 2
    assert_same(fresh_model.state_dict(), src_model.state_dict())
    assert_same(fresh_opt.state_dict(), src_opt.state_dict())


def test_tied_weights_stay_tied_and_exact(tmp_path):
    """Two names for one weight: restored once into the one parameter, which stays shared; the values are exact."""
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
def test_plain_dict_with_views_of_one_buffer_restores_exactly_or_changes_nothing(tmp_path, corrupt):
    """Two disjoint views of one buffer in a plain dict: copied into (exact), or untouched when a file is bad."""
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
    # the views keep their memory; "c", alone in its storage, may have exchanged its buffer (same object)
    assert {k: v.data_ptr() for k, v in live.items() if corrupt or k != "c"} == \
        {k: p for k, p in ptrs.items() if corrupt or k != "c"}
    assert torch.equal(base, torch.cat([expected["a"], expected["b"]]))


class _OwnLoad:
    """A Stateful whose load_state_dict keeps its own "frozen" tensor (a user's choice the restore must respect)."""

    def __init__(self) -> None:
        self.frozen, self.trained = torch.zeros(BIG), torch.zeros(BIG)

    def state_dict(self):
        return {"frozen": self.frozen, "trained": self.trained}

    def load_state_dict(self, sd):
        self.trained.copy_(sd["trained"])


@pytest.mark.parametrize("ignore_all", [False, True])
def test_a_stateful_decides_in_its_load_state_dict_what_changes(tmp_path, ignore_all):
    """A Stateful's tensors change only as its load_state_dict says: a key it ignores keeps its old bytes."""
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(1, {"frozen": torch.ones(BIG), "trained": torch.full((BIG,), 2.0)}).wait()
    state = _OwnLoad()
    if ignore_all:
        state.load_state_dict = lambda sd: None
    with CheckpointManager(tmp_path / "live") as mgr:
        mgr.save(1, state).wait()
        mgr.restore(state, path=next((tmp_path / "src").glob("step_*")))
    assert not state.frozen.any()
    assert torch.equal(state.trained, torch.zeros(BIG) if ignore_all else torch.full((BIG,), 2.0))


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


@pytest.mark.parametrize(("thread", "readers"), [("torch_ckpt_restore", 2), ("torch_ckpt_restore_crc", 1)])
def test_interrupt_while_a_helper_thread_starts_changes_nothing(tmp_path, saved, monkeypatch, thread, readers):
    """A Ctrl-C inside Thread.start() of a reader or CRC thread: every helper ends, nothing live changed."""
    step_dir, _, _, name = saved
    monkeypatch.setattr(restore_mod, "_READERS", readers)
    real_start, fired = threading.Thread.start, []

    def start_then_interrupt(self):
        real_start(self)  # the thread runs: the Ctrl-C lands in start()'s wait for it
        if self.name == thread and not fired:
            fired.append(self)
            raise KeyboardInterrupt

    model, opt = _wide(1, name)
    mgr = _restorer(tmp_path, model, opt)
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    ptrs = [t.data_ptr() for t in _tensors(model, opt)]
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with mgr, pytest.raises(KeyboardInterrupt):
        mgr.restore(TrainState(model=model, optimizer=opt, dataloader=_Loader()), path=step_dir)
    assert fired
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
        self.t = torch.zeros(BIG)
        self.inner = inner
        self.result = None

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t.copy_(sd["t"])
        self.result = self.inner()


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
    """A load_state_dict that restores again (same manager): both succeed."""
    plain = {"w": torch.arange(BIG, dtype=torch.float32)}
    mgr = CheckpointManager(tmp_path / "ck")  # not closed after a deadlock (close() would wait for it too)
    mgr.save(1, plain).wait()
    outer = _Restoring(lambda: mgr.restore(plain, step=1))
    mgr.save(2, {"t": torch.full_like(outer.t, 7.0)}).wait()
    plain["w"].zero_()
    assert _in_thread(lambda: mgr.restore(outer, step=2)) == 2
    mgr.close()
    assert outer.result == 1 and torch.equal(plain["w"], torch.arange(plain["w"].numel(), dtype=torch.float32))
    assert torch.equal(outer.t, torch.full_like(outer.t, 7.0))


def test_save_inside_a_restore_of_the_same_manager_does_not_deadlock(tmp_path):
    """A load_state_dict that saves through the restoring manager: the save commits, the restore returns."""
    mgr = CheckpointManager(tmp_path / "ck")  # not closed after a deadlock (close() would wait for it too)
    outer = _Restoring(lambda: mgr.save(3, {"t": torch.ones(BIG)}))
    mgr.save(2, {"t": torch.full((BIG,), 2.0)}).wait()
    assert _in_thread(lambda: mgr.restore(outer, step=2)) == 2
    outer.result.committed.result(timeout=20)
    mgr.close()
    assert torch.equal(outer.t, torch.full((BIG,), 2.0)) and 3 in CheckpointManager(tmp_path / "ck").all_steps()


@pytest.mark.parametrize("load_fails", [False, True])
def test_a_second_ctrl_c_at_the_end_of_a_restore_leaves_the_default_sigint_handler(tmp_path, monkeypatch,
                                                                                   load_fails):
    """Two Ctrl-C while the live state is written (or its load fails): KeyboardInterrupt, Python's handler is back."""
    live = {"t": torch.zeros(BIG)}
    real = restore_mod._write_live

    def then_two_ctrl_c(*args):
        try:
            real(*args)
        finally:
            signal.raise_signal(signal.SIGINT)  # held
            signal.raise_signal(signal.SIGINT)  # raised at once

    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"t": torch.ones_like(live["t"])}).wait()
        target = _Restoring(lambda: 1 / 0) if load_fails else live
        monkeypatch.setattr(restore_mod, "_write_live", then_two_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            mgr.restore(target, step=1)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # (reset for the next tests either way)
    assert handler is signal.default_int_handler
