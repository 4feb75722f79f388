"""Pickle-free reads of DCP checkpoints: the metadata, validated, and ``load_tensors``.

``.metadata`` is read with a restricted unpickler that admits only DCP's own metadata classes
(:func:`load_dcp_metadata_bytes`), then validated (:func:`metadata_problems`): every field type;
storage entries lie inside manifest-listed data files; every tensor's chunks lie inside its
declared shape, do not overlap and cover it exactly; each chunk fits in its storage entry, so
declared sizes are bounded by the files' real sizes before anything is allocated. Every chunk's
``torch.save`` record must match its declared byte range, dtype, size and shape
(:func:`record_problems`: headers only, nothing unpickled). :func:`load_tensors` runs ``dcp.load``
with :class:`SafeFileSystemReader` (opens only listed regular files) and :class:`SafeLoadPlanner`
(refuses pickled ``BYTE_IO`` items), so loading never executes code from a checkpoint, and turns
DCP's failures into :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the damaged file.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torch_ckpt.distributed._context import quiet_single_process_warning
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from torch_ckpt.format._manifest import (
    MANIFEST_NAME,
    MAX_NDIM,
    METADATA_NAME,
    NODE_METADATA_RE,
    RANK_FILE_RE,
    Manifest,
    read_listed,
)
from torch_ckpt.format._records import storage_record_problems
from torch_ckpt.storage._bounded import corrupt, short_repr
from torch_ckpt.storage._locations import Location, as_location, open_regular

__all__ = [
    "MAX_METADATA_BYTES",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_records",
    "load_dcp_metadata_bytes",
    "load_tensors",
    "metadata_name",
    "metadata_problems",
    "read_dcp_metadata",
    "read_metadata",
    "record_problems",
    "tensor_items",
    "unwrap_dcp_error",
]

quiet_single_process_warning()  # load_tensors calls dcp.load with no_dist=True when there is no process group


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

    Only the type of the result is checked here; :func:`torch_ckpt.format._dcp_read.metadata_problems`
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
    :func:`torch_ckpt.format._dcp_read.read_metadata` for the validated read of a checkpoint's metadata).

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
        metadata: the already validated DCP metadata (see :func:`torch_ckpt.format._dcp_read.read_metadata`);
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


MAX_METADATA_BYTES = 1 << 30
"""Largest DCP ``.metadata`` unpickled (bytes)."""


_INT_ONLY = frozenset((int,))


def _int_tuple(value: Any) -> bool:
    """A tuple (``torch.Size`` included) of at most ``MAX_NDIM`` non-negative ints (bools refused)."""
    # set/map/min run in C: no Python frame per element (this runs 4 times per tensor)
    return isinstance(value, tuple) and len(value) <= MAX_NDIM and set(map(type, value)) <= _INT_ONLY \
        and min(value, default=0) >= 0


def _outside(chunk: Any, size: tuple[int, ...]) -> bool:
    """Whether ``chunk`` (integer offsets and sizes) does not lie inside the shape ``size``."""
    if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
        return True
    if chunk.sizes == size and not any(chunk.offsets):  # the whole tensor in one chunk: the common case
        return False
    return any([o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size)])


def _overlapping(offsets: list[tuple[int, ...]], sizes: list[tuple[int, ...]]) -> tuple[int, int] | None:
    """Indices of two chunks that overlap, or None (sweep along the dimension with most distinct offsets)."""
    boxes = [i for i in range(len(offsets)) if all(sizes[i])]
    if len(boxes) < 2:
        return None
    ndim = len(offsets[0])
    if ndim == 0:
        return boxes[0], boxes[1]
    dim = max(range(ndim), key=lambda d: len({offsets[i][d] for i in boxes}))
    active: list[int] = []
    for i in sorted(boxes, key=lambda i: offsets[i][dim]):
        start = offsets[i][dim]
        active = [j for j in active if offsets[j][dim] + sizes[j][dim] > start]
        for j in active:
            if all(offsets[i][d] < offsets[j][d] + sizes[j][d] and offsets[j][d] < offsets[i][d] + sizes[i][d]
                   for d in range(ndim)):
                return j, i
        active.append(i)
    return None


def metadata_problems(md: Any, manifest: Any) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Check unpickled DCP metadata against itself and the manifest.

    Returns:
        ``(problems, tensors)``: ``[(file, problem)]`` (empty when valid) and ``{key:
        TensorStorageMetadata}`` of the well-formed tensors.
    """
    problems: list[tuple[str, str]] = []

    def bad(text: str, file: str = METADATA_NAME) -> None:
        problems.append((file, text))

    if not isinstance(md, Metadata):
        bad(f"not DCP metadata (got {type(md).__name__})")
        return problems, {}
    sdm, sd = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(sdm, dict):
        bad(f"state_dict_metadata is a {type(sdm).__name__}, expected a dict")
    if not isinstance(sd, dict):
        bad(f"storage_data is a {type(sd).__name__}, expected a dict")
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        bad(f"planner_data is a {type(md.planner_data).__name__}, expected a dict")
    if not isinstance(getattr(md, "storage_meta", None), (StorageMeta, type(None))):
        bad(f"storage_meta is a {type(md.storage_meta).__name__}, expected StorageMeta")
    if problems:
        return problems, {}

    tensors: dict[str, Any] = {}
    for key, item in sdm.items():
        if not isinstance(key, str):
            bad(f"item key {short_repr(key)} is not a string")
            continue
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            bad(f"item {key!r} is a {type(item).__name__}, expected tensor or bytes metadata")
            continue
        props, size, chunks = (getattr(item, a, None) for a in ("properties", "size", "chunks"))
        if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
            bad(f"tensor {key!r}: properties carry no torch dtype")
            continue
        if not _int_tuple(size):
            bad(f"tensor {key!r}: declared shape {short_repr(size)} is not a tuple of non-negative integers")
            continue
        if not isinstance(chunks, list) or not all([isinstance(c, ChunkStorageMetadata) and _int_tuple(c.offsets)
                                                    and _int_tuple(c.sizes) for c in chunks]):
            bad(f"tensor {key!r}: chunks are not a list of chunk metadata with integer offsets and sizes")
            continue
        outside = next((c for c in chunks if _outside(c, size)), None)
        if outside is not None:
            bad(f"tensor {key!r}: chunk at offset {list(outside.offsets)} of size {list(outside.sizes)} lies outside "
                f"its declared shape {list(size)}")
            continue
        tensors[key] = item

    stored: dict[tuple[str, tuple[int, ...]], int] = {}
    data_bytes: dict[str, int | None] = {}  # file name -> its size when it is a listed data file, else None
    for index, info in sd.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) or \
                not (index.offset is None or _int_tuple(index.offset)):
            bad(f"storage key {short_repr(index)} is not a valid metadata index")
            continue
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, (str, PurePath)) or \
                type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            bad(f"storage entry of {index.fqn!r} is malformed ({short_repr(info)})")
            continue
        if getattr(info, "transform_descriptors", None):
            bad(f"item {index.fqn!r} is stored with stream transforms {short_repr(info.transform_descriptors)}, which "
                "torch-ckpt never writes")
            continue
        rel = str(info.relative_path)
        if rel not in data_bytes:  # a few files hold every item: decide once per file
            listed = rel in manifest.files and rel not in (METADATA_NAME, MANIFEST_NAME) and \
                not RANK_FILE_RE.match(rel) and not NODE_METADATA_RE.match(rel)
            data_bytes[rel] = manifest.files[rel]["bytes"] if listed else None
        file_bytes = data_bytes[rel]
        if file_bytes is None:
            bad(f"item {index.fqn!r} is stored in {rel!r}, which is not a data file the manifest lists")
            continue
        end = info.offset + info.length
        if end > file_bytes:
            bad(f"item {index.fqn!r} is stored at bytes {info.offset}..{end}, past the end of the file "
                f"({file_bytes} bytes)", rel)
            continue
        if index.fqn not in sdm:
            bad(f"storage entry for {index.fqn!r}, which the metadata does not declare")
            continue
        if index.offset is not None:
            stored[(index.fqn, tuple(index.offset))] = info.length

    for key, item in list(tensors.items()):
        itemsize = item.properties.dtype.itemsize
        covered, ok = 0, True
        for chunk in item.chunks:
            length = stored.get((key, tuple(chunk.offsets)))
            n = math.prod(chunk.sizes)
            covered += n
            if length is None:
                bad(f"tensor {key!r}: the chunk at offset {list(chunk.offsets)} has no storage entry")
                ok = False
            elif n * itemsize > length:
                bad(f"tensor {key!r}: the chunk at offset {list(chunk.offsets)} declares {n * itemsize} bytes but its "
                    f"storage entry holds only {length}")
                ok = False
        total = math.prod(item.size)
        if covered != total:
            bad(f"tensor {key!r}: chunks hold {covered} of the {total} elements of its declared shape "
                f"{list(item.size)}")
            ok = False
        elif len(item.chunks) > 1 and (pair := _overlapping([tuple(c.offsets) for c in item.chunks],
                                                            [tuple(c.sizes) for c in item.chunks])):
            bad(f"tensor {key!r}: chunks at offsets {list(item.chunks[pair[0]].offsets)} and "
                f"{list(item.chunks[pair[1]].offsets)} overlap")
            ok = False
        if not ok:
            del tensors[key]
    return problems, tensors


