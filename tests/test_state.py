"""TrainState construction checks for dataloaders."""

import pytest
import torch

from torch_ckpt import ConfigError, TrainState


def test_plain_dataloader_is_refused_with_advice():
    """A torch DataLoader (no state_dict) is refused, naming torchdata's StatefulDataLoader."""
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        TrainState(dataloader=torch.utils.data.DataLoader(list(range(4))))


def test_plain_random_sampler_warns_that_resume_is_inexact():
    """A StatefulDataLoader over torch's RandomSampler warns; torchdata's sampler does not."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    data = list(range(8))
    with pytest.warns(UserWarning, match="resumed run will see different batches"):
        TrainState(dataloader=StatefulDataLoader(data, sampler=torch.utils.data.RandomSampler(data)))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*resumed run.*")
        TrainState(dataloader=StatefulDataLoader(data, sampler=RandomSampler(data)))


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_state_dict_does_not_advance_any_rng():
    """Capturing the state (RNG included) leaves Python, NumPy and torch generators where they were."""
    torch.manual_seed(0)
    state = TrainState(model=torch.nn.Linear(2, 2))
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = _draws()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state.state_dict()
    assert _draws() == expected


@pytest.mark.parametrize("consumed", [0, 2])
def test_state_dict_does_not_advance_the_dataloader(consumed):
    """Capturing a StatefulDataLoader's position (before or during an epoch) does not change the batches that follow."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    def batches(capture: bool) -> list:
        data = list(range(12))
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(3))
        loader = StatefulDataLoader(data, batch_size=2, sampler=sampler)
        state = TrainState(dataloader=loader, rng=False)
        it = iter(loader)
        out = [next(it).tolist() for _ in range(consumed)]
        if capture:
            state.state_dict()
        out += [b.tolist() for b in it]
        return out

    assert batches(capture=True) == batches(capture=False)


def test_loader_without_its_own_generator_warns_about_the_rng_stream():
    """A StatefulDataLoader without generator= warns that the global RNG stream shifts; with one it does not."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(8))
    with pytest.warns(UserWarning, match="no generator="):
        TrainState(dataloader=StatefulDataLoader(data, shuffle=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*generator.*")
        TrainState(dataloader=StatefulDataLoader(data, generator=torch.Generator().manual_seed(1)))


def _dropout_run(root, total, stop=None, resume=False):
    """Train a dropout model over a shuffled loader built as the README shows; returns per-step losses."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    from torch_ckpt import CheckpointManager

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randn(40, 1))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = StatefulDataLoader(data, batch_size=4,
                                sampler=RandomSampler(data, generator=torch.Generator().manual_seed(0)),
                                generator=torch.Generator().manual_seed(1))
    state = TrainState(model=model, optimizer=opt, dataloader=loader)
    losses = {}
    with CheckpointManager(root) as mgr:
        if resume:
            mgr.restore(state)
        while state.step < total:
            for x, y in loader:
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                state.step += 1
                losses[state.step] = loss.item()
                if state.step % 4 == 0:
                    mgr.save(state.step, state)
                if state.step in (total, stop):
                    break
            else:
                state.epoch += 1
                continue
            break
    return losses


