"""The storage/format layer: the one validation path for everything that reads a checkpoint.

``CheckpointManager.restore``, ``torch-ckpt verify``/``inspect``/``ls``, ``convert`` and the
listings all read a checkpoint through the functions of this module, so they accept and refuse the
same inputs. What a reader may rely on once a check here passed:

* **Manifest** (``manifest.json``): a regular file (never followed through a symlink unless asked),
  at most :data:`MAX_MANIFEST_BYTES`, parsed with bounded nesting (:data:`MAX_MANIFEST_DEPTH`) and
  integer length (:data:`MAX_MANIFEST_INT_DIGITS`), every field of the right type and range, every
  listed name a plain file name inside the checkpoint.
* **Files**: only files the manifest lists are ever opened; each must be a regular file inside the
  checkpoint (``O_NOFOLLOW``: a symlink, FIFO or directory is refused), with the listed size and,
  when checksums are on, the listed CRC-32.
* **Per-rank JSON** (``rank_00000.json`` ...): one per rank of the world size (counted against the
  manifest's file list before anything is allocated), at most :data:`MAX_RANK_JSON_BYTES`, parsed
  with bounded nesting (:data:`MAX_STATE_DEPTH`) and integer length; ``step``/``rank``/``world_size``
  agree with the manifest; every node of the tree is well formed, and every embedded tensor or array
  declares exactly as many bytes as its base64 data holds.
* **DCP metadata** (``.metadata``): read with the restricted unpickler, then every field type is
  checked; storage entries lie inside manifest-listed data files; every tensor's chunks lie inside
  its declared shape, do not overlap and cover it exactly; each chunk's bytes fit in its storage
  entry, so declared sizes are bounded by the files' real sizes before anything is allocated.
* **Tensor records** (:mod:`torch_ckpt.records`): every chunk's byte range in its data file holds
  exactly one ``torch.save`` record of a plain tensor of the declared dtype and chunk shape, ending
  at the end of the range and lying inside the real file (zip headers and pickle opcodes are
  parsed, nothing is unpickled).

Any violation raises :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file (the
``*_problems`` functions return every problem instead, for ``verify``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path, PurePath
from typing import Any

from torch_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from torch_ckpt.records import storage_record_problems

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_MANIFEST_INT_DIGITS",
    "MAX_METADATA_BYTES",
    "MAX_RANK_JSON_BYTES",
    "MAX_STATE_DEPTH",
    "MAX_STATE_INT_DIGITS",
    "METADATA_NAME",
    "loads_bounded",
    "manifest_from_doc",
    "parse_manifest",
    "read_manifest",
    "open_listed",
    "check_files",
    "rank_file_problems",
    "parse_rank_doc",
    "read_rank_tree",
    "metadata_problems",
    "read_metadata",
    "open_range",
    "local_data_file",
    "record_problems",
    "check_records",
    "walk_tree",
    "embedded_info",
    "unpickle_metadata",
]

MAX_MANIFEST_BYTES = 64 << 20
"""Largest ``manifest.json`` read (bytes); a real one lists ~100 bytes per file."""
MAX_MANIFEST_DEPTH = 16
"""Deepest nesting of containers in a manifest (a real one has 3)."""
MAX_MANIFEST_INT_DIGITS = 20
"""Longest integer in a manifest (digits); sizes, steps and CRCs fit in 64 bits."""
MAX_RANK_JSON_BYTES = 4 << 30
"""Largest per-rank JSON file read (bytes)."""
MAX_STATE_DEPTH = 400
"""Deepest nesting of containers in a per-rank JSON file (the saved state's nesting plus tags).

``codec.split_state`` refuses states nested deeper than ``codec.MAX_DEPTH`` (100) containers; one
container encodes to at most 3 JSON levels (tag object, item list, key/value pair), plus the document's
own wrapper, so everything ``save()`` accepts stays below this bound and restores."""
MAX_STATE_INT_DIGITS = 4300
"""Longest integer in a per-rank JSON file (digits): Python's default int/str conversion limit."""
MAX_METADATA_BYTES = 1 << 30
"""Largest DCP ``.metadata`` unpickled (bytes)."""
_MAX_NDIM = 64

METADATA_NAME = ".metadata"
_NODE_METADATA_RE = re.compile(r"^node_\d{5,}\.metadata$")
_RANK_FILE_RE = re.compile(r"^rank_(\d+)\.json$")
_B64_RE = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_CHUNK_BYTES = 16 << 20


class _Malformed(ValueError):
    """Internal: one malformed piece of content (message without the file name)."""


def _corrupt(source: str, text: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{source}: {text}")


# ---------------------------------------------------------------------------------------------
# bounded JSON


def _max_depth(value: Any) -> int:
    """Nesting depth of containers in a parsed JSON value, computed without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def loads_bounded(raw: bytes, source: str, *, what: str, max_depth: int, max_int_digits: int) -> Any:
    """Parse JSON from untrusted bytes with bounded nesting and integer length.

    Args:
        raw: the file's bytes (already bounded in size by the caller).
        source: the file's path or URL, for messages.
        what: what the file is ("manifest", "per-rank state file"), for messages.
        max_depth: deepest nesting of objects and arrays accepted.
        max_int_digits: longest integer literal accepted (digits).

    Raises:
        CheckpointCorruptError: not UTF-8 JSON, nested deeper than ``max_depth`` (the parser's own
            recursion limit included) or holding a longer integer; the message names ``source``.
    """

    def parse_int(text: str) -> int:
        digits = len(text) - text.startswith("-")
        if digits > max_int_digits:
            raise _Malformed(f"holds an integer of {digits} digits (at most {max_int_digits} are accepted)")
        return int(text)

    try:
        data = json.loads(raw, parse_int=parse_int)
    except _Malformed as exc:
        raise _corrupt(source, f"{what} {exc}") from None
    except RecursionError:
        raise _corrupt(source, f"{what} is nested too deeply to parse (at most {max_depth} levels are "
                               "accepted)") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise _corrupt(source, f"{what} is not valid JSON ({exc})") from None
    depth = _max_depth(data)
    if depth > max_depth:
        raise _corrupt(source, f"{what} is nested {depth} levels deep (at most {max_depth} are accepted)")
    return data


# ---------------------------------------------------------------------------------------------
# manifest


def _is_plain_file_name(name: Any) -> bool:
    """True for a bare file name (no directory part, no '..', no NUL): manifests may not point elsewhere."""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name \
        and "\\" not in name and "\0" not in name


def _int_field(doc: dict, key: str, lo: int, hi: int, *, default: int | None = None) -> int:
    if key not in doc and default is not None:
        return default
    if key not in doc:
        raise _Malformed(f"{key} is missing")
    value = doc[key]
    if type(value) is not int:
        raise _Malformed(f"{key} must be an integer, got {type(value).__name__} {_short(value)}")
    if not lo <= value <= hi:
        raise _Malformed(f"{key} {value} is out of range [{lo}, {hi}]")
    return value


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-57:]}"


def manifest_from_doc(data: Any, source: str) -> Any:
    """Validate a parsed manifest object and build the :class:`~torch_ckpt.layout.Manifest`.

    Raises:
        CheckpointCorruptError: a field is missing, of the wrong type or out of range; names ``source``.
    """
    from torch_ckpt.layout import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest

    try:
        if not isinstance(data, dict):
            raise _Malformed(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT_NAME:
            raise _Malformed(f"format is {_short(data.get('format'))}, expected {FORMAT_NAME!r}")
        version = _int_field(data, "format_version", 1, 1 << 31)
        if version > FORMAT_VERSION:
            raise _Malformed(f"format_version {version} is newer than this torch-ckpt supports ({FORMAT_VERSION}); "
                             "upgrade torch-ckpt")
        step = _int_field(data, "step", 0, (1 << 63) - 1)
        world_size = _int_field(data, "world_size", 1, (1 << 31) - 1)
        files_doc = data.get("files")
        if not isinstance(files_doc, dict):
            raise _Malformed(f"files must be an object, got {type(files_doc).__name__}")
        files: dict[str, dict[str, int]] = {}
        for name, info in files_doc.items():
            if not _is_plain_file_name(name) or name == MANIFEST_NAME:
                raise _Malformed(f"file name {_short(name)} is not a plain file name inside the checkpoint")
            if not isinstance(info, dict):
                raise _Malformed(f"entry of {name!r} must be an object, got {type(info).__name__}")
            try:
                files[name] = {"bytes": _int_field(info, "bytes", 0, (1 << 63) - 1),
                               "crc32": _int_field(info, "crc32", 0, (1 << 32) - 1)}
            except _Malformed as exc:
                raise _Malformed(f"entry of {name!r}: {exc}") from None
        wall_time = data.get("wall_time")
        if not _number(wall_time):
            raise _Malformed(f"wall_time must be a finite number, got {_short(wall_time)}")
        torch_version = data.get("torch_version")
        if not isinstance(torch_version, str):
            raise _Malformed(f"torch_version must be a string, got {_short(torch_version)}")
        tensor_bytes = _int_field(data, "tensor_bytes", 0, (1 << 63) - 1, default=0)
        timings = data.get("timings", {})
        if not isinstance(timings, dict) or not all(isinstance(k, str) and type(v) in (int, float)
                                                    for k, v in timings.items()):
            raise _Malformed("timings must map phase names to numbers")
        tiers = data.get("tiers", {})
        if not isinstance(tiers, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in tiers.items()):
            raise _Malformed("tiers must map tier names to objects")
        nodes, node = _nodes_fields(data, files, world_size)
    except _Malformed as exc:
        raise _corrupt(source, f"invalid manifest ({exc})") from None
    return Manifest(step=step, world_size=world_size, files=files, wall_time=float(wall_time),
                    torch_version=torch_version, tensor_bytes=tensor_bytes, timings=dict(timings),
                    format_version=version, tiers=dict(tiers), nodes=nodes, node=node)


def _nodes_fields(data: dict, files: dict[str, Any], world_size: int) -> tuple[dict[str, Any], int | None]:
    """The optional node-local fields of a manifest: ``nodes`` (which node holds which file) and ``node``."""
    nodes = data.get("nodes", {})
    if not isinstance(nodes, dict):
        raise _Malformed(f"nodes must be an object, got {type(nodes).__name__}")
    node = data.get("node")
    if not nodes:
        if node is not None:
            raise _Malformed("node is set but nodes (which node holds which file) is missing")
        return {}, None
    rank_node, file_node = nodes.get("rank_node"), nodes.get("file_node")
    if not isinstance(rank_node, list) or len(rank_node) != world_size or \
            not all(type(n) is int and 0 <= n < world_size for n in rank_node):
        raise _Malformed(f"nodes.rank_node must list the node (0..{world_size - 1}) of each of the {world_size} ranks")
    count = max(rank_node) + 1
    if not isinstance(file_node, dict) or set(file_node) != set(files) or \
            not all(type(n) is int and 0 <= n < count for n in file_node.values()):
        raise _Malformed("nodes.file_node must give the node (an int below the node count) of every listed file")
    if node is not None and (type(node) is not int or not 0 <= node < count):
        raise _Malformed(f"node must be an int in 0..{count - 1}, got {_short(node)}")
    out: dict[str, Any] = {"rank_node": list(rank_node), "file_node": dict(file_node)}
    for key in ("shared", "held"):
        if key in nodes:
            names = nodes[key]
            if not isinstance(names, list) or not all(isinstance(n, str) and n in files for n in names):
                raise _Malformed(f"nodes.{key} must list files of the manifest")
            out[key] = list(names)
    if "metadata" in nodes:
        if nodes["metadata"] not in files:
            raise _Malformed("nodes.metadata must name a file of the manifest")
        out["metadata"] = nodes["metadata"]
    return out, node


def parse_manifest(raw: bytes, source: str) -> Any:
    """Parse and validate the bytes of a ``manifest.json`` (see :func:`manifest_from_doc`).

    Raises:
        CheckpointCorruptError: larger than :data:`MAX_MANIFEST_BYTES`, not bounded JSON, or not a
            valid torch-ckpt manifest; the message names ``source``.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _corrupt(source, f"manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} accepted")
    data = loads_bounded(raw, source, what="manifest", max_depth=MAX_MANIFEST_DEPTH,
                         max_int_digits=MAX_MANIFEST_INT_DIGITS)
    return manifest_from_doc(data, source)


# ---------------------------------------------------------------------------------------------
# local files: regular files inside the checkpoint only


def _open_regular(path: Path, *, allow_symlinks: bool, what: str) -> int:
    """Open ``path`` read-only as a regular file (no symlink unless allowed); returns the descriptor.

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointCorruptError: it is a symlink (and symlinks are not allowed), a directory, a FIFO
            or anything else but a regular file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # NONBLOCK: a FIFO must not hang us
    if not allow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _corrupt(str(path), f"{what} is a symbolic link; torch-ckpt reads only regular files inside the "
                                      "checkpoint (copy the file in, or follow links explicitly: allow_symlinks=True, "
                                      "torch-ckpt --follow-symlinks)") from None
        if exc.errno in (errno.EISDIR,):
            raise _corrupt(str(path), f"{what} is a directory, not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _corrupt(str(path), f"{what} is not a regular file")
    os.set_blocking(fd, True)
    return fd


@contextmanager
def _reading(source: str, what: str) -> Iterator[None]:
    """Turn an I/O error while reading a checkpoint file into CheckpointCorruptError naming it."""
    try:
        yield
    except CheckpointCorruptError:
        raise
    except OSError as exc:
        raise _corrupt(source, f"{what} cannot be read ({exc.strerror or exc})") from exc


def _read_fd(fd: int, limit: int, source: str) -> bytes:
    """All bytes of an open regular file, refusing more than ``limit`` (never allocates beyond its size)."""
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise _corrupt(source, f"is {size} bytes, more than the {limit} accepted")
        data = f.read(size + 1)
    if len(data) > limit:
        raise _corrupt(source, f"grew past the {limit} bytes accepted while being read")
    return data


def read_manifest(step_dir: str | os.PathLike, *, allow_symlinks: bool = False) -> Any:
    """Read and validate ``step_dir/manifest.json`` (a regular file, bounded).

    Raises:
        CheckpointNotFoundError: there is no manifest.
        CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``), not a regular file,
            unreadable (permissions, I/O error), too large, or not a valid manifest; the message
            names the file.
    """
    from torch_ckpt.layout import MANIFEST_NAME

    path = Path(step_dir) / MANIFEST_NAME
    try:
        fd = _open_regular(path, allow_symlinks=allow_symlinks, what="the manifest")
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(f"{path} does not exist: {step_dir} is not a committed torch-ckpt "
                                      "checkpoint") from exc
    except OSError as exc:
        raise _corrupt(str(path), f"the manifest cannot be read ({exc.strerror or exc})") from exc
    with _reading(str(path), "the manifest"):
        raw = _read_fd(fd, MAX_MANIFEST_BYTES, str(path))
    return parse_manifest(raw, str(path))


def open_listed(step_dir: Path, manifest: Any, name: str, *, allow_symlinks: bool = False) -> int:
    """Open the manifest-listed file ``name`` of ``step_dir`` as a regular file; returns the descriptor.

    Raises:
        CheckpointCorruptError: ``name`` is not listed, is missing, or is not a regular file inside
            the checkpoint.
    """
    path = Path(step_dir) / name
    if name not in manifest.files:
        raise _corrupt(str(path), "is not listed in the manifest; refusing unverified data")
    try:
        return _open_regular(path, allow_symlinks=allow_symlinks, what="file listed in the manifest")
    except FileNotFoundError:
        raise _corrupt(str(path), "file listed in the manifest is missing") from None
    except OSError as exc:
        raise _corrupt(str(path), f"file listed in the manifest cannot be read ({exc.strerror})") from None


def check_files(step_dir: str | os.PathLike, manifest: Any, *, checksums: bool, part: int = 0, parts: int = 1,
                allow_symlinks: bool = False) -> None:
    """Check every file the manifest lists (this reader's share when ``parts`` > 1).

    Each must be a regular file inside ``step_dir`` with the listed size, and with ``checksums``
    the listed CRC-32. One node's copy of a node-local checkpoint is checked for that node's files.

    Raises:
        CheckpointCorruptError: a file is missing, a symlink, not a regular file, or has the wrong
            size or CRC-32; the message names it.
    """
    step_dir = Path(step_dir)
    local = manifest.local_files() if hasattr(manifest, "local_files") else manifest.files
    for i, (name, info) in enumerate(sorted(local.items())):
        if i % parts != part:
            continue
        path = step_dir / name
        fd = open_listed(step_dir, manifest, name, allow_symlinks=allow_symlinks)
        with _reading(str(path), "file listed in the manifest"), os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != info["bytes"]:
                raise _corrupt(str(path), f"size {size} bytes, manifest says {info['bytes']} (truncated?)")
            if checksums:
                crc = 0
                while chunk := f.read(_CHUNK_BYTES):
                    crc = zlib.crc32(chunk, crc)
                if crc != info["crc32"]:
                    raise _corrupt(str(path), f"CRC-32 {crc:#010x} does not match the manifest "
                                              f"({info['crc32']:#010x}); the file is corrupt")


def _read_listed(step_dir: Path, manifest: Any, name: str, limit: int, *, allow_symlinks: bool) -> bytes:
    path = Path(step_dir) / name
    if manifest.files.get(name, {}).get("bytes", 0) > limit:
        raise _corrupt(str(path), f"is {manifest.files[name]['bytes']} bytes, more than the {limit} accepted")
    fd = open_listed(step_dir, manifest, name, allow_symlinks=allow_symlinks)
    with _reading(str(path), "file listed in the manifest"):
        data = _read_fd(fd, limit, str(path))
    if len(data) != manifest.files[name]["bytes"]:
        raise _corrupt(str(path), f"size {len(data)} bytes, manifest says {manifest.files[name]['bytes']}")
    return data


# ---------------------------------------------------------------------------------------------
# per-rank JSON


def rank_file_problems(manifest: Any) -> list[tuple[str, str]]:
    """``[(file, problem)]`` when the manifest does not list exactly one JSON file per rank.

    Counts the listed rank files before anything is done per rank, so a manifest declaring a huge
    world size costs no more than its file list.
    """
    from torch_ckpt.layout import MANIFEST_NAME, rank_file_name

    listed = sum(1 for name in manifest.files if _RANK_FILE_RE.match(name))
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


@lru_cache(maxsize=None)
def _torch_dtype(name: str) -> Any:
    """The torch dtype ``name`` if an embedded tensor may use it (raw bytes viewable as it), else None."""
    import torch

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
    import numpy as np

    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        return None
    if dtype.hasobject or dtype.itemsize == 0:
        return None
    return dtype


def _shape(value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in value):
        raise _Malformed(f"invalid shape {_short(value)}")
    return value


def _b64_bytes(text: Any) -> int:
    """Bytes that base64 ``text`` decodes to; raises for anything but canonical base64."""
    if not isinstance(text, str) or len(text) % 4 or not _B64_RE.fullmatch(text):
        raise _Malformed("embedded data is not base64")
    return len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))


def embedded_info(kind: str, node: dict) -> tuple[list[int], str, int]:
    """``(shape, dtype name, bytes)`` of an embedded tensor (``kind`` "inline") or array ("ndarray").

    Raises:
        ValueError: unknown or unsafe dtype, invalid shape, data that is not base64, or data whose
            length differs from what the shape and dtype need (checked before any allocation).
    """
    from torch_ckpt.codec import _INLINE_TENSOR, _NDARRAY

    name = node.get("dtype")
    dtype = (_torch_dtype if kind == "inline" else _numpy_dtype)(name) if isinstance(name, str) else None
    if dtype is None:
        raise _Malformed(f"unsupported {'tensor' if kind == 'inline' else 'array'} dtype {_short(name)}")
    shape = _shape(node.get("shape"))
    nbytes = math.prod(shape) * dtype.itemsize
    got = _b64_bytes(node.get(_INLINE_TENSOR if kind == "inline" else _NDARRAY))
    if got != nbytes:
        raise _Malformed(f"embedded data holds {got} bytes, its shape {shape} and dtype need {nbytes}")
    dtype_name = str(dtype).removeprefix("torch.") if kind == "inline" else dtype.name
    return shape, dtype_name, nbytes


def walk_tree(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """Yield ``(path, kind, node)`` for every leaf of a per-rank tree, validating every node on the way.

    ``kind`` is "tensor" (a DCP placeholder), "inline" (an embedded tensor), "ndarray" (an embedded
    numpy array) or "value". Every node is checked the way :func:`torch_ckpt.codec.join_state` will
    decode it, so a tree this walk accepts decodes without error. Iterative (no recursion).

    Raises:
        ValueError: a malformed node; the message names its dotted path.
    """
    from torch_ckpt.codec import _BYTES, _DICT, _FLOAT, _INLINE_TENSOR, _NDARRAY, _NPSCALAR, _TUPLE, TENSOR_TAG

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
                    raise _Malformed(f"tensor placeholder {_short(node[TENSOR_TAG])} is not a key")
                yield where, "tensor", node
            elif _INLINE_TENSOR in node:
                embedded_info("inline", node)
                yield where, "inline", node
            elif _NDARRAY in node:
                embedded_info("ndarray", node)
                yield where, "ndarray", node
            elif _NPSCALAR in node:
                name = node.get("dtype")
                dtype = _numpy_dtype(name) if isinstance(name, str) else None
                value = node[_NPSCALAR]
                if dtype is None or isinstance(value, (dict, list)):
                    raise _Malformed(f"invalid numpy scalar {_short(node)}")
                try:
                    dtype.type(value)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise _Malformed(f"invalid numpy scalar {_short(node)} ({exc})") from None
                yield where, "value", node
            elif len(node) == 1 and _BYTES in node:
                _b64_bytes(node[_BYTES])
                yield where, "value", node
            elif len(node) == 1 and _FLOAT in node:
                if not isinstance(node[_FLOAT], str):
                    raise _Malformed(f"invalid float {_short(node[_FLOAT])}")
                try:
                    float(node[_FLOAT])
                except ValueError:
                    raise _Malformed(f"invalid float {_short(node[_FLOAT])}") from None
                yield where, "value", node
            elif len(node) == 1 and _TUPLE in node:
                if not isinstance(node[_TUPLE], list):
                    raise _Malformed(f"malformed {_TUPLE} node")
                stack.extend((v, where + (str(i),)) for i, v in reversed(list(enumerate(node[_TUPLE]))))
            elif len(node) == 1 and _DICT in node:
                items = node[_DICT]
                if not isinstance(items, list) or not all(isinstance(it, list) and len(it) == 2 and
                                                          not isinstance(it[0], list) for it in items):
                    raise _Malformed(f"malformed {_DICT} node")
                for key, value in reversed(items):  # a key is an encoded value too (tuple, bytes, numpy...)
                    label = str(key) if not isinstance(key, dict) else f"<key {_short(key)}>"
                    stack.append((value, where + (label,)))
                    if isinstance(key, dict):
                        stack.append((key, where + (label,)))
            else:
                stack.extend((v, where + (str(k),)) for k, v in reversed(list(node.items())))
        except _Malformed as exc:
            raise _Malformed(f"{'.'.join(where) or '<root>'}: {exc}") from None


def parse_rank_doc(raw: bytes, source: str, manifest: Any, rank: int, *,
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
        raise _corrupt(source, f"per-rank state file is {len(raw)} bytes, more than the {MAX_RANK_JSON_BYTES} "
                               "accepted")
    doc = loads_bounded(raw, source, what="per-rank state file", max_depth=MAX_STATE_DEPTH,
                        max_int_digits=MAX_STATE_INT_DIGITS)
    if not isinstance(doc, dict) or "tree" not in doc:
        raise _corrupt(source, "per-rank state file has no 'tree'")
    got = doc.get("rank")
    if type(got) is not int or got != rank:
        raise _corrupt(source, f"per-rank state file of rank {rank} says rank {_short(got)} (renamed or copied from "
                               "another rank)")
    from torch_ckpt.layout import MANIFEST_NAME

    manifest_source = source[: len(source) - len(PurePath(source).name)] + MANIFEST_NAME
    for field, want in (("step", manifest.step), ("world_size", manifest.world_size)):
        got = doc.get(field)
        if type(got) is not int or got != want:
            raise _corrupt(source, f"{field} {_short(got)} in this per-rank state file disagrees with {field} {want} in "
                                   f"{manifest_source}: one of the two files was altered, or they come from different "
                                   "checkpoints")
    from torch_ckpt.codec import TENSOR_TAG

    try:
        for where, kind, node in walk_tree(doc["tree"]):
            if kind == "tensor" and tensor_keys is not None and not tensor_keys(node[TENSOR_TAG]):
                raise _Malformed(f"{'.'.join(where) or '<root>'}: refers to tensor {node[TENSOR_TAG]!r}, which the "
                                 "DCP metadata does not hold")
    except _Malformed as exc:
        raise _corrupt(source, f"malformed state tree ({exc})") from None
    return doc


def read_rank_tree(step_dir: str | os.PathLike, manifest: Any, rank: int, *, allow_symlinks: bool = False,
                   tensor_keys: Callable[[str], bool] | None = None) -> Any:
    """The validated state tree of ``rank`` in a local checkpoint (see :func:`parse_rank_doc`).

    Raises:
        CheckpointCorruptError: the rank files are not one per rank, or this one is missing, not a
            regular file, or malformed; the message names the file.
    """
    from torch_ckpt.layout import rank_file_name

    step_dir = Path(step_dir)
    problems = rank_file_problems(manifest)
    if problems:
        raise _corrupt(str(step_dir / problems[0][0]), problems[0][1])
    name = rank_file_name(rank)
    raw = _read_listed(step_dir, manifest, name, MAX_RANK_JSON_BYTES, allow_symlinks=allow_symlinks)
    return parse_rank_doc(raw, str(step_dir / name), manifest, rank, tensor_keys=tensor_keys)["tree"]


# ---------------------------------------------------------------------------------------------
# DCP metadata


def _int_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) <= _MAX_NDIM and all(type(d) is int and d >= 0 for d in value)


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

    from torch_ckpt.layout import MANIFEST_NAME

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
            bad(f"item key {_short(key)} is not a string")
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
            bad(f"tensor {key!r}: declared shape {_short(size)} is not a tuple of non-negative integers")
            continue
        if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) and _int_tuple(c.offsets)
                                                   and _int_tuple(c.sizes) for c in chunks):
            bad(f"tensor {key!r}: chunks are not a list of chunk metadata with integer offsets and sizes")
            continue
        outside = next((c for c in chunks if len(c.offsets) != len(size) or len(c.sizes) != len(size) or
                        any(o + s > d for o, s, d in zip(c.offsets, c.sizes, size))), None)
        if outside is not None:
            bad(f"tensor {key!r}: chunk at offset {list(outside.offsets)} of size {list(outside.sizes)} lies outside "
                f"its declared shape {list(size)}")
            continue
        tensors[key] = item

    stored: dict[tuple[str, tuple[int, ...]], int] = {}
    for index, info in sd.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) or \
                not (index.offset is None or _int_tuple(index.offset)):
            bad(f"storage key {_short(index)} is not a valid metadata index")
            continue
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, (str, PurePath)) or \
                type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            bad(f"storage entry of {index.fqn!r} is malformed ({_short(info)})")
            continue
        if getattr(info, "transform_descriptors", None):
            bad(f"item {index.fqn!r} is stored with stream transforms {_short(info.transform_descriptors)}, which "
                "torch-ckpt never writes")
            continue
        rel = str(info.relative_path)
        if rel not in manifest.files or rel in (METADATA_NAME, MANIFEST_NAME) or _RANK_FILE_RE.match(rel) or \
                _NODE_METADATA_RE.match(rel):
            bad(f"item {index.fqn!r} is stored in {rel!r}, which is not a data file the manifest lists")
            continue
        end = info.offset + info.length
        if end > manifest.files[rel]["bytes"]:
            bad(f"item {index.fqn!r} is stored at bytes {info.offset}..{end}, past the end of the file "
                f"({manifest.files[rel]['bytes']} bytes)", rel)
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
        elif (pair := _overlapping([tuple(c.offsets) for c in item.chunks], [tuple(c.sizes) for c in item.chunks])):
            bad(f"tensor {key!r}: chunks at offsets {list(item.chunks[pair[0]].offsets)} and "
                f"{list(item.chunks[pair[1]].offsets)} overlap")
            ok = False
        if not ok:
            del tensors[key]
    return problems, tensors


def unpickle_metadata(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata bytes with the restricted unpickler (never executes code).

    Raises:
        UnsafeCheckpointError: the pickle references anything but DCP's metadata classes.
        CheckpointCorruptError: it is not a readable DCP metadata pickle.
    """
    from torch_ckpt.dcp_io import load_dcp_metadata_bytes

    return load_dcp_metadata_bytes(data, source)


def metadata_name(node: int) -> str:
    """File holding the DCP metadata that ``node``'s ranks load their node's copy with.

    A node-local checkpoint stores replicated tensors once per node; each node's metadata points
    every tensor at the copy its node holds. ``.metadata`` (on node 0 and in the durable tier)
    points every tensor at the one uploaded copy: the complete checkpoint every other reader uses.
    """
    return f"node_{node:05d}.metadata"


def read_metadata(step_dir: str | os.PathLike, manifest: Any, *, allow_symlinks: bool = False) -> Any:
    """The validated DCP metadata of a local checkpoint (see :func:`metadata_problems`); for one
    node's copy of a node-local checkpoint, that node's metadata (:func:`metadata_name`).

    Raises:
        CheckpointCorruptError: ``.metadata`` is not listed, not a regular file, unreadable, or
            inconsistent (with itself or with the manifest); the message names the file.
        UnsafeCheckpointError: the pickle references code.
    """
    step_dir = Path(step_dir)
    node = getattr(manifest, "node", None)
    name = (getattr(manifest, "nodes", None) or {}).get("metadata") or \
        (METADATA_NAME if node is None else metadata_name(node))
    source = str(step_dir / name)
    if name not in manifest.files:
        raise _corrupt(source, "DCP metadata is not listed in the manifest")
    raw = _read_listed(step_dir, manifest, name, MAX_METADATA_BYTES, allow_symlinks=allow_symlinks)
    md = unpickle_metadata(raw, source)
    problems, _ = metadata_problems(md, manifest)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise _corrupt(str(step_dir / file), f"{text}{more}")
    return md


# ---------------------------------------------------------------------------------------------
# tensor records in the data files


class _LocalFile:
    """A :class:`~torch_ckpt.records.RangeReader` over an open descriptor (``pread``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def read_at(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)


@contextmanager
def open_range(path: Path, *, allow_symlinks: bool = False) -> Iterator[_LocalFile]:
    """The local regular file ``path`` open for range reads (I/O errors become corruption naming it).

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``), not a regular file, or
            unreadable.
    """
    fd = _open_regular(path, allow_symlinks=allow_symlinks, what="file listed in the manifest")
    try:
        with _reading(str(path), "file listed in the manifest"):
            yield _LocalFile(fd)
    finally:
        os.close(fd)


@contextmanager
def local_data_file(step_dir: str | os.PathLike, manifest: Any, name: str, *,
                    allow_symlinks: bool = False) -> Iterator[_LocalFile]:
    """The manifest-listed file ``name`` of a local checkpoint, open for range reads.

    Raises:
        CheckpointCorruptError: it is not listed, missing, not a regular file, or unreadable.
    """
    path = Path(step_dir) / name
    fd = open_listed(Path(step_dir), manifest, name, allow_symlinks=allow_symlinks)
    try:
        with _reading(str(path), "file listed in the manifest"):
            yield _LocalFile(fd)
    finally:
        os.close(fd)


def _data_files(md: Any) -> list[str]:
    return sorted({str(info.relative_path) for info in md.storage_data.values()})


def record_problems(step_dir: str | os.PathLike, manifest: Any, md: Any, *, part: int = 0, parts: int = 1,
                    allow_symlinks: bool = False) -> list[tuple[str, str]]:
    """``[(file, problem)]`` for tensor records that do not match validated metadata (this reader's share).

    Args:
        step_dir: the local checkpoint directory.
        manifest: its manifest.
        md: its DCP metadata, already validated (:func:`read_metadata`).
        part: this reader's index when ``parts`` readers split the data files.
        parts: how many readers split the data files.
        allow_symlinks: follow symlinked data files.

    Raises:
        CheckpointCorruptError: a data file is missing, not a regular file, or unreadable.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    mine = [name for i, name in enumerate(_data_files(md)) if i % parts == part]

    def open_file(name: str) -> Any:
        return local_data_file(step_dir, manifest, name, allow_symlinks=allow_symlinks)

    return storage_record_problems(md, tensors, open_file, mine)


def check_records(step_dir: str | os.PathLike, manifest: Any, md: Any, *, part: int = 0, parts: int = 1,
                  allow_symlinks: bool = False) -> None:
    """Raise for the first tensor record that does not match validated metadata (see :func:`record_problems`).

    Raises:
        CheckpointCorruptError: a record's byte range, dtype, size or shape disagrees with
            ``.metadata``; the message names the data file, the tensor key and the byte range.
    """
    problems = record_problems(step_dir, manifest, md, part=part, parts=parts, allow_symlinks=allow_symlinks)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise _corrupt(str(Path(step_dir) / file), f"{text}{more}")
