"""Tests of torch_ckpt.distributed._context's public helpers on one process and on 2 gloo ranks."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed
from torch_ckpt import rank_and_world


def test_rank_and_world_without_a_process_group_is_zero_of_one():
    """A plain process is rank 0 of 1."""
    assert rank_and_world() == (0, 1)


def _check_rank(rank: int, world_size: int) -> None:
    assert rank_and_world() == (rank, world_size)


@pytest.mark.slow
def test_rank_and_world_on_two_ranks():
    """Each of 2 gloo ranks sees its own rank and world size 2."""
    run_distributed(_check_rank, 2)
