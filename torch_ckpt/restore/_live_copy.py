"""The copy of restored values into the live tensors, without torch's intra-op threads.

A restore reads into new buffers and, once every check passed, copies them into the live tensors
(about 0.1 s per GiB on an idle machine). ``Tensor.copy_`` runs on torch's intra-op (OpenMP) threads;
when other processes keep the cores busy, each of its parallel regions waits for a descheduled
thread, and copying 1 GiB in ~600 tensors took 1-5 s on the reference machine at load 8-9,
against 0.2-0.3 s single-threaded. :func:`copy_tensors` copies plain contiguous CPU tensors with
``memmove`` (no GIL held) split over a few Python threads, which degrades gracefully under load;
every other pair goes through ``copy_``.

:func:`swap_in` is the write-to-live step of a restore: where a live tensor is its storage's only
user, it exchanges the live tensor's contents with the new buffer's (``torch.utils.swap_tensors``,
O(1), the live Python object is kept) instead of copying; every other pair is copied.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch.utils import swap_tensors

__all__ = ["COPY_THREADS", "copy_tensors", "swap_in", "restore_buffers", "owners_in"]

#: threads for :func:`copy_tensors` (memory bandwidth is shared: a few are enough)
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
#: largest piece of one copy handed to a thread (bytes), so a single large tensor is split too
_PIECE_BYTES = 32 << 20
#: below this many bytes in all, one thread copies (starting threads would cost more)
_THREADED_BYTES = 16 << 20
#: plain pairs under this size are copied together by one ``torch._foreach_copy_`` call
_SMALL_BYTES = 64 << 10
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: ids of the new buffers the restore in progress owns (only those may be swapped into live tensors)
_OWNED: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("torch_ckpt_restore_buffers",
                                                                        default=frozenset())


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when ``dst.copy_(src)`` is exactly a byte copy of ``src``'s memory into ``dst``'s."""
    if type(dst) not in _PLAIN or type(src) not in _PLAIN:
        return False
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape:
        return False
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.layout != torch.strided or src.layout != torch.strided:
        return False
    if dst.is_quantized or src.is_quantized or dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg():
        return False
    nbytes = dst.numel() * dst.element_size()
    a, b = dst.data_ptr(), src.data_ptr()
    return nbytes > 0 and (a + nbytes <= b or b + nbytes <= a)  # no overlap: memmove would be right, copy_ too


def _move(pieces: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)  # a foreign call: the GIL is released while it copies


