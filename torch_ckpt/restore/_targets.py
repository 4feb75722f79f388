"""The memory a single-process restore reads into: live tensors written in place (with an undo log), new buffers.

A restore must not change the live state unless every byte it loads has been verified. The
default is to read into new buffers and exchange them with the live tensors at the end; new
memory costs a page fault per 4 KiB page on its first write (0.07-0.3 s per GiB on the reference
VM) and doubles the restore's memory. When the caller lends *scratch* host memory that is already
resident (the checkpointer's staging arena, idle during a restore), a live tensor can instead be
read into directly:

* :func:`in_place_keys` picks the live tensors that may be (plain, contiguous CPU tensors of the
  saved dtype and shape, at least :data:`MIN_IN_PLACE_BYTES`, whose memory no other tensor of the
  state overlaps) and that fit in the scratch memory;
* an :class:`UndoLog` copies each such tensor's bytes into the scratch memory *before* the reader
  writes its first byte there (:class:`Preparer` does it on a helper thread, ahead of the reader);
* when anything fails before the restore is complete, :meth:`UndoLog.put_back` copies every saved
  tensor back, so the live state holds exactly its old bytes again; on success the copies are
  simply dropped.

:class:`Preparer` also faults in the pages of new buffers ahead of the reader
(``MADV_POPULATE_WRITE``, which never changes a page's contents), so that work overlaps the disk
wait instead of following it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torch_ckpt.restore._interrupts import Launch

__all__ = ["MIN_IN_PLACE_BYTES", "UndoLog", "Preparer", "in_place_keys"]

#: smaller tensors are read into new buffers (per-tensor bookkeeping would cost more than the faults)
MIN_IN_PLACE_BYTES = 256 << 10
#: fault in new buffers on the helper thread (``MADV_POPULATE_WRITE``)
POPULATE = True
_MADV_POPULATE_WRITE = 23
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ALIGN = 64


def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
        return None


MADVISE = _madvise()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _writable_in_place(t: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """True for a plain, contiguous CPU tensor of ``dtype`` and ``shape`` whose bytes are its values."""
    return (type(t) is torch.Tensor and _nbytes(t) >= MIN_IN_PLACE_BYTES and t.device.type == "cpu"
            and t.layout == torch.strided and t.is_contiguous()
            and t.dtype == dtype and tuple(t.shape) == tuple(shape) and not t.is_inference()
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and not t.requires_grad)


def in_place_keys(live: Mapping[str, Any], saved: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                  scratch_bytes: int) -> list[str]:
    """The keys of ``saved`` whose live tensor may be restored in place, in ``saved``'s order.

    A key qualifies when its live tensor is :func:`_writable_in_place` for the saved dtype and
    shape and its bytes overlap the reach (first to last element) of no other live tensor of
    ``live`` (tied weights, overlapping views and the like are left to new buffers); keys are
    taken in order while their bytes (each rounded up to 64) fit in ``scratch_bytes``.

    Args:
        live: ``{key: live tensor}`` of the whole state (every tensor, not just the candidates).
        saved: ``{key: (dtype, shape)}`` of the checkpoint tensors to load.
        scratch_bytes: bytes of scratch memory available for the undo log.
    """
    wanted = [k for k, (dtype, shape) in saved.items() if _writable_in_place(live.get(k), dtype, shape)]
    if not wanted:
        return []
    spans = []
    for key, t in live.items():  # the bytes each tensor can reach: from its first element to its last
        t = getattr(t, "_local_tensor", t)  # a DTensor's shard
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() and t.layout == torch.strided:
            try:
                start = t.data_ptr()
            except RuntimeError:  # no data (a tensor subclass without storage)
                continue
            last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
            spans.append((start, start + (last + 1) * t.element_size(), key))
    spans.sort()
    shared: set[str] = set()
    reach, reach_key = -1, None
    for start, end, key in spans:  # any two overlapping spans: both keys are out
        if start < reach:
            shared.update((key, reach_key))
        if end > reach:
            reach, reach_key = end, key
    out, used = [], 0
    for key in wanted:
        if key in shared:
            continue
        need = -(-_nbytes(live[key]) // _ALIGN) * _ALIGN
        if used + need > scratch_bytes:
            continue
        out.append(key)
        used += need
    return out


class UndoLog:
    """Copies of live tensors' bytes in borrowed scratch memory, so an in-place restore can be undone.

    Args:
        scratch: a flat ``torch.uint8`` CPU tensor, resident and unused for the log's lifetime.
        tensors: ``{key: live tensor}`` to be written in place (from :func:`in_place_keys`; their
            bytes, each rounded up to 64, must fit in ``scratch``).

    Raises:
        ValueError: the tensors do not fit in ``scratch``.
    """

    def __init__(self, scratch: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        self._scratch = scratch
        base, room = scratch.data_ptr(), scratch.numel()
        self._slots: dict[str, tuple[int, int, int]] = {}
        off = 0
        for key, t in tensors.items():
            n = _nbytes(t)
            if off + n > room:
                raise ValueError(f"undo log: {key!r} ({n} bytes) does not fit in {room} bytes of scratch memory")
            self._slots[key] = (t.data_ptr(), base + off, n)
            off += -(-n // _ALIGN) * _ALIGN
        self.tensors = dict(tensors)
        self._saved: set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def save(self, key: str) -> None:
        """Copy ``key``'s live bytes into its slot (before anything writes them); releases the GIL."""
        live, slot, n = self._slots[key]
        ctypes.memmove(slot, live, n)
        with self._lock:
            self._saved.add(key)

    def put_back(self, keys: Iterable[str] | None = None) -> None:
        """Copy the saved bytes of ``keys`` (default: every saved key) back into their live tensors.

        Runs to the end even when a ``KeyboardInterrupt`` arrives meanwhile (it is re-raised
        afterwards): a half-undone state would be neither the old nor the new one.
        """
        interrupted: BaseException | None = None
        while True:  # (an interrupt before the first copy must not skip the undo either)
            try:
                with self._lock:
                    todo = sorted(self._saved if keys is None else self._saved & set(keys))
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        for key in todo:
            while True:
                try:
                    live, slot, n = self._slots[key]
                    ctypes.memmove(live, slot, n)
                    with self._lock:
                        self._saved.discard(key)
                    break
                except KeyboardInterrupt as exc:  # finish the undo first
                    interrupted = exc
        if interrupted is not None:
            raise interrupted

    def forget(self, keys: Iterable[str]) -> None:
        """Stop tracking ``keys`` (after :meth:`put_back` of them: they are loaded another way)."""
        for key in keys:
            self._slots.pop(key, None)
            self.tensors.pop(key, None)

    def bump_versions(self) -> None:
        """After a successful restore: bump each in-place tensor's autograd version, as ``copy_`` would."""
        bump = getattr(torch.autograd.graph, "increment_version", None)
        for t in self.tensors.values() if bump is not None else ():
            bump(t)


