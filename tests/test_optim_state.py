"""Optimizer state: capturing it never changes the run, and every state an optimizer can hold round-trips."""

from __future__ import annotations

import copy

import pytest
import torch

from torch_ckpt import CheckpointManager, StateMismatchError, TrainState

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def assert_same(a, b, path="") -> None:
    """Exact equality of nested state: same types, tensors equal bitwise with the same dtype."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _pair(seed: int = 0) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})


def _steps(model, opt, n: int, *, seed: int = 1, only_a: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(2, 4, generator=g)
        if isinstance(model, torch.nn.ModuleDict):
            y = model["a"](x) if only_a else model["b"](model["a"](x))
        else:
            y = model(x)
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _save(root, step, model, opt, **manager_kwargs) -> None:
    with CheckpointManager(root, **manager_kwargs) as mgr:
        mgr.save(step, TrainState(model=model, optimizer=opt)).wait()


def _restore(root, model, opt, **kwargs) -> int | None:
    with CheckpointManager(root) as mgr:
        return mgr.restore(TrainState(model=model, optimizer=opt), **kwargs)


def _restore_and_continue(root, model, opt, fresh, fresh_opt, *, seed: int = 3) -> int | None:
    """Restore into ``fresh``/``fresh_opt``, check the optimizer state equals ``opt``'s, then step both runs
    twice on the same batches (``seed``) and check the models stay equal; returns the restored step."""
    step = _restore(root, fresh, fresh_opt)
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    _steps(model, opt, 2, seed=seed)
    _steps(fresh, fresh_opt, 2, seed=seed)
    assert_same(fresh.state_dict(), model.state_dict())
    return step


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_save_before_first_step_leaves_training_bitwise_unchanged(tmp_path, kind):
    """Saving before the first optimizer.step() changes neither the parameters nor the optimizer of a later run."""
    ref_model = _linear()
    ref_opt = OPTIMIZERS[kind](ref_model.parameters())
    _steps(ref_model, ref_opt, 3)
    model = _linear()
    opt = OPTIMIZERS[kind](model.parameters())
    before = copy.deepcopy(opt.state_dict())
    _save(tmp_path, 0, model, opt)
    assert_same(opt.state_dict(), before)
    assert all(p.grad is None for p in model.parameters())
    _steps(model, opt, 3)
    assert_same(model.state_dict(), ref_model.state_dict())
    assert_same(opt.state_dict(), ref_opt.state_dict())


def test_given_input_adam_step_count_is_three_not_four(tmp_path):
    """Issue input: Linear(4,3) + Adam(lr=0.1), save before training, 3 steps: Adam's step is 3."""
    model = _linear()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _save(tmp_path, 0, model, opt)
    _steps(model, opt, 3)
    assert opt.state_dict()["state"][0]["step"].item() == 3.0


def _assert_save_leaves_run_unchanged(root, build, before, after, *, step: int, overlap: bool) -> None:
    """Two runs of ``build()``: both run ``before``; one saves (``overlap_staging=overlap``) and runs ``after``
    while the save is in flight, the other only runs ``after``: parameters and optimizer state must be equal."""
    ref, ref_opt = build()
    before(ref, ref_opt)
    after(ref, ref_opt)
    model, opt = build()
    before(model, opt)
    with CheckpointManager(root, overlap_staging=overlap) as mgr:
        mgr.save(step, TrainState(model=model, optimizer=opt))
        after(model, opt)
        mgr.wait()
    assert_same(model.state_dict(), ref.state_dict())
    assert_same(opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("overlap", [False, True])
def test_save_with_partial_state_leaves_training_unchanged(tmp_path, overlap):
    """A save while only some parameters have optimizer state (also with overlap staging) does not change the run."""
    def build():
        model = _pair()
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    _assert_save_leaves_run_unchanged(tmp_path, build, lambda m, o: _steps(m, o, 2, only_a=True),
                                      lambda m, o: _steps(m, o, 2, seed=2), step=2, overlap=overlap)


def test_overlap_staging_save_before_first_step_leaves_training_unchanged(tmp_path):
    """With overlap_staging the initial save (no optimizer state yet) does not change the run either."""
    def build():
        model = _linear()
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    _assert_save_leaves_run_unchanged(tmp_path, build, lambda m, o: None, lambda m, o: _steps(m, o, 3),
                                      step=0, overlap=True)


def test_parameters_without_state_round_trip(tmp_path):
    """Issue input A: AdamW, 3 steps with only `a` in the loss; restore into fresh objects; state_dict equal."""
    model = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 3, only_a=True)
    _save(tmp_path, 3, model, opt)
    fresh = _pair(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert _restore_and_continue(tmp_path, model, opt, fresh, fresh_opt) == 3
    assert_same(fresh_opt.state_dict(), opt.state_dict())


def test_frozen_parameter_with_state_round_trips(tmp_path):
    """Issue input B: a.weight frozen after 2 steps keeps its state; it restores into a run where it is frozen."""
    model = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 2)
    model["a"].weight.requires_grad_(False)
    _steps(model, opt, 2, seed=2)
    _save(tmp_path, 4, model, opt)
    fresh = _pair(seed=5)
    fresh["a"].weight.requires_grad_(False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    _restore_and_continue(tmp_path, model, opt, fresh, fresh_opt)


def test_restore_replaces_state_a_live_optimizer_has_but_the_checkpoint_lacks(tmp_path):
    """Restoring a partial state into a trained optimizer drops the state the checkpoint does not hold."""
    model = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 3, only_a=True)
    _save(tmp_path, 3, model, opt)
    live = _pair(seed=5)
    live_opt = torch.optim.AdamW(live.parameters(), lr=0.1)
    _steps(live, live_opt, 2)  # every parameter has state
    _restore(tmp_path, live, live_opt)
    assert_same(live_opt.state_dict(), opt.state_dict())


