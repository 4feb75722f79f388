"""Shared fixtures: small models, a TrainState factory and deterministic inputs."""

from __future__ import annotations

import threading

import pytest
import torch


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``cuda`` on machines without a CUDA device (never delete them)."""
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TinyNet(torch.nn.Module):
    """Two linear layers with a BatchNorm buffer and dropout."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(width, 2)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def train_steps(model, opt, sched, n: int) -> None:
    """Run ``n`` deterministic-by-RNG optimizer steps."""
    for _ in range(n):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


@pytest.fixture
def make_state():
    """Return a factory building (TrainState, model, optimizer, scheduler) with a given seed."""
    from torch_ckpt import TrainState

    def factory(seed: int = 0, width: int = 16, **kwargs):
        torch.manual_seed(seed)
        model = TinyNet(width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        state = TrainState(model=model, optimizer=opt, scheduler=sched, **kwargs)
        return state, model, opt, sched

    return factory


@pytest.fixture
def disk_full_once(monkeypatch):
    """The first manifest/JSON write of a save fails with ENOSPC (errno 28); later writes work."""
    import torch_ckpt.save._persist as persist_mod

    real, calls = persist_mod.write_json_durable, {"n": 0}

    def full_once(path, obj):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(persist_mod, "write_json_durable", full_once)
    return calls


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 for the module's tests (tests/_s3.py); skips without s3fs/moto."""
    pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    from tests._s3 import S3

    server = S3()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def held_writes(monkeypatch):
    """Background writes wait until ``.set()`` (set again at teardown)."""
    from torch_ckpt.save import _checkpointer as checkpointer
    gate = threading.Event()
    persist = checkpointer.persist_checkpoint

    def gated(req, ctx):
        assert gate.wait(30), "held write was never released"
        return persist(req, ctx)

    monkeypatch.setattr(checkpointer, "persist_checkpoint", gated)
    yield gate
    gate.set()