def metadata_name(node: int) -> str:
    """File holding the DCP metadata that ``node``'s ranks load their node's copy with.

    A node-local checkpoint stores replicated tensors once per node; each node's metadata points
    every tensor at the copy its node holds. ``.metadata`` (on node 0 and in the durable tier)
    points every tensor at the one uploaded copy: the complete checkpoint every other reader uses.
    """
    return f"node_{node:05d}.metadata"


def read_metadata(where: str | os.PathLike | Location, manifest: Manifest, *, allow_symlinks: bool = False) -> Metadata:
    """The validated DCP metadata of a checkpoint (see :func:`metadata_problems`); for one node's copy
    of a node-local checkpoint, that node's metadata (:func:`metadata_name`).

    Raises:
        CheckpointCorruptError: ``.metadata`` is not listed, not a regular file, unreadable, or
            inconsistent (with itself or with the manifest); the message names the file.
        UnsafeCheckpointError: the pickle references code.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    node = manifest.node
    name = (manifest.nodes or {}).get("metadata") or (METADATA_NAME if node is None else metadata_name(node))
    source = loc.describe(name)
    if name not in manifest.files:
        raise corrupt(source, "DCP metadata is not listed in the manifest")
    md = load_dcp_metadata_bytes(read_listed(loc, manifest, name, MAX_METADATA_BYTES), source)
    problems, _ = metadata_problems(md, manifest)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise corrupt(loc.describe(file), f"{text}{more}")
    return md


def tensor_items(md: Metadata) -> dict[str, TensorStorageMetadata]:
    """``{key: TensorStorageMetadata}`` of the tensors of (validated) metadata."""
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def record_problems(where: str | os.PathLike | Location, manifest: Manifest, md: Metadata, *, part: int = 0,
                    parts: int = 1, allow_symlinks: bool = False,
                    tensors: dict[str, TensorStorageMetadata] | None = None,
                    files: list[str] | None = None) -> list[tuple[str, str]]:
    """``[(file, problem)]`` for tensor records that do not match the metadata (this reader's share of the files).

    Args:
        where: the checkpoint directory.
        manifest: its manifest (only the data files it lists are opened).
        md: its DCP metadata (validated: :func:`read_metadata` or :func:`metadata_problems`).
        part: this reader's index when ``parts`` readers split the data files.
        parts: how many readers split the data files.
        allow_symlinks: follow symlinked data files.
        tensors: the well-formed tensors to check (default: every tensor of ``md``).
        files: check the records of these data files only (instead of a ``part`` of all of them).

    Raises:
        CheckpointCorruptError: a data file is not listed, missing, not a regular file, or unreadable.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    tensors = tensor_items(md) if tensors is None else tensors
    if files is None:  # one node's copy holds its own files only: records of another node's are checked there
        held = manifest.local_files()
        every = sorted({str(info.relative_path) for index, info in md.storage_data.items()
                        if index.fqn in tensors and str(info.relative_path) in held})
        files = [name for i, name in enumerate(every) if i % parts == part]
    mine = list(files)
    for name in mine:
        if name not in manifest.files:
            raise corrupt(loc.describe(name), "is not listed in the manifest; refusing unverified data")
    return storage_record_problems(md, tensors, loc.open_range, mine)


def check_records(where: str | os.PathLike | Location, manifest: Manifest, md: Metadata, *, part: int = 0,
                  parts: int = 1, allow_symlinks: bool = False) -> None:
    """Raise for the first tensor record that does not match the metadata (see :func:`record_problems`).

    Raises:
        CheckpointCorruptError: a record's byte range, dtype, size or shape disagrees with
            ``.metadata``; the message names the data file, the tensor key and the byte range.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    problems = record_problems(loc, manifest, md, part=part, parts=parts)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise corrupt(loc.describe(file), f"{text}{more}")
