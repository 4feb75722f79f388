"""state._optim: an optimizer kept by its own state_dict (integer ids), checked before anything loads.

End-to-end saves and restores of OptimizerState through the manager are in test_optim_state.py.
"""

from __future__ import annotations

import pytest
import torch

from torch_ckpt.errors import CheckpointCorruptError, StateMismatchError
from torch_ckpt.state._optim import OptimizerState, check_plain_optimizer_state, plain_state_target


def stepped_adam(seed: int = 0, **kwargs) -> torch.optim.Adam:
    """Adam over two parameter groups (2 + 1 parameters), after one step."""
    torch.manual_seed(seed)
    a, b, c = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    opt = torch.optim.Adam([{"params": [a, b]}, {"params": [c], "lr": 0.5}], **kwargs)
    (a.sum() + b.sum() + c.sum()).backward()
    opt.step()
    return opt


def fresh_adam(**kwargs) -> torch.optim.Adam:
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    return torch.optim.Adam([{"params": [a, b]}, {"params": [c], "lr": 0.5}], **kwargs)


def test_matching_state_passes_with_nothing_to_cast():
    """A state_dict of the same optimizer layout passes and reports no cast."""
    assert check_plain_optimizer_state(fresh_adam(), stepped_adam().state_dict(), prefix="opt.") == []


@pytest.mark.parametrize("saved", [None, {"state": {}}, {"param_groups": [], "state": []}],
                         ids=["none", "no-groups", "state-not-mapping"])
def test_not_an_optimizer_state_dict_is_corrupt(saved):
    """Anything but an optimizer state_dict raises CheckpointCorruptError naming the prefix."""
    with pytest.raises(CheckpointCorruptError, match="^opt: not an optimizer state_dict"):
        check_plain_optimizer_state(fresh_adam(), saved, prefix="opt.")


def test_other_group_sizes_are_a_mismatch():
    """Different parameter group sizes raise StateMismatchError giving both layouts."""
    one_group = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3)) for _ in range(3)])
    with pytest.raises(StateMismatchError, match=r"sizes \[2, 1\] in the checkpoint, \[3\] here"):
        check_plain_optimizer_state(one_group, stepped_adam().state_dict(), prefix="opt.")


def test_state_for_an_unknown_parameter_id_is_unexpected():
    """State under an id the optimizer does not have raises StateMismatchError listing the key."""
    saved = stepped_adam().state_dict()
    saved["state"][7] = saved["state"][0]
    with pytest.raises(StateMismatchError) as info:
        check_plain_optimizer_state(fresh_adam(), saved, prefix="opt.")
    assert info.value.unexpected == ["opt.state.7"]


def test_dtype_that_would_be_cast_is_refused_unless_allowed():
    """A float64 moment for a float32 parameter is refused, and reported as a cast with allow_cast."""
    saved = stepped_adam().state_dict()
    saved["state"][1]["exp_avg"] = saved["state"][1]["exp_avg"].double()
    with pytest.raises(StateMismatchError, match="opt.state.1.exp_avg: checkpoint torch.float64"):
        check_plain_optimizer_state(fresh_adam(), saved, prefix="opt.")
    cast = check_plain_optimizer_state(fresh_adam(), saved, prefix="opt.", allow_cast=True)
    assert len(cast) == 1 and cast[0].startswith("opt.state.1.exp_avg")


def test_step_counter_dtype_is_never_a_cast():
    """The step counter keeps its own dtype: a float32 step for any parameter is not a cast."""
    saved = stepped_adam().state_dict()
    saved["state"][0]["step"] = saved["state"][0]["step"].double()
    assert check_plain_optimizer_state(fresh_adam(), saved, prefix="opt.") == []


def test_target_of_a_moment_is_on_the_parameter_device_with_the_given_shape():
    """A moment's target is a new tensor of the saved shape and dtype where the parameter lives."""
    t = plain_state_target(fresh_adam(), 2, "exp_avg", (3,), torch.float32)
    assert t.shape == (3,) and t.dtype == torch.float32 and t.device == torch.device("cpu")


def test_target_of_an_unknown_id_is_none():
    """An id past the optimizer's parameters has no target."""
    assert plain_state_target(fresh_adam(), 3, "exp_avg", (3,), torch.float32) is None
    assert plain_state_target(fresh_adam(), -1, "exp_avg", (3,), torch.float32) is None


def test_only_state_entries_are_optional_keys():
    """state.<id>.<entry> keys may be missing on one side; group settings may not."""
    holder = OptimizerState(fresh_adam())
    assert holder.load_optional_key("state.0.exp_avg")
    assert not holder.load_optional_key("param_groups.0.lr")
    assert holder.load_target("param_groups.0.lr", (), torch.float32) is None


def test_undo_puts_back_the_state_before_the_load():
    """undo() after load_state_dict restores the previous (empty) state and groups."""
    holder = OptimizerState(fresh_adam())
    holder.load_state_dict(stepped_adam().state_dict())
    assert len(holder.optimizer.state) == 3 and holder.optimizer.param_groups[1]["lr"] == 0.5
    holder.optimizer.param_groups[1]["lr"] = 9.0
    holder.undo()
    assert len(holder.optimizer.state) == 0 and holder.optimizer.param_groups[1]["lr"] == 0.5


def test_keep_live_copies_loaded_values_into_the_earlier_tensors():
    """keep_live() keeps the tensors held before the load, now holding the loaded values."""
    holder = OptimizerState(stepped_adam(seed=1))
    param = holder.optimizer.param_groups[0]["params"][0]
    live = holder.optimizer.state[param]["exp_avg"]
    saved = stepped_adam(seed=2).state_dict()
    holder.load_state_dict(saved)
    holder.keep_live()
    assert holder.optimizer.state[param]["exp_avg"] is live
    assert torch.equal(live, saved["state"][0]["exp_avg"])


def test_check_load_uses_the_holder_name():
    """check_load names errors with the holder's name as prefix."""
    holder = OptimizerState(fresh_adam(), name="optimizers_plain.0")
    with pytest.raises(CheckpointCorruptError, match="^optimizers_plain.0: "):
        holder.check_load({"state": {}})
