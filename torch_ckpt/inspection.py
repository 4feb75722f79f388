"""Read-only views of checkpoint roots and checkpoints: listing, contents and verification.

The functions behind ``torch-ckpt ls``, ``inspect`` and ``verify``, usable from Python. They work on
local directories and on any fsspec URL (``s3://``, ``gs://``, ``memory://``...; credentials and
endpoints in ``storage_options``), and return JSON-serialisable dicts (the commands' ``--json``
output).

Nothing here writes to a checkpoint, and nothing executes code from one: DCP's ``.metadata`` is read
with torch-ckpt's restricted unpickler (:func:`torch_ckpt.dcp_io.read_dcp_metadata`), the per-rank
trees are JSON, and tensor payloads are never loaded (sizes come from the metadata).

Status of an entry of a root (:func:`list_root`):

* ``committed``: ``manifest.json`` is readable and every file it lists is present with its size
  (and, with ``verify=True``, its CRC-32 and the structure checks of :func:`verify_checkpoint`);
* ``partial``: a temporary ``.step_N.tmp`` (a save or download in progress, or left by a crash), or
  a ``step_N`` directory without a manifest (on an object store: an upload in progress or abandoned);
* ``corrupt``: the manifest is unreadable or names another step, or files are missing or have the
  wrong size (or fail verification).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from typing import Any

from torch_ckpt.codec import (  # the on-disk tags of the per-rank JSON trees
    _BYTES,
    _DICT,
    _FLOAT,
    _INLINE_TENSOR,
    _NDARRAY,
    _NPSCALAR,
    _TUPLE,
    TENSOR_TAG,
)
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    UnsafeCheckpointError,
)
from torch_ckpt.layout import MANIFEST_NAME, Manifest, rank_file_name

__all__ = [
    "COMMITTED",
    "CORRUPT",
    "PARTIAL",
    "Location",
    "PathNotFoundError",
    "inspect_checkpoint",
    "is_url",
    "list_root",
    "progress_bar",
    "resolve_checkpoint",
    "verify_checkpoint",
    "verify_path",
    "verify_root",
]

COMMITTED, PARTIAL, CORRUPT = "committed", "partial", "corrupt"

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_(\d+)(\.download)?\.tmp$")
_METADATA = ".metadata"
_CHUNK_BYTES = 8 << 20


class PathNotFoundError(CheckpointNotFoundError):
    """The path or URL given does not exist (a bad argument rather than a damaged checkpoint)."""


# ---------------------------------------------------------------------------------------------
# progress


class _NullBar:
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> _NullBar:
        return self

    def __exit__(self, *exc: object) -> None: ...


def progress_bar(total: int, desc: str, *, enabled: bool = True, unit: str = "B") -> Any:
    """A tqdm bar on stderr when ``enabled`` and stderr is a terminal; otherwise a silent stand-in.

    Both have ``update(n)``, ``close()`` and work as context managers.
    """
    if not enabled or not sys.stderr.isatty():
        return _NullBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return _NullBar()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, leave=False,
                file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# locations


def is_url(text: str | os.PathLike) -> bool:
    """True for an fsspec URL (``s3://...``, ``memory://...``); ``file://`` counts as a local path."""
    text = os.fspath(text)
    return "://" in text and not text.startswith("file://")


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
        if isinstance(value, _dt.datetime):
            return value.timestamp()
    return None


class Location:
    """A directory on the local file system or on an fsspec store; files are addressed by name.

    Args:
        text: a local path (``file://`` allowed) or an fsspec URL.
        storage_options: fsspec options for URLs (credentials, ``client_kwargs``...).

    Raises:
        ConfigError: the URL's protocol is unknown or its backend is not installed.
    """

    def __init__(self, text: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> None:
        text = os.fspath(text)
        self.storage_options = dict(storage_options or {})
        if is_url(text):
            from torch_ckpt.tiers import DurableTier

            tier = DurableTier(text, storage_options=self.storage_options)
            self.fs, self.path, self.url, self.remote = tier.fs, tier.root, tier.url, True
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache()
        else:
            import fsspec

            local = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
            self.fs, self.path, self.url, self.remote = fsspec.filesystem("file"), local, local, False

    def child(self, name: str) -> Location:
        """The location of the entry ``name`` of this directory."""
        new = object.__new__(Location)
        new.storage_options, new.fs, new.remote = self.storage_options, self.fs, self.remote
        new.path = f"{self.path.rstrip('/')}/{name}"
        new.url = f"{self.url.rstrip('/')}/{name}" if self.remote else os.path.join(self.url, name)
        return new

    @property
    def name(self) -> str:
        """Last component of the path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def describe(self, name: str | None = None) -> str:
        """The URL or path of this directory, or of its file ``name`` (for messages)."""
        if name is None:
            return self.url
        return f"{self.url.rstrip('/')}/{name}" if self.remote else os.path.join(self.url, name)

    def _p(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a file-system call; on a remote store, backend errors become DurableUnavailableError."""
        if not self.remote:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001 - any backend error (botocore, aiohttp...) means unreachable
            from torch_ckpt.tiers import DurableUnavailableError

            raise DurableUnavailableError(f"cannot read {self.describe()}: {exc}") from exc

    def exists(self, name: str | None = None) -> bool:
        """Whether the directory (on object stores, the prefix), or its entry ``name``, exists."""
        return bool(self._call(self.fs.exists, self.path if name is None else self._p(name)))

    def is_dir(self) -> bool:
        """Whether this is a directory (a prefix with entries, on object stores)."""
        return bool(self._call(self.fs.isdir, self.path))

    def entries(self) -> dict[str, dict[str, Any]]:
        """``{name: {"type": "file"|"directory", "size": int, "mtime": float|None}}`` of the directory."""
        out: dict[str, dict[str, Any]] = {}
        for info in self._call(self.fs.ls, self.path, detail=True):
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if not name or self._p(name).rstrip("/") == self.path.rstrip("/"):
                continue
            kind = "directory" if info.get("type") == "directory" else "file"
            out[name] = {"type": kind, "size": int(info.get("size") or 0), "mtime": _mtime(info)}
        return out

    def read_bytes(self, name: str) -> bytes:
        """Contents of the file ``name``."""
        return self._call(self.fs.cat_file, self._p(name))

    def checksum(self, name: str, bar: Any = None) -> tuple[int, int]:
        """``(bytes, crc32)`` of the file ``name``, read in chunks (advancing ``bar``)."""

        def read() -> tuple[int, int]:
            crc, size = 0, 0
            with self.fs.open(self._p(name), "rb", **({"block_size": _CHUNK_BYTES} if self.remote else {})) as f:
                while chunk := f.read(_CHUNK_BYTES):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            return size, crc

        return self._call(read)

    def read_metadata(self, name: str = _METADATA) -> Any:
        """DCP metadata read with the restricted unpickler (never executes code from the file).

        Raises:
            UnsafeCheckpointError: the pickle references anything but DCP's metadata classes.
            CheckpointCorruptError: the file is truncated or not DCP metadata.
        """
        from torch_ckpt.dcp_io import read_dcp_metadata

        if not self.remote:
            return read_dcp_metadata(self._p(name))
        data = self.read_bytes(name)
        with tempfile.TemporaryDirectory(prefix="torch-ckpt-md-") as tmp:
            path = os.path.join(tmp, "metadata")
            with open(path, "wb") as f:
                f.write(data)
            try:
                return read_dcp_metadata(path)
            except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
                raise type(exc)(str(exc).replace(path, self.describe(name))) from None

    def read_manifest(self) -> Manifest:
        """The manifest of this checkpoint directory.

        Raises:
            CheckpointNotFoundError: there is no ``manifest.json`` (not a committed checkpoint).
            CheckpointCorruptError: it is not valid JSON or not a torch-ckpt manifest.
        """
        source = self.describe(MANIFEST_NAME)
        try:
            raw = self.read_bytes(MANIFEST_NAME)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{source} does not exist: {self.describe()} is not a committed "
                                          "torch-ckpt checkpoint") from exc
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"{source}: manifest is not valid JSON ({exc})") from exc
        return Manifest.from_json(data, source)

    def read_rank_doc(self, rank: int) -> dict[str, Any]:
        """The per-rank JSON document (``{"step", "rank", "world_size", "tree"}``) of ``rank``.

        Raises:
            CheckpointCorruptError: the file is missing, not JSON, or has no ``tree``.
        """
        name = rank_file_name(rank)
        try:
            doc = json.loads(self.read_bytes(name))
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{self.describe(name)}: per-rank state file is missing") from exc
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{self.describe(name)}: per-rank state file is not valid JSON "
                                         f"({exc})") from exc
        if not isinstance(doc, dict) or "tree" not in doc:
            raise CheckpointCorruptError(f"{self.describe(name)}: per-rank state file has no 'tree'")
        return doc


