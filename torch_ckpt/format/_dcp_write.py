"""The checksumming DCP storage writer: :class:`ChecksumFileSystemWriter`.

A DCP ``StorageWriter`` keeping DCP's on-disk format (one ``.distcp`` file per writer thread and
rank, each tensor a ``torch.save`` record at a recorded offset (see :mod:`torch_ckpt.format._dcp_record`),
plus DCP's ``.metadata``). It writes the staged bytes straight from host memory with large
``write`` calls that release the GIL, computes a CRC-32 and byte count of every file *while*
writing it (no re-read), fsyncs, and compares each file's on-disk size with the bytes written. An
error in any of its writer threads fails the write (DCP's own ``FileSystemWriter`` loses errors
raised in its extra threads). The read side is :mod:`torch_ckpt.format._read`.
"""

from __future__ import annotations

import errno as errno_mod
import io
import os
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from torch_ckpt.distributed._context import quiet_single_process_warning
from torch_ckpt.errors import CheckpointWriteError
from torch_ckpt.format._dcp_record import serialize_tensor
from torch_ckpt.format._write_behind import WriteBehind
from torch_ckpt.storage._crc import crc32

quiet_single_process_warning()  # dcp.save runs with this writer and no_dist=True when there is no process group

__all__ = ["ChecksumFileSystemWriter"]

#: pieces smaller than this are gathered into one buffer before they reach the OS (bytes)
_SMALL_WRITE_BYTES = 256 << 10
#: most bytes handed to one ``write`` system call (Linux caps a call just below 2 GiB)
_MAX_WRITE_BYTES = 1 << 30
_DISTCP_SUFFIX = ".distcp"

class _FileSink(io.RawIOBase):
    """One data file being written: small pieces are gathered, large ones go straight to the OS.

    Keeps a running CRC-32 and byte count of everything handed to the OS. ``flush`` is a no-op
    (``torch.save`` calls it after every record); :meth:`finish` writes what is left, fsyncs and
    checks the on-disk size. With ``write_behind`` (files that will be fsynced), writeback starts
    while the file is being written (:class:`torch_ckpt.format._write_behind.WriteBehind`).
    """

    def __init__(self, path: str | os.PathLike, *, write_behind: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        self._f = self.path.open("wb", buffering=0)  # raw FileIO: every write is one system call
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
            self._behind.advance(self.nbytes + done)
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
            are staged (pipelined staging; see :class:`torch_ckpt.save._staging.StagingProgress`). An
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
            return _FileSink(path, write_behind=self.sync_files)
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

