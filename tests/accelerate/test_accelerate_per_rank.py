"""Accelerate on 2 processes: per-process values (RNG, registered objects' tensors) come back per process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import run_distributed  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore::UserWarning")]


class _PerRank:
    """A registered object whose tensor differs per process."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"].clone()


def _body(rank: int, world: int, folder: str) -> None:
    from accelerate import Accelerator

    import accelerate_ckpt

    acc = Accelerator(cpu=True)
    ckpt = accelerate_ckpt.attach(acc)
    torch.manual_seed(0)
    model, opt = acc.prepare(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    obj = _PerRank(torch.full((2 + rank,), float(rank)))
    acc.register_for_checkpointing(obj)
    torch.manual_seed(100 + rank)
    acc.save_state(folder)
    expected = torch.rand(3)  # the draws after the save, per process
    obj.value = torch.zeros(2 + rank)
    torch.manual_seed(7)
    acc.load_state(folder)
    assert torch.equal(obj.value, torch.full((2 + rank,), float(rank))), (rank, obj.value)
    assert torch.equal(torch.rand(3), expected), rank
    ckpt.close()


@pytest.mark.slow
def test_registered_object_tensor_and_rng_come_back_per_process(tmp_path):
    """2 processes: each gets its own registered object's tensor (own shape) and its own torch RNG back."""
    run_distributed(_body, 2, str(tmp_path / "ck"), timeout_s=150)
