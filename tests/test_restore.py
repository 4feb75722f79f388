"""Restore: a failed restore changes nothing, and tensors are never cast silently."""

from __future__ import annotations

import copy
import gc
import logging
import random

import numpy as np
import pytest
import torch

import torch_ckpt.restore._restore as restore_mod
from tests.test_optim_state import assert_same
from torch_ckpt import CheckpointManager, StateMismatchError, TrainState


def _trained(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(3, 4, dtype=dtype)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


class _Loader:
    """A stateful 'dataloader' whose load_state_dict can be told to fail."""

    def __init__(self, position: int = 0, fail: bool = False) -> None:
        self.position, self.fail = position, fail

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        if self.fail:
            raise ValueError("loader refuses this state")
        self.position = sd["position"]


def _snapshot(model, opt, sched, loader=None):
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "sched": copy.deepcopy(sched.state_dict()), "loader": None if loader is None else loader.state_dict(),
            "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(), "np_rng": np.random.get_state()[1].copy()}


def _assert_unchanged(before, model, opt, sched, loader=None):
    after = _snapshot(model, opt, sched, loader)
    assert_same(after["model"], before["model"])
    assert_same(after["opt"], before["opt"])
    assert_same(after["sched"], before["sched"])
    assert after["loader"] == before["loader"]
    assert torch.equal(after["torch_rng"], before["torch_rng"])
    assert after["py_rng"] == before["py_rng"]
    assert np.array_equal(after["np_rng"], before["np_rng"])


@pytest.fixture
def saved(tmp_path):
    """A committed step 2 of a trained model, optimizer, scheduler and loader (position 5)."""
    model, opt, sched = _trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader(5))).wait()
    return tmp_path


def test_a_shape_mismatch_says_what_to_do_next(tmp_path):
    """A restore refused for a shape mismatch names the differing tensor and points to the saved shapes."""
    model, opt, _ = _trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError) as info:
        mgr.restore(TrainState(model=other, optimizer=torch.optim.Adam(other.parameters())))
    assert "model.0.weight" in str(info.value) and "torch-ckpt inspect" in str(info.value)


def test_mismatch_leaves_a_fresh_optimizer_without_state(tmp_path):
    """A restore refused for a shape mismatch leaves a fresh optimizer without state (not initialised)."""
    model, opt, _ = _trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError, match="shapes differ"):
        mgr.restore(TrainState(model=other, optimizer=other_opt))
    assert not other_opt.state and all(p.grad is None for p in other.parameters())


@pytest.mark.parametrize("reader", ["load_direct", "load_tensors"])
def test_read_failure_after_data_arrived_leaves_everything_untouched(saved, monkeypatch, reader):
    """A reader (single-pass or DCP's) failing after it wrote tensors leaves the whole state as it was."""
    if reader == "load_tensors":  # the single-pass reader places nothing: DCP's reader loads every tensor
        monkeypatch.setattr(restore_mod, "load_direct", lambda targets, *a, **k: set(targets))
    real_load = getattr(restore_mod, reader)

    def load_then_fail(*args, **kwargs):
        real_load(*args, **kwargs)
        raise OSError("disk went away mid-read")

    monkeypatch.setattr(restore_mod, reader, load_then_fail)
    model, opt, sched = _trained(seed=3)
    loader = _Loader(1)
    before = _snapshot(model, opt, sched, loader)
    with CheckpointManager(saved) as mgr, pytest.raises(OSError, match="mid-read"):
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader))
    _assert_unchanged(before, model, opt, sched, loader)


def test_failing_component_load_rolls_back_the_others(saved):
    """A dataloader that refuses its state undoes the optimizer, scheduler and RNG already loaded."""
    model, opt, sched = _trained(seed=3)
    loader = _Loader(1, fail=True)
    before = _snapshot(model, opt, sched, loader)
    with CheckpointManager(saved) as mgr, pytest.raises(ValueError, match="refuses"):
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader))
    _assert_unchanged(before, model, opt, sched, loader)


