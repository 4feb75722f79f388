"""Fixtures for the Lightning adapter tests: a trainer factory and a write gate."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

import lightning as L
from lightning_helpers import WriteGate


@pytest.fixture
def make_trainer(tmp_path):
    """Return a factory of quiet CPU trainers rooted in ``tmp_path``."""

    def factory(**kwargs) -> L.Trainer:
        options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=tmp_path, max_steps=4)
        options.update(kwargs)
        return L.Trainer(**options)

    return factory


@pytest.fixture
def write_gate(monkeypatch):
    """A :class:`WriteGate` installed around ``torch_ckpt``'s persist step (released at teardown)."""
    import torch_ckpt.save._checkpointer as checkpointer

    gate = WriteGate()
    monkeypatch.setattr(checkpointer, "persist_checkpoint", gate.wrap(checkpointer.persist_checkpoint))
    yield gate
    gate.open()