def test_param_groups_with_extra_keys_round_trip(tmp_path):
    """Several groups with their own hyper-parameters, initial_lr (from a scheduler) and user keys round-trip."""
    def build(seed):
        model = _pair(seed)
        opt = torch.optim.SGD([{"params": model["a"].parameters(), "lr": 0.2, "name": "encoder", "tags": ["x", 1]},
                               {"params": model["b"].parameters(), "momentum": 0.5, "name": "head"}],
                              lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    model, opt, sched = build(0)
    for _ in range(3):
        _steps(model, opt, 1)
        sched.step()
    opt.param_groups[1]["user_counter"] = 7
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, TrainState(model=model, optimizer=opt, scheduler=sched)).wait()
    fresh, fresh_opt, fresh_sched = build(5)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(TrainState(model=fresh, optimizer=fresh_opt, scheduler=fresh_sched))
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    for _ in range(2):
        _steps(model, opt, 1, seed=4)
        sched.step()
        _steps(fresh, fresh_opt, 1, seed=4)
        fresh_sched.step()
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fresh_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_every_optimizer_round_trips_and_continues_bitwise(tmp_path, kind):
    """Save after 2 steps, restore into fresh objects: optimizer state_dict equal and the next steps bitwise equal."""
    model = _linear()
    opt = OPTIMIZERS[kind](model.parameters())
    _steps(model, opt, 2)
    _save(tmp_path, 2, model, opt)
    fresh = _linear(seed=7)
    fresh_opt = OPTIMIZERS[kind](fresh.parameters())
    _restore_and_continue(tmp_path, model, opt, fresh, fresh_opt, seed=9)


def test_two_optimizers_of_one_model_round_trip(tmp_path):
    """Two optimizers over disjoint parameters of one model each get their own state and groups back."""
    def build(seed):
        model = _pair(seed)
        return model, [torch.optim.Adam(model["a"].parameters(), lr=0.1), torch.optim.SGD(model["b"].parameters(),
                                                                                           lr=0.1, momentum=0.9)]

    model, opts = build(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model["b"](model["a"](torch.randn(2, 4, generator=g))).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    _save(tmp_path, 2, model, opts)
    fresh, fresh_opts = build(3)
    _restore(tmp_path, fresh, fresh_opts)
    for mine, ref in zip(fresh_opts, opts):
        assert_same(mine.state_dict(), ref.state_dict())


def test_another_model_is_still_a_mismatch(tmp_path):
    """A checkpoint of another architecture is refused with StateMismatchError naming the keys."""
    model = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 1)
    _save(tmp_path, 1, model, opt)
    torch.manual_seed(0)
    other = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "c": torch.nn.Linear(4, 4)})
    with pytest.raises(StateMismatchError, match="model.c.weight"):
        _restore(tmp_path, other, torch.optim.AdamW(other.parameters(), lr=0.1))


def test_other_parameter_groups_are_a_mismatch(tmp_path):
    """The same model with its parameters split into other groups is refused, naming the groups."""
    model = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 1)
    _save(tmp_path, 1, model, opt)
    fresh = _pair(1)
    fresh_opt = torch.optim.AdamW([{"params": fresh["a"].parameters()}, {"params": fresh["b"].parameters()}])
    with pytest.raises(StateMismatchError, match="param_groups"):
        _restore(tmp_path, fresh, fresh_opt)
    assert not fresh_opt.state


