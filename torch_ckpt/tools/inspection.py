"""Read-only views of checkpoint roots and checkpoints: listing, contents and verification.

The functions behind ``torch-ckpt ls``, ``inspect`` and ``verify``, usable from Python. They work on
local directories and on any fsspec URL (``s3://``, ``gs://``, ``memory://``...; credentials and
endpoints in ``storage_options``), and return JSON-serialisable dicts (the commands' ``--json``
output).

Every check goes through :mod:`torch_ckpt.format`, the validation path restore uses too, so these
views accept exactly what a restore would load. Nothing here writes to a checkpoint, and nothing
executes code from one: DCP's ``.metadata`` is read
with torch-ckpt's restricted unpickler (:func:`torch_ckpt.dcp_io.read_dcp_metadata`), the per-rank
trees are JSON, and tensor payloads are never loaded (sizes come from the metadata).

Status of an entry of a root (:func:`list_root`):

* ``committed``: ``manifest.json`` is valid, names this step and lists ``.metadata`` and one rank
  file per rank, and every file it lists is a regular file present with its size (and, with
  ``verify=True``, its CRC-32 and all the checks of :func:`verify_checkpoint`);
* ``partial``: a temporary ``.step_N.tmp[.<id>]`` (a save or download in progress, or left by a crash), or
  a ``step_N`` directory without a manifest (on an object store: an upload in progress or abandoned);
* ``corrupt``: one of those checks failed (what a restore would refuse too).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from tqdm import tqdm

from torch_ckpt.codec import (  # the on-disk tags of the per-rank JSON trees
    TENSOR_TAG,
)
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
)
from torch_ckpt.format import embedded_info, metadata_problems, rank_file_problems, walk_tree
from torch_ckpt.layout import MANIFEST_NAME, rank_file_name
from torch_ckpt.records import storage_record_problems
from torch_ckpt.tools.location import (  # private helpers shared by the read-only tools
    _METADATA,
    COMMITTED,
    CORRUPT,
    PARTIAL,
    Location,
    PathNotFoundError,
    _as_location,
    _dtype_name,
    _iso,
    _require_dir,
    _step_of,
    is_url,
)
from torch_ckpt.tools.verification import (
    _check_dir_manifest,
    _check_files,
    _Report,
    verify_checkpoint,
    verify_path,
    verify_root,
)

__all__ = [
    "COMMITTED",
    "CORRUPT",
    "PARTIAL",
    "Location",
    "PathNotFoundError",
    "inspect_checkpoint",
    "is_url",
    "list_root",
    "resolve_checkpoint",
    "verify_checkpoint",
    "verify_path",
    "verify_root",
]

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
        if result.get("partial"):
            row["reason"] = f"partial: {result['partial']}"
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
    every rank). The checks of a restore are made, except checksums (see :func:`verify_checkpoint`):
    the tensor records' headers are read, never their payload.

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
        CheckpointCorruptError: the manifest, metadata, a listed file (missing, a symlink, wrong
            size) or a per-rank file fails the checks of :mod:`torch_ckpt.format`, or the state
            refers to a tensor the metadata lacks.
        UnsafeCheckpointError: the DCP metadata references code (refused, not executed).
    """
    loc = resolve_checkpoint(where, step=step, storage_options=storage_options)
    manifest = loc.read_manifest()
    md = loc.read_metadata(_METADATA) if _METADATA in manifest.files else None
    if md is None:
        raise CheckpointCorruptError(f"{loc.describe(_METADATA)}: DCP metadata is not listed in the manifest")
    problems, tensors = metadata_problems(md, manifest)
    problems += rank_file_problems(manifest)
    listed = _Report(loc)  # the listed files must be what a restore reads: regular files of the listed sizes
    with tqdm(disable=True) as bar:
        _check_files(loc, manifest, loc.entries(), listed, checksums=False, bar=bar)
    problems = [(p["file"], p["problem"]) for p in listed.problems] + problems
    if not problems:  # the tensor records must match the metadata (headers only: no payload is read)
        problems = storage_record_problems(md, tensors, loc.open_range)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise CheckpointCorruptError(f"{loc.describe(file)}: {text}{more}")
    comps: dict[str, dict[str, Any]] = {}
    key_rows: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(comp: dict[str, Any], nbytes: int, dtype: str, *, local: bool) -> None:
        comp["tensors"] += 1
        comp["tensor_bytes"] += nbytes
        comp["dtypes"][dtype] = comp["dtypes"].get(dtype, 0) + 1
        comp["rank_local_tensors"] += int(local)

    with tqdm(total=manifest.world_size, desc=f"inspect {loc.name}", unit="rank", leave=False, dynamic_ncols=True,
              disable=None if progress and manifest.world_size > 8 else True) as bar:  # None: only on a terminal
        for rank in range(manifest.world_size):
            tree = loc.read_rank_doc(rank, manifest)["tree"]
            source = loc.describe(rank_file_name(rank))
            tops = tree.items() if isinstance(tree, dict) else [("<root>", tree)]
            for top, sub in tops:
                comp = comps.setdefault(top, _component())
                leaves = list(walk_tree(sub, (top,)))  # validated by read_rank_doc
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
                        shape, dtype, nbytes = embedded_info(kind, node)
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


