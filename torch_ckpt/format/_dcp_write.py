"""Writing a DCP checkpoint: :class:`ChecksumFileSystemWriter`, its tensor records, write-behind and the plan.

DCP's format (one ``.distcp`` file per writer thread and rank of ``torch.save`` records at recorded
offsets, plus ``.metadata``), written straight from host memory with large GIL-free ``write`` calls,
CRC-32 and size computed while writing, fsynced, size checked on disk; an error in any writer thread
fails the write (DCP's own ``FileSystemWriter`` loses those). The read side is :mod:`._files`.

:class:`WriteBehind` keeps at most ``(LAG_WINDOWS + 1) * WINDOW_BYTES`` dirty, so the final ``fsync``
(still the durability barrier) finds little left (reference VM, 1 GiB: write + fsync 0.43 s, 0.32 s
with it). ``dcp.save`` spends ~17 us per *top-level* key holding the GIL: :func:`group_by_first_segment`
nests the state by first key segment and :class:`FlatKeysSavePlanner` keeps ``.metadata`` unchanged.

Incremental saves: data files whose records are unchanged since the last save are hard-linked, not rewritten.

Every tensor record a rank writes is remembered per root and file prefix (:class:`Baseline`: file, offset,
length, the tensor's signature and the CRC-32 of its bytes, computed by the writer from the staged host
copy, never trusting a flag or version counter). At the next save a tensor whose signature and digest
equal its record's is not written: the record's data file is hard-linked into the new checkpoint's
partial directory and the tensor's DCP entry points at the record in it, provided the file is the very
file remembered (same device, inode, size; listed with that size and CRC-32 by the checkpoint's
committed manifest) and at least half of its bytes are still referenced (so a checkpoint never keeps
more than about twice its own bytes alive). A link that fails (``EXDEV``, ``EPERM``, no hard links)
means the tensors are written as usual.

Each checkpoint stays self-contained: every file it references is a link in its own directory, so
retention only deletes directories and the bytes live while any link does; a kill between link and
commit leaves only an uncommitted partial (removed as usual) and the previous checkpoint untouched.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import io
import math
import os
import pickle
import re
import shutil
import stat as stat_mod
import struct
import sys
import threading
import zipfile
import zlib
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import quiet_single_process_warning
from torch_ckpt.errors import CheckpointError, CheckpointWriteError
from torch_ckpt.format._files import (
    MAX_RANK_JSON_BYTES,
    parse_rank_doc,
    rank_file_name,
    read_listed,
    read_manifest,
    read_metadata,
)
from torch_ckpt.storage._crc import crc32, file_crc32

log = get_logger(__name__)

quiet_single_process_warning()  # dcp.save runs with this writer and no_dist=True when there is no process group

__all__ = ["ChecksumFileSystemWriter", "serialize_tensor", "record_framing", "WriteBehind", "WINDOW_BYTES",
           "LAG_WINDOWS", "group_by_first_segment", "FlatKeysSavePlanner",
           "Record", "Baseline", "remember", "baseline_for", "baseline_on_disk", "link_file", "LINK_MIN_SHARE",
           "forget_all"]


# -- write-behind ----------------------------------------------------------------------------

#: bytes handed to the disk per ``sync_file_range`` call
WINDOW_BYTES = 64 << 20
#: windows the writer may run ahead of the oldest window not yet on disk
LAG_WINDOWS = 2

_WRITE = 2  # SYNC_FILE_RANGE_WRITE
_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER
#: errno values meaning "not available here": write-behind turns itself off for the file (EPERM and
#: EACCES are not errors of the call itself: a seccomp filter or security module refuses it)
_UNSUPPORTED = {errno_mod.ENOSYS, errno_mod.EINVAL, errno_mod.ESPIPE, errno_mod.EOPNOTSUPP, errno_mod.ENOTSUP,
                errno_mod.EPERM, errno_mod.EACCES}
#: errno values meaning "not now": the window is retried with the next one (the data is still
#: written, and the final ``fsync`` still makes it durable)
_TRANSIENT = {errno_mod.EINTR, errno_mod.ENOMEM, errno_mod.EAGAIN}


def _load() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - not glibc/Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load()


class WriteBehind:
    """Write-behind of a file written front to back through ``fd``: each :data:`WINDOW_BYTES` window is
    handed to the disk when written (``sync_file_range(WRITE)``) and, :data:`LAG_WINDOWS` later, waited
    for and dropped from the page cache. Off where the call is missing or refused (seccomp ``EPERM``).

    :meth:`advance` raises ``OSError`` (errno, path) for a kernel write error the final ``fsync`` would
    otherwise report.
    """

    def __init__(self, fd: int, path: str | os.PathLike, *, enabled: bool = True) -> None:
        self._fd = fd
        self._path = str(path)
        self.enabled = bool(enabled and _SYNC_FILE_RANGE is not None and WINDOW_BYTES > 0)
        self._started = 0  # bytes handed to the disk
        self._settled = 0  # bytes on disk and dropped from the page cache

    def advance(self, written: int) -> None:
        """Note that the first ``written`` bytes of the file have been written (call after each write)."""
        if not self.enabled or written - self._started < WINDOW_BYTES:
            return
        if not self._sync(self._started, written - self._started, _WRITE):
            return
        self._started = written
        oldest = written - LAG_WINDOWS * WINDOW_BYTES
        if oldest - self._settled >= WINDOW_BYTES and self._sync(self._settled, oldest - self._settled, _WAIT):
            if hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(self._fd, self._settled, oldest - self._settled, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass  # only a hint (the pages are on disk already): never fails the write
            self._settled = oldest

    def _sync(self, offset: int, nbytes: int, flags: int) -> bool:
        """One ``sync_file_range`` call (GIL released); False when unsupported (then disabled)."""
        if _SYNC_FILE_RANGE(self._fd, offset, nbytes, flags) == 0:
            return True
        err = ctypes.get_errno()
        if err in _UNSUPPORTED:
            self.enabled = False
            return False
        if err in _TRANSIENT:
            return False  # retried with a larger range at the next window
        raise OSError(err, os.strerror(err), self._path)


# -- tensor records --------------------------------------------------------------------------
#
# A record is a zip archive that ``torch.load`` reads: the ``data.pkl`` that ``torch.serialization._save``
# pickles for the tensor, its ``byteorder``, the storage's bytes (``data/0``) and the archive ``version``,
# stored uncompressed with no alignment padding (~610 bytes around the data; ``torch.save`` writes ~1.5 kB,
# which is 8% of a LoRA adapter's checkpoint). The entries ``torch.save`` adds for ``mmap`` loading and
# its own bookkeeping (``.format_version``, ``.storage_alignment``, ``.data/serialization_id``) mean
# nothing to one byte range read by DCP. The data entry's CRC-32 is left 0 (``torch.load`` does not check
# it; the manifest's file CRC-32 covers every byte). Data of 4 GiB or more (which would need ZIP64 fields)
# and tensors this torch cannot pickle so are written by torch's own zip writer.

_ZIP32_DATA_MAX = 0xFFFF0000  # data bytes below which a record's zip fields all fit 32 bits
_ZIP_DATE = 0x21  # 1980-01-01, the zip epoch: records do not depend on the clock


class _Entries:
    """Stands in for torch's zip writer: keeps the entries ``torch.serialization._save`` hands it."""

    def __init__(self) -> None:
        self.entries: dict[str, Any] = {}

    def write_record(self, name: str, data: Any, size: int) -> None:
        self.entries[name] = data


