"""The copy into live tensors (torch_ckpt.host_memory): every route gives copy_'s values and version bump."""

from __future__ import annotations

import pytest
import torch

from torch_ckpt import host_memory


def _route(monkeypatch, route: str) -> None:
    """Send plain pairs through one path of copy_tensors: one foreach call, memmove, or memmove on threads."""
    if route != "foreach":
        monkeypatch.setattr(host_memory, "_SMALL_BYTES", 0)
    if route == "threads":
        monkeypatch.setattr(host_memory, "_THREADED_BYTES", 0)
        monkeypatch.setattr(host_memory, "_PIECE_BYTES", 4096)
        monkeypatch.setattr(host_memory, "COPY_THREADS", 3)


@pytest.mark.parametrize("route", ["foreach", "memmove", "threads"])
def test_copy_tensors_gives_every_destination_its_source_values(monkeypatch, route):
    """Plain pairs (batched, whole, or split in pieces over threads) and other pairs all get src's values."""
    from torch_ckpt.host_memory import copy_tensors

    _route(monkeypatch, route)
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(5000, generator=g), torch.randn(7, 3, generator=g), torch.randn(4, 6, generator=g),
            torch.arange(100, dtype=torch.int64), torch.randn(3, generator=g)]
    dsts = [torch.zeros(5000), torch.zeros(7, 3), torch.zeros(6, 4).t(), torch.zeros(100, dtype=torch.int64),
            torch.zeros(3, dtype=torch.float64)]
    copy_tensors(list(zip(dsts, srcs)))
    for dst, src in zip(dsts, srcs):
        assert torch.equal(dst, src.to(dst.dtype))


@pytest.mark.parametrize("route", ["foreach", "memmove"])
def test_copy_tensors_bumps_the_version_counter_like_copy_(monkeypatch, route):
    """A parameter written by copy_tensors has a new autograd version, so a stale backward is refused."""
    from torch_ckpt.host_memory import copy_tensors

    _route(monkeypatch, route)
    p = torch.nn.Parameter(torch.zeros(1000))
    before = p._version
    copy_tensors([(p, torch.ones(1000))])
    assert p._version > before and torch.equal(p.detach(), torch.ones(1000))
