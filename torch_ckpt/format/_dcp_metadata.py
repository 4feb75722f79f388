"""DCP's ``.metadata`` of a checkpoint, validated against itself, the manifest and the stored records.

Part of the one validation path every reader uses (see :mod:`torch_ckpt.format._files`). ``.metadata`` is
read with the restricted unpickler (:func:`torch_ckpt.format._dcp_read.load_dcp_metadata_bytes`), then every
field type is checked; storage entries lie inside manifest-listed data files; every tensor's
chunks lie inside its declared shape, do not overlap and cover it exactly; each chunk's bytes fit
in its storage entry, so declared sizes are bounded by the files' real sizes before anything is
allocated. Finally every chunk's ``torch.save`` record in the data files must match its declared
byte range, dtype, size and shape (:mod:`torch_ckpt.format._records`: headers only, nothing unpickled).
"""

from __future__ import annotations

import math
import os
from pathlib import PurePath
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torch_ckpt.format._dcp_read import load_dcp_metadata_bytes
from torch_ckpt.format._files import METADATA_NAME, NODE_METADATA_RE, RANK_FILE_RE, read_listed
from torch_ckpt.format._manifest import MANIFEST_NAME, Manifest
from torch_ckpt.format._records import storage_record_problems
from torch_ckpt.format._state_tree import MAX_NDIM
from torch_ckpt.storage._locations import Location, as_location, corrupt, short_repr

__all__ = ["MAX_METADATA_BYTES", "check_records", "metadata_name", "metadata_problems", "read_metadata",
           "record_problems", "tensor_items"]

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