def test_fresh_optimizer_stays_fresh_when_a_component_fails(saved):
    """A fresh optimizer is left without state when a later component of the restore fails."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = _snapshot(model, opt, sched)
    with CheckpointManager(saved) as mgr, pytest.raises(ValueError):
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader(fail=True)))
    assert not opt.state
    _assert_unchanged(before, model, opt, sched)


def test_scheduler_count_mismatch_is_refused_before_any_write(saved):
    """A checkpoint with another number of schedulers is refused and nothing is loaded."""
    model, opt, sched = _trained(seed=3)
    extra = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    before = _snapshot(model, opt, sched)
    with CheckpointManager(saved) as mgr, pytest.raises(StateMismatchError, match="scheduler"):
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=[sched, extra], dataloader=_Loader()))
    _assert_unchanged(before, model, opt, sched)


def test_dtype_mismatch_names_each_key_and_both_dtypes(saved):
    """A bfloat16 model restoring a float32 checkpoint is refused, naming keys and dtypes; nothing changes."""
    model, opt, sched = _trained(seed=3, dtype=torch.bfloat16)
    before = _snapshot(model, opt, sched)
    with CheckpointManager(saved) as mgr, pytest.raises(StateMismatchError) as info:
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader()))
    for key in ("model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"):
        assert f"{key}: checkpoint torch.float32, live torch.bfloat16" in str(info.value)
    assert "allow_cast=True" in str(info.value)
    _assert_unchanged(before, model, opt, sched)


def test_allow_cast_casts_and_logs_each_key_once(saved, caplog):
    """With allow_cast=True the values are cast to the live dtypes and each cast key is logged exactly once."""
    ref, ref_opt, _ = _trained()
    model, opt, sched = _trained(seed=3, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="torch_ckpt"), CheckpointManager(saved) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader()), allow_cast=True)
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, ref[0].weight.to(torch.bfloat16))
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.bfloat16
    lines = [r.getMessage() for r in caplog.records if "casting" in r.getMessage()]
    for key in ("model.0.weight", "optimizer.state.0.weight.exp_avg", "optimizer.state.1.bias.exp_avg_sq"):
        assert sum(f"{key}:" in line for line in lines) == 1, (key, lines)


@pytest.mark.parametrize("reader", ["load_direct", "load_tensors"])
def test_plain_dict_state_is_untouched_when_the_read_fails(tmp_path, monkeypatch, reader):
    """A dict state keeps its tensors when a reader fails after writing into its buffers."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3), "n": 1}).wait()
    if reader == "load_tensors":
        monkeypatch.setattr(restore_mod, "load_direct", lambda targets, *a, **k: set(targets))
    real_load = getattr(restore_mod, reader)

    def load_then_fail(*args, **kwargs):
        real_load(*args, **kwargs)
        raise OSError("read failed")

    monkeypatch.setattr(restore_mod, reader, load_then_fail)
    live = {"w": torch.zeros(3), "n": 0}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(OSError):
        mgr.restore(live)
    assert torch.equal(live["w"], torch.zeros(3)) and live["n"] == 0


def test_plain_dict_dtype_mismatch_is_refused(tmp_path):
    """A dict state with a float64 tensor restoring a float32 one is refused naming the key."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    live = {"w": torch.zeros(3, dtype=torch.float64)}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError, match="w: checkpoint torch.float32, "
                                                                                     "live torch.float64"):
        mgr.restore(live)
    assert torch.equal(live["w"], torch.zeros(3, dtype=torch.float64))


def _rewrite_rank_tree(step_dir, edit):
    """Apply ``edit`` to rank 0's state tree and re-checksum the file in the manifest (a consistent forgery)."""
    import json
    import zlib

    path = step_dir / "rank_00000.json"
    doc = json.loads(path.read_text())
    edit(doc["tree"])
    raw = json.dumps(doc).encode()
    path.write_bytes(raw)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["rank_00000.json"] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit", [lambda t: t.__setitem__("extras", [1]), lambda t: t.__setitem__("step", "x"),
                                  lambda t: t.__setitem__("epoch", True)],
                         ids=["extras_list", "step_str", "epoch_bool"])
