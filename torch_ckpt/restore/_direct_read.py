"""Single-pass restore: read each data file once, checksum it while reading, place tensors directly.

DCP's own reader costs two reads per byte when the checksums are verified first, plus a copy out
of each record. For plain, contiguous CPU targets on a single process, :func:`load_direct` reads
every ``.distcp`` file front to back exactly once:

* the bytes of each tensor's data go straight into its target tensor (``readinto`` its memory);
* the record framing around them (the ``torch.save`` zip headers) is read into a small buffer and
  compared byte for byte with the framing ``torch.save`` produces for a tensor of the target's
  dtype, shape and strides; only an exact match places the data (the record then is exactly what
  ``torch.load`` would decode into those bytes), anything else is left to DCP's reader;
* a second thread computes the file's CRC-32 over every byte, in file order, while the next bytes
  are read (both release the GIL); size and CRC-32 are compared with the manifest at the end.

Up to two data files (DCP writes two per rank) are read at the same time, each by its own thread,
so one file's disk wait overlaps the other's copying. Every file's size is checked first.

The targets are new buffers (see :func:`torch_ckpt.restore._restore.load_into`), or live tensors backed up
first by an :class:`~torch_ckpt.restore._targets.UndoLog`, so a file that fails its check leaves the
live state as it was. A helper thread per file (:class:`~torch_ckpt.restore._targets.Preparer`)
makes the backups and faults in new buffers ahead of the reader.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.format._dcp_write import record_framing
from torch_ckpt.format._files import open_listed
from torch_ckpt.restore._interrupts import Stopped, run_all
from torch_ckpt.restore._targets import Preparer, UndoLog
from torch_ckpt.storage._crc import crc32

__all__ = ["DATA_SUFFIX", "load_direct"]

DATA_SUFFIX = ".distcp"
#: bytes per ``readinto`` call and per CRC-32 work item
_CHUNK_BYTES = 8 << 20
#: read-ahead buffer for small pieces; pieces at least this large are read straight into place
_BUFFER_BYTES = 1 << 20
#: chunks read ahead of the CRC-32 thread (bounds the transient memory for skipped regions)
_QUEUE_DEPTH = 8
#: data files read at the same time (one thread each)
_READERS = 2
def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of the contiguous CPU tensor ``t`` (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                   (t.numel() * t.element_size(),))
    return memoryview(flat.numpy())


def _placeable(key: str, target: Any, md: Metadata) -> bool:
    """True when ``target`` can receive checkpoint tensor ``key`` straight from its record."""
    if type(target) is not torch.Tensor or target.device.type != "cpu" or not target.is_contiguous():
        return False
    if target.is_quantized or target.is_conj() or target.is_neg() or target.numel() == 0:
        return False
    smd = md.state_dict_metadata.get(key)
    if not isinstance(smd, TensorStorageMetadata) or len(smd.chunks) != 1:
        return False
    chunk = smd.chunks[0]
    return (tuple(smd.size) == tuple(target.shape) and tuple(chunk.sizes) == tuple(target.shape)
            and not any(chunk.offsets) and smd.properties.dtype == target.dtype)


class _Crc:
    """CRC-32 and byte count of one file, computed by a helper thread over views queued in file order."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.crc = 0
        self.nbytes = 0
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._thread = threading.Thread(target=self._run, name="torch_ckpt_restore_crc", daemon=True)
        if enabled:
            self._thread.start()

    def _run(self) -> None:
        while (view := self._q.get()) is not None:
            try:
                self.crc = crc32(view, self.crc)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the reading thread in finish()
                self.error = exc

    def add(self, view: Any) -> None:
        self.nbytes += memoryview(view).nbytes
        if self.enabled:
            self._q.put(view)

    def finish(self) -> int:
        if self.enabled:
            self._q.put(None)
            self._thread.join()
            if self.error is not None:
                raise self.error
        return self.crc

    def abandon(self) -> None:
        if self.enabled and self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