def _compact_framing(tensor: torch.Tensor, version: bytes) -> tuple[bytes, bytes] | None:
    """``(bytes before the data, bytes after it)`` of ``tensor``'s compact record (None: use torch's writer)."""
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes >= _ZIP32_DATA_MAX:
        return None
    recorder = _Entries()
    torch.serialization._save(tensor, recorder, pickle, torch.serialization.DEFAULT_PROTOCOL, True)
    pkl, storages = recorder.entries.get("data.pkl"), [n for n in recorder.entries if n.startswith("data/")]
    if not isinstance(pkl, bytes) or len(storages) != 1:
        return None
    entries = [("data.pkl", pkl, zlib.crc32(pkl)), ("byteorder", sys.byteorder.encode(), None),
               (storages[0], None, 0), ("version", version, None)]
    out, central, offset, head = bytearray(), bytearray(), 0, b""
    for name, data, crc in entries:
        raw = f"archive/{name}".encode()
        size = nbytes if data is None else len(data)
        crc = zlib.crc32(data or b"") if crc is None else crc
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, _ZIP_DATE, crc, size, size, len(raw), 0) + raw
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, _ZIP_DATE, crc, size, size,
                               len(raw), 0, 0, 0, 0, 0, offset) + raw
        if data is None:
            head, out = bytes(out), bytearray()
            offset = len(head) + nbytes
        else:
            out += data
            offset += 30 + len(raw) + size
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central),
                                 offset, 0)
    return head, bytes(out)


def _probe_records() -> tuple[bytes | None, bool]:
    """``(zip version entry for compact records, torch's writer can skip its CRC-32)`` on this torch."""
    def loads(record: bytes, tensor: torch.Tensor) -> bool:
        return bool(torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor))

    probe = torch.arange(3.0)
    version: bytes | None = None
    try:
        with zipfile.ZipFile(_saved(probe)) as archive:
            version = archive.read(next(n for n in archive.namelist() if n.endswith("/version")))
        framing = _compact_framing(probe, version)
        if framing is None or not loads(framing[0] + probe.numpy().tobytes() + framing[1], probe):
            version = None
    except Exception:  # noqa: BLE001 - any incompatibility: torch's own writer
        version = None
    try:
        buf = io.BytesIO()
        zf = torch._C.PyTorchFileWriter(buf, False, torch.serialization._get_storage_alignment())
        torch.serialization._save(probe, zf, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
        return version, loads(buf.getvalue(), probe)
    except Exception:  # noqa: BLE001 - any incompatibility: plain torch.save
        return version, False


def _saved(tensor: torch.Tensor) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    buf.seek(0)
    return buf


_ZIP_VERSION, _SAVE_WITHOUT_ZIP_CRC = _probe_records()


class _Capture:
    """File-like target of ``torch.save`` that only collects the pieces it is given.

    The tensor's data arrives as a view of its own storage and is kept by reference (no copy);
    every other piece (zip headers, pickle, padding) is small and copied, because its memory
    belongs to the serializer. Nothing here can fail, so no I/O error ever crosses torch's C++
    zip writer (which aborts the process when its destructor meets one).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._ptr = tensor.untyped_storage().data_ptr()
        self._nbytes = tensor.untyped_storage().nbytes()
        self.pieces: list[Any] = []

    def write(self, b) -> int:
        view = memoryview(b)
        n = view.nbytes
        if n and n == self._nbytes and np.frombuffer(view, dtype=np.uint8).ctypes.data == self._ptr:
            self.pieces.append(view)
        else:
            self.pieces.append(bytes(view))
        return n

    def flush(self) -> None:
        pass


#: ``{tensor signature: (bytes before the data, bytes after it)}`` of records; see serialize_tensor
_RECORD_CACHE: dict[tuple, tuple[bytes, bytes]] = {}
_RECORD_CACHE_MAX = 4096


def _record_key(tensor: torch.Tensor) -> tuple | None:
    """What a record's non-data bytes depend on (None: do not cache this tensor)."""
    if type(tensor) is not torch.Tensor or tensor.is_quantized or not (_ZIP_VERSION or _SAVE_WITHOUT_ZIP_CRC):
        return None
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
            tensor.untyped_storage().nbytes(), tensor.is_conj(), tensor.is_neg(), tensor.requires_grad)