def test_malformed_trainstate_fields_are_corrupt_and_change_nothing(tmp_path, edit):
    """A rank tree whose step/epoch/extras has the wrong type is corrupt: nothing changes and resume falls back."""
    from torch_ckpt import CheckpointCorruptError
    from torch_ckpt.root._layout import step_dir_name

    model, opt, sched = _trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt, scheduler=sched, extras={"a": 1})).wait()
        mgr.save(2, TrainState(model=model, optimizer=opt, scheduler=sched, extras={"a": 2})).wait()
    _rewrite_rank_tree(tmp_path / step_dir_name(2), edit)
    live_model, live_opt, live_sched = _trained(seed=7)
    live = TrainState(model=live_model, optimizer=live_opt, scheduler=live_sched, extras={"mine": 0})
    before = _snapshot(live_model, live_opt, live_sched)
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(CheckpointCorruptError):
            mgr.restore(live, step=2)
        _assert_unchanged(before, live_model, live_opt, live_sched)
        assert live.extras == {"mine": 0}
        assert mgr.restore(live) == 1 and live.extras == {"a": 1}


def _wide(seed: int):
    """A model and Adam optimizer (after one step) whose state fills two data files with MiB-sized tensors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 768), torch.nn.Linear(768, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 1024)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_crc_failure_in_the_last_data_file_leaves_the_live_state_unchanged(tmp_path, persist):
    """A byte flipped in the last of two data files fails the restore; model and optimizer keep their values."""
    from torch_ckpt import CheckpointCorruptError

    model, opt = _wide(0)
    with CheckpointManager(tmp_path, persist=persist, thread_count=2) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
    last = sorted(tmp_path.glob("step_*/*.distcp"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-len(raw) // 3] ^= 0x04
    last.write_bytes(bytes(raw))
    live_model, live_opt = _wide(1)
    before = (copy.deepcopy(live_model.state_dict()), copy.deepcopy(live_opt.state_dict()))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointCorruptError, match=f"{last.name}.*CRC-32"):
        mgr.restore(TrainState(model=live_model, optimizer=live_opt), step=1)
    assert_same(live_model.state_dict(), before[0])
    assert_same(live_opt.state_dict(), before[1])


@pytest.mark.parametrize("persist", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_single_process_restore_checks_no_record_outside_the_one_pass(tmp_path, monkeypatch, persist):
    """An intact checkpoint restores with every record matched during the read: no separate header reads."""
    model, opt = _wide(0)
    with CheckpointManager(tmp_path, persist=persist, thread_count=2) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
    calls = []
    monkeypatch.setattr(restore_mod, "check_records", lambda *a, **k: calls.append(k))
    live_model, live_opt = _wide(1)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=live_model, optimizer=live_opt)) == 1
    assert calls == []
    assert_same(live_model.state_dict(), model.state_dict())
    assert_same(live_opt.state_dict(), opt.state_dict())


def test_record_the_reader_cannot_place_is_checked_before_dcp_reads_it(tmp_path):
    """A record whose framing was altered (checksums forged to match) is refused as corrupt, naming its file."""
    import json
    import zlib

    from torch_ckpt import CheckpointCorruptError

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(300), "b": torch.ones(5)}).wait()
    step_dir = next(tmp_path.glob("step_*"))
    data = sorted(step_dir.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # the zip header of the first record
    data.write_bytes(bytes(raw))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][data.name] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    live = {"w": torch.zeros(300), "b": torch.zeros(5)}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointCorruptError, match=data.name):
        mgr.restore(live, step=1)
    assert torch.count_nonzero(live["w"]) == 0 and torch.count_nonzero(live["b"]) == 0


class _GcProbe(TrainState):
    """A TrainState that records whether the cyclic collector was enabled while it was being loaded."""

    def load_state_dict(self, state_dict):
        self.gc_enabled_during_load = gc.isenabled()
        super().load_state_dict(state_dict)


def test_collector_is_paused_during_restore_and_enabled_after(saved):
    """The cyclic GC is off while the state is loaded and back on afterwards."""
    model, opt, sched = _trained(seed=3)
    state = _GcProbe(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader())
    assert gc.isenabled()
    with CheckpointManager(saved) as mgr:
        assert mgr.restore(state) == 2
    assert state.gc_enabled_during_load is False
    assert gc.isenabled()


def test_collector_is_enabled_again_after_a_failed_restore(saved):
    """A restore that fails still leaves the cyclic GC enabled."""
    model, opt, sched = _trained(seed=3)
    with CheckpointManager(saved) as mgr, pytest.raises(ValueError, match="refuses"):
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader(fail=True)))
    assert gc.isenabled()


def test_collector_left_disabled_when_it_was_disabled(saved):
    """A restore does not switch on a collector the program had disabled."""
    model, opt, sched = _trained(seed=3)
    gc.disable()
    try:
        with CheckpointManager(saved) as mgr:
            assert mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader())) == 2
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Refusing:
    """A Stateful holding one tensor whose load_state_dict refuses every state (after validating it)."""

    def __init__(self, value: float) -> None:
        self.t = torch.full((4,), value)

    def state_dict(self):
        return {"t": self.t, "n": 1}

    def load_state_dict(self, sd):
        raise ValueError("refused")


def test_stateful_refusing_its_state_keeps_its_tensors():
    """A Stateful (no check_load) whose load_state_dict raises keeps its live tensor values."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        with CheckpointManager(root) as mgr:
            mgr.save(1, _Refusing(1.0)).wait()
        live = _Refusing(2.0)
        with CheckpointManager(root) as mgr, pytest.raises(ValueError, match="refused"):
            mgr.restore(live)
        assert torch.equal(live.t, torch.full((4,), 2.0))


