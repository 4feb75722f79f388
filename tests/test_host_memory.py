"""The copy into live tensors (torch_ckpt.restore._restore): every route gives copy_'s values and version bump."""

from __future__ import annotations

import pytest
import torch

from torch_ckpt.restore import _restore as host_memory


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
    from torch_ckpt.restore._restore import copy_tensors

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
    from torch_ckpt.restore._restore import copy_tensors

    _route(monkeypatch, route)
    p = torch.nn.Parameter(torch.zeros(1000))
    before = p._version
    copy_tensors([(p, torch.ones(1000))])
    assert p._version > before and torch.equal(p.detach(), torch.ones(1000))


def _swap_in(pairs, owned=None, aliases=None) -> int:
    """swap_in inside a restore_buffers block owning ``owned`` (default: every new buffer)."""
    from torch_ckpt.restore._restore import restore_buffers, swap_in

    pairs = list(pairs)
    with restore_buffers([new for _, new in pairs] if owned is None else owned):
        return swap_in(pairs, aliases)


def test_swap_in_exchanges_a_plain_tensor_keeping_the_object_and_its_attributes():
    """A plain tensor nothing else uses is exchanged: same object and __dict__, new values and storage."""
    live, new = torch.zeros(1000), torch.arange(1000.0)
    live.tag = "mine"
    ptr, version = new.data_ptr(), live._version
    assert _swap_in([(live, new)]) == 1
    assert torch.equal(live, torch.arange(1000.0)) and live.data_ptr() == ptr and live.tag == "mine"
    assert live._version > version and not hasattr(new, "tag")


def test_swap_in_keeps_a_parameters_class_requires_grad_and_grad():
    """A parameter is exchanged as itself: still an nn.Parameter with its requires_grad and .grad."""
    p = torch.nn.Parameter(torch.zeros(64))
    frozen = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    p.grad = torch.full((64,), 3.0)
    grad = p.grad
    assert _swap_in([(p, torch.ones(64)), (frozen, torch.ones(64))]) == 2
    assert type(p) is torch.nn.Parameter and p.requires_grad and p.grad is grad and p.is_leaf
    assert type(frozen) is torch.nn.Parameter and not frozen.requires_grad
    assert torch.equal(p.detach(), torch.ones(64)) and torch.equal(frozen, torch.ones(64))


def test_swap_in_copies_into_a_tensor_that_shares_its_storage():
    """A live tensor with a view or alias on its storage is copied into, so the view sees the new values."""
    base, alias_of = torch.zeros(100), torch.zeros(100)
    view, alias = base[10:20], alias_of.detach()
    assert _swap_in([(base, torch.ones(100)), (alias_of, torch.ones(100))]) == 0
    assert torch.equal(view, torch.ones(10)) and torch.equal(alias, torch.ones(100))


def test_swap_in_exchanges_a_tensor_whose_only_aliases_are_declared():
    """A parameter whose storage is shared only with the declared state_dict() entries is exchanged."""
    p = torch.nn.Parameter(torch.zeros(8))
    entry = p.detach()
    assert _swap_in([(p, torch.ones(8))], aliases={id(p): 1}) == 1
    assert torch.equal(p.detach(), torch.ones(8)) and torch.equal(entry, torch.zeros(8))


def test_swap_in_copies_from_a_buffer_the_restore_does_not_own():
    """A new tensor outside the restore's own buffers (e.g. another optimizer's state) is only read from."""
    live, theirs = torch.zeros(100), torch.ones(100)
    assert _swap_in([(live, theirs)], owned=[]) == 0
    assert torch.equal(live, torch.ones(100)) and torch.equal(theirs, torch.ones(100))


def test_swap_in_copies_into_a_parameter_an_autograd_graph_holds():
    """A parameter saved by a live graph is copied into; backward through the old graph then raises, as after copy_."""
    p = torch.nn.Parameter(torch.zeros(16))
    loss = p.pow(2).sum()  # pow saves p for the backward
    assert _swap_in([(p, torch.ones(16))]) == 0
    assert torch.equal(p.detach(), torch.ones(16))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_swap_in_copies_into_a_tensor_with_a_weak_reference():
    """A live tensor something holds a weak reference to is copied into, not exchanged."""
    import weakref

    live = torch.zeros(100)
    ref = weakref.ref(live)
    assert _swap_in([(live, torch.ones(100))]) == 0
    assert ref() is live and torch.equal(live, torch.ones(100))


def test_swap_in_exchanges_a_live_tensor_given_twice_only_once():
    """A tied live tensor (two keys, one parameter) is exchanged once and copied into for the second key."""
    p = torch.nn.Parameter(torch.zeros(32))
    first, second = torch.ones(32), torch.full((32,), 2.0)
    assert _swap_in([(p, first), (p, second)]) == 1
    assert torch.equal(p.detach(), torch.full((32,), 2.0))  # the last value wins, as with copy_


def test_swap_in_copies_into_device_tensors():
    """Only host tensors are exchanged: a tensor on another device (here meta) goes to copy_, never swapped."""
    live, new = torch.empty(8, device="meta"), torch.empty(8, device="meta")
    assert _swap_in([(live, new)]) == 0
