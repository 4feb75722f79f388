"""Fixtures for the Accelerate adapter tests: a fresh Accelerate state per test, a clean environment."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch):
    """Each test builds its own Accelerator; Accelerate's process-wide singletons are reset afterwards."""
    from accelerate_ckpt import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