def test_optimizer_passed_directly_with_other_param_groups_keeps_its_state(tmp_path):
    """Restoring into an optimizer whose param groups differ from the saved one leaves its momentum unchanged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, opt).wait()
    live = torch.optim.SGD([{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}],
                           lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    live.step()
    before = copy.deepcopy(live.state_dict())
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ValueError, match="parameter groups"):
        mgr.restore(live)
    assert_same(live.state_dict(), before)


def _gloo_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


def _gloo_save(rank, world_size, root):
    model, opt = _gloo_model(0)
    with CheckpointManager(root, thread_count=2) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()


def _gloo_restore_corrupt(rank, world_size, root, bad_file):
    from torch_ckpt import CheckpointCorruptError

    model, opt = _gloo_model(1)
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointCorruptError, match=f"{bad_file}.*CRC-32"):
        mgr.restore(TrainState(model=model, optimizer=opt), step=1)
    assert_same(model.state_dict(), before[0])
    assert_same(opt.state_dict(), before[1])


@pytest.mark.slow
def test_two_rank_restore_with_a_flipped_byte_in_the_last_file_changes_nothing(tmp_path):
    """On 2 gloo ranks a byte flipped in the last data file fails both ranks' restore, naming it; nothing changes."""
    from tests._dist import run_distributed

    run_distributed(_gloo_save, 2, str(tmp_path))
    last = sorted(tmp_path.glob("step_*/*.distcp"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-len(raw) // 3] ^= 0x04
    last.write_bytes(bytes(raw))
    run_distributed(_gloo_restore_corrupt, 2, str(tmp_path), last.name)


def test_inference_mode_live_tensors_are_refused_before_any_write(tmp_path):
    """Live tensors made under inference_mode are refused with a StateMismatchError before anything is written."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"big": torch.ones(600_000), "small": torch.ones(10)}).wait()
    with torch.inference_mode():
        live = {"big": torch.zeros(600_000), "small": torch.zeros(10)}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError, match="inference"):
        mgr.restore(live)
    assert not live["big"].any() and not live["small"].any()


def _tied(seed: int, vocab: int = 10, dim: int = 4):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab, bias=False))
    model[1].weight = model[0].weight
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).pow(2).mean().backward()
    opt.step()
    return model, opt


def test_restore_exchanges_parameters_and_optimizer_state_keeping_every_object(saved):
    """A TrainState restore gives the live parameters/state tensors new storage (exchanged) but keeps the objects."""
    source, source_opt, _ = _trained()
    model, opt, sched = _trained(seed=3)
    params = list(model.parameters())
    state = {id(p): dict(opt.state[p]) for p in params}
    ptrs = [p.data_ptr() for p in params] + [t.data_ptr() for p in params for t in opt.state[p].values()]
    with CheckpointManager(saved) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader()))
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
    assert all(opt.state[p][k] is t for p in params for k, t in state[id(p)].items())
    assert_same(model.state_dict(), source.state_dict())
    assert_same(opt.state_dict()["state"], source_opt.state_dict()["state"])
    now = [p.data_ptr() for p in params] + [t.data_ptr() for p in params for t in opt.state[p].values()]
    assert not set(now) & set(ptrs)  # exchanged, not copied into
    assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in params)


def test_restore_keeps_tied_weights_tied(tmp_path):
    """A parameter under two names is restored once and stays one parameter, with the saved values."""
    source, source_opt = _tied(0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, TrainState(model=source, optimizer=source_opt)).wait()
    model, opt = _tied(1)
    weight = model[0].weight
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt))
    assert model[0].weight is weight and model[1].weight is weight
    assert torch.equal(weight.detach(), source[0].weight.detach())
    assert torch.equal(opt.state[weight]["exp_avg"], source_opt.state[source[0].weight]["exp_avg"])


def test_restore_copies_into_parameters_whose_storage_a_caller_shares(saved):
    """A state_dict() the caller keeps shares the parameters' storage: they are copied into, so it sees the values."""
    source, _, _ = _trained()
    model, opt, sched = _trained(seed=3)
    held = model.state_dict()
    with CheckpointManager(saved) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader()))
    assert_same(held, source.state_dict())
    assert all(held[k].data_ptr() == t.data_ptr() for k, t in model.state_dict().items())


