"""TrainState's RNG capture and restore (Python, NumPy, torch CPU generators); malformed states refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.state._train_state import capture_rng_state, check_rng_state, restore_rng_state


def draws() -> tuple:
    """One value from each host generator (advances them)."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """Leave the process's generators as the test found them."""
    saved = capture_rng_state()
    yield
    restore_rng_state(saved)


def test_restore_replays_the_same_python_numpy_and_torch_draws():
    """After restore, every host generator repeats the draws made right after capture."""
    state = capture_rng_state()
    first = draws()
    draws()
    restore_rng_state(state)
    assert draws() == first


def test_restore_replays_a_cached_gaussian():
    """Python's and NumPy's cached second Gaussian are part of the state."""
    random.gauss(0, 1)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's legacy generator
    state = capture_rng_state()
    first = (random.gauss(0, 1), float(np.random.standard_normal()))
    restore_rng_state(state)
    assert (random.gauss(0, 1), float(np.random.standard_normal())) == first


def test_captured_state_is_plain_data():
    """The captured state is ints, floats, numpy arrays and uint8 tensors (storable without pickling)."""
    state = capture_rng_state()
    assert state["python"]["mt"].dtype == np.uint32 and type(state["python"]["version"]) is int
    assert state["numpy"]["keys"].dtype == np.uint32 and type(state["numpy"]["pos"]) is int
    assert state["torch_cpu"].dtype == torch.uint8


def test_restore_accepts_a_list_for_the_python_state():
    """Python's state as a list of ints (checkpoints written before it was an array) restores the same stream."""
    state = capture_rng_state()
    first = random.random()
    state["python"]["mt"] = state["python"]["mt"].tolist()
    restore_rng_state(state)
    assert random.random() == first


def test_restore_accepts_lists_for_numpy_keys():
    """NumPy keys given back as a list (as a JSON-like round trip would) restore the same stream."""
    state = capture_rng_state()
    first = float(np.random.rand())
    state["numpy"]["keys"] = state["numpy"]["keys"].tolist()
    restore_rng_state(state)
    assert float(np.random.rand()) == first


@pytest.mark.parametrize("damage", [
    lambda s: s.pop("python"),
    lambda s: s.pop("torch_cpu"),
    lambda s: s["numpy"].pop("keys"),
    lambda s: s["python"].__setitem__("mt", [1, 2, 3]),
    lambda s: s["numpy"].__setitem__("keys", np.zeros(5, dtype=np.uint32)),
    lambda s: s.__setitem__("torch_cpu", [0] * 10),
    lambda s: s.__setitem__("torch_cpu", torch.zeros(3, dtype=torch.uint8)),
    lambda s: s.__setitem__("cuda", [[1, 2, 3]]),
    lambda s: s["numpy"].__setitem__("pos", 10**30),
    lambda s: s["numpy"].__setitem__("has_gauss", 10**30),
    lambda s: s["numpy"].__setitem__("cached_gaussian", "x"),
    lambda s: s["python"].__setitem__("version", 10**30),
], ids=["no-python", "no-torch", "no-numpy-keys", "short-mt", "short-numpy-keys", "torch-list",
        "torch-short", "cuda-not-tensor", "huge-numpy-pos", "huge-has-gauss", "text-gaussian", "huge-version"])
def test_malformed_state_is_corrupt(damage):
    """A missing or malformed entry raises CheckpointCorruptError from check and restore."""
    state = capture_rng_state()
    damage(state)
    with pytest.raises(CheckpointCorruptError, match="RNG state"):
        check_rng_state(state)
    with pytest.raises(CheckpointCorruptError, match="RNG state"):
        restore_rng_state(state)


def test_refused_restore_changes_no_generator():
    """A state refused because its torch entry is bad leaves the Python and NumPy generators untouched."""
    bad = capture_rng_state()
    draws()
    bad["torch_cpu"] = torch.zeros(3, dtype=torch.uint8)
    before = capture_rng_state()
    with pytest.raises(CheckpointCorruptError):
        restore_rng_state(bad)
    expected = draws()
    restore_rng_state(before)
    assert draws() == expected


def test_check_changes_no_generator():
    """check_rng_state validates on scratch generators: the live streams continue unchanged."""
    old = capture_rng_state()
    draws()
    now = capture_rng_state()
    check_rng_state(old)
    expected = draws()
    restore_rng_state(now)
    assert draws() == expected


def test_state_that_is_not_a_mapping_is_corrupt():
    """A state that is not a mapping at all raises CheckpointCorruptError."""
    with pytest.raises(CheckpointCorruptError):
        check_rng_state([1, 2, 3])
