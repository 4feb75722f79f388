"""Tests of the reusable staging arena."""

import pytest
import torch

from torch_ckpt.errors import ConfigError
from torch_ckpt.save._checkpointer import HostStager


def _state():
    return {"w": torch.randn(4, 5), "step": torch.tensor(3.0), "ids": torch.arange(7), "flag": torch.tensor([True]),
            "half": torch.ones(3, dtype=torch.bfloat16)}


def test_staged_values_equal_and_storage_is_separate():
    """Every staged tensor equals its source and shares no storage with it (0-dim included)."""
    src = _state()
    staged = HostStager().stage(src)
    for k, t in src.items():
        assert torch.equal(staged.tensors[k], t), k
        assert staged.tensors[k].untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), k


def test_each_staged_tensor_has_a_minimal_storage():
    """Staged tensors own exactly their bytes, so DCP does not clone them again."""
    staged = HostStager().stage(_state())
    for k, t in staged.tensors.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), k


def test_arena_is_reused_across_saves():
    """Saving the same layout twice allocates once and reuses the same memory."""
    stager = HostStager()
    first = stager.stage(_state()).tensors["w"].data_ptr()
    second = stager.stage(_state()).tensors["w"].data_ptr()
    assert stager.allocations == 1 and first == second


def test_shape_change_reallocates():
    """A changed shape re-allocates the arena (and only then)."""
    stager = HostStager()
    stager.stage(_state())
    changed = _state()
    changed["w"] = torch.randn(8, 5)
    staged = stager.stage(changed)
    assert stager.allocations == 2 and torch.equal(staged.tensors["w"], changed["w"])


def test_budget_is_checked():
    """fits() compares the state's bytes with the budget."""
    stager = HostStager(budget_bytes=64)
    assert not stager.fits({"w": torch.zeros(100)})
    assert stager.fits({"w": torch.zeros(4)})


def test_invalid_budget_rejected():
    """A non-positive budget is a ConfigError."""
    with pytest.raises(ConfigError, match="budget_bytes"):
        HostStager(budget_bytes=0)


def test_shared_memory_arena():
    """share_memory=True puts the arena in shared memory (for the writer process)."""
    stager = HostStager(share_memory=True)
    stager.stage(_state())
    assert stager.arena.is_shared()


@pytest.mark.cuda
def test_cuda_tensors_staged_via_pinned_side_stream():
    """CUDA tensors land in a pinned arena through a side stream; the event completes the copy."""
    src = {"w": torch.randn(1024, 1024, device="cuda")}
    stager = HostStager()
    staged = stager.stage(src)
    staged.synchronize()
    assert stager.arena.is_pinned() and staged.event is not None
    assert torch.equal(staged.tensors["w"], src["w"].cpu())
