"""A checkpoint's files: the values codec, the manifest and rank files, DCP metadata, and pickle-free DCP reads.

Restore, ``verify``, ``inspect``, ``convert`` and the durable tier read checkpoints only through
here. Every check raises :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file, or,
with ``collect=``, appends to a list (``verify`` reports every problem):

* **Manifest** (:func:`read_manifest`, local or fsspec): a regular file (no symlink unless asked) of
  at most :data:`MAX_MANIFEST_BYTES`, bounded JSON, every field typed and in range, every listed
  name a plain file name with its size and CRC-32.
* **Files** (:func:`verify_files`): only listed files are opened, as regular files inside the
  checkpoint (``O_NOFOLLOW``), with the listed size and, with checksums, CRC-32.
* **Per-rank JSON** (:func:`read_rank_doc`): one per rank, at most :data:`MAX_RANK_JSON_BYTES`,
  bounded JSON; ``rank``/``step``/``world_size`` agree with the manifest; :func:`walk_tree` checks
  each node the way :func:`join_state` decodes it.
* **DCP metadata** (:func:`read_metadata`): unpickled admitting only DCP's metadata classes, then
  :func:`metadata_problems`: storage entries lie inside listed data files; chunks lie inside the
  shape, do not overlap, cover it and fit their storage entries (sizes bounded before allocating).
* **Records** (:func:`record_problems`): each chunk's ``torch.save`` record matches its byte range,
  dtype, size and shape (headers only, nothing unpickled).

:func:`load_tensors` runs ``dcp.load`` through :class:`SafeFileSystemReader` (listed regular files)
and :class:`SafeLoadPlanner` (no pickled ``BYTE_IO``), so loading never executes checkpoint code.

The codec (:func:`split_state`, :func:`join_state`) sends tensors to DCP under flat dot-joined keys
and every other value to a JSON tree keeping its exact type; which values are stored and which are
refused (with a :class:`ConfigError` naming the key path, before anything is written) is listed in
``docs/values.md``. Tensors of *rank-local* subtrees are embedded as base64 (DCP would deduplicate
same-named tensors of several ranks). With ``replicated_keys`` only plain tensors under those
prefixes and ``DTensor``/``ShardedTensor`` are global; any other tensor is per rank, stored by rank
``r`` under ``__rank<r>__.<key>`` (:func:`rank_key`; rank 0 keeps ``<key>``).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import io
import json
import math
import os
import pickle
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path, PurePath
from typing import Any, TypeGuard, cast

import numpy as np
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
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    UnsafeCheckpointError,
)
from torch_ckpt.format._records import storage_record_problems
from torch_ckpt.policy._lineage import BASE, Lineage, MalformedLineage, lineage_from_doc
from torch_ckpt.storage._locations import (
    DurableUnavailableError,
    Location,
    Malformed,
    as_location,
    corrupt,
    loads_bounded,
    open_regular,
    short_repr,
)

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH",
    "MAX_MANIFEST_INT_DIGITS", "MAX_METADATA_BYTES", "MAX_NDIM", "MAX_RANK_JSON_BYTES", "MAX_STATE_DEPTH",
    "MAX_STATE_INT_DIGITS", "METADATA_NAME", "Manifest", "NODE_METADATA_RE", "RANK_FILE_RE", "SafeFileSystemReader",
    "SafeLoadPlanner", "check_records", "embedded_info", "load_dcp_metadata_bytes", "load_tensors",
    "metadata_name", "metadata_problems", "open_listed", "parse_manifest", "parse_rank_doc",
    "rank_file_name", "rank_file_problems", "read_dcp_metadata", "read_listed", "read_manifest", "read_metadata",
    "read_rank_doc", "record_problems", "tensor_items", "tensor_keys", "unwrap_dcp_error", "verify_files",
    "walk_tree", "split_state", "join_state", "TENSOR_TAG", "MAX_DEPTH", "rank_key", "logical_key",
    "is_per_rank_key", "tensor_kind"
]

TENSOR_TAG, INLINE_TENSOR_TAG, NDARRAY_TAG = "__tensor__", "__tensor_b64__", "__ndarray_b64__"
NPSCALAR_TAG, _NPSCALAR_RAW, TUPLE_TAG, DICT_TAG = "__np_scalar__", "__np_scalar_b64__", "__tuple__", "__dict__"
BYTES_TAG, _BYTEARRAY, FLOAT_TAG, _COMPLEX = "__bytes_b64__", "__bytearray_b64__", "__float__", "__complex__"
_BIGINT, _SET, _FROZENSET = "__int_hex__", "__set__", "__frozenset__"
ODICT_TAG = "__odict__"  # wraps the encoding of an OrderedDict's items (a plain dict node or a __dict__ node)
_TAGS = {TENSOR_TAG, INLINE_TENSOR_TAG, NDARRAY_TAG, NPSCALAR_TAG, _NPSCALAR_RAW, TUPLE_TAG, DICT_TAG, BYTES_TAG,
         _BYTEARRAY, FLOAT_TAG, _COMPLEX, _BIGINT, _SET, _FROZENSET, ODICT_TAG}

#: Deepest nesting of containers (dicts, lists, tuples, sets) a state may have.
MAX_DEPTH = 100
# ints beyond this many bits are stored as hex text (Python's JSON refuses more than 4300 decimal digits)
_JSON_INT_BITS = 4096
# numpy scalar kinds stored as a JSON value (exact for these item sizes), and those stored as raw bytes
_NP_VALUE_KINDS, _NP_RAW_KINDS = {"b", "i", "u", "U"}, {"f", "c", "M", "m", "S"}
_RANK_PREFIX = "__rank"
_RANK_KEY_RE = re.compile(r"__rank(\d+)__\.")


def rank_key(key: str, rank: int) -> str:
    """The DCP key of rank ``rank``'s own (per-rank) tensor at state key ``key``: ``key`` itself on rank 0."""
    return key if rank == 0 else f"{_RANK_PREFIX}{rank}__.{key}"