def _cache(key: tuple, framing: tuple[bytes, bytes]) -> None:
    if len(_RECORD_CACHE) >= _RECORD_CACHE_MAX:
        _RECORD_CACHE.clear()
    _RECORD_CACHE[key] = framing


def serialize_tensor(tensor: torch.Tensor) -> list[Any]:
    """``tensor`` as one record that DCP's reader ``torch.load``\\ s, as a list of pieces (data by reference).

    The record is compact (see above) where this torch allows it, else written by torch's zip writer
    with its per-record CRC-32 skipped (computed holding the GIL, ~3 GB/s), else by ``torch.save``. The
    bytes around the data depend only on the tensor's signature and are cached per signature (~150 us
    -> a few us per tensor).
    """
    key = _record_key(tensor)
    cached = _RECORD_CACHE.get(key) if key is not None else None
    if cached is None and key is not None and _ZIP_VERSION is not None:
        cached = _compact_framing(tensor, _ZIP_VERSION)
        if cached is not None:
            _cache(key, cached)
    if cached is not None:
        return [cached[0], _data_view(tensor), cached[1]]
    capture = _Capture(tensor)
    if _SAVE_WITHOUT_ZIP_CRC:
        zf = torch._C.PyTorchFileWriter(cast(IO[bytes], capture), False, torch.serialization._get_storage_alignment())
        torch.serialization._save(tensor, zf, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
    else:
        torch.save(tensor, cast(IO[bytes], capture))
    pieces = capture.pieces
    data_at = [i for i, p in enumerate(pieces) if isinstance(p, memoryview)]
    if key is not None and len(data_at) == 1:
        i = data_at[0]
        _cache(key, (b"".join(pieces[:i]), b"".join(pieces[i + 1:])))
    return pieces


def record_framing(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes this writer puts before and after ``tensor``'s data in its record (None: no fixed framing).

    A reader whose record has exactly this framing can read the data straight into such a tensor.
    """
    key = _record_key(tensor)
    if key is None:
        return None
    if key not in _RECORD_CACHE:
        serialize_tensor(tensor)
    return _RECORD_CACHE.get(key)


def _word_crcs(view: memoryview, itemsize: int) -> tuple[int, ...]:
    """The CRC-32 of each of the first ``w - 1`` word columns of elements of ``itemsize`` bytes, ``w =
    itemsize // 4`` 32-bit words each (``()`` for elements of 4 bytes or less).

    CRC-32 detects every change confined to 32 consecutive bits (a burst of length <= 32; Peterson and
    Brown 1961), so it alone catches any change of one element of up to 4 bytes. A change of one wider
    element is a burst of up to 64 or 128 bits, which the CRC-32 of the whole misses for 1 in 2**32 of
    them. With these columns it is always caught: if the element's first changed word is its last, the
    change is a 32-bit burst of the whole; otherwise it is the only changed word of its column. The cost
    is a strided copy of ``(w - 1) / w`` of the bytes, for 8- and 16-byte dtypes only.
    """
    words = itemsize // 4
    if words <= 1 or view.nbytes == 0:
        return ()
    table = np.frombuffer(view, dtype=np.uint32).reshape(-1, words)
    return tuple(crc32(np.ascontiguousarray(table[:, j])) for j in range(words - 1))


def _data_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s whole storage, without a copy (the view keeps the storage alive)."""
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy())  # type: ignore[arg-type]


# -- the plan --------------------------------------------------------------------------------

def group_by_first_segment(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": x, "d": y}`` as ``{"a": {"b.c": x}, "d": y}`` (values not copied), which DCP flattens back.

    ``dict(flat)`` where grouping could change a key (``"a"`` and ``"a.b"``; a key not a string).
    """
    grouped: dict[str, Any] = {}
    groups: set[str] = set()  # heads whose value is a dict made here (never a value of the caller's)
    for key, value in flat.items():
        if not isinstance(key, str):
            return dict(flat)
        head, dot, rest = key.partition(".")
        if not dot:
            if head in grouped:
                return dict(flat)
            grouped[head] = value
        elif head in groups:
            grouped[head][rest] = value
        elif head in grouped:
            return dict(flat)
        else:
            grouped[head] = {rest: value}
            groups.add(head)
    return grouped


class FlatKeysSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose metadata records every key as a flat dict's would be (``(fqn,)``).

    Use it with :func:`group_by_first_segment`: the nested view then changes nothing in the files.
    """

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,  # noqa: D102
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if self.flatten_state_dict:
            self.mappings = {fqn: (fqn,) for fqn in self.mappings}

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # one plan has nothing to deduplicate (DCP's pass over every item changes nothing then)
        return all_plans if len(all_plans) == 1 else super()._dedup_save_plans(all_plans)


# -- the writer ------------------------------------------------------------------------------

#: pieces smaller than this are gathered into one buffer before they reach the OS (bytes)
_SMALL_WRITE_BYTES = 256 << 10
#: most bytes handed to one ``write`` system call (Linux caps a call just below 2 GiB)
_MAX_WRITE_BYTES = 1 << 30
_DISTCP_SUFFIX = ".distcp"

class _FileSink(io.RawIOBase):
    """One data file: small pieces gathered, large ones straight to the OS, with a running CRC-32 and size.

    ``flush`` is a no-op (``torch.save`` calls it after every record); :meth:`finish` completes the file.
    """

    def __init__(self, path: str | os.PathLike, *, write_behind: bool = False, spare: Path | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self._reused = _reuse_spare(spare, self.path) if spare is not None else None
        if self._reused is not None:
            self._f = self._reused[0]
        else:
            try:  # never opened for writing in place: a hard link (incremental saves) would change every copy
                self._f = self.path.open("xb", buffering=0)  # raw FileIO: every write is one system call
            except FileExistsError:
                os.unlink(self.path)
                self._f = self.path.open("xb", buffering=0)
        self._fd = self._f.fileno()
        self._behind = WriteBehind(self._fd, self.path, enabled=write_behind)
        self._buf = bytearray()
        self.nbytes = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.nbytes + len(self._buf)

    def fileno(self) -> int:
        self._drain()  # whoever asks for the descriptor (to fsync it) expects the bytes to be there
        return self._fd

    def flush(self) -> None:
        pass

    def write(self, b) -> int:
        view = memoryview(b)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        if n < _SMALL_WRITE_BYTES:
            self._buf += view
            if len(self._buf) >= _SMALL_WRITE_BYTES:
                self._drain()
        else:
            self._drain()
            self._write_all(view)
        return n

    def _drain(self) -> None:
        if self._buf:
            with memoryview(self._buf) as view:
                self._write_all(view)
            del self._buf[:]

    def _write_all(self, view: memoryview) -> None:
        done, n = 0, view.nbytes
        while done < n:
            # the write and the CRC both release the GIL for large buffers
            try:
                k = os.write(self._fd, view[done:done + _MAX_WRITE_BYTES])
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            if k <= 0:
                raise OSError(errno_mod.EIO, f"write returned {k}", str(self.path))
            self.crc = crc32(view[done:done + k], self.crc)
            done += k
            self._behind.advance(self.nbytes + done)
        self.nbytes += n

    def finish(self, *, sync: bool) -> tuple[int, int]:
        """Write the rest, fsync (when ``sync``), check the on-disk size, close; returns ``(bytes, crc32)``.

        Raises ``OSError`` (a write or the fsync) or CheckpointWriteError (the size on disk differs).
        """
        self._drain()
        if self._reused is not None and self._reused[1] > self.nbytes:  # a spare file's old bytes past the new end
            try:
                os.ftruncate(self._fd, self.nbytes)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        if sync:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        size = os.fstat(self._fd).st_size
        if size != self.nbytes:
            raise CheckpointWriteError(errno_mod.EIO, f"{self.path}: {size} bytes on disk after writing "
                                                      f"{self.nbytes}; the file system lost data")
        self.close()
        return self.nbytes, self.crc

    def close(self) -> None:
        if not self.closed:
            try:
                self._f.close()
            finally:
                super().close()


def _reuse_spare(spare: Path, path: Path) -> tuple[Any, int] | None:
    """Move one file of the directory ``spare`` (the memory tier's recycled files) to ``path`` and open it for
    writing in place, so that its pages (tmpfs) are overwritten rather than freed and allocated again: ``(raw
    file, its size)``, or None when none is there. Another writer may claim a file first (the rename is atomic);
    one that is not a regular file with a single link (a hard link would change another checkpoint) is
    removed instead. ``spare`` itself is never followed through a symlink."""
    try:
        where = os.open(spare, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        for name in os.listdir(where):
            try:
                os.rename(name, path, src_dir_fd=where)
            except OSError:
                continue  # claimed by another writer meanwhile
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                fd = None
            if fd is not None:
                info = os.fstat(fd)
                if stat_mod.S_ISREG(info.st_mode) and info.st_nlink == 1:
                    return os.fdopen(fd, "r+b", buffering=0), info.st_size
                os.close(fd)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    except OSError:
        pass  # unreadable or changed meanwhile: a new file instead
    finally:
        os.close(where)
    return None


class _ChecksumFileSystem(FileSystem):
    """DCP ``FileSystem`` (used for ``.metadata``) recording ``{file name: (bytes, crc32)}`` of what it writes."""

    def __init__(self, writer: ChecksumFileSystemWriter) -> None:
        super().__init__()
        self._writer = writer

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        sink = self._writer._open(path)
        try:
            yield sink
            self._writer._record(sink, sync=self._writer.sync_files)
        finally:
            sink.close()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self._writer._renamed(Path(path).name, Path(new_path).name)


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return torch.Size(item.tensor_data.size).numel() * item.tensor_data.properties.dtype.itemsize


def _balance(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Split write items into ``bins`` lists of about equal bytes (largest first, to the lightest list)."""
    out: list[list[WriteItem]] = [[] for _ in range(bins)]
    load = [0] * bins
    for size, item in sorted(((_item_bytes(it), it) for it in items), key=lambda p: p[0], reverse=True):
        i = load.index(min(load))
        out[i].append(item)
        load[i] += max(size, 1)
    return [b for b in out if b]


def _host_tensor(data: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements (so ``torch.save`` writes only them), with no
    conjugate or negative bit (those pickle as extra metadata, which the record checks refuse)."""
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _record_id(index: Any) -> tuple:
    """What identifies a tensor record across saves: its key and chunk offset (``MetadataIndex``)."""
    return (index.fqn, tuple(index.offset) if index.offset is not None else None)


def _in_threads(work: Any, buckets: list[list[WriteItem]], name: str) -> None:
    """``work(bucket)`` for every bucket, the first on this thread, the others on threads of their own;
    raises the first error."""
    errors: list[BaseException] = []

    def run(bucket: list[WriteItem]) -> None:
        try:
            work(bucket)
        except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,), name=f"{name}_{i}", daemon=True)
               for i, b in enumerate(buckets[1:], 1)]
    for t in threads:
        t.start()
    if buckets:
        run(buckets[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class _Aborted(Exception):
    """Another writer thread of the same save failed; this one stopped early."""


class ChecksumFileSystemWriter(FileSystemWriter):
    """DCP ``StorageWriter`` writing ``thread_count`` files per rank (``__{rank}_{i}.distcp``, balanced by
    bytes) into local ``path``, fsynced with ``sync_files``. An error in any thread fails :meth:`write_data`
    (the others stop at their next item); see :attr:`error`.

    ``incremental=(final, step)``: ``path`` is the partial of checkpoint directory ``final`` (of ``step``);
    host tensors unchanged since this root's last committed save (same signature and CRC-32 of their
    bytes) are not written: their data file is hard-linked from that checkpoint
    (incremental saves, below; :attr:`linked_files`); new files then take the next free names. The
    tensors of ``changed_keys`` (written in place since the previous capture: their version counters
    moved) are always written, even where their CRC-32 happens to equal the old one.
    """

    def __init__(self, path: str | os.PathLike, *, thread_count: int = 1, sync_files: bool = True,
                 incremental: tuple[Path, int] | None = None, changed_keys: frozenset[str] = frozenset(),
                 spare: Path | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=thread_count,
                         overwrite=True)
        self.fs = _ChecksumFileSystem(self)
        self.path = self.fs.init_path(path)
        self._target = incremental
        self._changed = changed_keys
        self._spare = spare
        self._files: dict[str, tuple[int, int]] = {}
        self._linked: dict[str, int] = {}
        self._digests_doc: dict[str, list[list[int]]] = {}
        self._framings: dict[Any, tuple[bytes, bytes]] = {}  # {item index: record framing} of digested tensors
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    # -- bookkeeping -------------------------------------------------------------------------------
    def _open(self, path: str | os.PathLike) -> _FileSink:
        try:
            return _FileSink(path, write_behind=self.sync_files, spare=self._spare)
        except OSError as exc:
            self._fail(exc)
            raise

    def _record(self, sink: _FileSink, *, sync: bool) -> None:
        try:
            size, crc = sink.finish(sync=sync)
        except BaseException as exc:
            self._fail(exc)
            raise
        with self._lock:
            self._files[sink.path.name] = (size, crc)

    def _renamed(self, old: str, new: str) -> None:
        with self._lock:
            if old in self._files:
                self._files[new] = self._files.pop(old)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if not any(e is exc for e in self._errors):
                self._errors.append(exc)

    @property
    def error(self) -> BaseException | None:
        """The first error met while writing (an ``OSError`` with errno when there is one), if any."""
        with self._lock:
            errors = [e for e in self._errors if not isinstance(e, _Aborted)]
        for exc in errors:
            if isinstance(exc, OSError) and exc.errno is not None:
                return exc
        return errors[0] if errors else None

    @property
    def written_files(self) -> dict[str, tuple[int, int]]:
        """``{file name: (size in bytes, crc32)}`` of the files this rank wrote."""
        with self._lock:
            return dict(self._files)

    @property
    def record_digests(self) -> dict[str, list[list[int]]]:
        """``{data file: [[record offset, CRC-32 of the tensor's data, *word column CRC-32s], ...]}`` of an
        incremental save (else empty; the columns only for 8- and 16-byte dtypes, see :func:`_word_crcs`),
        kept in the rank's JSON so that the first save after a restart can share unchanged records too."""
        return self._digests_doc

    @property
    def linked_files(self) -> dict[str, int]:
        """``{file name: step of the checkpoint it was hard-linked from}`` of this rank's linked data files."""
        with self._lock:
            return dict(self._linked)

    # -- incremental saves -----------------------------------------------------------------------
    def _digests(self, items: list[WriteItem], planner: SavePlanner) -> dict[Any, tuple[tuple, tuple[int, ...], int]]:
        """``{item index: (signature, (bytes, crc32, *word column crc32s) of the data, record length)}`` of the
        host tensors of ``items`` with a fixed record framing (others are always written), ``thread_count``
        threads at once."""
        out: dict[Any, tuple[tuple, tuple[int, ...], int]] = {}

        def digest(bucket: list[WriteItem]) -> None:
            for item in bucket:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                data = planner.resolve_data(item)
                if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
                    continue  # a live device tensor (unstaged save): not copied twice to digest it
                tensor = _host_tensor(data)
                framing, key = record_framing(tensor), _record_key(tensor)
                if framing is None or key is None:
                    continue
                view = _data_view(tensor)
                found = (key, (view.nbytes, crc32(view), *_word_crcs(view, tensor.element_size())),
                         len(framing[0]) + view.nbytes + len(framing[1]))
                with self._lock:
                    out[item.index] = found
                    self._framings[item.index] = framing

        _in_threads(digest, _balance(items, self.thread_count), "torch_ckpt_dcp_digest")
        return out

    def _reuse(self, prefix: str, items: list[WriteItem], digests: dict[Any, tuple]) -> dict[Any, WriteResult]:
        """Link the previous save's data files whose records ``items`` can point at; ``{item index: result}``."""
        assert self._target is not None
        base = baseline_for(self._target[0], prefix) or baseline_on_disk(*self._target, prefix)
        if base is None:
            return {}
        by_file: dict[str, list[tuple[WriteItem, Record]]] = {}
        for item in items:
            if item.index.fqn in self._changed:
                continue  # its live tensor was written in place since the last capture: written again
            found, rec = digests.get(item.index), base.records.get(_record_id(item.index))
            if found is not None and rec is not None and found == (rec.signature, rec.digest, rec.length):
                by_file.setdefault(rec.file, []).append((item, rec))
        if not base.signatures_recorded:  # inferred from .metadata: the record's own bytes must say the same
            by_file = {name: self._same_framing(base.directory / name, pairs) for name, pairs in by_file.items()}
        reused: dict[Any, WriteResult] = {}
        for name, pairs in sorted(by_file.items()):
            if sum(rec.length for _, rec in pairs) < LINK_MIN_SHARE * base.files[name][0]:
                continue  # mostly stale records: its live tensors are written instead
            if not link_file(base, name, Path(self.path)):
                continue
            with self._lock:
                self._files[name] = base.files[name][:2]
                self._linked[name] = base.step
            for item, rec in pairs:
                reused[item.index] = WriteResult(index=item.index, size_in_bytes=rec.length,
                                                 storage_data=_StorageInfo(name, rec.offset, rec.length))
        return reused

    def _same_framing(self, path: Path, pairs: list[tuple[WriteItem, Record]]) -> list[tuple[WriteItem, Record]]:
        """The ``(item, record)`` pairs whose record in file ``path`` has, byte for byte, the framing the item's
        tensor would get (its pickle: dtype, shape, strides, storage offset, conj/neg bits, requires_grad)."""
        kept: list[tuple[WriteItem, Record]] = []
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return kept
        try:
            for item, rec in pairs:
                head, tail = self._framings[item.index]
                if os.pread(fd, len(head), rec.offset) == head and \
                        os.pread(fd, len(tail), rec.offset + rec.length - len(tail)) == tail:
                    kept.append((item, rec))
        except OSError:
            return []
        finally:
            os.close(fd)
        return kept

    def _remember(self, prefix: str, results: list[WriteResult], digests: dict[Any, tuple]) -> None:
        """Record this save's data files and tensor records as the baseline of the next (once committed)."""
        assert self._target is not None
        final, step = self._target
        files: dict[str, tuple[int, int, int, int]] = {}
        records: dict[tuple, Record] = {}
        for r in results:
            info = cast(_StorageInfo, r.storage_data)
            name = str(info.relative_path)
            if name not in files:
                st = os.stat(Path(self.path) / name)
                size, crc = self.written_files[name]
                files[name] = (size, crc, st.st_dev, st.st_ino)
            found = digests.get(r.index)
            if found is not None and found[2] == info.length:
                records[_record_id(r.index)] = Record(name, info.offset, info.length, found[0], found[1])
        self._digests_doc = {name: sorted([r.offset, *r.digest[1:]] for r in records.values() if r.file == name)
                             for name in files}
        remember(final, prefix, Baseline(directory=Path(final), step=step, files=files, records=records))

    def _new_names(self, prefix: str, count: int) -> list[str]:
        """``count`` data file names ``{prefix}{i}.distcp``, skipping those of linked files."""
        names: list[str] = []
        i = 0
        while len(names) < count:
            name = f"{prefix}{i}{_DISTCP_SUFFIX}"
            if name not in self._linked:
                names.append(name)
            i += 1
        return names

    # -- StorageWriter -----------------------------------------------------------------------------
    def _write_file(self, file_name: str, items: list[WriteItem], planner: SavePlanner,
                    abort: threading.Event) -> list[WriteResult]:
        results = []
        sink = self._open(self.fs.concat_path(self.path, file_name))
        try:
            for item in items:
                if abort.is_set():
                    raise _Aborted(file_name)
                data = planner.resolve_data(item)
                offset = sink.tell()
                if item.type == WriteItemType.BYTE_IO:
                    sink.write(cast(io.BytesIO, data).getbuffer())
                else:
                    tensor = _host_tensor(cast(torch.Tensor, data))  # referenced until written: the pieces may point in
                    for piece in serialize_tensor(tensor):
                        sink.write(piece)
                    del tensor
                length = sink.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(file_name, offset, length)))
            self._record(sink, sync=self.sync_files)
        except BaseException as exc:
            abort.set()
            self._fail(exc)
            raise
        finally:
            sink.close()
        return results

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """Write this rank's items, one file per thread; fails if any thread fails.

        Raises:
            CheckpointWriteError: a write, fsync or size check failed (errno of the first OS error).
        """
        prefix = plan.storage_data.prefix
        items = list(plan.items)
        digests = self._digests(items, planner) if self._target is not None else {}
        reused = self._reuse(prefix, items, digests) if digests else {}
        buckets = _balance([item for item in items if item.index not in reused], self.thread_count)
        names = self._new_names(prefix, len(buckets))
        abort = threading.Event()
        outcomes: list[Any] = [None] * len(buckets)

        def run(i: int) -> None:
            try:
                outcomes[i] = self._write_file(names[i], buckets[i], planner, abort)
            except BaseException as exc:  # noqa: BLE001 - summarised below, never printed by the thread
                outcomes[i] = exc

        # plain threads rather than an executor: a save flushed at interpreter exit may still start them
        threads = [threading.Thread(target=run, args=(i,), name=f"torch_ckpt_dcp_write_{i}", daemon=True)
                   for i in range(1, len(buckets))]
        for t in threads:
            t.start()
        if buckets:
            run(0)
        for t in threads:
            t.join()
        for out in outcomes:
            if isinstance(out, (KeyboardInterrupt, SystemExit)):
                raise out
        results = [r for out in outcomes if isinstance(out, list) for r in out]
        failed = [(n, e) for n, e in zip(names, outcomes) if e is not None and not isinstance(e, (list, _Aborted))]
        if failed:
            first = self.error
            detail = "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failed)
            code = first.errno if isinstance(first, OSError) and first.errno is not None else errno_mod.EIO
            raise CheckpointWriteError(code, f"writing {len(failed)} of {len(buckets)} data files in {self.path} "
                                             f"failed: {detail}")
        results += reused.values()
        if self._target is not None:
            self._remember(prefix, results, digests)
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done


# -- incremental saves: the records of the last save ------------------------------------------------

#: least share of a previous data file's bytes the new checkpoint must reference for it to be linked
LINK_MIN_SHARE = 0.5
#: baselines kept per slot: the newest save's, and the one before (used when the newest was not committed)
_KEPT = 2


@dataclass(frozen=True)
class Record:
    """One tensor record of a data file: where it lies and what it holds.

    Attributes:
        file: data file name. offset, length: the record's byte range in it (bytes).
        signature: dtype, shape, strides, storage offset and size of the tensor (what its framing depends on).
        digest: ``(bytes, crc32, *word column crc32s)`` of the tensor's data (see :func:`_word_crcs`).
    """

    file: str
    offset: int
    length: int
    signature: tuple
    digest: tuple[int, ...]


@dataclass
class Baseline:
    """The data files and records one save of one rank (one file prefix) wrote or linked.

    Attributes:
        directory: the checkpoint directory they are committed in (when the save committed).
        step: its step (the manifest's).
        files: ``{name: (bytes, crc32, st_dev, st_ino)}``.
        records: ``{(key, chunk offset): Record}``.
    """

    directory: Path
    step: int
    files: dict[str, tuple[int, int, int, int]]
    records: dict[tuple, Record] = field(default_factory=dict)
    listed: dict[str, dict[str, int]] | None = None  # the committed manifest's files, once checked
    #: False: the records' signatures are inferred from ``.metadata`` (a baseline read from disk, which
    #: assumes a contiguous layout); a record is then shared only if its framing bytes equal the new tensor's
    signatures_recorded: bool = True


_lock = threading.Lock()
_slots: dict[tuple[str, str], list[Baseline]] = {}


def _slot(final: Path, prefix: str) -> tuple[str, str]:
    return (os.path.abspath(final.parent), prefix)


def remember(final: Path, prefix: str, baseline: Baseline) -> None:
    """Record what the save into ``final`` wrote with file ``prefix`` (used once it is committed)."""
    with _lock:
        kept = [b for b in _slots.get(_slot(final, prefix), []) if b.directory != baseline.directory
                or b.step != baseline.step]
        _slots[_slot(final, prefix)] = [baseline, *kept][:_KEPT]


def forget_all() -> None:
    """Drop every baseline (tests; the next save of each root writes everything)."""
    with _lock:
        _slots.clear()


def baseline_for(final: Path, prefix: str) -> Baseline | None:
    """The newest remembered save of this root and prefix that is committed (its manifest reads), or None."""
    with _lock:
        candidates = list(_slots.get(_slot(final, prefix), []))
    for base in candidates:
        try:
            manifest = read_manifest(base.directory)
        except (CheckpointError, OSError):
            continue  # not committed (the save failed), or deleted by retention since
        if manifest.step == base.step:
            base.listed = manifest.files
            return base
    return None


def baseline_on_disk(final: Path, step: int, prefix: str) -> Baseline | None:
    """The baseline of this process's first incremental save into a root (after a restart): the newest
    committed checkpoint of ``final``'s root older than ``step``, as its manifest, DCP metadata and the
    rank's JSON (the digests its save kept, :attr:`ChecksumFileSystemWriter.record_digests`) describe it.

    None when there is none, or any of those files is missing, unreadable or disagrees with the manifest
    (its size or CRC-32); a record is shared only if its digest equals the new tensor's and its framing
    bytes in the file equal the new tensor's (the signature here is inferred from ``.metadata``, which
    does not know strides or a storage offset), and its file only if the file's bytes still have the
    manifest's CRC-32 (:func:`link_file`).
    """
    match = re.fullmatch(r"__(\d+)_", prefix)
    if match is None:
        return None
    newest: tuple[int, Path, Any] | None = None
    try:
        entries = list(os.scandir(final.parent))
    except OSError:
        return None
    for entry in entries:
        if entry.name.startswith(".") or entry.path == os.fspath(final) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            manifest = read_manifest(entry.path)
        except (CheckpointError, OSError):
            continue
        if manifest.step < step and (newest is None or manifest.step > newest[0]):
            newest = (manifest.step, Path(entry.path), manifest)
    if newest is None:
        return None
    _, directory, manifest = newest
    name = rank_file_name(int(match[1]))
    try:
        raw = read_listed(directory, manifest, name, MAX_RANK_JSON_BYTES)
        if crc32(raw) != manifest.files[name]["crc32"]:
            return None
        doc = parse_rank_doc(raw, str(directory / name), manifest, int(match[1]))
        md = read_metadata(directory, manifest)
    except (CheckpointError, OSError):
        return None
    digests = doc.get("records")
    if not isinstance(digests, dict):
        return None
    chunks = {(fqn, tuple(c.offsets)): (item.properties.dtype, tuple(c.sizes))
              for fqn, item in md.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)
              for c in item.chunks}
    ranges = {(str(info.relative_path), info.offset): (index, info.length) for index, info in md.storage_data.items()}
    files: dict[str, tuple[int, int, int, int]] = {}
    records: dict[tuple, Record] = {}
    for file, pairs in digests.items():
        listed = manifest.files.get(file) if isinstance(file, str) else None
        if listed is None or not isinstance(pairs, list):
            continue
        try:
            st = os.stat(directory / file, follow_symlinks=False)
        except OSError:
            continue
        files[file] = (listed["bytes"], listed["crc32"], st.st_dev, st.st_ino)
        for pair in pairs:
            if not (isinstance(pair, list) and 2 <= len(pair) <= 5 and all(type(v) is int for v in pair)):
                continue
            found = ranges.get((file, pair[0]))
            chunk = chunks.get((found[0].fqn, tuple(found[0].offset or ()))) if found is not None else None
            if found is None or chunk is None:
                continue
            dtype, sizes = chunk
            nbytes = math.prod(sizes) * dtype.itemsize
            signature = (dtype, sizes, torch.empty(sizes, device="meta").stride(), 0, nbytes, False, False, False)
            records[_record_id(found[0])] = Record(file, pair[0], found[1], signature, (nbytes, *pair[1:]))
    return Baseline(directory=directory, step=manifest.step, files=files, records=records, listed=manifest.files,
                    signatures_recorded=False)


def _same_file(st: os.stat_result, info: tuple[int, int, int, int]) -> bool:
    return (st.st_size, st.st_dev, st.st_ino) == (info[0], info[2], info[3])


def link_file(base: Baseline, name: str, into: Path) -> bool:
    """Hard-link ``base``'s data file ``name`` into directory ``into``; False (nothing left behind) when it is
    not the remembered file any more (listed size or CRC-32, device, inode, size differ), its bytes no longer
    have that CRC-32 (read through the new link: a read instead of a write), or it cannot be linked."""
    info = base.files.get(name)
    listed = (base.listed or {}).get(name)
    if info is None or listed is None or (listed.get("bytes"), listed.get("crc32")) != info[:2]:
        return False
    src, dst = base.directory / name, into / name
    try:
        if not _same_file(os.stat(src, follow_symlinks=False), info):
            return False
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:  # EXDEV, EPERM, EMLINK, ENOTSUP...: the tensors are written instead
        log.debug("incremental save: cannot link %s into %s (%s); writing its tensors", src, into, exc)
        return False
    try:
        if _same_file(os.stat(dst, follow_symlinks=False), info):  # not a file that replaced it between stat and link
            if file_crc32(dst) == info[:2]:  # its bytes too: a file damaged since it was written is never shared on
                return True
            log.warning("incremental save: %s no longer matches the CRC-32 it was written with (damaged since); its "
                        "tensors are written again, not linked", src)
        os.unlink(dst)
    except OSError:
        pass
    return False