def test_optimizer_over_a_foreign_parameter_is_refused_at_save(tmp_path):
    """An optimizer holding a parameter its model does not own is refused naming the shape, before any I/O."""
    from torch_ckpt import ConfigError

    model = _linear()
    stray = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ConfigError, match=r"\(5,\)"):
        mgr.save(0, TrainState(model=model, optimizer=opt))
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".lock")] == []  # only the root lock


def test_existing_optimizer_state_tensors_are_loaded_in_place(tmp_path):
    """A restore into an optimizer that has state writes into its existing tensors (references stay valid)."""
    model = _linear()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _steps(model, opt, 2)
    _save(tmp_path, 2, model, opt)
    live = _linear(seed=4)
    live_opt = torch.optim.Adam(live.parameters(), lr=0.1)
    _steps(live, live_opt, 1, seed=6)
    held = live_opt.state[live.weight]["exp_avg"]
    _restore(tmp_path, live, live_opt)
    assert live_opt.state[live.weight]["exp_avg"] is held
    assert torch.equal(held, opt.state[model.weight]["exp_avg"])


def test_nested_lbfgs_state_round_trips(tmp_path):
    """LBFGS's nested state (lists of tensors, ints) round-trips into a fresh optimizer and continues bitwise."""
    def run_steps(model, opt, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            x = torch.randn(2, 4, generator=g)

            def closure(x=x):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss
            opt.step(closure)

    model = _linear()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    run_steps(model, opt, 2, 1)
    assert opt.state_dict()["state"][0]["old_dirs"]  # nested tensors exist
    _save(tmp_path, 2, model, opt)
    fresh = _linear(seed=3)
    fresh_opt = torch.optim.LBFGS(fresh.parameters(), lr=0.5, max_iter=3, history_size=4)
    _restore(tmp_path, fresh, fresh_opt)
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    run_steps(model, opt, 2, 5)
    run_steps(fresh, fresh_opt, 2, 5)
    assert_same(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.Adam(p, lr=0.1),
                                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.AdamW(p, lr=0.1)])
def test_optimizer_state_round_trips_into_a_fresh_optimizer(tmp_path, make_opt):
    """OptimizerState saves optimizer.state_dict() and restores it into an optimizer without state, bitwise."""
    from torch_ckpt import CheckpointManager, OptimizerState

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_opt(model.parameters())
    for _ in range(2):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, OptimizerState(opt)).wait()
    fresh = make_opt(torch.nn.Linear(4, 3).parameters())
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(OptimizerState(fresh)) == 2
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for pid, entries in a["state"].items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][pid][name])), (pid, name)


def test_optimizer_state_refuses_other_parameter_groups(tmp_path):
    """Restoring into an optimizer with other group sizes raises StateMismatchError and changes nothing."""
    from torch_ckpt import CheckpointManager, OptimizerState, StateMismatchError

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, OptimizerState(opt)).wait()
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError):
        mgr.restore(OptimizerState(other), step=1)
    assert other.state_dict()["state"] == {}
def test_param_names_follow_a_replaced_parameter():
    """param_names answers for the parameters a module holds now, not those of an earlier call."""
    from torch_ckpt.state._optim import param_names

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    first = param_names(model)
    old = model[0].weight
    model[0].weight = torch.nn.Parameter(torch.zeros(2, 2))
    again = param_names(model)
    assert again[id(model[0].weight)] == "0.weight"
    assert id(old) in first and id(old) not in again
def _adam_with_state(seed: int) -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_keep_live_copies_loaded_values_into_the_live_tensors():
    """OptimizerState: after load + keep_live, the optimizer holds its old tensor objects with the loaded values."""
    from torch_ckpt import OptimizerState

    _, source = _adam_with_state(0)
    _, target = _adam_with_state(1)
    live = target.state[target.param_groups[0]["params"][0]]["exp_avg"]
    wrapped = OptimizerState(target)
    assert wrapped.check_load(source.state_dict()) == []
    wrapped.load_state_dict(source.state_dict())
    wrapped.keep_live()
    now = target.state[target.param_groups[0]["params"][0]]["exp_avg"]
    assert now is live and torch.equal(now, source.state[source.param_groups[0]["params"][0]]["exp_avg"])


def test_optimizer_state_undo_puts_the_previous_state_back():
    """OptimizerState: undo() after a load leaves the optimizer's state exactly as before the load."""
    from torch_ckpt import OptimizerState

    _, source = _adam_with_state(0)
    _, target = _adam_with_state(1)
    before = copy.deepcopy(target.state_dict())
    wrapped = OptimizerState(target)
    wrapped.load_state_dict(source.state_dict())
    wrapped.undo()
    after = target.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][i][k], v) for i, entry in before["state"].items() for k, v in entry.items())
