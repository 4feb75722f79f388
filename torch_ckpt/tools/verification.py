"""Verification of checkpoints (``torch-ckpt verify``): sizes, CRC-32 and structure, naming each bad file.

Nothing executes code from a checkpoint: DCP's ``.metadata`` is read with the restricted unpickler
and tensor payloads are never loaded.
"""

from __future__ import annotations

import dataclasses

import os
import re
from typing import Any

from tqdm import tqdm

from torch_ckpt.codec import TENSOR_TAG
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from torch_ckpt.format import metadata_problems, rank_file_problems, walk_tree
from torch_ckpt.layout import MANIFEST_NAME, Manifest, rank_file_name
from torch_ckpt.records import storage_record_problems
from torch_ckpt.tools.location import (  # private helpers shared by the read-only tools
    _METADATA,
    PARTIAL,
    Location,
    _as_location,
    _require_dir,
    _step_of,
)

__all__ = ["verify_checkpoint", "verify_path", "verify_root"]

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
        kind = None if entry is None else entry["type"]
        if kind != "file":
            rep.problem(name, {None: "listed in the manifest but missing",
                               "directory": "listed in the manifest as a file but is a directory",
                               "symlink": "is a symbolic link; restore reads only regular files inside the checkpoint",
                               }.get(kind, "listed in the manifest but is not a regular file"))
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
            except (OSError, CheckpointCorruptError) as exc:
                rep.problem(name, f"cannot be read ({_strip(loc, name, exc)})")
                continue
            if size != info["bytes"]:
                rep.problem(name, f"read {size} bytes, manifest says {info['bytes']}")
            elif crc != info["crc32"]:
                rep.problem(name, f"CRC-32 {crc:#010x} does not match the manifest ({info['crc32']:#010x}); "
                                  "the file is corrupt")
    for name, entry in sorted(listing.items()):
        if name != MANIFEST_NAME and name not in manifest.files:
            rep.warning(name, f"{entry['type']} not listed in the manifest (ignored on restore)")


def _strip(loc: Location, name: str, exc: BaseException) -> str:
    """The message of ``exc`` without its leading file name (the report names the file)."""
    return str(exc).replace(loc.describe(name) + ": ", "")


def _check_structure(loc: Location, manifest: Manifest, listing: dict[str, dict[str, Any]], rep: _Report) -> int:
    """DCP metadata and per-rank trees, with the checks a restore makes; returns the number of DCP tensors."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = None
    if _METADATA not in manifest.files:
        rep.problem(_METADATA, "DCP metadata is not listed in the manifest")
    elif not any(p["file"] == _METADATA for p in rep.problems):  # else: already missing, truncated or corrupt
        try:
            md = loc.read_metadata(_METADATA)
        except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
            rep.problem(_METADATA, _strip(loc, _METADATA, exc))
        except OSError as exc:
            rep.problem(_METADATA, f"cannot be read ({exc})")
    tensors: dict[str, Any] = {}
    if md is not None:
        problems, tensors = metadata_problems(md, manifest)
        for file, text in problems:
            rep.problem(file, text)
        if tensors:  # empty when the metadata is malformed as a whole
            _check_records(loc, md, tensors, rep)
        if not problems:
            for key, item in md.state_dict_metadata.items():
                if isinstance(item, BytesStorageMetadata):
                    rep.warning(_METADATA, f"item {key!r} is a pickled object; torch-ckpt never writes those and "
                                           "refuses to load them")

    referenced: set[str] = set()
    trees_read = 0
    rank_problems = rank_file_problems(manifest)
    for file, text in rank_problems:
        rep.problem(file, text)
    ranks = range(manifest.world_size) if not rank_problems or rank_problems[0][0] != MANIFEST_NAME else range(0)
    for rank in ranks:
        name = rank_file_name(rank)
        if name not in manifest.files or name not in listing or any(p["file"] == name for p in rep.problems):
            continue  # already reported as unlisted, missing, truncated or corrupt
        try:
            doc = loc.read_rank_doc(rank, manifest)
        except (CheckpointCorruptError, OSError) as exc:
            rep.problem(name, _strip(loc, name, exc))
            continue
        for path, kind, node in walk_tree(doc["tree"]):
            if kind == "tensor":
                key = node[TENSOR_TAG]
                referenced.add(key)
                if md is not None and key not in tensors:
                    rep.problem(name, f"state key {'.'.join(path) or '<root>'!r} refers to tensor {key!r}, which the "
                                      "DCP metadata does not hold (as a valid tensor)")
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


def _check_manifest_consistency(manifest: Manifest, rep: _Report) -> None:
    """What the manifest alone shows a restore would refuse: DCP metadata unlisted, not one rank file per rank."""
    if _METADATA not in manifest.files:
        rep.problem(_METADATA, "DCP metadata is not listed in the manifest")
    for file, text in rank_file_problems(manifest):
        rep.problem(file, text)


def _check_records(loc: Location, md: Any, tensors: dict[str, Any], rep: _Report) -> None:
    """Every chunk's record in the data files that passed the file checks matches the metadata."""
    reported = {p["file"] for p in rep.problems}
    files = sorted({str(info.relative_path) for index, info in md.storage_data.items()
                    if index.fqn in tensors} - reported)
    for name in files:
        try:
            for file, text in storage_record_problems(md, tensors, loc.open_range, [name]):
                rep.problem(file, text)
        except (OSError, CheckpointCorruptError) as exc:
            rep.problem(name, f"cannot be read ({_strip(loc, name, exc)})")


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
        full = manifest
        if manifest.partial:  # one node's copy of a node-local checkpoint: that node's files only
            out["partial"] = (f"this node's shards (node {manifest.node} of {max(manifest.nodes['rank_node']) + 1}); "
                              "the other nodes and the durable tier hold the rest")
            manifest = dataclasses.replace(manifest, files=manifest.local_files())
            out.update(files=len(manifest.files), bytes=sum(i["bytes"] for i in manifest.files.values()))
        with tqdm(total=out["bytes"] if checksums else 0, desc=f"verify {loc.name}", unit="B", unit_scale=True,
                  unit_divisor=1024, leave=False, dynamic_ncols=True,
                  disable=None if progress and checksums else True) as bar:  # None: only on a terminal
            _check_files(loc, manifest, listing, rep, checksums=checksums, bar=bar)
        if structure and not full.partial:
            out["tensors"] = _check_structure(loc, manifest, listing, rep)
        elif not full.partial:
            _check_manifest_consistency(manifest, rep)
        manifest = full
    out["ok"] = not rep.problems
    return out, manifest


# ---------------------------------------------------------------------------------------------
# verify


def verify_checkpoint(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                      checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Check one checkpoint directory: files and structure.

    Every file of the manifest must be present with its size and (``checksums``) CRC-32; the DCP
    metadata must be readable with the restricted unpickler, its storage entries must lie inside
    listed files and cover each tensor, and every chunk's record in the data files must match its
    declared byte range, dtype, size and shape (headers only); every rank's JSON file must be listed,
    readable and consistent with the manifest, and every tensor placeholder of its tree must be a
    tensor of the metadata.

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
    from torch_ckpt.tools.inspection import (
        list_root,  # listing and verification use each other
    )

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
    from torch_ckpt.tools.inspection import (
        _looks_like_checkpoint,  # listing and verification use each other
    )

    loc = _as_location(where, storage_options)
    _require_dir(loc)
    if _looks_like_checkpoint(loc):
        return _summary(loc, "checkpoint", [_check_dir(loc, checksums=checksums, structure=True, progress=progress)],
                        [])
    return verify_root(loc, checksums=checksums, progress=progress)
