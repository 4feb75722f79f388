"""A checkpoint's manifest, the files it lists, and the per-rank state trees: the one validation path.

Every reader (restore, ``verify``, ``inspect``, ``convert``, the durable tier) goes through here;
DCP's ``.metadata`` is checked in :mod:`torch_ckpt.format._dcp_read`. What a reader may rely on once
a check here passed:

* **Manifest** (:func:`read_manifest`, the only reader, for local directories and fsspec URLs
  alike): written last into a checkpoint (:mod:`torch_ckpt.root._layout`), a regular file (never
  followed through a symlink unless asked) of at most :data:`MAX_MANIFEST_BYTES`, parsed with
  bounded nesting and integer length, every field of the right type and range, every listed name
  a plain file name inside the checkpoint, each with its size and CRC-32.
* **Files** (:func:`verify_files`): only listed files are ever opened, each a regular file inside
  the checkpoint (``O_NOFOLLOW``), with the listed size and, when checksums are on, CRC-32.
* **Per-rank JSON** (``rank_00000.json`` ...; :func:`read_rank_doc`): one per rank of the world
  size, at most :data:`MAX_RANK_JSON_BYTES`, parsed with bounded nesting (:data:`MAX_STATE_DEPTH`)
  and integer length; ``rank``, ``step`` and ``world_size`` agree with the manifest; every node of
  the tree is well formed (:func:`walk_tree`, the one walker of encoded trees, which checks each
  node the way :func:`torch_ckpt.format._codec.join_state` will decode it).

Any violation raises :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file, or, with
``collect=``, is appended to a list instead (``verify`` reports every problem).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from torch_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from torch_ckpt.format._codec import (
    BYTES_TAG,
    DICT_TAG,
    FLOAT_TAG,
    INLINE_TENSOR_TAG,
    NDARRAY_TAG,
    NPSCALAR_TAG,
    ODICT_TAG,
    TENSOR_TAG,
    TUPLE_TAG,
)
from torch_ckpt.policy._lineage import BASE, Lineage, MalformedLineage, lineage_from_doc
from torch_ckpt.storage._bounded import Malformed, corrupt, loads_bounded, short_repr
from torch_ckpt.storage._local_files import open_regular
from torch_ckpt.storage._locations import DurableUnavailableError, Location, as_location

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_MANIFEST_INT_DIGITS",
    "MAX_NDIM",
    "MAX_RANK_JSON_BYTES",
    "MAX_STATE_DEPTH",
    "MAX_STATE_INT_DIGITS",
    "METADATA_NAME",
    "Manifest",
    "NODE_METADATA_RE",
    "RANK_FILE_RE",
    "embedded_info",
    "manifest_from_doc",
    "open_listed",
    "parse_manifest",
    "parse_rank_doc",
    "rank_file_name",
    "rank_file_problems",
    "read_listed",
    "read_manifest",
    "read_rank_doc",
    "tensor_keys",
    "verify_files",
    "walk_tree",
]

FORMAT_NAME = "torch-ckpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
"""Largest ``manifest.json`` read (bytes); a real one lists ~100 bytes per file."""
MAX_MANIFEST_DEPTH = 16
"""Deepest nesting of containers in a manifest (a real one has 3)."""
MAX_MANIFEST_INT_DIGITS = 20
"""Longest integer in a manifest (digits); sizes, steps and CRCs fit in 64 bits."""


def rank_file_name(rank: int) -> str:
    """Per-rank JSON file holding that rank's non-tensor state."""
    return f"rank_{rank:05d}.json"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` records about one committed checkpoint.

    Attributes:
        step: training step (int).
        world_size: number of ranks that wrote it.
        files: ``{file name: {"bytes": int, "crc32": int}}`` for every file except the manifest.
        wall_time: Unix time (seconds) of the commit.
        torch_version: ``torch.__version__`` of the writer.
        tensor_bytes: bytes of tensor payload saved (all ranks, after deduplication).
        timings: seconds spent per phase (``staging_s``, ``persist_s``, ...).
        format_version: on-disk format version.
        tiers: tiers holding a complete, verified copy besides this one, e.g.
            ``{"durable": {"url": "s3://b/run", "committed_at": 1.7e9}}``.
        nodes: for a checkpoint written to node-local roots, ``{"rank_node": [node of each rank],
            "file_node": {file name: node holding it}, "shared": [uploaded files holding tensors
            several nodes hold]}``, plus for a node's copy fetched from the durable tier ``"held"``
            (its files) and ``"metadata"`` (the DCP metadata file it loads with); empty for a
            shared root.
        node: the node whose copy this directory is (it holds only the files ``file_node`` gives
            that node); None for a complete copy (shared root, durable tier).
        lineage: the run segment the checkpoint belongs to (:mod:`torch_ckpt.policy._lineage`); written as
            ``"lineage"`` except for the base segment (manifests without it).
    """

    step: int
    world_size: int
    files: dict[str, dict[str, int]]
    wall_time: float = field(default_factory=time.time)
    torch_version: str = field(default_factory=lambda: torch.__version__)
    tensor_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    tiers: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)
    node: int | None = None
    lineage: Lineage = BASE

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written to disk."""
        doc = {"format": FORMAT_NAME, "format_version": self.format_version, "step": self.step,
               "wall_time": self.wall_time, "world_size": self.world_size, "torch_version": self.torch_version,
               "tensor_bytes": self.tensor_bytes, "timings": self.timings, "tiers": self.tiers, "files": self.files}
        if self.nodes:
            doc["nodes"] = self.nodes
        if self.node is not None:
            doc["node"] = self.node
        if not self.lineage.is_base:
            doc["lineage"] = self.lineage.to_json()
        return doc

    @property
    def partial(self) -> bool:
        """True for one node's copy of a node-local checkpoint (it holds only that node's files)."""
        return self.node is not None

    def local_files(self) -> dict[str, dict[str, int]]:
        """The listed files this copy holds: all of them, or those of :attr:`node` for a node's copy."""
        if self.node is None:
            return self.files
        if "held" in self.nodes:  # a copy fetched from the durable tier
            return {name: self.files[name] for name in self.nodes["held"]}
        held = self.nodes.get("file_node", {})
        return {name: info for name, info in self.files.items() if held.get(name) == self.node}

    @classmethod
    def from_json(cls, data: Any, source: str) -> Manifest:
        """Validate a parsed manifest object (every field's type and range, plain file names).

        Raises:
            CheckpointCorruptError: naming ``source`` and the offending field.
        """
        return manifest_from_doc(data, source)


def _is_plain_file_name(name: Any) -> bool:
    """True for a bare file name (no directory part, no '..', no NUL): manifests may not point elsewhere."""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name \
        and "\\" not in name and "\0" not in name


def _int_field(doc: dict, key: str, lo: int, hi: int, *, default: int | None = None) -> int:
    if key not in doc and default is not None:
        return default
    if key not in doc:
        raise Malformed(f"{key} is missing")
    value = doc[key]
    if type(value) is not int:
        raise Malformed(f"{key} must be an integer, got {type(value).__name__} {short_repr(value)}")
    if not lo <= value <= hi:
        raise Malformed(f"{key} {value} is out of range [{lo}, {hi}]")
    return value


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def manifest_from_doc(data: Any, source: str) -> Manifest:
    """Validate a parsed manifest object and build the :class:`~torch_ckpt.root._layout.Manifest`.

    Raises:
        CheckpointCorruptError: a field is missing, of the wrong type or out of range; names ``source``.
    """
    try:
        if not isinstance(data, dict):
            raise Malformed(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT_NAME:
            raise Malformed(f"format is {short_repr(data.get('format'))}, expected {FORMAT_NAME!r}")
        version = _int_field(data, "format_version", 1, 1 << 31)
        if version > FORMAT_VERSION:
            raise Malformed(f"format_version {version} is newer than this torch-ckpt supports ({FORMAT_VERSION}); "
                             "upgrade torch-ckpt")
        step = _int_field(data, "step", 0, (1 << 63) - 1)
        world_size = _int_field(data, "world_size", 1, (1 << 31) - 1)
        files_doc = data.get("files")
        if not isinstance(files_doc, dict):
            raise Malformed(f"files must be an object, got {type(files_doc).__name__}")
        files: dict[str, dict[str, int]] = {}
        for name, info in files_doc.items():
            if not _is_plain_file_name(name) or name == MANIFEST_NAME:
                raise Malformed(f"file name {short_repr(name)} is not a plain file name inside the checkpoint")
            if not isinstance(info, dict):
                raise Malformed(f"entry of {name!r} must be an object, got {type(info).__name__}")
            try:
                files[name] = {"bytes": _int_field(info, "bytes", 0, (1 << 63) - 1),
                               "crc32": _int_field(info, "crc32", 0, (1 << 32) - 1)}
            except Malformed as exc:
                raise Malformed(f"entry of {name!r}: {exc}") from None
        wall_time = data.get("wall_time")
        if not _number(wall_time):
            raise Malformed(f"wall_time must be a finite number, got {short_repr(wall_time)}")
        torch_version = data.get("torch_version")
        if not isinstance(torch_version, str):
            raise Malformed(f"torch_version must be a string, got {short_repr(torch_version)}")
        tensor_bytes = _int_field(data, "tensor_bytes", 0, (1 << 63) - 1, default=0)
        timings = data.get("timings", {})
        if not isinstance(timings, dict) or not all(isinstance(k, str) and type(v) in (int, float)
                                                    for k, v in timings.items()):
            raise Malformed("timings must map phase names to numbers")
        tiers = data.get("tiers", {})
        if not isinstance(tiers, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in tiers.items()):
            raise Malformed("tiers must map tier names to objects")
        nodes, node = _nodes_fields(data, files, world_size)
        try:
            lineage = lineage_from_doc(data.get("lineage"))
        except MalformedLineage as exc:
            raise Malformed(str(exc)) from None
    except Malformed as exc:
        raise corrupt(source, f"invalid manifest ({exc})") from None
    return Manifest(step=step, world_size=world_size, files=files, wall_time=float(wall_time),
                    torch_version=torch_version, tensor_bytes=tensor_bytes, timings=dict(timings),
                    format_version=version, tiers=dict(tiers), nodes=nodes, node=node, lineage=lineage)


def _nodes_fields(data: dict, files: dict[str, Any], world_size: int) -> tuple[dict[str, Any], int | None]:
    """The optional node-local fields of a manifest: ``nodes`` (which node holds which file) and ``node``."""
    nodes = data.get("nodes", {})
    if not isinstance(nodes, dict):
        raise Malformed(f"nodes must be an object, got {type(nodes).__name__}")
    node = data.get("node")
    if not nodes:
        if node is not None:
            raise Malformed("node is set but nodes (which node holds which file) is missing")
        return {}, None
    rank_node, file_node = nodes.get("rank_node"), nodes.get("file_node")
    if not isinstance(rank_node, list) or len(rank_node) != world_size or \
            not all(type(n) is int and 0 <= n < world_size for n in rank_node):
        raise Malformed(f"nodes.rank_node must list the node (0..{world_size - 1}) of each of the {world_size} ranks")
    count = max(rank_node) + 1
    if not isinstance(file_node, dict) or set(file_node) != set(files) or \
            not all(type(n) is int and 0 <= n < count for n in file_node.values()):
        raise Malformed("nodes.file_node must give the node (an int below the node count) of every listed file")
    if node is not None and (type(node) is not int or not 0 <= node < count):
        raise Malformed(f"node must be an int in 0..{count - 1}, got {short_repr(node)}")
    out: dict[str, Any] = {"rank_node": list(rank_node), "file_node": dict(file_node)}
    for key in ("shared", "held"):
        if key in nodes:
            names = nodes[key]
            if not isinstance(names, list) or not all(isinstance(n, str) and n in files for n in names):
                raise Malformed(f"nodes.{key} must list files of the manifest")
            out[key] = list(names)
    if "metadata" in nodes:
        if nodes["metadata"] not in files:
            raise Malformed("nodes.metadata must name a file of the manifest")
        out["metadata"] = nodes["metadata"]
    return out, node


def parse_manifest(raw: bytes, source: str) -> Manifest:
    """Parse and validate the bytes of a ``manifest.json`` (see :func:`manifest_from_doc`).

    Raises:
        CheckpointCorruptError: larger than :data:`MAX_MANIFEST_BYTES`, not bounded JSON, or not a
            valid torch-ckpt manifest; the message names ``source``.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise corrupt(source, f"manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} accepted")
    data = loads_bounded(raw, source, what="manifest", max_depth=MAX_MANIFEST_DEPTH,
                         max_int_digits=MAX_MANIFEST_INT_DIGITS)
    return manifest_from_doc(data, source)


def read_manifest(step_dir: str | os.PathLike | Location, *, allow_symlinks: bool = False) -> Manifest:
    """Read and validate the ``manifest.json`` of a checkpoint directory (local path or :class:`Location`).

    Raises:
        CheckpointNotFoundError: there is no manifest (not a committed checkpoint).
        CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``), not a regular file,
            unreadable (permissions, I/O error), too large, or not a valid manifest; the message
            names the file.
        DurableUnavailableError: the store holding it cannot be reached.
    """
    loc = as_location(step_dir, allow_symlinks=allow_symlinks)
    source = loc.describe(MANIFEST_NAME)
    try:
        raw = loc.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES, what="the manifest")
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(f"{source} does not exist: {loc.describe()} is not a committed torch-ckpt "
                                      "checkpoint") from exc
    except DurableUnavailableError:
        raise
    except OSError as exc:
        raise corrupt(source, f"the manifest cannot be read ({exc.strerror or exc})") from exc
    return parse_manifest(raw, source)


MAX_NDIM = 64
"""Most dimensions of an embedded tensor or array."""
_B64_RE = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@cache
def _torch_dtype(name: str) -> Any:
    """The torch dtype ``name`` if an embedded tensor may use it (raw bytes viewable as it), else None."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        return None
    try:
        torch.empty(dtype.itemsize, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError):
        return None
    return dtype


@lru_cache(maxsize=256)
def _numpy_dtype(name: str) -> Any:
    """The numpy dtype ``name`` if an embedded array may use it (no objects, non-empty items), else None."""
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        return None
    if dtype.hasobject or dtype.itemsize == 0:
        return None
    return dtype


def _shape(value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in value):
        raise Malformed(f"invalid shape {short_repr(value)}")
    return value


def _b64_bytes(text: Any) -> int:
    """Bytes that base64 ``text`` decodes to; raises for anything but canonical base64."""
    if not isinstance(text, str) or len(text) % 4 or not _B64_RE.fullmatch(text):
        raise Malformed("embedded data is not base64")
    return len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))


def embedded_info(kind: str, node: dict) -> tuple[list[int], str, int]:
    """``(shape, dtype name, bytes)`` of an embedded tensor (``kind`` "inline") or array ("ndarray").

    Raises:
        ValueError: unknown or unsafe dtype, invalid shape, data that is not base64, or data whose
            length differs from what the shape and dtype need (checked before any allocation).
    """
    name = node.get("dtype")
    dtype = (_torch_dtype if kind == "inline" else _numpy_dtype)(name) if isinstance(name, str) else None
    if dtype is None:
        raise Malformed(f"unsupported {'tensor' if kind == 'inline' else 'array'} dtype {short_repr(name)}")
    shape = _shape(node.get("shape"))
    nbytes = math.prod(shape) * dtype.itemsize
    got = _b64_bytes(node.get(INLINE_TENSOR_TAG if kind == "inline" else NDARRAY_TAG))
    if got != nbytes:
        raise Malformed(f"embedded data holds {got} bytes, its shape {shape} and dtype need {nbytes}")
    dtype_name = str(dtype).removeprefix("torch.") if kind == "inline" else dtype.name
    return shape, dtype_name, nbytes


def _is_tag_node(node: dict, tag: str) -> bool:
    return len(node) == 1 and tag in node


def walk_tree(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """Yield ``(path, kind, node)`` for every leaf of a per-rank tree, validating every node on the way.

    ``kind`` is "tensor" (a DCP placeholder), "inline" (an embedded tensor), "ndarray" (an embedded
    numpy array) or "value". Every node is checked the way :func:`torch_ckpt.format._codec.join_state` will
    decode it, so a tree this walk accepts decodes without error. Iterative (no recursion).

    Raises:
        ValueError: a malformed node; the message names its dotted path.
    """
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, path)]
    while stack:
        node, where = stack.pop()
        try:
            if isinstance(node, list):
                stack.extend((v, where + (str(i),)) for i, v in reversed(list(enumerate(node))))
            elif not isinstance(node, dict):
                yield where, "value", node
            elif len(node) == 1 and TENSOR_TAG in node:
                if not isinstance(node[TENSOR_TAG], str):
                    raise Malformed(f"tensor placeholder {short_repr(node[TENSOR_TAG])} is not a key")
                yield where, "tensor", node
            elif INLINE_TENSOR_TAG in node:
                embedded_info("inline", node)
                yield where, "inline", node
            elif NDARRAY_TAG in node:
                embedded_info("ndarray", node)
                yield where, "ndarray", node
            elif NPSCALAR_TAG in node:
                name = node.get("dtype")
                dtype = _numpy_dtype(name) if isinstance(name, str) else None
                value = node[NPSCALAR_TAG]
                if dtype is None or isinstance(value, (dict, list)):
                    raise Malformed(f"invalid numpy scalar {short_repr(node)}")
                try:
                    dtype.type(value)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise Malformed(f"invalid numpy scalar {short_repr(node)} ({exc})") from None
                yield where, "value", node
            elif len(node) == 1 and BYTES_TAG in node:
                _b64_bytes(node[BYTES_TAG])
                yield where, "value", node
            elif len(node) == 1 and FLOAT_TAG in node:
                if not isinstance(node[FLOAT_TAG], str):
                    raise Malformed(f"invalid float {short_repr(node[FLOAT_TAG])}")
                try:
                    float(node[FLOAT_TAG])
                except ValueError:
                    raise Malformed(f"invalid float {short_repr(node[FLOAT_TAG])}") from None
                yield where, "value", node
            elif len(node) == 1 and TUPLE_TAG in node:
                if not isinstance(node[TUPLE_TAG], list):
                    raise Malformed(f"malformed {TUPLE_TAG} node")
                stack.extend((v, where + (str(i),)) for i, v in reversed(list(enumerate(node[TUPLE_TAG]))))
            elif len(node) == 1 and ODICT_TAG in node:  # an OrderedDict: its items, encoded as a dict's
                inner = node[ODICT_TAG]
                if not isinstance(inner, dict) or _is_tag_node(inner, ODICT_TAG):
                    raise Malformed(f"malformed {ODICT_TAG} node")
                stack.append((inner, where))
            elif len(node) == 1 and DICT_TAG in node:
                items = node[DICT_TAG]
                if not isinstance(items, list) or not all(isinstance(it, list) and len(it) == 2 and
                                                          not isinstance(it[0], list) for it in items):
                    raise Malformed(f"malformed {DICT_TAG} node")
                for key, value in reversed(items):  # a key is an encoded value too (tuple, bytes, numpy...)
                    label = str(key) if not isinstance(key, dict) else f"<key {short_repr(key)}>"
                    stack.append((value, where + (label,)))
                    if isinstance(key, dict):
                        stack.append((key, where + (label,)))
            else:
                stack.extend((v, where + (str(k),)) for k, v in reversed(list(node.items())))
        except Malformed as exc:
            raise Malformed(f"{'.'.join(where) or '<root>'}: {exc}") from None


def tensor_keys(tree: Any) -> set[str]:
    """Keys of the DCP tensors that a (validated) encoded tree refers to."""
    return {node[TENSOR_TAG] for _, kind, node in walk_tree(tree) if kind == "tensor"}


MAX_RANK_JSON_BYTES = 4 << 30
"""Largest per-rank JSON file read (bytes)."""
MAX_STATE_DEPTH = 400
"""Deepest nesting of containers in a per-rank JSON file (the saved state's nesting plus tags).

``codec.split_state`` refuses states nested deeper than ``codec.MAX_DEPTH`` (100) containers; one
container encodes to at most 3 JSON levels (tag object, item list, key/value pair), plus the document's
own wrapper, so everything ``save()`` accepts stays below this bound and restores."""
MAX_STATE_INT_DIGITS = 4300
"""Longest integer in a per-rank JSON file (digits): Python's default int/str conversion limit."""
METADATA_NAME = ".metadata"
RANK_FILE_RE = re.compile(r"^rank_(\d+)\.json$")
NODE_METADATA_RE = re.compile(r"^node_\d{5,}\.metadata$")


def open_listed(step_dir: str | os.PathLike, manifest: Manifest, name: str, *, allow_symlinks: bool = False) -> int:
    """Open the manifest-listed file ``name`` of a local checkpoint as a regular file; returns the descriptor.

    Raises:
        CheckpointCorruptError: ``name`` is not listed, is missing, or is not a regular file inside
            the checkpoint.
    """
    path = Path(step_dir) / name
    if name not in manifest.files:
        raise corrupt(str(path), "is not listed in the manifest; refusing unverified data")
    try:
        return open_regular(path, allow_symlinks=allow_symlinks, what="file listed in the manifest")
    except FileNotFoundError:
        raise corrupt(str(path), "listed in the manifest but missing") from None
    except OSError as exc:
        raise corrupt(str(path), f"file listed in the manifest cannot be read ({exc.strerror})") from None


def read_listed(where: str | os.PathLike | Location, manifest: Manifest, name: str, limit: int, *,
                allow_symlinks: bool = False) -> bytes:
    """All bytes of the manifest-listed file ``name`` (at most ``limit``; its size must be the listed one).

    Raises:
        CheckpointCorruptError: not listed, larger than ``limit``, missing, not a regular file,
            unreadable, or not of the listed size; the message names it.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    source = loc.describe(name)
    if name not in manifest.files:
        raise corrupt(source, "is not listed in the manifest; refusing unverified data")
    if manifest.files[name]["bytes"] > limit:
        raise corrupt(source, f"is {manifest.files[name]['bytes']} bytes, more than the {limit} accepted")
    try:
        data = loc.read_bytes(name, limit)
    except (FileNotFoundError, NotADirectoryError):
        raise corrupt(source, "listed in the manifest but missing") from None
    except (CheckpointCorruptError, DurableUnavailableError):
        raise
    except OSError as exc:
        raise corrupt(source, f"file listed in the manifest cannot be read ({exc.strerror or exc})") from None
    if len(data) != manifest.files[name]["bytes"]:
        raise corrupt(source, f"size {len(data)} bytes, manifest says {manifest.files[name]['bytes']}")
    return data


def verify_files(where: str | os.PathLike | Location, manifest: Manifest, *, checksums: bool, part: int = 0,
                 parts: int = 1, allow_symlinks: bool = False, collect: list[tuple[str, str]] | None = None,
                 progress: Any = None, store_digests: Mapping[str, str] | None = None) -> int:
    """Check every file the manifest lists (this reader's share when ``parts`` > 1).

    Each must be a regular file inside the checkpoint with the listed size, and with ``checksums``
    the listed CRC-32 (read in chunks through :func:`torch_ckpt.storage._crc.crc32`). One node's copy of a
    node-local checkpoint is checked for that node's files. The same function checks local
    checkpoints, checkpoints on a store, uploads to the durable tier and files fetched from it, with
    the same messages.

    Store digests: with ``checksums`` and ``store_digests`` (``{file name: digest}``), a file whose
    stored object reports exactly that digest (:meth:`~torch_ckpt.storage._locations.Location.stat`, e.g. the
    MD5 ETag an S3-compatible store computed over the bytes it received) passes without being read.
    The caller vouches that each digest is of bytes with the listed CRC-32 (the durable tier
    computes it from the local file in the same pass as that file's CRC-32). Any other file is read
    and its CRC-32 compared, so a digest that cannot match (SSE-KMS ETags) costs a read, never a
    false alarm.

    Args:
        where: the checkpoint directory (local path or :class:`~torch_ckpt.storage._locations.Location`).
        manifest: its manifest.
        checksums: also compare every file's CRC-32 (reads every byte not vouched for by ``store_digests``).
        part: this reader's index when ``parts`` readers split the files.
        parts: how many readers split the files.
        allow_symlinks: follow symlinked files.
        collect: append ``(file name, problem)`` for every problem instead of raising the first.
        progress: an object with ``update(bytes)`` (a progress bar), advanced as files are checked.
        store_digests: expected store digests of some files (see above).

    Returns:
        Bytes read to compare CRC-32s (0 without ``checksums``).

    Raises:
        CheckpointCorruptError: (without ``collect``) a file is missing, a symlink, not a regular
            file, unreadable, or has the wrong size or CRC-32; the message names it.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    read = 0

    def bad(name: str, text: str) -> None:
        if collect is None:
            raise corrupt(loc.describe(name), text)
        collect.append((name, text))

    for i, (name, info) in enumerate(sorted(manifest.local_files().items())):
        if i % parts != part:
            continue
        try:
            size, digest = loc.stat(name)
            if size != info["bytes"]:
                bad(name, f"size {size} bytes, manifest says {info['bytes']} (truncated or overwritten)")
            elif checksums and not (digest is not None and store_digests and digest == store_digests.get(name)):
                size, crc = loc.checksum(name, progress)
                read += size
                if size != info["bytes"]:
                    bad(name, f"read {size} bytes, manifest says {info['bytes']}")
                elif crc != info["crc32"]:
                    bad(name, f"CRC-32 {crc:#010x} does not match the manifest ({info['crc32']:#010x}); the "
                              "file is corrupt")
                continue
        except (FileNotFoundError, NotADirectoryError):
            bad(name, "listed in the manifest but missing")
        except CheckpointCorruptError as exc:  # a symlink, directory or FIFO
            if collect is None:
                raise
            bad(name, str(exc).removeprefix(loc.describe(name) + ": "))
        except DurableUnavailableError:
            raise
        except OSError as exc:
            bad(name, f"cannot be read ({exc.strerror or exc})")
        if checksums and progress is not None:
            progress.update(info["bytes"])
    return read


def rank_file_problems(manifest: Any) -> list[tuple[str, str]]:
    """``[(file, problem)]`` when the manifest does not list exactly one JSON file per rank.

    Counts the listed rank files before anything is done per rank, so a manifest declaring a huge
    world size costs no more than its file list.
    """
    listed = sum(1 for name in manifest.files if RANK_FILE_RE.match(name))
    if manifest.world_size > listed:  # checked first: never loop over a declared (untrusted) world size
        missing = next(r for r in range(listed + 1) if rank_file_name(r) not in manifest.files)
        return [(MANIFEST_NAME, f"world size {manifest.world_size} but the manifest lists {listed} per-rank state "
                                f"file(s); {rank_file_name(missing)} is not listed")]
    problems = []
    for r in range(manifest.world_size):
        if rank_file_name(r) not in manifest.files:
            problems.append((rank_file_name(r), f"per-rank state file of rank {r} is not listed in the manifest "
                                                f"(world size {manifest.world_size})"))
    return problems


def parse_rank_doc(raw: bytes, source: str, manifest: Manifest, rank: int, *,
                   tensor_keys: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Parse and validate the per-rank JSON document of ``rank`` (bounded; see the module docstring).

    Args:
        raw: the file's bytes.
        source: its path or URL, for messages.
        manifest: the checkpoint's manifest (step and world size must agree).
        rank: the rank the file belongs to.
        tensor_keys: when given, every tensor placeholder must satisfy it (be a DCP tensor).

    Returns:
        The document ``{"step", "rank", "world_size", "tree"}``.

    Raises:
        CheckpointCorruptError: too large, not bounded JSON, fields that disagree with the manifest,
            or a malformed tree node (named by its dotted path).
    """
    if len(raw) > MAX_RANK_JSON_BYTES:
        raise corrupt(source, f"per-rank state file is {len(raw)} bytes, more than the {MAX_RANK_JSON_BYTES} "
                               "accepted")
    doc = loads_bounded(raw, source, what="per-rank state file", max_depth=MAX_STATE_DEPTH,
                        max_int_digits=MAX_STATE_INT_DIGITS)
    if not isinstance(doc, dict) or "tree" not in doc:
        raise corrupt(source, "per-rank state file has no 'tree'")
    got = doc.get("rank")
    if type(got) is not int or got != rank:
        raise corrupt(source, f"per-rank state file of rank {rank} says rank {short_repr(got)} (renamed or copied from "
                               "another rank)")
    manifest_source = source[: len(source) - len(PurePath(source).name)] + MANIFEST_NAME
    for key, want in (("step", manifest.step), ("world_size", manifest.world_size)):
        got = doc.get(key)
        if type(got) is not int or got != want:
            raise corrupt(source, f"{key} {short_repr(got)} in this per-rank state file disagrees with {key} "
                                  f"{want} in {manifest_source}: one of the two files was altered, or they come from "
                                  "different checkpoints")
    try:
        for where, kind, node in walk_tree(doc["tree"]):
            if kind == "tensor" and tensor_keys is not None and not tensor_keys(node[TENSOR_TAG]):
                raise Malformed(f"{'.'.join(where) or '<root>'}: refers to tensor {node[TENSOR_TAG]!r}, which the "
                                 "DCP metadata does not hold")
    except Malformed as exc:
        raise corrupt(source, f"malformed state tree ({exc})") from None
    return doc


def read_rank_doc(where: str | os.PathLike | Location, manifest: Manifest, rank: int, *, allow_symlinks: bool = False,
                  tensor_keys: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The validated per-rank document ``{"step", "rank", "world_size", "tree"}`` of ``rank``.

    The one reader of per-rank files, local or on a store; see :func:`parse_rank_doc` for the checks.

    Raises:
        CheckpointCorruptError: the rank files are not one per rank, or this one is missing, not a
            regular file, or malformed; the message names the file.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    problems = rank_file_problems(manifest)
    if problems:
        raise corrupt(loc.describe(problems[0][0]), problems[0][1])
    name = rank_file_name(rank)
    raw = read_listed(loc, manifest, name, MAX_RANK_JSON_BYTES)
    return parse_rank_doc(raw, loc.describe(name), manifest, rank, tensor_keys=tensor_keys)