def _as_location(where: str | os.PathLike | Location, storage_options: dict[str, Any] | None) -> Location:
    return where if isinstance(where, Location) else Location(where, storage_options=storage_options)


def _require_dir(loc: Location) -> None:
    if not loc.exists():
        raise PathNotFoundError(f"{loc.describe()} does not exist")
    if not loc.is_dir():
        raise PathNotFoundError(f"{loc.describe()} is not a directory")


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def _step_of(name: str) -> tuple[int | None, bool]:
    """``(step, temporary)`` parsed from a directory name; step None for other names."""
    m = _STEP_RE.match(name)
    if m:
        return int(m.group(1)), False
    t = _TMP_RE.match(name)
    if t:
        return int(t.group(1)), True
    return None, False


# ---------------------------------------------------------------------------------------------
# walking the per-rank JSON trees


def _walk(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """Yield ``(path, kind, node)`` for every leaf of a codec tree.

    ``kind`` is "tensor" (a DCP placeholder), "inline" (a base64 rank-local tensor), "ndarray"
    (a base64 numpy array) or "value" (anything else).
    """
    if isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (str(i),))
        return
    if not isinstance(node, dict):
        yield path, "value", node
        return
    if len(node) == 1 and TENSOR_TAG in node:
        if not isinstance(node[TENSOR_TAG], str):
            raise ValueError(f"{'.'.join(path) or '<root>'}: tensor placeholder {node[TENSOR_TAG]!r} is not a key")
        yield path, "tensor", node
    elif _INLINE_TENSOR in node:
        yield path, "inline", node
    elif _NDARRAY in node:
        yield path, "ndarray", node
    elif _NPSCALAR in node or (len(node) == 1 and (_BYTES in node or _FLOAT in node)):
        yield path, "value", node
    elif len(node) == 1 and _TUPLE in node:
        yield from _walk(node[_TUPLE], path)
    elif len(node) == 1 and _DICT in node:
        items = node[_DICT]
        if not isinstance(items, list):
            raise ValueError(f"{'.'.join(path) or '<root>'}: malformed {_DICT} node")
        for item in items:
            if not (isinstance(item, list) and len(item) == 2):
                raise ValueError(f"{'.'.join(path) or '<root>'}: malformed {_DICT} item")
            yield from _walk(item[1], path + (str(item[0]),))
    else:
        for k, v in node.items():
            yield from _walk(v, path + (str(k),))


