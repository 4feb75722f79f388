"""Tests of torch_ckpt.codec: tensors split from JSON values, types preserved."""

import json

import numpy as np
import pytest
import torch

from torch_ckpt.codec import join_state, split_state
from torch_ckpt.errors import ConfigError


def roundtrip(state, **kw):
    tensors, tree = split_state(state, **kw)
    tree = json.loads(json.dumps(tree))
    return tensors, join_state(tree, tensors)


def test_tensors_use_dcp_dotted_keys():
    """Nested dict tensors get DCP's dot-joined flat keys."""
    t = torch.ones(2)
    tensors, _ = split_state({"model": {"fc.weight": t}, "optim": {"state": {"fc.weight": {"exp_avg": t}}}})
    assert set(tensors) == {"model.fc.weight", "optim.state.fc.weight.exp_avg"}


def test_python_types_survive_json():
    """int, float, bool, None, str, tuple, int-keyed dict, nan and inf keep their type and value."""
    state = {"i": 3, "f": 0.1, "b": True, "n": None, "s": "x", "t": (1, (2, 3)), "d": {1: "a", 2: [1.5]},
             "nan": float("nan"), "inf": float("-inf"), "l": [1, 2]}
    _, out = roundtrip(state)
    assert type(out["i"]) is int and out["i"] == 3
    assert out["t"] == (1, (2, 3)) and isinstance(out["t"][1], tuple)
    assert out["d"] == {1: "a", 2: [1.5]}
    assert out["nan"] != out["nan"] and out["inf"] == float("-inf")
    assert out["b"] is True and out["n"] is None and out["l"] == [1, 2]


def test_numpy_values_roundtrip():
    """numpy arrays and scalars come back with dtype and value."""
    arr = np.arange(6, dtype=np.uint32).reshape(2, 3)
    _, out = roundtrip({"a": arr, "s": np.float32(1.5)})
    assert out["a"].dtype == np.uint32 and (out["a"] == arr).all()
    assert out["s"].dtype == np.float32 and out["s"] == np.float32(1.5)


def test_rank_local_tensors_are_inlined():
    """Tensors under rank-local keys go into the JSON tree, not to DCP."""
    rng = torch.get_rng_state()
    tensors, out = roundtrip({"rng": {"cpu": rng}, "w": torch.zeros(1)}, rank_local_keys=("rng",))
    assert set(tensors) == {"w"}
    assert torch.equal(out["rng"]["cpu"], rng) and out["rng"]["cpu"].dtype == torch.uint8


def test_dict_shaped_like_a_tag_is_escaped():
    """A user dict whose only key looks like an internal tag is not mistaken for one."""
    _, out = roundtrip({"x": {"__tuple__": [1]}})
    assert out == {"x": {"__tuple__": [1]}}


def test_unsupported_value_names_the_key():
    """An object that would need pickling is rejected with its key path."""
    with pytest.raises(ConfigError, match="extras.fn"):
        split_state({"extras": {"fn": object()}})


def test_flattening_collision_is_rejected():
    """Two paths flattening to the same DCP key raise instead of silently overwriting."""
    with pytest.raises(ConfigError, match="a.b"):
        split_state({"a": {"b": torch.zeros(1)}, "a.b": torch.zeros(1)})