def logical_key(key: str) -> str:
    """The state key of DCP key ``key`` (``__rank<r>__.`` removed; other keys unchanged)."""
    m = _RANK_KEY_RE.match(key) if key.startswith(_RANK_PREFIX) else None
    return key if m is None else key[m.end():]


def is_per_rank_key(key: str) -> bool:
    """True for the DCP key of a per-rank tensor of a rank other than 0 (``__rank<r>__.<key>``)."""
    return key.startswith(_RANK_PREFIX) and _RANK_KEY_RE.match(key) is not None


@lru_cache(maxsize=64)
def _prefixes(replicated_keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p + "." for p in replicated_keys)


def tensor_kind(key: str, t: torch.Tensor, replicated_keys: tuple[str, ...] | None) -> str:
    """How DCP key ``key`` of :func:`split_state` is stored: "sharded", "replicated" or "rank" (per rank)."""
    if isinstance(t, _distributed_tensor_types()):
        return "sharded"
    if is_per_rank_key(key):
        return "rank"
    if replicated_keys is None or key.startswith(_prefixes(tuple(replicated_keys))) or key in replicated_keys:
        return "replicated"
    return "rank"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _refuse(path: str, what: str, advice: str) -> ConfigError:
    return ConfigError(f"state key {path or '<root>'!r} holds {what}, which cannot be checkpointed exactly without "
                       f"pickling; {advice}")


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}".removeprefix("builtins.")


@lru_cache(maxsize=1)
def _distributed_tensor_types() -> tuple[type, ...]:
    """Tensor subclasses DCP stores as shards (imported lazily: torch.distributed is heavy)."""
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return ()
    return DTensor, ShardedTensor


# raw-bit and sub-byte dtypes: DCP's planner or the staging copy fail on them (in the background)
_UNSUPPORTED_DTYPES = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and (
    str(d).startswith("torch.bits") or re.fullmatch(r"torch\.u?int[1-7]", str(d))))


def _check_tensor(t: torch.Tensor, path: str, *, inline: bool) -> None:
    """Refuse tensors that DCP (or the inline encoding) cannot store and restore exactly."""
    kind = type(t)
    if t.dtype in _UNSUPPORTED_DTYPES:
        raise _refuse(path, f"a tensor of dtype {t.dtype}", "store it as a tensor of a byte-sized dtype (e.g. "
                      "t.view(torch.uint8) or a packed uint8 tensor)")
    if kind is not torch.Tensor:
        if inline:
            raise _refuse(path, f"a {_type_name(t)} in a rank-local part of the state", "only plain tensors can be "
                          "stored per rank; move it out of the rank-local part of the state")
        if kind is not torch.nn.Parameter:
            if isinstance(t, _distributed_tensor_types()):
                return  # DTensor / ShardedTensor: DCP saves and loads their local shards
            raise _refuse(path, f"a tensor subclass {_type_name(t)}", "store a plain tensor (e.g. t.detach().clone() "
                          "or its plain components) instead; supported are torch.Tensor, nn.Parameter, DTensor and "
                          "ShardedTensor")
    if t.layout is not torch.strided:
        raise _refuse(path, f"a sparse tensor (layout {t.layout})", "store t.to_dense(), or its indices()/values() "
                      "and its shape as separate entries")
    if t.is_quantized:
        raise _refuse(path, f"a quantized tensor ({t.dtype})", "store t.dequantize(), or t.int_repr() with its scale "
                      "and zero point as separate entries")
    if t.is_nested:
        raise _refuse(path, "a nested tensor", "store its components (t.unbind()) as a list of tensors")
    if t.device.type == "meta":
        raise _refuse(path, "a meta tensor (no data)", "materialise it (e.g. module.to_empty(device=...) and "
                      "initialise it) before saving")