class Preparer:
    """Readies one file's targets, in file order, on a helper thread ahead of the reader.

    For a target in the undo log, its live bytes are copied there first (the reader must call
    :meth:`ready` before writing it); any other target's pages are faulted in with
    ``MADV_POPULATE_WRITE`` (which never changes a page's contents, so it may race the reader;
    an error, e.g. an older kernel, just stops the faulting).

    Args:
        items: ``(target tensor, key)`` in the order the reader writes them.
        undo: the restore's undo log, or None.
    """

    def __init__(self, items: list[tuple[torch.Tensor, str]], undo: UndoLog | None) -> None:
        self._items = items
        self._undo = undo
        self._done = 0
        self._stop = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        needed = undo is not None and any(key in undo for _, key in items)
        self._launch = Launch([self._run], "torch_ckpt_restore_prepare")
        self._started = bool(items) and (needed or (POPULATE and MADVISE is not None))
        if self._started:
            try:  # interrupted: the helper either never backs anything up or is stopped and joined here
                self._launch.start()
            except BaseException:
                self.close()
                raise

    def _run(self) -> None:
        populate = POPULATE and MADVISE is not None
        try:
            for i, (t, key) in enumerate(self._items):
                if self._stop:
                    return
                if self._undo is not None and key in self._undo:
                    self._undo.save(key)
                elif populate:
                    a, n = t.data_ptr(), _nbytes(t)
                    start, end = -(-a // _PAGE) * _PAGE, (a + n) // _PAGE * _PAGE
                    if end - start >= 16 * _PAGE and MADVISE(start, end - start, _MADV_POPULATE_WRITE) != 0:
                        populate = False
                with self._cond:
                    self._done = i + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the reader in ready()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def ready(self, i: int) -> None:
        """Wait until item ``i`` is backed up (call before writing a target in the undo log)."""
        key = self._items[i][1]
        if not self._started:
            if self._undo is not None and key in self._undo:
                self._undo.save(key)
            return
        with self._cond:
            while self._done <= i and self._error is None:
                self._cond.wait()
            if self._done <= i:
                raise RuntimeError(f"restore: backing up {key!r} before writing it in place failed") from self._error

    def close(self) -> None:
        """Stop the helper and wait for it (nothing is written by it afterwards)."""
        self._stop = True
        if self._started and self._launch.working:
            self._launch.threads[0].join()