def _numel(shape: Any) -> int:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"invalid shape {shape!r}")
    return math.prod(shape)


def _torch_dtype(name: Any) -> Any:
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _inline_info(node: dict) -> tuple[list[int], str, int]:
    """``(shape, dtype name, bytes)`` of an inline tensor node (validated)."""
    dtype = _torch_dtype(node.get("dtype"))
    shape = list(node.get("shape", []))
    return shape, _dtype_name(dtype), _numel(shape) * dtype.itemsize


def _ndarray_info(node: dict) -> tuple[list[int], str, int]:
    import numpy as np

    dtype = np.dtype(node.get("dtype"))
    shape = list(node.get("shape", []))
    return shape, dtype.name, _numel(shape) * dtype.itemsize


def _b64_len(text: Any) -> int:
    if not isinstance(text, str):
        return -1
    pad = len(text) - len(text.rstrip("="))
    return len(text) * 3 // 4 - pad


# ---------------------------------------------------------------------------------------------
# verification of one checkpoint directory


class _Report:
    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.problems: list[dict[str, str]] = []
        self.warnings: list[dict[str, str]] = []

    def problem(self, file: str, text: str) -> None:
        self.problems.append({"file": file, "path": self.loc.describe(file), "problem": text})

    def warning(self, file: str, text: str) -> None:
        self.warnings.append({"file": file, "path": self.loc.describe(file), "problem": text})


def _check_files(loc: Location, manifest: Manifest, listing: dict[str, dict[str, Any]], rep: _Report, *,
                 checksums: bool, bar: Any) -> None:
    for name, info in sorted(manifest.files.items()):
        entry = listing.get(name)
        if entry is None or entry["type"] != "file":
            rep.problem(name, "listed in the manifest but missing" if entry is None else
                        "listed in the manifest as a file but is a directory")
            bar.update(info["bytes"])
            continue
        if entry["size"] != info["bytes"]:
            rep.problem(name, f"size {entry['size']} bytes, manifest says {info['bytes']} (truncated or "
                              "overwritten)")
            bar.update(info["bytes"])
            continue
        if checksums:
            try:
                size, crc = loc.checksum(name, bar)
            except OSError as exc:
                rep.problem(name, f"cannot be read ({exc})")
                continue
            if size != info["bytes"]:
                rep.problem(name, f"read {size} bytes, manifest says {info['bytes']}")
            elif crc != info["crc32"]:
                rep.problem(name, f"CRC-32 {crc:#010x} does not match the manifest ({info['crc32']:#010x}); "
                                  "the file is corrupt")
    for name, entry in sorted(listing.items()):
        if name != MANIFEST_NAME and name not in manifest.files:
            rep.warning(name, f"{entry['type']} not listed in the manifest (ignored on restore)")


