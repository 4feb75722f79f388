"""The copy of restored values into the live tensors, without torch's intra-op threads.

A restore reads into new buffers and, once every check passed, copies them into the live tensors
(about 0.1 s per GiB on an idle machine). ``Tensor.copy_`` runs on torch's intra-op (OpenMP) threads;
when other processes keep the cores busy, each of its parallel regions waits for a descheduled
thread, and copying 1 GiB in ~600 tensors took 1-5 s on the reference machine at load 8-9,
against 0.2-0.3 s single-threaded. :func:`copy_tensors` copies plain contiguous CPU tensors with
``memmove`` (no GIL held) split over a few Python threads, which degrades gracefully under load;
every other pair goes through ``copy_``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable

import torch

__all__ = ["COPY_THREADS", "copy_tensors"]

#: threads for :func:`copy_tensors` (memory bandwidth is shared: a few are enough)
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
#: largest piece of one copy handed to a thread (bytes), so a single large tensor is split too
_PIECE_BYTES = 32 << 20
#: below this many bytes in all, one thread copies (starting threads would cost more)
_THREADED_BYTES = 16 << 20
#: plain pairs under this size are copied together by one ``torch._foreach_copy_`` call
_SMALL_BYTES = 64 << 10
_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