@torch.no_grad()
def copy_tensors(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair, the plain CPU ones as threaded ``memmove``.

    Pairs of contiguous CPU tensors of the same dtype and shape whose memory does not overlap are
    copied byte for byte, in pieces of at most 32 MiB spread over :data:`COPY_THREADS` threads;
    their autograd version counters are bumped as ``copy_`` would. Those under 64 KiB are copied by
    one ``torch._foreach_copy_`` call (too small for torch to start its threads; one call saves the
    per-tensor Python work when there are thousands). Any other pair (other devices, strides,
    dtypes, DTensors, subclasses) is copied with ``copy_``.

    Raises:
        RuntimeError: from ``copy_`` for a pair it cannot copy (e.g. shapes that do not broadcast).
    """
    fast: list[torch.Tensor] = []
    pieces: list[tuple[int, int, int]] = []
    small_dst: list[torch.Tensor] = []
    small_src: list[torch.Tensor] = []
    for dst, src in pairs:
        if not _plain(dst, src):
            dst.copy_(src)
            continue
        if dst.numel() * dst.element_size() < _SMALL_BYTES:  # one call for all: no per-tensor Python work
            small_dst.append(dst)
            small_src.append(src)
            continue
        fast.append(dst)
        fast.append(src)  # kept alive until every piece is copied
        a, b, n = dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()
        pieces.extend((a + i, b + i, min(_PIECE_BYTES, n - i)) for i in range(0, n, _PIECE_BYTES))
    if small_dst:
        torch._foreach_copy_(small_dst, small_src)  # below the intra-op grain size: no OpenMP region
    total = sum(n for _, _, n in pieces)
    workers = 1 if total < _THREADED_BYTES else min(COPY_THREADS, len(pieces))
    if workers <= 1:
        _move(pieces)
    else:
        shares: list[list[tuple[int, int, int]]] = [[] for _ in range(workers)]
        loads = [0] * workers
        for piece in sorted(pieces, key=lambda p: -p[2]):  # largest first, each to the least loaded thread
            i = loads.index(min(loads))
            shares[i].append(piece)
            loads[i] += piece[2]
        errors: list[BaseException] = []

        def run(share: list[tuple[int, int, int]]) -> None:
            try:
                _move(share)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the calling thread
                errors.append(exc)

        helpers = [threading.Thread(target=run, args=(share,), name="torch_ckpt_copy", daemon=True)
                   for share in shares[1:]]
        for t in helpers:
            t.start()
        run(shares[0])
        for t in helpers:
            t.join()
        if errors:
            raise errors[0]
    bump = getattr(torch.autograd.graph, "increment_version", None)
    for dst in fast[::2] if bump is not None else ():
        bump(dst)  # as copy_ would: autograd refuses a backward through the old values


@contextlib.contextmanager
def restore_buffers(buffers: Iterable[torch.Tensor]) -> Iterator[None]:
    """Within this block, :func:`swap_in` may exchange live tensors with these new buffers.

    A restore allocates its own buffers and drops them after the write to the live state; only
    those may end up holding the old values. A tensor a caller passed in (e.g. the values of
    another optimizer's ``state_dict()`` given to ``load_state_dict``) is never swapped, only
    copied from. The caller must keep ``buffers`` alive for the whole block (ids are compared).
    """
    token = _OWNED.set(_OWNED.get() | {id(t) for t in buffers})
    try:
        yield
    finally:
        _OWNED.reset(token)


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``t``'s storage, ``t`` included."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the temporary storage object


def _swappable(live: torch.Tensor, new: torch.Tensor, aliases: int) -> bool:
    """True when exchanging ``live``'s and ``new``'s contents is indistinguishable from ``live.copy_(new)``.

    Host memory only: device memory may be known by address to code that holds no reference (a
    captured CUDA graph), which would keep using the old, freed memory; device tensors are copied.
    ``new`` must be a plain tensor, one of the buffers of the enclosing :func:`restore_buffers`;
    ``live`` a plain tensor or an ``nn.Parameter`` (no other subclass, no DTensor) without hooks;
    neither a view, alike in device, dtype, shape, strides and layout, each on the whole of its
    own storage and the only tensor there but for ``aliases`` known aliases of ``live`` (a
    module's ``state_dict()`` entries), with no other C++ reference (autograd graph, hooks) and
    no weak reference.
    """
    if type(new) is not torch.Tensor or type(live) not in _PLAIN or live is new or id(new) not in _OWNED.get():
        return False
    if new.requires_grad or new.grad is not None:
        return False
    if type(live) is torch.Tensor and (live.requires_grad or live.grad is not None):
        return False
    if live._backward_hooks or getattr(live, "_post_accumulate_grad_hooks", None):
        return False
    if (live.device != new.device or live.dtype != new.dtype or live.shape != new.shape
            or live.stride() != new.stride() or live.layout != torch.strided or new.layout != torch.strided):
        return False
    for t, others in ((live, aliases), (new, 0)):
        if (t._is_view() or t.is_inference() or t.is_quantized or t.is_conj() or t.is_neg()
                or not t.is_contiguous() or t.storage_offset() != 0 or t.device.type != "cpu"):
            return False
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():  # part of a larger buffer
            return False
        if t._use_count() != 1 or _storage_users(t) != 1 + others or weakref.getweakrefs(t):
            return False
    return True


def _swap(live: torch.Tensor, new: torch.Tensor) -> None:
    """Exchange the contents of a :func:`_swappable` pair; ``live`` keeps its ``__dict__``, gradient and class."""
    grad = live.grad
    other = torch.nn.Parameter(new, requires_grad=live.requires_grad) if type(live) is not type(new) else new
    kept, theirs = live.__dict__, other.__dict__
    swap_tensors(live, other)  # raises before changing anything when it finds other references
    live.__dict__, other.__dict__ = kept, theirs
    if grad is not None:
        live.grad = grad  # the gradient belongs to the parameter, not to its values


@torch.no_grad()
def swap_in(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], aliases: Mapping[int, int] | None = None) -> int:
    """Give each live tensor its new buffer's values: exchanged where possible, else copied.

    For a ``(live, new)`` pair that :func:`_swappable` accepts (``new`` is a buffer of the enclosing
    :func:`restore_buffers` block that appears once in ``pairs``, ``live`` a plain tensor or
    parameter nothing else refers to), ``torch.utils.swap_tensors`` exchanges the two tensors'
    contents in O(1): ``live`` stays the same Python object (class, ``__dict__``,
    ``requires_grad`` and ``.grad`` kept) and now holds the new values and storage, while ``new``
    holds the old ones (or shares the new storage with ``live``, for a parameter), so the caller
    must not use ``new`` afterwards. ``live``'s autograd version is bumped as ``copy_`` would. A
    live tensor that appears again (tied entries) is copied into, not swapped twice. Every other
    pair, and any pair ``swap_tensors`` refuses, goes to :func:`copy_tensors`. Checks come before
    any swap, so a refused pair changes nothing.

    Args:
        pairs: ``(live, new)`` tensors.
        aliases: ``id(live) -> n`` for a live tensor known to share its storage with ``n`` other
            tensors the caller drops (a module's ``state_dict()`` entries for its parameters).

    Returns:
        The number of pairs exchanged (the others were copied).

    Raises:
        RuntimeError: from ``copy_`` for a pair it cannot copy (e.g. shapes that do not broadcast).
    """
    pairs = list(pairs)
    aliases = aliases or {}
    uses: dict[int, int] = {}
    for _, new in pairs:
        uses[id(new)] = uses.get(id(new), 0) + 1
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    swapped = 0
    bump = getattr(torch.autograd.graph, "increment_version", None)
    for live, new in pairs:
        first = id(live) not in seen
        seen.add(id(live))
        if not (first and uses[id(new)] == 1 and _swappable(live, new, aliases.get(id(live), 0))):
            copies.append((live, new))
            continue
        try:
            _swap(live, new)
        except RuntimeError:  # refused before changing anything (references found): copy instead
            copies.append((live, new))
            continue
        if bump is not None:
            bump(live)  # as copy_ would: a newer version than any the old values had
        swapped += 1
    copy_tensors(copies)
    return swapped


def owners_in(module: torch.nn.Module,
              live: Mapping[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """The parameter or buffer of ``module`` behind each ``state_dict()`` entry of ``live``, and its alias count.

    Returns ``id(entry) -> tensor`` for entries that are the whole of exactly one of the module's
    parameters/buffers (same storage start, dtype, shape and strides), and ``id(tensor) -> n``, the
    number of distinct entries of ``live`` (other than the tensor itself) on that storage, for
    :func:`swap_in`'s ``aliases``. DTensors and other subclasses are left out (copied).
    """
    by_ptr: dict[int, list[torch.Tensor]] = {}
    for _, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if type(t) in _PLAIN and t.numel():
            same = by_ptr.setdefault(t.data_ptr(), [])
            if all(x is not t for x in same):
                same.append(t)
    owner: dict[int, torch.Tensor] = {}
    entries: dict[int, dict[int, torch.Tensor]] = {}
    for dst in live.values():
        found = by_ptr.get(dst.data_ptr()) if type(dst) in (torch.Tensor, torch.nn.Parameter) and dst.numel() else None
        if found is None or len(found) != 1:
            continue
        o = found[0]
        if (o.device, o.dtype, o.shape, o.stride(), o.storage_offset()) == (
                dst.device, dst.dtype, dst.shape, dst.stride(), dst.storage_offset()):
            owner[id(dst)] = o
            if dst is not o:
                entries.setdefault(id(o), {})[id(dst)] = dst
    return owner, {k: len(v) for k, v in entries.items()}
