"""Host memory work of a restore: cheaper first writes into new buffers, the copy into live tensors.

**New buffers** (Linux, best effort). A restore reads a checkpoint into buffers allocated for it.
Each 4 KiB page of such a buffer is faulted in by the kernel the first time the read writes it, one
fault at a time, which cost about 0.25-0.5 s per GiB on the reference machine, on top of the disk
read. :func:`prepare_for_write` asks the kernel to back the buffer with transparent huge pages
(``MADV_HUGEPAGE``, 2 MiB: 512 times fewer faults) and to fault it in with one call
(``MADV_POPULATE_WRITE``, Linux 5.14+). Both are hints about memory the caller is about to
overwrite: the bytes of the buffer never change, and where the kernel or platform lacks them
nothing happens.

**The copy into the live tensors.** ``Tensor.copy_`` runs on torch's intra-op (OpenMP) threads;
when other processes keep the cores busy, each of its parallel regions waits for a descheduled
thread, and copying 1 GiB in ~600 tensors took 1-5 s on the reference machine at load 8-9,
against 0.2-0.3 s single-threaded. :func:`copy_tensors` copies plain contiguous CPU tensors with
``memmove`` (no GIL held) split over a few Python threads, which degrades gracefully under load and
is as fast as ``copy_`` on an idle machine; every other pair goes through ``copy_``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable

import torch

__all__ = ["HUGE_PAGE_BYTES", "copy_tensors", "prepare_for_write"]

HUGE_PAGE_BYTES = 2 << 20
"""Size of a transparent huge page on x86-64 and most arm64 kernels (bytes); smaller buffers are left alone."""

_PAGE = mmap.PAGESIZE
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
#: Linux's value (5.14+); Python's mmap module does not name it before 3.13
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()
#: advice the kernel refused once (EINVAL on kernels that lack it) is not asked for again
_refused: set[int] = set()


def _advise(start: int, end: int, advice: int | None) -> bool:
    """``madvise(start, end - start, advice)``; False when unavailable or refused."""
    if _madvise is None or advice is None or advice in _refused or end <= start:
        return False
    if _madvise(start, end - start, advice) != 0:  # ctypes releases the GIL for the call
        _refused.add(advice)
        return False
    return True


def prepare_for_write(tensor: torch.Tensor, *, huge: bool = True, populate: bool = True) -> bool:
    """Hint that the new CPU buffer of ``tensor`` is about to be written in full.

    Only whole pages inside the tensor's bytes are advised (huge pages only for the 2 MiB-aligned
    part), so memory around it is not affected. Values are never changed.

    Args:
        tensor: a contiguous CPU tensor, normally just allocated (``torch.empty``).
        huge: ask for transparent huge pages (``MADV_HUGEPAGE``).
        populate: fault every page in now, in one call (``MADV_POPULATE_WRITE``).

    Returns:
        True when the kernel accepted at least one hint; False for small tensors, other devices,
        platforms without ``madvise``, or kernels that refuse it.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < HUGE_PAGE_BYTES:
        return False
    addr = tensor.data_ptr()
    done = False
    if huge:
        done |= _advise(-(-addr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES,
                        (addr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, _MADV_HUGEPAGE)
    if populate:
        done |= _advise(-(-addr // _PAGE) * _PAGE, (addr + nbytes) // _PAGE * _PAGE, _MADV_POPULATE_WRITE)
    return done


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