def test_restore_keeps_gradients_of_exchanged_parameters(saved):
    """Parameters with a .grad are exchanged and keep that gradient tensor."""
    model, opt, sched = _trained(seed=3)
    model(torch.randn(3, 4)).sum().backward()
    grads = {id(p): p.grad for p in model.parameters()}
    ptrs = {id(p): p.data_ptr() for p in model.parameters()}
    with CheckpointManager(saved) as mgr:
        mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=_Loader()))
    assert all(p.grad is grads[id(p)] and p.data_ptr() != ptrs[id(p)] for p in model.parameters())


def test_plain_dict_state_tensors_keep_their_objects_after_restore(tmp_path):
    """A plain dict state's tensors stay the same objects and get the saved values."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.arange(1000.0), "b": torch.ones(3)}).wait()
    state = {"w": torch.zeros(1000), "b": torch.zeros(3)}
    w, b = state["w"], state["b"]
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(state)
    assert state["w"] is w and state["b"] is b
    assert torch.equal(w, torch.arange(1000.0)) and torch.equal(b, torch.ones(3))


@pytest.mark.parametrize("kind", ["dict", "train_state"])
def test_live_tensor_with_self_overlapping_elements_is_refused_before_any_write(tmp_path, kind):
    """An expand() view in the live state is a StateMismatchError naming it; no other tensor is written."""
    def build(value):
        module = torch.nn.Linear(4, 4)
        module.register_buffer("grid", torch.full((1, 4), value).expand(8, 4))  # stride 0 over 8 rows
        torch.nn.init.constant_(module.weight, value)
        if kind == "dict":
            return module, {"weight": module.weight.detach(), "grid": module.grid, "x": torch.full((8,), value)}
        return module, TrainState(model=module)

    _, source = build(1.0)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {k: v.clone() for k, v in source.items()} if kind == "dict" else source).wait()
    module, live = build(0.0)
    before = {k: v.clone() for k, v in (live if kind == "dict" else module.state_dict()).items()}
    with CheckpointManager(tmp_path / "ck") as mgr, pytest.raises(StateMismatchError, match="grid"):
        mgr.restore(live)
    after = live if kind == "dict" else module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_every_candidate_failing_names_each_checkpoint_tried(tmp_path):
    """When every committed step fails its CRC-32, the error names each step tried, newest first."""
    from torch_ckpt import CheckpointCorruptError

    model, opt = _wide(0)
    with CheckpointManager(tmp_path, incremental=False) as mgr:
        for step in (1, 2):
            mgr.save(step, TrainState(model=model, optimizer=opt)).wait()
    for data in tmp_path.glob("step_*/*.distcp"):
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    live_model, live_opt = _wide(1)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointCorruptError) as caught:
        mgr.restore(TrainState(model=live_model, optimizer=live_opt))
    text = str(caught.value)
    assert "none of the 2 checkpoints tried" in text
    assert text.index("step_000000002") < text.index("step_000000001")
