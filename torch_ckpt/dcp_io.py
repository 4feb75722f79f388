"""The bridge to ``torch.distributed.checkpoint`` (DCP): checksummed writes and pickle-free reads.

* :class:`ChecksumFileSystemWriter` is a DCP ``StorageWriter`` keeping DCP's on-disk format (one
  ``.distcp`` file per writer thread and rank, each tensor a ``torch.save`` record at a recorded
  offset, plus DCP's ``.metadata``). It writes the staged bytes straight from host memory with
  large ``write`` calls that release the GIL, computes a CRC-32 and byte count of every file
  *while* writing it (no re-read), fsyncs, and compares each file's on-disk size with the bytes
  written. An error in any of its writer threads fails the write (DCP's own ``FileSystemWriter``
  loses errors raised in its extra threads).
* :class:`SafeFileSystemReader` reads DCP's ``.metadata`` with a restricted unpickler that admits
  only DCP's own metadata classes, and :class:`SafeLoadPlanner` refuses pickled (``BYTE_IO``)
  items, so loading a checkpoint never executes code from it. Tensor payloads are read by DCP with
  ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import errno as errno_mod
import io
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from torch_ckpt.crc import crc32
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError, UnsafeCheckpointError
from torch_ckpt.storage import open_regular

# dcp.save/dcp.load warn "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is
# to save (load) in a single process" on every call with no_dist=True, which torch-ckpt passes on purpose
# when there is no process group; no argument avoids it. One filter, installed once when this module (every
# path to DCP goes through it) is imported, matches that message only, attributed to DCP (or to torch-ckpt
# should DCP stop wrapping the call). Unlike warnings.catch_warnings around each call, it never changes the
# process-wide filters from the writer thread. It also quiets the same message for the process's other
# single-process DCP calls, which carry the same non-information.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
            r"(save|load) in a single process",
    category=UserWarning,
    module=r"(torch\.distributed\.checkpoint|torch_ckpt)\.",
)

__all__ = [
    "ChecksumFileSystemWriter",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_dcp_metadata",
    "load_dcp_metadata_bytes",
    "load_tensors",
    "file_crc32",
]

_CRC_CHUNK_BYTES = 16 << 20
#: pieces smaller than this are gathered into one buffer before they reach the OS (bytes)
_SMALL_WRITE_BYTES = 256 << 10
#: most bytes handed to one ``write`` system call (Linux caps a call just below 2 GiB)
_MAX_WRITE_BYTES = 1 << 30
_DISTCP_SUFFIX = ".distcp"


def _probe_torch_save_without_zip_crc() -> bool:
    """True when this torch exposes the pieces of ``torch.save`` needed to skip its zip CRC-32."""
    try:
        buf = io.BytesIO()
        zf = torch._C.PyTorchFileWriter(buf, False, torch.serialization._get_storage_alignment())
        torch.serialization._save(torch.zeros(2), zf, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
        buf.seek(0)
        return bool(torch.equal(torch.load(buf, weights_only=True), torch.zeros(2)))
    except Exception:  # noqa: BLE001 - any incompatibility: use plain torch.save
        return False


_SAVE_WITHOUT_ZIP_CRC = _probe_torch_save_without_zip_crc()


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


#: ``{tensor signature: (bytes before the data, bytes after it)}`` of ``torch.save`` records; see _serialize_tensor
_RECORD_CACHE: dict[tuple, tuple[bytes, bytes]] = {}
_RECORD_CACHE_MAX = 4096


def _record_key(tensor: torch.Tensor) -> tuple | None:
    """What a ``torch.save`` record's non-data bytes depend on (None: do not cache this tensor)."""
    if type(tensor) is not torch.Tensor or tensor.is_quantized or not _SAVE_WITHOUT_ZIP_CRC:
        return None
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
            tensor.untyped_storage().nbytes(), tensor.is_conj(), tensor.is_neg())