def test_readme_loader_setup_resumes_dropout_bitwise(tmp_path):
    """With the README's loader (own generators), a model with dropout resumes bitwise mid-epoch and across epochs."""
    reference = _dropout_run(tmp_path / "ref", total=30)
    _dropout_run(tmp_path / "run", total=30, stop=14)  # "killed" after step 14; step 12 is the newest save
    resumed = _dropout_run(tmp_path / "run", total=30, resume=True)
    assert min(resumed) == 13 and all(resumed[s] == reference[s] for s in resumed)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _assert_same_capture(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.data_ptr() == b[key].data_ptr() and value.shape == b[key].shape, key
        else:
            assert value == b[key], key


def test_repeated_capture_of_a_plain_module_equals_dcps():
    """The second and later captures of a plain module (its own state_dict) equal DCP's get_model_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _net()
    state = TrainState(model=model, rng=False)
    for _ in range(3):
        _assert_same_capture(state.state_dict()["model"], get_model_state_dict(model))


@pytest.mark.slow
def test_capture_of_a_compiled_module_keeps_dcps_names():
    """A torch.compile wrapper's '_orig_mod.' prefix is removed on every capture, as DCP does."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    compiled = torch.compile(_net())
    state = TrainState(model=compiled, rng=False)
    for _ in range(2):
        sd = state.state_dict()["model"]
        assert not any(k.startswith("_orig_mod.") for k in sd)
        _assert_same_capture(sd, get_model_state_dict(compiled))


def test_capture_follows_a_replaced_submodule():
    """A submodule replaced after the first capture shows up with its own keys in the next one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _net()
    state = TrainState(model=model, rng=False)
    state.state_dict()
    model[1] = torch.nn.LayerNorm(4)
    sd = state.state_dict()["model"]
    assert "1.running_mean" not in sd and "1.weight" in sd
    _assert_same_capture(sd, get_model_state_dict(model))


def _count_param_names(monkeypatch):
    """Count calls of optim_state.param_names wherever torch_ckpt looks it up; return the counter."""
    import torch_ckpt.state._optim as optim_state
    import torch_ckpt.state._train_state as state_load

    calls = []
    real = optim_state.param_names

    def counting(model):
        calls.append(model)
        return real(model)

    monkeypatch.setattr(optim_state, "param_names", counting)
    monkeypatch.setattr(state_load, "param_names", counting)
    return calls


def test_restore_computes_parameter_names_once(tmp_path, monkeypatch):
    """One restore of a TrainState with Adam state asks param_names once per model."""
    from torch_ckpt import CheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt)).wait()
        fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        state = TrainState(model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))
        calls = _count_param_names(monkeypatch)
        assert mgr.restore(state) == 1
    assert calls == [fresh]
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_direct_load_state_dict_computes_parameter_names_once(monkeypatch):
    """A load_state_dict outside a restore checks and loads with one param_names answer."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sd = TrainState(model=model, optimizer=opt).state_dict()
    target = torch.nn.Linear(3, 1)
    state = TrainState(model=target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9))
    calls = _count_param_names(monkeypatch)
    state.load_state_dict(sd)
    assert calls == [target]
    assert state._session_names is None


def test_parameter_names_are_recomputed_after_the_model_changes_between_loads(monkeypatch):
    """Names are not kept from one load_state_dict to the next (the model may change meanwhile)."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    sd = state.state_dict()
    calls = _count_param_names(monkeypatch)
    state.load_state_dict(sd)
    state.load_state_dict(sd)
    assert calls == [model, model]


def _rollback_run(root, caplog, *, restore_inside_loop: bool):
    """Save after batch 1, take batches 2-3, restore step 1 (inside the loop or after leaving it); the next batches."""
    import logging

    from torchdata.stateful_dataloader import StatefulDataLoader

    from torch_ckpt import CheckpointManager

    loader = StatefulDataLoader(torch.arange(16), batch_size=2)
    state = TrainState(dataloader=loader, rng=False)
    caplog.set_level(logging.WARNING, logger="torch_ckpt")
    with CheckpointManager(root) as mgr:
        it = iter(loader)
        next(it)
        mgr.save(1, state)
        next(it), next(it)
        if not restore_inside_loop:
            it = None
        mgr.restore(state, step=1)
        running = next(it).tolist() if it is not None else None
        fresh = next(iter(loader)).tolist()
    return running, fresh, [r.getMessage() for r in caplog.records if "being iterated" in r.getMessage()]


def test_restore_while_the_loader_is_iterated_warns_that_the_running_iterator_keeps_its_position(tmp_path, caplog):
    """A restore inside a loop over the loader warns; the old iterator goes on, a new iter() starts at the restore."""
    running, fresh, warned = _rollback_run(tmp_path / "ckpt", caplog, restore_inside_loop=True)
    assert running == [6, 7] and fresh == [2, 3]
    assert len(warned) == 1 and "start a new `for batch in loader`" in warned[0]


def test_restore_after_leaving_the_loop_does_not_warn(tmp_path, caplog):
    """A restore once nothing holds the loader's unfinished iterator any more (the loop was left) is silent."""
    _running, fresh, warned = _rollback_run(tmp_path / "ckpt", caplog, restore_inside_loop=False)
    assert fresh == [2, 3] and not warned


@pytest.mark.parametrize("case", ["never iterated", "epoch finished", "made by state_dict()", "loop left"])
def test_iteration_in_progress_is_false_without_a_running_iterator(case):
    """No iterator, a finished one, the one state_dict() makes, or one only the loader refers to: not in progress."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torch_ckpt.state._train_state import iteration_in_progress

    loader = StatefulDataLoader(torch.arange(8), batch_size=2)
    if case == "epoch finished":
        list(loader)
    elif case == "made by state_dict()":
        loader.state_dict()
    elif case == "loop left":
        for _ in loader:
            break
    assert not iteration_in_progress(loader)
    it = iter(loader)
    next(it)
    assert iteration_in_progress(loader)