class _FileReader:
    """Sequential reads of one open data file, every byte handed to a :class:`_Crc` once, in order.

    Large pieces (a tensor's data) are read straight into their destination; small ones (record
    framing, small tensors) are served from a 1 MiB read-ahead buffer, so a file of many small
    records costs a few large reads rather than three system calls per record.
    """

    def __init__(self, fd: int, path: Path, crc: _Crc, stop: threading.Event | None = None) -> None:
        self._f = os.fdopen(fd, "rb", buffering=0)
        self._stop = stop
        self.path = path
        self.crc = crc
        self.pos = 0  # bytes consumed by the caller
        self._buf = memoryview(b"")
        self._off = 0

    def _truncated(self, at: int) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: ends at byte {at}, before the data DCP's metadata places "
                                      "there (truncated?)")

    def _fill(self) -> None:
        """Read the next buffer's worth (a new buffer: the CRC-32 thread may still hold the last one)."""
        buf = bytearray(_BUFFER_BYTES)
        n = self._f.readinto(buf)
        if not n:
            raise self._truncated(self.pos)
        self._buf, self._off = memoryview(buf)[:n], 0
        self.crc.add(self._buf)

    def into(self, view: memoryview) -> None:
        """Fill ``view`` from the current position (raises on a file shorter than that)."""
        done, n = 0, view.nbytes
        while done < n:
            if self._stop is not None and self._stop.is_set():
                raise Stopped()
            avail = self._buf.nbytes - self._off
            if avail:
                k = min(avail, n - done)
                view[done:done + k] = self._buf[self._off:self._off + k]
                self._off += k
                done += k
            elif n - done >= _BUFFER_BYTES:
                k = min(_CHUNK_BYTES, n - done)
                part = view[done:done + k]
                got = 0
                while got < k:
                    r = self._f.readinto(part[got:])
                    if not r:
                        raise self._truncated(self.pos + done + got)
                    got += r
                self.crc.add(part)
                done += k
            else:
                self._fill()
        self.pos += n

    def bytes(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        if self._buf.nbytes - self._off >= n:  # the common case: framing inside the read-ahead buffer
            out = self._buf[self._off:self._off + n].tobytes()
            self._off += n
            self.pos += n
            return out
        buf = bytearray(n)
        self.into(memoryview(buf))
        return bytes(buf)

    def skip(self, n: int) -> None:
        """Read (and checksum) the next ``n`` bytes without keeping them."""
        while n > 0:
            k = min(_CHUNK_BYTES, n)
            self.into(memoryview(bytearray(k)))
            n -= k

    def rest(self) -> None:
        """Read to the end of the file."""
        self.pos += self._buf.nbytes - self._off
        self._off = self._buf.nbytes
        while chunk := self._f.read(_CHUNK_BYTES):
            if self._stop is not None and self._stop.is_set():
                raise Stopped()
            self.crc.add(chunk)
            self.pos += len(chunk)

    def close(self) -> None:
        self._f.close()


def load_direct(targets: dict[str, torch.Tensor], step_dir: str | os.PathLike, md: Metadata, manifest: Any, *,
                verify: bool, allow_symlinks: bool = False, undo: UndoLog | None = None) -> set[str]:
    """Read the data files of a single-rank checkpoint once, placing tensors and checking CRC-32s.

    Every ``.distcp`` file the manifest lists is read front to back (with ``verify``; without it,
    only files holding a placeable tensor), up to two files at a time. Every file's size is compared
    with the manifest before the first byte is placed; with ``verify``, so is its CRC-32 after the
    read. A tensor is placed only when its record's framing equals, byte for byte, what
    ``torch.save`` writes for its dtype and shape; when several files fail, the error of the first
    one (in name order) is raised.

    Args:
        targets: ``{key: tensor}`` to fill: new buffers (a failure leaves them half written) or,
            for the keys in ``undo``, live tensors, each backed up there before its first byte is
            written (the caller puts them back with :meth:`UndoLog.put_back` on failure).
        step_dir: the committed checkpoint directory.
        md: its validated DCP metadata.
        manifest: its manifest (``files``: ``{name: {"bytes", "crc32"}}``).
        verify: check the CRC-32 of every data file.
        allow_symlinks: follow symlinks when opening the files.
        undo: the undo log of the targets that are live tensors, or None.

    Returns:
        The keys of ``targets`` not placed here (another layout, dtype or framing); load them with
        DCP's reader (:func:`torch_ckpt.format._dcp_read.load_tensors`) after checking their records.

    Raises:
        CheckpointCorruptError: a data file is missing, not a regular file, truncated, or has the
            wrong size or CRC-32; the message names it.
    """
    step_dir = Path(step_dir)
    by_file: dict[str, list[tuple[int, int, str | None]]] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if name not in manifest.files:
            continue  # DCP's reader refuses it with a clear error
        key = index.fqn if index.fqn in targets and not getattr(info, "transform_descriptors", None) else None
        by_file.setdefault(name, []).append((int(info.offset), int(info.length), key))
    seen: dict[str, int] = {}
    for entries in by_file.values():
        for _, _, key in entries:
            if key is not None:
                seen[key] = seen.get(key, 0) + 1
    placeable = {k for k, n in seen.items() if n == 1 and _placeable(k, targets[k], md)}
    names = sorted(n for n in manifest.files if n.endswith(DATA_SUFFIX))
    jobs = [(name, sorted(by_file.get(name, []))) for name in names]
    jobs = [(name, entries) for name, entries in jobs if verify or any(k in placeable for _, _, k in entries)]

    opened: list[tuple[str, list[tuple[int, int, str | None]], int, int]] = []
    try:  # every file's size is checked before the first byte is placed
        for name, entries in jobs:
            fd, size = _open_checked(step_dir, name, manifest, allow_symlinks=allow_symlinks)
            opened.append((name, entries, fd, size))
    except BaseException:
        for _, _, fd, _ in opened:
            os.close(fd)
        raise

    stop = threading.Event()

    def read(job: tuple[str, list[tuple[int, int, str | None]], int, int]) -> set[str]:
        name, entries, fd, size = job
        return _read_file(fd, size, step_dir / name, manifest.files[name], entries, targets, placeable, verify=verify,
                          undo=undo, stop=stop)

    placed: set[str] = set()
    if len(opened) <= 1 or _READERS <= 1:
        pending = list(opened)
        try:
            while pending:
                placed |= read(pending.pop(0))  # closes that file
        except BaseException:
            for _, _, fd, _ in pending:
                os.close(fd)
            raise
    else:
        for result in run_all(read, opened, stop, min(_READERS, len(opened)), abandon=lambda job: os.close(job[2]),
                              name="torch_ckpt_restore"):
            if isinstance(result, BaseException):  # the first error, in file order
                raise result
            placed |= result
    return set(targets) - placed


def _open_checked(step_dir: Path, name: str, manifest: Any, *, allow_symlinks: bool) -> tuple[int, int]:
    """Open the listed data file ``name`` and check its size against the manifest; returns ``(fd, size)``."""
    path = step_dir / name
    expected = manifest.files[name]["bytes"]
    fd = open_listed(step_dir, manifest, name, allow_symlinks=allow_symlinks)
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise CheckpointCorruptError(f"{path}: size {size} bytes, manifest says {expected} (truncated?)")
        _advise(fd)
    except OSError as exc:
        os.close(fd)
        raise CheckpointCorruptError(f"{path}: data file cannot be read ({exc.strerror or exc})") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _advise(fd: int) -> None:
    """Read-ahead hints for a data file; a refused hint (a security policy, an odd file system) is ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:  # (POSIX_FADV_WILLNEED on the whole file was measured slower: benchmarks/README.md, session 5)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except OSError:
        pass  # only a hint: the reads that follow report any real error


def _read_file(fd: int, size: int, path: Path, expected: dict[str, int], entries: list[tuple[int, int, str | None]],
               targets: dict[str, torch.Tensor], placeable: set[str], *, verify: bool, undo: UndoLog | None,
               stop: threading.Event) -> set[str]:
    """Read one opened data file (see :func:`load_direct`) and close it; returns the keys placed from it."""
    placed: set[str] = set()
    items = [(targets[k], k) for _, _, k in entries if k in placeable]
    order = {k: i for i, (_, k) in enumerate(items)}
    crc = reader = preparer = None
    try:  # (an interrupt while a helper thread starts still closes the file and stops the helpers)
        crc = _Crc(verify)
        reader = _FileReader(fd, path, crc, stop)
        preparer = Preparer(items, undo)  # backs up in-place targets and faults in new ones, ahead of the reader
        for offset, length, key in entries:
            if key not in placeable or offset < reader.pos or offset + length > size:
                continue  # bytes read (and checksummed) as part of the gaps
            target = targets[key]
            framing = record_framing(target)
            if framing is None:
                continue
            head, tail = framing
            nbytes = target.numel() * target.element_size()
            if len(head) + nbytes + len(tail) != length:
                continue
            reader.skip(offset - reader.pos)
            if reader.bytes(len(head)) != head:
                reader.skip(nbytes + len(tail))
                continue
            if undo is not None and key in undo:
                preparer.ready(order[key])  # its live bytes are in the undo log
            reader.into(_byte_view(target))
            if reader.bytes(len(tail)) == tail:
                placed.add(key)
        if verify:
            reader.rest()
        got = crc.finish()
        if verify and crc.nbytes != expected["bytes"]:
            raise CheckpointCorruptError(f"{path}: read {crc.nbytes} bytes, manifest says {expected['bytes']} "
                                         "(the file changed while it was read?)")
        if verify and got != expected["crc32"]:
            raise CheckpointCorruptError(f"{path}: CRC-32 {got:#010x} does not match the manifest "
                                         f"({expected['crc32']:#010x}); the file is corrupt")
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: data file cannot be read ({exc.strerror or exc})") from exc
    finally:
        if preparer is not None:
            preparer.close()
        if crc is not None:
            crc.abandon()
        if reader is not None:
            reader.close()
        else:
            os.close(fd)
    return placed
