"""Pickle-free reads of DCP checkpoints: the metadata unpickler, the confined reader and ``load_tensors``.

:func:`load_dcp_metadata_bytes` / :func:`read_dcp_metadata` read DCP's ``.metadata`` with a
restricted unpickler that admits only DCP's own metadata classes; :class:`SafeFileSystemReader`
opens only the files a checkpoint's manifest lists, as regular files; :class:`SafeLoadPlanner`
refuses pickled (``BYTE_IO``) items. Loading a checkpoint therefore never executes code from it:
tensor payloads are read by DCP with ``torch.load(weights_only=True)``. :func:`load_tensors` runs
``dcp.load`` with all three and turns DCP's failures into :class:`~torch_ckpt.errors.CheckpointCorruptError`
naming the damaged file.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from torch_ckpt.distributed._context import quiet_single_process_warning
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from torch_ckpt.storage._locations import open_regular

quiet_single_process_warning()  # load_tensors calls dcp.load with no_dist=True when there is no process group

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_dcp_metadata",
    "load_dcp_metadata_bytes",
    "load_tensors",
    "unwrap_dcp_error",
]

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

    Only the type of the result is checked here; :func:`torch_ckpt.format._dcp_metadata.metadata_problems`
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
    :func:`torch_ckpt.format._dcp_metadata.read_metadata` for the validated read of a checkpoint's metadata).

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
        metadata: the already validated DCP metadata (see :func:`torch_ckpt.format._dcp_metadata.read_metadata`);
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
        first = unwrap_dcp_error(exc)
        if isinstance(first, CheckpointError) or not isinstance(first, Exception):
            raise first from None  # ours, or an interrupt (Ctrl-C, SystemExit): not a damaged file
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


def unwrap_dcp_error(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (which holds one ``(error, traceback)`` per rank).

    DCP wraps whatever fails in its collective steps, e.g. writing or fsyncing ``.metadata`` in the
    storage writer's ``finish``, so an ``ENOSPC`` there would otherwise lose its errno. Prefers a
    :class:`CheckpointError`, then an ``OSError`` with an errno; returns ``exc`` when it wraps nothing.
    """
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return exc
    causes = [c[0] if isinstance(c, tuple) else c for c in failures.values()]
    causes = [c for c in causes if isinstance(c, BaseException)]
    for wanted in (CheckpointError, OSError):
        for cause in causes:
            if isinstance(cause, wanted) and (wanted is not OSError or cause.errno is not None):
                return cause
    return causes[0] if causes else exc


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
