"""The bridge to ``torch.distributed.checkpoint`` (DCP): checksummed writes and pickle-free reads.

* :class:`ChecksumFileSystemWriter` is DCP's ``FileSystemWriter`` whose file streams compute a
  CRC-32 and byte count of every file *while* it is written (no re-read), so the manifest can
  record per-file checksums at zero extra I/O.
* :class:`SafeFileSystemReader` reads DCP's ``.metadata`` with a restricted unpickler that admits
  only DCP's own metadata classes, and :class:`SafeLoadPlanner` refuses pickled (``BYTE_IO``)
  items, so loading a checkpoint never executes code from it. Tensor payloads are read by DCP with
  ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from torch_ckpt.errors import CheckpointCorruptError, UnsafeCheckpointError

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


class _HashingStream(io.RawIOBase):
    """Write-through file wrapper that keeps a running CRC-32 and byte count."""

    def __init__(self, raw: io.BufferedWriter, on_close, on_error) -> None:
        super().__init__()
        self._raw = raw
        self._on_close = on_close
        self._on_error = on_error
        self.crc = 0
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        view = memoryview(b)
        try:
            n = self._raw.write(view)
        except OSError as exc:  # torch.save turns this into an opaque RuntimeError: remember it
            self._on_error(exc)
            raise
        self.crc = zlib.crc32(view[:n] if n is not None and n < len(view) else view, self.crc)
        self.nbytes += n if n is not None else len(view)
        return n if n is not None else len(view)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            try:
                self._raw.close()
            finally:
                self._on_close(self)
                super().close()


class _ChecksumFileSystem(FileSystem):
    """DCP ``FileSystem`` recording ``{file name: (bytes, crc32)}`` of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, tuple[int, int]] = {}
        self.os_error: OSError | None = None
        self._lock = threading.Lock()

    def _record_error(self, exc: OSError) -> None:
        with self._lock:
            if self.os_error is None:
                self.os_error = exc

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name

        def record(s: _HashingStream) -> None:
            with self._lock:
                self.files[name] = (s.nbytes, s.crc)

        try:
            raw = Path(path).open(mode)
        except OSError as exc:
            self._record_error(exc)
            raise
        stream = _HashingStream(raw, record, self._record_error)
        try:
            yield stream  # type: ignore[misc]
        finally:
            stream.close()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            old, new = Path(path).name, Path(new_path).name
            if old in self.files:
                self.files[new] = self.files.pop(old)


class ChecksumFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that checksums while writing; see :attr:`written_files`.

    Args:
        path: local directory to write the DCP checkpoint into.
        thread_count: writer threads per rank.
        sync_files: fsync every file (True for a local durable commit).
    """

    def __init__(self, path: str | os.PathLike, *, thread_count: int = 1, sync_files: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=thread_count,
                         overwrite=True)
        self.fs = _ChecksumFileSystem()
        self.path = self.fs.init_path(path)

    @property
    def os_error(self) -> OSError | None:
        """The first OS error (disk full, permission...) met while writing, if any."""
        return self.fs.os_error

    @property
    def written_files(self) -> dict[str, tuple[int, int]]:
        """``{file name: (size in bytes, crc32)}`` of the files this rank wrote."""
        return dict(self.fs.files)


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

    Only the type of the result is checked here; :func:`torch_ckpt.format.metadata_problems`
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
    :func:`torch_ckpt.format.read_metadata` for the validated read of a checkpoint's metadata).

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
        from torch_ckpt.format import _open_regular

        name = Path(path).name
        if "r" not in mode or "+" in mode or name not in self.allowed:
            raise CheckpointCorruptError(f"{path}: DCP asked to open a file the manifest does not list "
                                         f"(mode {mode!r}); refusing")
        fd = _open_regular(Path(path), allow_symlinks=self.allow_symlinks, what="file listed in the manifest")
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
        metadata: the already validated DCP metadata (see :func:`torch_ckpt.format.read_metadata`);
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

    from torch_ckpt.errors import CheckpointError

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
    """Return ``(size in bytes, crc32)`` of a file, reading it in 16 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc
