"""Advice for new host buffers (torch_ckpt.host_memory): never changes values, stays inside the tensor."""

from __future__ import annotations

import sys

import pytest
import torch

from torch_ckpt import host_memory
from torch_ckpt.host_memory import HUGE_PAGE_BYTES, prepare_for_write


def test_values_are_unchanged_by_the_advice():
    """A large tensor holding data keeps every value after huge-page and populate advice."""
    t = torch.arange(3 * HUGE_PAGE_BYTES // 8, dtype=torch.int64)
    prepare_for_write(t)
    assert torch.equal(t, torch.arange(3 * HUGE_PAGE_BYTES // 8, dtype=torch.int64))


def test_small_and_non_cpu_tensors_are_left_alone(monkeypatch):
    """Tensors under 2 MiB, meta tensors and non-contiguous views get no advice at all."""
    calls = []
    monkeypatch.setattr(host_memory, "_madvise", lambda *a: calls.append(a) or 0)
    big = torch.empty(2 * HUGE_PAGE_BYTES // 4)
    assert not prepare_for_write(torch.empty(1000))
    assert not prepare_for_write(torch.empty(HUGE_PAGE_BYTES, dtype=torch.uint8, device="meta"))
    assert not prepare_for_write(big.view(2, -1).t())
    assert calls == []


def test_only_whole_pages_inside_the_tensor_are_advised(monkeypatch):
    """Every advised range lies inside the tensor's bytes; huge-page advice covers only 2 MiB-aligned pages."""
    calls = []
    monkeypatch.setattr(host_memory, "_madvise", lambda start, n, advice: calls.append((start, n, advice)) or 0)
    monkeypatch.setattr(host_memory, "_refused", set())
    base = torch.empty(5 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    t = base[12345:12345 + 3 * HUGE_PAGE_BYTES + 777]
    assert prepare_for_write(t)
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
    assert {a for _, _, a in calls} == {host_memory._MADV_HUGEPAGE, host_memory._MADV_POPULATE_WRITE}
    for start, n, advice in calls:
        assert lo <= start and start + n <= hi
        if advice == host_memory._MADV_HUGEPAGE:
            assert start % HUGE_PAGE_BYTES == 0 and n % HUGE_PAGE_BYTES == 0 and n > 0


def test_advice_the_kernel_refuses_is_not_asked_for_again(monkeypatch):
    """After madvise fails for an advice, later buffers skip that call and report no advice taken."""
    calls = []
    monkeypatch.setattr(host_memory, "_madvise", lambda start, n, advice: calls.append(advice) or -1)
    monkeypatch.setattr(host_memory, "_refused", set())
    t = torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert not prepare_for_write(t)
    assert len(calls) == 2
    assert not prepare_for_write(t)
    assert len(calls) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice is Linux-only")
def test_linux_accepts_the_advice_for_a_new_buffer():
    """On Linux the kernel takes the advice for a fresh 8 MiB buffer (huge pages or populate)."""
    assert prepare_for_write(torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8))


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