def _encode_inline_tensor(t: torch.Tensor, path: str) -> dict:
    _check_tensor(t, path, inline=True)
    cpu = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {INLINE_TENSOR_TAG: _b64(raw), "dtype": str(cpu.dtype).removeprefix("torch."), "shape": list(cpu.shape),
            "device": str(t.device)}


def _decode_inline_tensor(node: dict) -> torch.Tensor:
    dtype = getattr(torch, node["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"unknown tensor dtype {node['dtype']!r} in checkpoint JSON")
    raw = bytearray(base64.b64decode(node[INLINE_TENSOR_TAG]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(node["shape"]).clone()


def _np_dtype_name(obj: np.generic) -> str | None:
    """A dtype string that maps back to ``type(obj)`` exactly (``np.longlong`` is not ``np.int64``), or None."""
    for name in (obj.dtype.str, obj.dtype.char):
        try:
            if np.dtype(name).type is type(obj):
                return name
        except TypeError:
            continue
    return None


def _encode_np_scalar(obj: np.generic, path: str) -> dict:
    kind = obj.dtype.kind
    name = _np_dtype_name(obj)
    if name is None or kind not in _NP_VALUE_KINDS | _NP_RAW_KINDS:
        raise _refuse(path, f"a numpy scalar of type {_type_name(obj)} (dtype {obj.dtype})",
                      "store a numpy scalar of a boolean, integer, float, complex, str, bytes, datetime64 or "
                      "timedelta64 dtype, or its .item()")
    if kind in _NP_VALUE_KINDS:
        return {NPSCALAR_TAG: str(obj) if kind == "U" else obj.item(), "dtype": name}  # numpy ints: <= 64 bits
    raw = bytes(cast(np.bytes_, obj)) if kind == "S" else np.array(obj).tobytes()
    return {_NPSCALAR_RAW: _b64(raw), "dtype": name}


def _encode_ndarray(arr: np.ndarray, path: str) -> dict:
    if type(arr) is not np.ndarray:
        raise _refuse(path, f"a numpy array subclass {_type_name(arr)}", "store np.asarray(value) (a plain ndarray)")
    if arr.dtype.kind in ("O", "V") or arr.dtype.hasobject or arr.dtype.names is not None:
        what = "an object array" if arr.dtype.kind == "O" else f"a structured or void array (dtype {arr.dtype})"
        raise _refuse(path, f"a numpy {what}", "store an array of a numeric, bool, str, bytes, datetime64 or "
                      "timedelta64 dtype (for structured arrays: one array per field), or a list of plain values")
    if np.dtype(arr.dtype.str) != arr.dtype:
        raise _refuse(path, f"a numpy array of dtype {arr.dtype}", "store an array of a standard dtype")
    return {NDARRAY_TAG: _b64(np.ascontiguousarray(arr).tobytes()), "dtype": arr.dtype.str, "shape": list(arr.shape)}


def _advice_for(obj: Any) -> str:
    if isinstance(obj, enum.Enum):
        return "store its .value or .name and rebuild the enum member after loading"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "store it as a dict (obj._asdict()) or a plain tuple"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "store dataclasses.asdict(obj) and rebuild it after loading"
    if hasattr(obj, "__fspath__"):
        return "store str(path)"
    if isinstance(obj, (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)):
        return "convert it to the plain builtin type (int, float, str, bytes, list, tuple, dict, set)"
    if hasattr(obj, "state_dict"):
        return "store obj.state_dict() instead"
    return ("store tensors, numpy arrays or scalars, or plain Python values (None, bool, int, float, complex, str, "
            "bytes, list, tuple, dict, set)")


def split_state(state: Any, *, rank_local_keys: tuple[str, ...] = (), replicated_keys: tuple[str, ...] | None = None,
                rank: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``state`` into ``({dcp_key: live tensor}, JSON tree with {"__tensor__": key} placeholders)``.

    ``rank_local_keys``: top-level keys whose tensors are embedded in the tree; ``replicated_keys``:
    prefixes of tensors stored once for the job (None: every tensor is), the others are stored per
    rank under :func:`rank_key`.

    Raises:
        ConfigError: a value outside the supported set, a container that contains itself or nests
            deeper than :data:`MAX_DEPTH`, two paths flattening to one key, or a key starting with
            ``__rank<N>__.``; names the key path and what to store instead, before anything is written.
    """
    tensors: dict[str, torch.Tensor] = {}

    def dcp_key(obj: torch.Tensor, key: str) -> str:
        if is_per_rank_key(key):
            raise ConfigError(f"state key {key!r} starts with '__rank<N>__.', which names per-rank tensors in "
                              "checkpoints; rename it")
        return rank_key(key, rank) if rank and tensor_kind(key, obj, replicated_keys) == "rank" else key

    active: set[int] = set()  # ids of the containers on the current path (cycle detection)

    def enter(obj: Any, key: str, depth: int) -> None:
        if id(obj) in active:
            raise _refuse(key, f"a {_type_name(obj)} that contains itself", "break the reference cycle")
        if depth > MAX_DEPTH:
            raise ConfigError(f"state key {key!r} is nested deeper than {MAX_DEPTH} containers; flatten the state")
        active.add(id(obj))

    def enc_hashable(obj: Any, key: str, depth: int) -> Any:
        """A dict key or set element: a hashable value of the supported set, never a tensor or array."""
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            raise _refuse(key, f"a {_type_name(obj)} as a dict key or set element", "use plain values as keys")
        return enc(obj, key, False, depth)

    def enc(obj: Any, key: str, local: bool, depth: int, path: tuple[str, ...] = ()) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            if local:
                return _encode_inline_tensor(obj, key)
            _check_tensor(obj, key, inline=False)
            name = dcp_key(obj, key)
            if name in tensors:
                raise ConfigError(f"state key {key!r} occurs twice after flattening nested keys with '.'; rename one")
            tensors[name] = obj
            return {TENSOR_TAG: name}
        if obj is None or kind is bool or kind is str:
            return obj
        if kind is int:
            return obj if obj.bit_length() <= _JSON_INT_BITS else {_BIGINT: hex(obj)}
        if kind is float:
            return obj if obj == obj and obj not in (float("inf"), float("-inf")) else {FLOAT_TAG: repr(obj)}
        if kind is complex:
            return {_COMPLEX: [enc(obj.real, key, local, depth), enc(obj.imag, key, local, depth)]}
        if kind is bytes:
            return {BYTES_TAG: _b64(obj)}
        if kind is bytearray:
            return {_BYTEARRAY: _b64(bytes(obj))}
        if isinstance(obj, np.ndarray):
            return _encode_ndarray(obj, key)
        if isinstance(obj, np.generic):
            return _encode_np_scalar(obj, key)
        if kind is dict or kind is OrderedDict:
            enter(obj, key, depth)
            sub_local = lambda k: local or (not path and k in rank_local_keys)  # noqa: E731
            if all(type(k) is str for k in obj) and not any(k in _TAGS for k in obj):
                out: dict[Any, Any] | list[Any] = {k: enc(v, _join(key, k), sub_local(k), depth + 1, path + (k,))
                                                   for k, v in obj.items()}
            else:
                items = []
                for k, v in obj.items():
                    name = k if type(k) is str else str(k)
                    items.append([enc_hashable(k, _join(key, name), depth + 1),
                                  enc(v, _join(key, name), sub_local(name), depth + 1, path + (name,))])
                out = {DICT_TAG: items}
            active.discard(id(obj))
            return {ODICT_TAG: out} if kind is OrderedDict else out
        if kind is list or kind is tuple:
            enter(obj, key, depth)
            out = [enc(v, _join(key, str(i)), local, depth + 1, path + (str(i),)) for i, v in enumerate(obj)]
            active.discard(id(obj))
            return {TUPLE_TAG: out} if kind is tuple else out
        if kind is set or kind is frozenset:
            enter(obj, key, depth)
            elems = [enc_hashable(v, key, depth + 1) for v in obj]
            active.discard(id(obj))
            elems.sort(key=lambda e: json.dumps(e, sort_keys=True))  # deterministic on every rank
            return {_SET if kind is set else _FROZENSET: elems}
        raise _refuse(key, f"a value of type {_type_name(obj)}", _advice_for(obj))

    tree = enc(state, "", False, 0)
    return tensors, tree


def _join(key: str, part: str) -> str:
    return f"{key}.{part}" if key else part


def join_state(tree: Any, tensors: dict[str, torch.Tensor] | Any) -> Any:
    """The state of a JSON tree and loaded tensors (inverse of :func:`split_state`); CheckpointCorruptError for
    a placeholder of a tensor ``tensors`` lacks, or a malformed tagged node."""

    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if TENSOR_TAG in node and len(node) == 1:
            key = node[TENSOR_TAG]
            if key not in tensors:
                raise CheckpointCorruptError(f"state refers to tensor {key!r}, which the checkpoint does not hold "
                                             "as a tensor")
            return tensors[key]
        if INLINE_TENSOR_TAG in node:
            return _decode_inline_tensor(node)
        if NDARRAY_TAG in node:
            data = base64.b64decode(node[NDARRAY_TAG])
            return np.frombuffer(data, dtype=np.dtype(node["dtype"])).reshape(node["shape"]).copy()
        if NPSCALAR_TAG in node:
            return np.dtype(node["dtype"]).type(node[NPSCALAR_TAG])
        if _NPSCALAR_RAW in node:
            dtype, raw = np.dtype(node["dtype"]), base64.b64decode(node[_NPSCALAR_RAW])
            return dtype.type(raw) if dtype.kind == "S" else np.frombuffer(raw, dtype=dtype)[0]
        if len(node) == 1:
            tag, value = next(iter(node.items()))
            if tag in single:
                return single[tag](value)
        return {k: dec(v) for k, v in node.items()}

    def odict(value: Any) -> OrderedDict:
        inner = dec(value)
        if not isinstance(inner, dict):
            raise TypeError(f"{ODICT_TAG} holds a {type(inner).__name__}, not a mapping")
        return OrderedDict(inner)

    single: dict[str, Callable[[Any], Any]]
    single = {BYTES_TAG: base64.b64decode, _BYTEARRAY: lambda v: bytearray(base64.b64decode(v)), FLOAT_TAG: float,
              _BIGINT: lambda v: int(v, 16), _COMPLEX: lambda v: complex(dec(v[0]), dec(v[1])),
              TUPLE_TAG: lambda v: tuple(dec(x) for x in v), _SET: lambda v: {dec(x) for x in v},
              _FROZENSET: lambda v: frozenset(dec(x) for x in v), DICT_TAG: lambda v: {dec(k): dec(x) for k, x in v},
              ODICT_TAG: odict}

    try:
        return dec(tree)
    except CheckpointCorruptError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise CheckpointCorruptError(f"malformed value in the checkpoint's state tree ({type(exc).__name__}: {exc})") \
            from exc


FORMAT_NAME = "torch-ckpt"
FORMAT_VERSION = 2
"""Newest manifest format this torch-ckpt reads. Version 2 (written only by a durable manifest with
``stored``, which older readers would take for missing files) adds that field; every other manifest is 1."""
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
"""Largest ``manifest.json`` read (bytes); a real one lists ~100 bytes per file."""
MAX_MANIFEST_DEPTH = 16
"""Deepest nesting of containers in a manifest (a real one has 3)."""
MAX_MANIFEST_INT_DIGITS = 20
"""Longest integer in a manifest (digits); sizes, steps and CRCs fit in 64 bits."""


#: the manifest field of a file an incremental save hard-linked (the step of the checkpoint it was linked from)
LINKED_FROM = "linked_from"
#: the manifest field, on the durable tier, naming for each file stored under another step the directory holding it
STORED = "stored"


def bytes_written(files: Mapping[str, Mapping[str, int]], stored: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(bytes written, bytes referenced)`` of a manifest's ``files``: those the save wrote, and those it
    hard-linked from an earlier checkpoint (shared on disk, still part of this checkpoint). With ``stored``
    (a durable manifest's :attr:`Manifest.stored`): those its upload stored under its own prefix, and those
    it references in an earlier step's objects."""
    linked = sum(info["bytes"] for name, info in files.items()
                 if (name in stored if stored is not None else LINKED_FROM in info))
    return sum(info["bytes"] for info in files.values()) - linked, linked


def rank_file_name(rank: int) -> str:
    """Per-rank JSON file holding that rank's non-tensor state."""
    return f"rank_{rank:05d}.json"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` records about one committed checkpoint.

    Attributes:
        step: training step (int).
        world_size: number of ranks that wrote it.
        files: ``{file name: {"bytes": int, "crc32": int}}`` for every file except the manifest; a data file an
            incremental save hard-linked from an earlier checkpoint instead of writing it also has
            ``"linked_from": <that checkpoint's step>`` (:func:`bytes_written`).
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
        stored: on the durable tier, ``{file name: directory name}`` for the files of an incremental save whose
            object is the one of an earlier step (a sibling directory of the same root) instead of a copy in
            this directory; every reader opens them there (:meth:`Location.resolving`); empty elsewhere.
    """

    step: int
    world_size: int
    files: dict[str, dict[str, int]]
    wall_time: float = field(default_factory=time.time)
    torch_version: str = field(default_factory=lambda: torch.__version__)
    tensor_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = 1
    tiers: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)
    node: int | None = None
    lineage: Lineage = BASE
    stored: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written to disk."""
        version = 2 if self.stored else 1  # what a reader needs: 2 only for references (stored)
        doc = {"format": FORMAT_NAME, "format_version": version, "step": self.step,
               "wall_time": self.wall_time, "world_size": self.world_size, "torch_version": self.torch_version,
               "tensor_bytes": self.tensor_bytes, "timings": self.timings, "tiers": self.tiers, "files": self.files}
        if self.nodes:
            doc["nodes"] = self.nodes
        if self.node is not None:
            doc["node"] = self.node
        if not self.lineage.is_base:
            doc["lineage"] = self.lineage.to_json()
        if self.stored:
            doc[STORED] = self.stored
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
        """Validate a parsed manifest object; raises CheckpointCorruptError naming ``source`` and the field."""
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
                    if LINKED_FROM in info:
                        files[name][LINKED_FROM] = _int_field(info, LINKED_FROM, 0, (1 << 63) - 1)
                except Malformed as exc:
                    raise Malformed(f"entry of {name!r}: {exc}") from None
            wall_time: Any = data.get("wall_time")
            if type(wall_time) not in (int, float) or not math.isfinite(wall_time):
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
            if not isinstance(tiers, dict) or not all(isinstance(k, str) and isinstance(v, dict)
                                                      for k, v in tiers.items()):
                raise Malformed("tiers must map tier names to objects")
            nodes, node = _nodes_fields(data, files, world_size)
            stored = data.get(STORED, {})
            if not isinstance(stored, dict) or not all(name in files and _is_plain_file_name(where)
                                                       for name, where in stored.items()):
                raise Malformed(f"{STORED} must map files of the manifest to plain directory names")
            try:
                lineage = lineage_from_doc(data.get("lineage"))
            except MalformedLineage as exc:
                raise Malformed(str(exc)) from None
        except Malformed as exc:
            raise corrupt(source, f"invalid manifest ({exc})") from None
        return cls(step=step, world_size=world_size, files=files, wall_time=float(wall_time),
                   torch_version=torch_version, tensor_bytes=tensor_bytes, timings=dict(timings),
                   format_version=version, tiers=dict(tiers), nodes=nodes, node=node, lineage=lineage,
                   stored=dict(stored))


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
    """Validate the bytes of a ``manifest.json``; raises CheckpointCorruptError naming ``source``."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise corrupt(source, f"manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} accepted")
    data = loads_bounded(raw, source, what="manifest", max_depth=MAX_MANIFEST_DEPTH,
                         max_int_digits=MAX_MANIFEST_INT_DIGITS)
    return Manifest.from_json(data, source)


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
    """``(shape, dtype name, bytes)`` of an embedded tensor (``kind`` "inline") or array ("ndarray"); ValueError
    for an unsafe dtype, a bad shape, or data not base64 of the length they need (checked before allocating)."""
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

    ``kind`` is "tensor" (a DCP placeholder), "inline" (an embedded tensor), "ndarray" or "value". A tree
    this (iterative) walk accepts decodes with :func:`join_state`; ValueError names a bad node's dotted path.
    """
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, path)]
    while stack:
        node, where = stack.pop()
        try:
            if isinstance(node, list) or (isinstance(node, dict) and _is_tag_node(node, TUPLE_TAG)):
                items = node if isinstance(node, list) else node[TUPLE_TAG]
                if not isinstance(items, list):
                    raise Malformed(f"malformed {TUPLE_TAG} node")
                stack.extend((v, where + (str(i),)) for i, v in reversed(list(enumerate(items))))
            elif not isinstance(node, dict):
                yield where, "value", node
            elif len(node) == 1 and TENSOR_TAG in node:
                if not isinstance(node[TENSOR_TAG], str):
                    raise Malformed(f"tensor placeholder {short_repr(node[TENSOR_TAG])} is not a key")
                yield where, "tensor", node
            elif INLINE_TENSOR_TAG in node or NDARRAY_TAG in node:
                kind = "inline" if INLINE_TENSOR_TAG in node else "ndarray"
                embedded_info(kind, node)
                yield where, kind, node
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
"""Deepest nesting of containers in a per-rank JSON file: :func:`split_state` refuses more than :data:`MAX_DEPTH`
(100) containers, each at most 3 JSON levels (tag object, item list, key/value pair), plus the document's own."""
MAX_STATE_INT_DIGITS = 4300
"""Longest integer in a per-rank JSON file (digits): Python's default int/str conversion limit."""
METADATA_NAME = ".metadata"
RANK_FILE_RE = re.compile(r"^rank_(\d+)\.json$")
NODE_METADATA_RE = re.compile(r"^node_\d{5,}\.metadata$")


def open_listed(step_dir: str | os.PathLike, manifest: Manifest, name: str, *, allow_symlinks: bool = False) -> int:
    """A descriptor of the manifest-listed regular file ``name`` of a local checkpoint (else CheckpointCorruptError)."""
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
    """All bytes of the manifest-listed file ``name``, of its listed size and at most ``limit``.

    Raises:
        CheckpointCorruptError: anything else (not listed, missing, unreadable...); names the file.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks).resolving(manifest.stored)
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
    """Check every file this copy of the checkpoint lists (every ``parts``-th from ``part``): a regular file
    of the listed size and, with ``checksums``, CRC-32. ``collect`` gets ``(file, problem)`` instead of a raise;
    ``progress.update(bytes)`` is called as files are checked. Returns the bytes read for CRC-32s.

    A file whose store digest (:meth:`~torch_ckpt.storage._locations.Location.stat`, e.g. an S3 MD5 ETag)
    equals ``store_digests[name]`` passes unread: the caller vouches that digest is of bytes with the listed
    CRC-32 (the durable tier computes both in one pass); a digest that cannot match costs a read, never a
    false alarm.

    Raises:
        CheckpointCorruptError: (without ``collect``) a file is missing, not a regular file, unreadable, or
            has the wrong size or CRC-32; names it.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks).resolving(manifest.stored)
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
    """``[(file, problem)]`` when the manifest does not list exactly one JSON file per rank."""
    listed = sum(1 for name in manifest.files if RANK_FILE_RE.match(name))
    if manifest.world_size > listed:  # checked first: never loop over a declared (untrusted) world size
        missing = next(r for r in range(listed + 1) if rank_file_name(r) not in manifest.files)
        return [(MANIFEST_NAME, f"world size {manifest.world_size} but the manifest lists {listed} per-rank state "
                                f"file(s); {rank_file_name(missing)} is not listed")]
    return [(rank_file_name(r), f"per-rank state file of rank {r} is not listed in the manifest (world size "
                                f"{manifest.world_size})") for r in range(manifest.world_size)
            if rank_file_name(r) not in manifest.files]


def parse_rank_doc(raw: bytes, source: str, manifest: Manifest, rank: int, *,
                   tensor_keys: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The validated per-rank document ``{"step", "rank", "world_size", "tree"}`` of ``rank`` in ``raw``.

    Every tensor placeholder must satisfy ``tensor_keys`` (be a DCP tensor) when given. Raises
    CheckpointCorruptError naming ``source`` (and a malformed node's dotted path).
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
    """:func:`parse_rank_doc` of the listed file of ``rank`` (local or on a store), once the manifest lists
    one per rank; raises CheckpointCorruptError naming the file, or DurableUnavailableError."""
    loc = as_location(where, allow_symlinks=allow_symlinks).resolving(manifest.stored)
    _raise_first(loc, rank_file_problems(manifest))
    name = rank_file_name(rank)
    raw = read_listed(loc, manifest, name, MAX_RANK_JSON_BYTES)
    return parse_rank_doc(raw, loc.describe(name), manifest, rank, tensor_keys=tensor_keys)


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
} | {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}


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
    """Unpickle DCP ``.metadata`` bytes admitting only DCP's metadata classes (fields unchecked:
    :func:`metadata_problems`).

    Raises:
        UnsafeCheckpointError: the pickle references anything else.
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
    """:func:`load_dcp_metadata_bytes` of a ``.metadata`` file (unvalidated: see :func:`read_metadata`)."""
    return load_dcp_metadata_bytes(Path(path).read_bytes(), str(path))


class _ListedFileSystem(FileSystem):
    """DCP ``FileSystem`` opening only the given names, as regular files; remembers the file whose read failed."""

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
    """``FileSystemReader`` opening only ``allowed`` names (None: any), with ``metadata`` already validated
    (None: :func:`read_dcp_metadata`, unvalidated, for tests and plain DCP)."""

    def __init__(self, path: str | os.PathLike, *, metadata: Metadata | None = None,
                 allowed: set[str] | None = None, allow_symlinks: bool = False) -> None:
        super().__init__(path)
        self._metadata = metadata
        if allowed is not None:
            self.fs = _ListedFileSystem(allowed, allow_symlinks=allow_symlinks)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = self._metadata if self._metadata is not None else read_dcp_metadata(self._get_metadata_path(rank))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        assert md.storage_meta is not None
        md.storage_meta.load_id = self.load_id
        return md


def load_tensors(tensors: dict[str, torch.Tensor], step_dir: str | os.PathLike, metadata: Metadata,
                 allowed: set[str], *, process_group: Any = None, no_dist: bool = True,
                 allow_symlinks: bool = False) -> None:
    """``dcp.load`` of ``tensors`` from a validated checkpoint, reading only ``allowed`` regular files.

    Raises:
        CheckpointCorruptError: DCP could not read or decode the data (no CRC caught the damage first);
            names the file when this rank knows it, and the first error without DCP's tracebacks.
        UnsafeCheckpointError: an item would need unpickling.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(step_dir, metadata=metadata, allowed=allowed, allow_symlinks=allow_symlinks)
    try:
        dcp.load(tensors, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group,
                 no_dist=no_dist)
    except (CheckpointException, RuntimeError, ValueError, EOFError, OSError) as exc:
        first = unwrap_dcp_error(exc)
        if isinstance(first, CheckpointError) or not isinstance(first, Exception):
            raise first from None  # ours, or an interrupt (Ctrl-C, SystemExit): not a damaged file
        where = cast(_ListedFileSystem, reader.fs).failed_file or str(step_dir)
        raise CheckpointCorruptError(
            f"{where}: tensor data cannot be read ({_first_line(first)}); the file is damaged. Run torch-ckpt "
            "verify, or restore with verify_on_load=True to catch this by checksum before loading") from None


def unwrap_dcp_error(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (one ``(error, traceback)`` per rank), so that e.g. an
    ``ENOSPC`` fsyncing ``.metadata`` keeps its errno: a :class:`CheckpointError`, else an ``OSError`` with an
    errno, else the first; ``exc`` when it wraps nothing."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return exc
    causes = [c[0] if isinstance(c, tuple) else c for c in failures.values()]
    causes = [c for c in causes if isinstance(c, BaseException)]
    for wanted in (CheckpointError, OSError):
        for cause in causes:
            if isinstance(cause, wanted) and (wanted is not OSError or cast(OSError, cause).errno is not None):
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


def _int_tuple(value: Any) -> TypeGuard[tuple[int, ...]]:
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
    for attr, kinds, want in (("state_dict_metadata", dict, "a dict"), ("storage_data", dict, "a dict"),
                              ("planner_data", (dict, type(None)), "a dict"),
                              ("storage_meta", (StorageMeta, type(None)), "StorageMeta")):
        if not isinstance(value := getattr(md, attr, None), kinds):
            bad(f"{attr} is a {type(value).__name__}, expected {want}")
    if problems:
        return problems, {}
    sdm, sd = md.state_dict_metadata, md.storage_data

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
        covered, before = 0, len(problems)
        for chunk in item.chunks:
            length = stored.get((key, tuple(chunk.offsets)))
            n = math.prod(chunk.sizes)
            covered += n
            if length is None:
                bad(f"tensor {key!r}: the chunk at offset {list(chunk.offsets)} has no storage entry")
            elif n * itemsize > length:
                bad(f"tensor {key!r}: the chunk at offset {list(chunk.offsets)} declares {n * itemsize} bytes but its "
                    f"storage entry holds only {length}")
        total = math.prod(item.size)
        if covered != total:
            bad(f"tensor {key!r}: chunks hold {covered} of the {total} elements of its declared shape "
                f"{list(item.size)}")
        elif len(item.chunks) > 1 and (pair := _overlapping([tuple(c.offsets) for c in item.chunks],
                                                            [tuple(c.sizes) for c in item.chunks])):
            bad(f"tensor {key!r}: chunks at offsets {list(item.chunks[pair[0]].offsets)} and "
                f"{list(item.chunks[pair[1]].offsets)} overlap")
        if len(problems) > before:
            del tensors[key]
    return problems, tensors


def metadata_name(node: int) -> str:
    """The DCP metadata pointing every tensor at ``node``'s own copy (a node-local checkpoint stores replicated
    tensors once per node); ``.metadata`` points at the one uploaded copy every other reader uses."""
    return f"node_{node:05d}.metadata"


def read_metadata(where: str | os.PathLike | Location, manifest: Manifest, *, allow_symlinks: bool = False) -> Metadata:
    """The validated DCP metadata (:func:`metadata_problems`) of a checkpoint, or of one node's copy
    (:func:`metadata_name`).

    Raises:
        CheckpointCorruptError: not listed, not a regular file, unreadable, or inconsistent (with itself
            or the manifest); names the file.
        UnsafeCheckpointError: the pickle references code.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks).resolving(manifest.stored)
    node = manifest.node
    name = manifest.nodes.get("metadata") or (METADATA_NAME if node is None else metadata_name(node))
    md = load_dcp_metadata_bytes(read_listed(loc, manifest, name, MAX_METADATA_BYTES), loc.describe(name))
    _raise_first(loc, metadata_problems(md, manifest)[0])
    return md


def _raise_first(loc: Location, problems: list[tuple[str, str]]) -> None:
    """Raise ``CheckpointCorruptError`` for the first of ``problems`` (``[(file, text)]``), counting the rest."""
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise corrupt(loc.describe(file), f"{text}{more}")


def tensor_items(md: Metadata) -> dict[str, TensorStorageMetadata]:
    """``{key: TensorStorageMetadata}`` of the tensors of (validated) metadata."""
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def record_problems(where: str | os.PathLike | Location, manifest: Manifest, md: Metadata, *, part: int = 0,
                    parts: int = 1, allow_symlinks: bool = False,
                    tensors: dict[str, TensorStorageMetadata] | None = None,
                    files: list[str] | None = None) -> list[tuple[str, str]]:
    """``[(file, problem)]`` for records of ``tensors`` (default: all of validated ``md``) that disagree with it.

    Checks the data files ``files``, else every ``parts``-th from ``part`` of those this copy holds.

    Raises:
        CheckpointCorruptError: a data file is not listed, missing, not a regular file, or unreadable.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks).resolving(manifest.stored)
    tensors = tensor_items(md) if tensors is None else tensors
    if files is None:  # one node's copy holds its own files only: records of another node's are checked there
        held = manifest.local_files()
        every = sorted({str(info.relative_path) for index, info in md.storage_data.items()
                        if index.fqn in tensors and str(info.relative_path) in held})
        files = [name for i, name in enumerate(every) if i % parts == part]
    for name in files:
        if name not in manifest.files:
            raise corrupt(loc.describe(name), "is not listed in the manifest; refusing unverified data")
    return storage_record_problems(md, tensors, loc.open_range, files)


def check_records(where: str | os.PathLike | Location, manifest: Manifest, md: Metadata, *, part: int = 0,
                  parts: int = 1, allow_symlinks: bool = False,
                  tensors: dict[str, TensorStorageMetadata] | None = None) -> None:
    """Raise CheckpointCorruptError (naming the data file, key and byte range) for the first problem of
    :func:`record_problems`."""
    loc = as_location(where, allow_symlinks=allow_symlinks).resolving(manifest.stored)
    if tensors is None or tensors:
        _raise_first(loc, record_problems(loc, manifest, md, part=part, parts=parts, tensors=tensors))
