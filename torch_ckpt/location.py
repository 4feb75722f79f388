"""Where checkpoints live for the read-only tools: a local directory or an fsspec URL.

:class:`Location` gives ``ls``/``inspect``/``verify`` one interface over both, plus a progress bar
that stays silent off a terminal.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

from torch_ckpt._progress import progress_bar
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
    UnsafeCheckpointError,
)
from torch_ckpt.layout import MANIFEST_NAME, Manifest, rank_file_name

__all__ = ["Location", "PathNotFoundError", "is_url", "progress_bar", "COMMITTED", "PARTIAL", "CORRUPT"]

COMMITTED, PARTIAL, CORRUPT = "committed", "partial", "corrupt"

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_(\d+)(\.download)?\.tmp(\.[0-9a-f]+)?$")  # old and incarnation-id forms
_METADATA = ".metadata"
_CHUNK_BYTES = 8 << 20


class PathNotFoundError(CheckpointNotFoundError):
    """The path or URL given does not exist (a bad argument rather than a damaged checkpoint)."""


# ---------------------------------------------------------------------------------------------
# progress


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


