"""Fixtures of the storage/format layer tests: a small committed checkpoint and private copies of it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests._format_fixtures import STEP
from torch_ckpt import CheckpointManager, TrainState


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A committed checkpoint of a small TrainState (a (16, 16) weight, AdamW state, RNG)."""
    root = tmp_path_factory.mktemp("format")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt))
    return root / STEP


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint directory (to damage)."""
    dst = tmp_path / STEP
    shutil.copytree(saved, dst)
    return dst
