"""``manifest.json``: what it records, and the one way to read and validate it.

The manifest is written last into a checkpoint (see :mod:`torch_ckpt.root._layout`) and lists every
other file with its size and CRC-32. :func:`read_manifest` is the only reader, for local
directories and fsspec URLs alike (through :class:`~torch_ckpt.storage._locations.Location`): the file must be
a regular file (never followed through a symlink unless asked) of at most
:data:`MAX_MANIFEST_BYTES`, parsed with bounded nesting (:data:`MAX_MANIFEST_DEPTH`) and integer
length (:data:`MAX_MANIFEST_INT_DIGITS`), with every field of the right type and range and every
listed name a plain file name inside the checkpoint.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_ckpt.errors import CheckpointNotFoundError
from torch_ckpt.policy._lineage import BASE, Lineage, MalformedLineage, lineage_from_doc
from torch_ckpt.storage._locations import (
    DurableUnavailableError,
    Location,
    Malformed,
    as_location,
    corrupt,
    loads_bounded,
    short_repr,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_MANIFEST_INT_DIGITS",
    "Manifest",
    "manifest_from_doc",
    "parse_manifest",
    "rank_file_name",
    "read_manifest",
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