def _serialize_tensor(tensor: torch.Tensor) -> list[Any]:
    """``tensor`` as one ``torch.save`` record (what DCP's reader ``torch.load``\\ s), as a list of pieces.

    The zip container's own per-record CRC-32 is skipped when this torch allows it: it is computed
    while holding the GIL (about 3 GB/s) and duplicates the file CRC-32 recorded in the manifest;
    ``torch.load`` does not check it. Without that CRC, the bytes around the tensor's data depend
    only on its dtype, shape and strides, so they are serialized once per signature and reused
    (a state of many small tensors then costs a few microseconds per tensor instead of ~150 us).
    """
    key = _record_key(tensor)
    cached = _RECORD_CACHE.get(key) if key is not None else None
    if cached is not None:
        return [cached[0], _data_view(tensor), cached[1]]
    capture = _Capture(tensor)
    if _SAVE_WITHOUT_ZIP_CRC:
        zf = torch._C.PyTorchFileWriter(capture, False, torch.serialization._get_storage_alignment())
        torch.serialization._save(tensor, zf, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
    else:
        torch.save(tensor, capture)
    pieces = capture.pieces
    data_at = [i for i, p in enumerate(pieces) if isinstance(p, memoryview)]
    if key is not None and len(data_at) == 1:
        if len(_RECORD_CACHE) >= _RECORD_CACHE_MAX:
            _RECORD_CACHE.clear()
        i = data_at[0]
        _RECORD_CACHE[key] = (b"".join(pieces[:i]), b"".join(pieces[i + 1:]))
    return pieces


def record_framing(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes this writer puts before and after ``tensor``'s data in its ``torch.save`` record.

    They depend only on the tensor's dtype, shape and strides (not its values), so a reader can
    compare a record's framing with them and, on an exact match, read the data straight into a
    tensor of that signature. None when this torch or tensor gives no fixed framing.
    """
    key = _record_key(tensor)
    if key is None:
        return None
    if key not in _RECORD_CACHE:
        _serialize_tensor(tensor)
    return _RECORD_CACHE.get(key)


def _data_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s whole storage, without a copy (the view keeps the storage alive)."""
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy())


class _FileSink(io.RawIOBase):
    """One data file being written: small pieces are gathered, large ones go straight to the OS.

    Keeps a running CRC-32 and byte count of everything handed to the OS. ``flush`` is a no-op
    (``torch.save`` calls it after every record); :meth:`finish` writes what is left, fsyncs and
    checks the on-disk size.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self._f = self.path.open("wb", buffering=0)  # raw FileIO: every write is one system call
        self._fd = self._f.fileno()
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

    def write(self, b) -> int:  # type: ignore[override]
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
        self.nbytes += n

    def finish(self, *, sync: bool) -> tuple[int, int]:
        """Write the rest, fsync (when ``sync``), check the on-disk size and close.

        Returns:
            ``(size in bytes, crc32)`` of the file.

        Raises:
            OSError: a write or the fsync failed.
            CheckpointWriteError: the file on disk does not have the size that was written.
        """
        self._drain()
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
            yield sink  # type: ignore[misc]
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
    """A CPU tensor whose storage holds exactly its elements (so ``torch.save`` writes only them)."""
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class _Aborted(Exception):
    """Another writer thread of the same save failed; this one stopped early."""


class ChecksumFileSystemWriter(FileSystemWriter):
    """DCP ``StorageWriter`` that writes straight from host memory and checksums while writing.

    One file per writer thread (``__{rank}_{i}.distcp``), items balanced by bytes. Any error in any
    thread fails :meth:`write_data` (the other threads stop at their next item); see :attr:`error`.

    Args:
        path: local directory to write the DCP checkpoint into.
        thread_count: writer threads (and files) per rank.
        sync_files: fsync every file (True for a local durable commit).
        wait_for: called with a tensor's key right before its bytes are written; blocks until they
            are staged (pipelined staging; see :class:`torch_ckpt.staging.StagingProgress`). An
            exception it raises fails the write like any other error.
    """

    def __init__(self, path: str | os.PathLike, *, thread_count: int = 1, sync_files: bool = True,
                 wait_for: Callable[[str], None] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=thread_count,
                         overwrite=True)
        self.fs = _ChecksumFileSystem(self)
        self.path = self.fs.init_path(path)
        self._files: dict[str, tuple[int, int]] = {}
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._wait_for = wait_for

    # -- bookkeeping -------------------------------------------------------------------------------
    def _open(self, path: str | os.PathLike) -> _FileSink:
        try:
            return _FileSink(path)
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
    def os_error(self) -> OSError | None:
        """The first OS error (disk full, permission...) met while writing, if any."""
        exc = self.error
        return exc if isinstance(exc, OSError) else None

    @property
    def written_files(self) -> dict[str, tuple[int, int]]:
        """``{file name: (size in bytes, crc32)}`` of the files this rank wrote."""
        with self._lock:
            return dict(self._files)

    # -- StorageWriter -----------------------------------------------------------------------------
    def _write_file(self, file_name: str, items: list[WriteItem], planner: SavePlanner,
                    abort: threading.Event) -> list[WriteResult]:
        results = []
        sink = self._open(self.fs.concat_path(self.path, file_name))
        try:
            for item in items:
                if abort.is_set():
                    raise _Aborted(file_name)
                if self._wait_for is not None and item.type != WriteItemType.BYTE_IO:
                    self._wait_for(item.index.fqn)
                data = planner.resolve_data(item)
                offset = sink.tell()
                if item.type == WriteItemType.BYTE_IO:
                    sink.write(data.getbuffer())
                else:
                    tensor = _host_tensor(data)  # referenced until written: the pieces may point into it
                    for piece in _serialize_tensor(tensor):
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
        buckets = _balance(list(plan.items), self.thread_count)
        names = [f"{prefix}{i}{_DISTCP_SUFFIX}" for i in range(len(buckets))]
        abort = threading.Event()
        results: list[WriteResult] = []
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
            if isinstance(out, list):
                results += out
        outcomes = [o if isinstance(o, BaseException) else None for o in outcomes]
        for out in outcomes:
            if isinstance(out, (KeyboardInterrupt, SystemExit)):
                raise out
        failed = [(n, e) for n, e in zip(names, outcomes) if e is not None and not isinstance(e, _Aborted)]
        if failed:
            first = self.error
            detail = "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failed)
            code = first.errno if isinstance(first, OSError) and first.errno is not None else errno_mod.EIO
            raise CheckpointWriteError(code, f"writing {len(failed)} of {len(buckets)} data files in {self.path} "
                                             f"failed: {detail}")
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done


_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to unpickle {module}.{name}; DCP metadata may only reference DCP's own "
            "metadata classes. The file was not written by DCP or has been tampered with."
        )


def load_dcp_metadata_bytes(data: bytes, source: str) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes with the restricted unpickler (never executes code from them).

    Only the type of the result is checked here; :func:`torch_ckpt.dcp_metadata.metadata_problems`
    validates its fields.

    Raises:
        UnsafeCheckpointError: the pickle references anything but DCP metadata classes.
        CheckpointCorruptError: the bytes are truncated or not a DCP metadata pickle (named ``source``).
    """
    try:
        md = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to parse untrusted bytes means "corrupt"
        raise CheckpointCorruptError(f"{source}: DCP metadata is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{source}: not a DCP metadata file (got {type(md).__name__})")
    return md


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """Read a DCP ``.metadata`` file without executing arbitrary code (types unchecked; see
    :func:`torch_ckpt.dcp_metadata.read_metadata` for the validated read of a checkpoint's metadata).

    Raises:
        UnsafeCheckpointError: the pickle references anything but DCP metadata classes.
        CheckpointCorruptError: the file is truncated or not a DCP metadata pickle.
    """
    with open(path, "rb") as f:
        data = f.read()
    return load_dcp_metadata_bytes(data, str(path))


class _ListedFileSystem(FileSystem):
    """DCP ``FileSystem`` that opens for reading only the given file names, as regular files (no symlinks).

    Remembers the file being read when a read fails, so the error can name it.
    """

    def __init__(self, allowed: set[str], *, allow_symlinks: bool = False) -> None:
        super().__init__()
        self.allowed = set(allowed)
        self.allow_symlinks = allow_symlinks
        self.failed_file: str | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if "r" not in mode or "+" in mode or name not in self.allowed:
            raise CheckpointCorruptError(f"{path}: DCP asked to open a file the manifest does not list "
                                         f"(mode {mode!r}); refusing")
        fd = open_regular(Path(path), allow_symlinks=self.allow_symlinks, what="file listed in the manifest")
        with os.fdopen(fd, "rb") as stream:
            try:
                yield stream
            except BaseException:
                self.failed_file = self.failed_file or str(path)
                raise


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` confined to a checkpoint's verified files, with pickle-free metadata.

    Args:
        path: the checkpoint directory.
        metadata: the already validated DCP metadata (see :func:`torch_ckpt.dcp_metadata.read_metadata`);
            None reads it with :func:`read_dcp_metadata` (unvalidated: tests and plain-DCP use).
        allowed: file names DCP may open (the manifest's); None allows any name.
        allow_symlinks: follow symlinks when opening them.
    """

    def __init__(self, path: str | os.PathLike, *, metadata: Metadata | None = None,
                 allowed: set[str] | None = None, allow_symlinks: bool = False) -> None:
        super().__init__(path)
        self._metadata = metadata
        if allowed is not None:
            self.fs = _ListedFileSystem(allowed, allow_symlinks=allow_symlinks)

    @property
    def failed_file(self) -> str | None:
        """The file whose read failed, when known."""
        return getattr(self.fs, "failed_file", None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        md = self._metadata if self._metadata is not None else read_dcp_metadata(self._get_metadata_path(rank))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def load_tensors(tensors: dict[str, torch.Tensor], step_dir: str | os.PathLike, metadata: Metadata,
                 allowed: set[str], *, process_group: Any = None, no_dist: bool = True,
                 allow_symlinks: bool = False) -> None:
    """``dcp.load`` of ``tensors`` from a validated checkpoint, reading only ``allowed`` regular files.

    Raises:
        CheckpointCorruptError: DCP could not read or decode the data (a damaged file: with
            ``verify_on_load=False`` no CRC caught it first); the message names the file when this
            rank knows it, and the first underlying error, without DCP's embedded tracebacks.
        UnsafeCheckpointError: an item would need unpickling.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(step_dir, metadata=metadata, allowed=allowed, allow_symlinks=allow_symlinks)
    try:
        dcp.load(tensors, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group,
                 no_dist=no_dist)
    except CheckpointException as exc:
        causes = [pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, CheckpointError):
                raise cause from None
        first = next((c for c in causes if c is not None), exc)
        where = reader.failed_file or str(step_dir)
        raise CheckpointCorruptError(
            f"{where}: tensor data cannot be read ({_first_line(first)}); the file is damaged. Run torch-ckpt "
            "verify, or restore with verify_on_load=True to catch this by checksum before loading") from None
    except (RuntimeError, ValueError, EOFError, OSError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        where = reader.failed_file or str(step_dir)
        raise CheckpointCorruptError(f"{where}: tensor data cannot be read ({_first_line(exc)}); the file is "
                                     "damaged") from None


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (DCP and torch.load messages carry tracebacks and advice)."""
    text = str(exc).strip()
    if isinstance(exc, pickle.UnpicklingError):  # torch.load's text advises weights_only=False: never repeat it
        detail = text.split("WeightsUnpickler error:", 1)[1].strip() if "WeightsUnpickler error:" in text else ""
        return f"not a valid tensor record: {detail.splitlines()[0] if detail else type(exc).__name__}"
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """Load planner that refuses pickled (``BYTE_IO``) items instead of ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item, value) -> None:  # noqa: D102
        raise UnsafeCheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object; torch-ckpt never writes those and "
            "refuses to unpickle them. Load it with plain torch.distributed.checkpoint only if you trust the file."
        )


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """Return ``(size in bytes, crc32)`` of a file, read in 16 MiB chunks.

    Reading and checksumming overlap: a helper thread reads the next chunk into a second buffer
    while this one computes the CRC of the current chunk (both release the GIL), so a cold file
    costs about its read time rather than read + CRC.
    """
    crc, size = 0, 0
    bufs = [bytearray(_CRC_CHUNK_BYTES), bytearray(_CRC_CHUNK_BYTES)]
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        n = f.readinto(bufs[0])
        i = 0
        while n:
            result: list[Any] = []
            reader = threading.Thread(target=lambda b=bufs[1 - i], out=result: out.append(_readinto(f, b)), daemon=True)
            reader.start()
            with memoryview(bufs[i]) as view:
                crc = crc32(view[:n], crc)
            size += n
            reader.join()
            if isinstance(result[0], BaseException):
                raise result[0]
            n, i = result[0], 1 - i
    return size, crc


def _readinto(f: Any, buf: bytearray) -> int | BaseException:
    try:
        return f.readinto(buf) or 0
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
        return exc