def _check_structure(loc: Location, manifest: Manifest, listing: dict[str, dict[str, Any]], rep: _Report) -> int:
    """DCP metadata and per-rank trees; returns the number of DCP tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = None
    if _METADATA not in manifest.files:
        rep.problem(_METADATA, "DCP metadata is not listed in the manifest")
    if _METADATA in listing:
        try:
            md = loc.read_metadata(_METADATA)
        except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
            rep.problem(_METADATA, str(exc).replace(loc.describe(_METADATA) + ": ", ""))
        except OSError as exc:
            rep.problem(_METADATA, f"cannot be read ({exc})")
    tensors: dict[str, Any] = {}
    if md is not None:
        for key, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                tensors[key] = item
            else:
                rep.warning(_METADATA, f"item {key!r} is a pickled object; torch-ckpt never writes those and refuses "
                                       "to load them")
        stored: set[tuple[str, tuple[int, ...]]] = set()
        for index, info in md.storage_data.items():
            rel = str(getattr(info, "relative_path", ""))
            if index.offset is not None:
                stored.add((index.fqn, tuple(index.offset)))
            if rel not in manifest.files:
                rep.problem(_METADATA, f"item {index.fqn!r} is stored in {rel!r}, which the manifest does not list")
                continue
            end = int(info.offset) + int(info.length)
            if end > manifest.files[rel]["bytes"]:
                rep.problem(rel, f"item {index.fqn!r} is stored at bytes {info.offset}..{end}, past the end of the "
                                 f"file ({manifest.files[rel]['bytes']} bytes)")
        for key, item in tensors.items():
            covered = 0
            for chunk in item.chunks:
                if (key, tuple(chunk.offsets)) not in stored:
                    rep.problem(_METADATA, f"tensor {key!r}: the chunk at offset {list(chunk.offsets)} has no "
                                           "storage entry")
                covered += math.prod(chunk.sizes)
            if covered != math.prod(item.size):
                rep.problem(_METADATA, f"tensor {key!r}: chunks hold {covered} of {math.prod(item.size)} elements")

    referenced: set[str] = set()
    trees_read = 0
    if manifest.world_size < 1:
        rep.problem(MANIFEST_NAME, f"world size {manifest.world_size} is not positive")
    for rank in range(manifest.world_size):
        name = rank_file_name(rank)
        if name not in manifest.files:
            rep.problem(name, f"per-rank state file of rank {rank} is not listed in the manifest (world size "
                              f"{manifest.world_size})")
            continue
        if name not in listing or any(p["file"] == name for p in rep.problems):
            continue  # already reported as missing, truncated or corrupt
        try:
            doc = loc.read_rank_doc(rank)
        except (CheckpointCorruptError, OSError) as exc:
            rep.problem(name, str(exc).replace(loc.describe(name) + ": ", ""))
            continue
        for field, want in (("rank", rank), ("step", manifest.step), ("world_size", manifest.world_size)):
            if doc.get(field) != want:
                rep.problem(name, f"{field} is {doc.get(field)!r}, expected {want!r}")
        try:
            for path, kind, node in _walk(doc["tree"], ()):
                where = ".".join(path) or "<root>"
                if kind == "tensor":
                    key = node[TENSOR_TAG]
                    referenced.add(key)
                    if md is not None and key not in tensors:
                        rep.problem(name, f"state key {where!r} refers to tensor {key!r}, which the DCP metadata "
                                          "does not hold")
                elif kind in ("inline", "ndarray"):
                    try:
                        _, _, nbytes = (_inline_info if kind == "inline" else _ndarray_info)(node)
                    except (ValueError, TypeError) as exc:
                        rep.problem(name, f"state key {where!r}: {exc}")
                        continue
                    got = _b64_len(node.get(_INLINE_TENSOR if kind == "inline" else _NDARRAY))
                    if got != nbytes:
                        rep.problem(name, f"state key {where!r}: embedded data holds {got} bytes, its shape and "
                                          f"dtype need {nbytes}")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            rep.problem(name, f"malformed state tree ({exc})")
            continue
        trees_read += 1
    for name in sorted(manifest.files):
        m = re.match(r"^rank_(\d+)\.json$", name)
        if m and int(m.group(1)) >= manifest.world_size:
            rep.warning(name, f"per-rank file beyond the world size {manifest.world_size}")
    unreferenced = sorted(set(tensors) - referenced)
    if unreferenced and trees_read == manifest.world_size:  # otherwise the unread trees may refer to them
        rep.warning(_METADATA, f"{len(unreferenced)} tensor(s) are not referenced by any rank's state, e.g. "
                               f"{unreferenced[:3]}")
    return len(tensors)


def _check_dir(loc: Location, *, checksums: bool, structure: bool, progress: bool) -> dict[str, Any]:
    """Verify one checkpoint directory; never raises for a damaged checkpoint (problems are listed)."""
    return _check_dir_manifest(loc, checksums=checksums, structure=structure, progress=progress)[0]


def _check_dir_manifest(loc: Location, *, checksums: bool, structure: bool,
                        progress: bool) -> tuple[dict[str, Any], Manifest | None]:
    rep = _Report(loc)
    step, _ = _step_of(loc.name)
    out: dict[str, Any] = {"checkpoint": loc.describe(), "name": loc.name, "step": step, "ok": False,
                           "checksums": checksums, "structure": structure, "world_size": None, "files": 0,
                           "bytes": 0, "tensors": None, "problems": rep.problems, "warnings": rep.warnings}
    try:
        listing = loc.entries()
    except FileNotFoundError:
        rep.problem("", "the checkpoint directory does not exist")
        return out
    manifest = None
    if MANIFEST_NAME not in listing:
        rep.problem(MANIFEST_NAME, "missing: not a committed checkpoint")
    else:
        try:
            manifest = loc.read_manifest()
        except (CheckpointCorruptError, CheckpointNotFoundError, OSError) as exc:
            rep.problem(MANIFEST_NAME, str(exc).replace(loc.describe(MANIFEST_NAME) + ": ", ""))
    if manifest is not None:
        if step is not None and manifest.step != step:
            rep.problem(MANIFEST_NAME, f"says step {manifest.step} but the directory is {loc.name}")
        out.update(step=manifest.step, world_size=manifest.world_size, files=len(manifest.files),
                   bytes=sum(i["bytes"] for i in manifest.files.values()))
        with progress_bar(out["bytes"] if checksums else 0, f"verify {loc.name}",
                          enabled=progress and checksums) as bar:
            _check_files(loc, manifest, listing, rep, checksums=checksums, bar=bar)
        if structure:
            out["tensors"] = _check_structure(loc, manifest, listing, rep)
    out["ok"] = not rep.problems
    return out, manifest


# ---------------------------------------------------------------------------------------------
# ls


def _tier_steps(url: str, storage_options: dict[str, Any], cache: dict[str, set[int] | None]) -> set[int] | None:
    if url not in cache:
        try:
            from torch_ckpt.tiers import DurableTier

            cache[url] = set(DurableTier(url, storage_options=storage_options).list_steps())
        except (CheckpointError, OSError, ValueError):
            cache[url] = None
    return cache[url]


def list_root(root: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
              verify: bool = False, check_tiers: bool = False, progress: bool = False) -> dict[str, Any]:
    """List the checkpoints of a run root with their status, time, size and tiers.

    Args:
        root: a local run root or an fsspec URL of one.
        storage_options: fsspec options for URLs (also used for the tiers checked by ``check_tiers``).
        verify: also check every file's CRC-32 and the structure (reads every byte).
        check_tiers: list each durable tier recorded in the manifests and keep only the tiers that
            still hold the step (retention on the durable tier may have removed it since).
        progress: show a progress bar for verification on a terminal.

    Returns:
        ``{"root", "verified", "steps": [entry...], "counts": {status: n}}``; each entry has ``step``,
        ``name``, ``status``, ``wall_time`` and ``time`` (ISO 8601, UTC; the commit time, or the
        directory's modification time for other entries when known), ``age_s``, ``bytes`` (on-disk
        bytes, manifest included), ``tensor_bytes``, ``world_size``, ``tiers`` (``{name: info}``: this
        root's own copy as "local" or "durable", plus the copies the manifest records), ``problems``
        (``[{"file", "path", "problem"}]``) and ``reason`` (why an entry is partial).

    Raises:
        PathNotFoundError: ``root`` does not exist or is not a directory.
    """
    loc = _as_location(root, storage_options)
    _require_dir(loc)
    own = "durable" if loc.remote else "local"
    now = time.time()
    rows: list[dict[str, Any]] = []
    tier_cache: dict[str, set[int] | None] = {}
    for name, info in loc.entries().items():
        step, temporary = _step_of(name)
        if step is None or info["type"] != "directory":
            continue
        row: dict[str, Any] = {"step": step, "name": name, "status": PARTIAL, "wall_time": None, "time": None,
                               "age_s": None, "bytes": None, "tensor_bytes": None, "world_size": None, "tiers": {},
                               "problems": [], "reason": None}
        child = loc.child(name)
        try:
            listing = child.entries()
        except FileNotFoundError:  # removed while listing (retention, commit rename)
            continue
        present = sum(e["size"] for e in listing.values() if e["type"] == "file")
        if temporary or MANIFEST_NAME not in listing:
            row["reason"] = ("temporary directory: a save or download in progress, or left by a crash" if temporary
                             else "no manifest.json: an upload or copy in progress, or abandoned")
            row["bytes"] = present
            mtime = info["mtime"] or max((e["mtime"] or 0.0 for e in listing.values()), default=0.0) or None
            row.update(wall_time=mtime, time=_iso(mtime), age_s=None if mtime is None else now - mtime)
            rows.append(row)
            continue
        result, manifest = _check_dir_manifest(child, checksums=verify, structure=verify, progress=progress)
        if not result["ok"] and not child.exists():
            continue  # deleted while listing (retention renames it away first)
        row["problems"] = result["problems"]
        row["status"] = COMMITTED if result["ok"] else CORRUPT
        row["bytes"] = present
        if manifest is not None:
            row.update(wall_time=manifest.wall_time, time=_iso(manifest.wall_time), age_s=now - manifest.wall_time,
                       tensor_bytes=manifest.tensor_bytes, world_size=manifest.world_size)
            # this root's copy counts only when intact; copies recorded elsewhere are listed either way
            tiers: dict[str, Any] = {own: {"location": loc.describe()}} if row["status"] == COMMITTED else {}
            for tier, tinfo in manifest.tiers.items():
                if tier == own or not isinstance(tinfo, dict):
                    continue
                tiers[tier] = dict(tinfo)
                url = tinfo.get("url")
                if check_tiers and isinstance(url, str):
                    steps = _tier_steps(url, loc.storage_options, tier_cache)
                    tiers[tier]["checked"] = steps is not None
                    if steps is not None and manifest.step not in steps:
                        del tiers[tier]
                        row.setdefault("stale_tiers", []).append(tier)
            row["tiers"] = tiers
        rows.append(row)
    rows.sort(key=lambda r: (r["step"], r["name"]))
    counts = {s: sum(r["status"] == s for r in rows) for s in (COMMITTED, PARTIAL, CORRUPT)}
    return {"root": loc.describe(), "verified": verify, "steps": rows, "counts": counts}


# ---------------------------------------------------------------------------------------------
# resolving a checkpoint argument


def _looks_like_checkpoint(loc: Location) -> bool:
    step, _ = _step_of(loc.name)
    return step is not None or loc.exists(MANIFEST_NAME)


def resolve_checkpoint(where: str | os.PathLike | Location, *, step: int | None = None,
                       storage_options: dict[str, Any] | None = None) -> Location:
    """The checkpoint directory meant by ``where``: a step directory, or a root (its newest committed
    checkpoint, or ``step``).

    Raises:
        PathNotFoundError: ``where`` does not exist.
        ConfigError: ``step`` was given with a step directory.
        CheckpointNotFoundError: the root has no committed checkpoint (of that step).
    """
    loc = _as_location(where, storage_options)
    _require_dir(loc)
    if _looks_like_checkpoint(loc):
        if step is not None:
            raise ConfigError(f"{loc.describe()} is a checkpoint directory; a step applies to a run root only")
        return loc
    listing = [r for r in list_root(loc)["steps"] if r["status"] == COMMITTED]
    if step is not None:
        listing = [r for r in listing if r["step"] == step]
        if not listing:
            raise CheckpointNotFoundError(f"{loc.describe()} has no committed checkpoint of step {step}")
    if not listing:
        raise CheckpointNotFoundError(f"{loc.describe()} holds no committed checkpoint")
    return loc.child(listing[-1]["name"])


# ---------------------------------------------------------------------------------------------
# inspect


def _component() -> dict[str, Any]:
    return {"bytes": 0, "tensor_bytes": 0, "tensors": 0, "dtypes": {}, "rank_local_tensors": 0, "arrays": 0,
            "array_bytes": 0, "values": 0}


def inspect_checkpoint(where: str | os.PathLike | Location, *, step: int | None = None,
                       storage_options: dict[str, Any] | None = None, keys: bool = False,
                       progress: bool = False) -> dict[str, Any]:
    """What a checkpoint holds, per component (top-level key of the saved state).

    Sizes come from the DCP metadata (global shapes and dtypes, so a sharded tensor counts once at
    its full size) and from the per-rank JSON trees (rank-local tensors, embedded per rank, count on
    every rank). No tensor payload is read and no checksum is checked (see :func:`verify_checkpoint`).

    Args:
        where: a checkpoint directory, or a run root (its newest committed checkpoint, or ``step``).
        step: with a root, the step to inspect.
        storage_options: fsspec options for URLs.
        keys: also list every tensor and array with its shape and dtype.
        progress: show a progress bar over the ranks' files on a terminal.

    Returns:
        ``{"checkpoint", "step", "world_size", "wall_time", "time", "torch_version", "format_version",
        "files", "file_bytes", "manifest_tensor_bytes", "components": [...], "totals": {...}}`` and,
        with ``keys``, ``"keys": [...]``. A component is ``{"name", "bytes"`` (tensor + array bytes),
        ``"tensor_bytes", "tensors", "dtypes"`` (``{dtype: count}``), ``"rank_local_tensors",
        "arrays", "array_bytes", "values"`` (other leaves of rank 0's state)``}``; a key is ``{"key",
        "component", "kind"`` ("tensor" or "ndarray"), ``"storage"`` ("dcp" or "json"), ``"rank"``
        (json only), ``"shape", "dtype", "bytes", "chunks"`` (dcp only)``}``.

    Raises:
        PathNotFoundError: ``where`` does not exist.
        CheckpointNotFoundError: not a committed checkpoint.
        CheckpointCorruptError: the manifest, metadata or a per-rank file is unreadable, or the state
            refers to a tensor the metadata lacks.
        UnsafeCheckpointError: the DCP metadata references code (refused, not executed).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    loc = resolve_checkpoint(where, step=step, storage_options=storage_options)
    manifest = loc.read_manifest()
    if manifest.world_size < 1:
        raise CheckpointCorruptError(f"{loc.describe(MANIFEST_NAME)}: world size {manifest.world_size} is not positive")
    md = loc.read_metadata(_METADATA)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    comps: dict[str, dict[str, Any]] = {}
    key_rows: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(comp: dict[str, Any], nbytes: int, dtype: str, *, local: bool) -> None:
        comp["tensors"] += 1
        comp["tensor_bytes"] += nbytes
        comp["dtypes"][dtype] = comp["dtypes"].get(dtype, 0) + 1
        comp["rank_local_tensors"] += int(local)

    with progress_bar(manifest.world_size, f"inspect {loc.name}", enabled=progress and manifest.world_size > 8,
                      unit="rank") as bar:
        for rank in range(manifest.world_size):
            tree = loc.read_rank_doc(rank)["tree"]
            source = loc.describe(rank_file_name(rank))
            tops = tree.items() if isinstance(tree, dict) else [("<root>", tree)]
            for top, sub in tops:
                comp = comps.setdefault(top, _component())
                try:
                    leaves = list(_walk(sub, (top,)))
                except (ValueError, TypeError) as exc:
                    raise CheckpointCorruptError(f"{source}: malformed state tree ({exc})") from exc
                for path, kind, node in leaves:
                    name = ".".join(path)
                    if kind == "tensor":
                        key = node[TENSOR_TAG]
                        if key in seen:
                            continue
                        seen.add(key)
                        tmd = tensors.get(key)
                        if tmd is None:
                            raise CheckpointCorruptError(f"{source}: state key {name!r} refers to tensor {key!r}, "
                                                         "which the DCP metadata does not hold")
                        dtype = _dtype_name(tmd.properties.dtype)
                        nbytes = math.prod(tmd.size) * tmd.properties.dtype.itemsize
                        add(comp, nbytes, dtype, local=False)
                        if keys:
                            key_rows.append({"key": key, "component": top, "kind": "tensor", "storage": "dcp",
                                             "shape": list(tmd.size), "dtype": dtype, "bytes": nbytes,
                                             "chunks": len(tmd.chunks)})
                    elif kind in ("inline", "ndarray"):
                        try:
                            shape, dtype, nbytes = (_inline_info if kind == "inline" else _ndarray_info)(node)
                        except (ValueError, TypeError) as exc:
                            raise CheckpointCorruptError(f"{source}: state key {name!r}: {exc}") from exc
                        if kind == "inline":
                            add(comp, nbytes, dtype, local=True)
                        else:
                            comp["arrays"] += 1
                            comp["array_bytes"] += nbytes
                        if keys:
                            key_rows.append({"key": name, "component": top,
                                             "kind": "tensor" if kind == "inline" else "ndarray",
                                             "storage": "json", "rank": rank, "shape": shape, "dtype": dtype,
                                             "bytes": nbytes})
                    elif rank == 0:
                        comp["values"] += 1
            bar.update(1)
    stray = [k for k in tensors if k not in seen]
    if stray:
        comp = comps.setdefault("(not in state)", _component())
        for key in stray:
            tmd = tensors[key]
            nbytes = math.prod(tmd.size) * tmd.properties.dtype.itemsize
            add(comp, nbytes, _dtype_name(tmd.properties.dtype), local=False)
            if keys:
                key_rows.append({"key": key, "component": "(not in state)", "kind": "tensor", "storage": "dcp",
                                 "shape": list(tmd.size), "dtype": _dtype_name(tmd.properties.dtype),
                                 "bytes": nbytes, "chunks": len(tmd.chunks)})
    components = []
    for name, comp in comps.items():
        comp["bytes"] = comp["tensor_bytes"] + comp["array_bytes"]
        comp["dtypes"] = dict(sorted(comp["dtypes"].items()))
        components.append({"name": name, **comp})
    totals = {k: sum(c[k] for c in components)
              for k in ("bytes", "tensor_bytes", "tensors", "rank_local_tensors", "arrays", "array_bytes", "values")}
    totals["dcp_tensor_bytes"] = sum(math.prod(t.size) * t.properties.dtype.itemsize for t in tensors.values())
    out: dict[str, Any] = {
        "checkpoint": loc.describe(), "step": manifest.step, "world_size": manifest.world_size,
        "wall_time": manifest.wall_time, "time": _iso(manifest.wall_time), "torch_version": manifest.torch_version,
        "format_version": manifest.format_version, "files": len(manifest.files),
        "file_bytes": sum(i["bytes"] for i in manifest.files.values()),
        "manifest_tensor_bytes": manifest.tensor_bytes, "components": components, "totals": totals,
    }
    if keys:
        out["keys"] = key_rows
    return out


# ---------------------------------------------------------------------------------------------
# verify


def verify_checkpoint(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                      checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Check one checkpoint directory: files and structure.

    Every file of the manifest must be present with its size and (``checksums``) CRC-32; the DCP
    metadata must be readable with the restricted unpickler, its storage entries must lie inside
    listed files and cover each tensor; every rank's JSON file must be listed, readable and consistent
    with the manifest, and every tensor placeholder of its tree must be a tensor of the metadata.

    Returns:
        ``{"checkpoint", "name", "step", "ok", "checksums", "structure", "world_size", "files",
        "bytes", "tensors", "problems": [{"file", "path", "problem"}], "warnings": [...]}``.

    Raises:
        PathNotFoundError: ``where`` does not exist.
    """
    loc = _as_location(where, storage_options)
    _require_dir(loc)
    return _check_dir(loc, checksums=checksums, structure=True, progress=progress)


def verify_root(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Verify every checkpoint of a run root (partial entries are skipped and listed).

    Returns:
        ``{"target", "kind": "root", "ok", "checkpoints": [verify_checkpoint results], "skipped":
        [{"name", "step", "reason"}], "problems": total count, "general_problems": [str]}``. A root
        without any checkpoint to verify is not ok (one general problem).

    Raises:
        PathNotFoundError: ``where`` does not exist.
    """
    loc = _as_location(where, storage_options)
    listing = list_root(loc)
    results, skipped = [], []
    for row in listing["steps"]:
        if row["status"] == PARTIAL:
            skipped.append({"name": row["name"], "step": row["step"], "reason": row["reason"]})
            continue
        results.append(_check_dir(loc.child(row["name"]), checksums=checksums, structure=True, progress=progress))
    return _summary(loc, "root", results, skipped)


def _summary(loc: Location, kind: str, results: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> dict[str, Any]:
    general = [] if results else [f"{loc.describe()} holds no checkpoint to verify"]
    problems = sum(len(r["problems"]) for r in results) + len(general)
    return {"target": loc.describe(), "kind": kind, "ok": problems == 0, "checkpoints": results, "skipped": skipped,
            "problems": problems, "general_problems": general}


def verify_path(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Verify a checkpoint directory or every checkpoint of a root (see :func:`verify_root`).

    Returns:
        The :func:`verify_root` shape in both cases (``kind`` is "checkpoint" or "root").
    """
    loc = _as_location(where, storage_options)
    _require_dir(loc)
    if _looks_like_checkpoint(loc):
        return _summary(loc, "checkpoint", [_check_dir(loc, checksums=checksums, structure=True, progress=progress)],
                        [])
    return verify_root(loc, checksums=checksums, progress=progress)
