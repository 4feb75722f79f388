"""Listing a run root (``torch-ckpt ls``) and resolving a checkpoint argument.

The functions behind ``torch-ckpt ls``, ``inspect`` and ``verify``, usable from Python. They work on
local directories and on any fsspec URL (``s3://``, ``gs://``, ``memory://``...; credentials and
endpoints in ``storage_options``), and return JSON-serialisable dicts (the commands' ``--json``
output).

Every check goes through :mod:`torch_ckpt.format`, the validation path restore uses too, so these
views accept exactly what a restore would load. Nothing here writes to a checkpoint, and nothing
executes code from one: DCP's ``.metadata`` is read
with torch-ckpt's restricted unpickler (:func:`torch_ckpt.dcp_read.read_dcp_metadata`), the per-rank
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

import os
import time
from typing import Any

from torch_ckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from torch_ckpt.manifest import MANIFEST_NAME
from torch_ckpt.storage import Location, as_location
from torch_ckpt.tiers import DurableTier
from torch_ckpt.tools.checks import COMMITTED, CORRUPT, PARTIAL, check_dir, iso_time, require_dir, step_of

__all__ = ["list_root", "looks_like_checkpoint", "resolve_checkpoint"]


def _tier_steps(url: str, storage_options: dict[str, Any], cache: dict[str, set[int] | None]) -> set[int] | None:
    if url not in cache:
        try:
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
    loc = as_location(root, storage_options=storage_options)
    require_dir(loc)
    own = "durable" if loc.remote else "local"
    now = time.time()
    rows: list[dict[str, Any]] = []
    tier_cache: dict[str, set[int] | None] = {}
    for name, info in loc.entries().items():
        step, temporary = step_of(name)
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
            row.update(wall_time=mtime, time=iso_time(mtime), age_s=None if mtime is None else now - mtime)
            rows.append(row)
            continue
        result, manifest = check_dir(child, checksums=verify, structure=verify, progress=progress)
        if not result["ok"] and not child.exists():
            continue  # deleted while listing (retention renames it away first)
        row["problems"] = result["problems"]
        row["status"] = COMMITTED if result["ok"] else CORRUPT
        if result.get("partial"):
            row["reason"] = f"partial: {result['partial']}"
        row["bytes"] = present
        if manifest is not None:
            row.update(wall_time=manifest.wall_time, time=iso_time(manifest.wall_time), age_s=now - manifest.wall_time,
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


def looks_like_checkpoint(loc: Location) -> bool:
    """True for a step directory's name or a directory holding a manifest (rather than a run root)."""
    step, _ = step_of(loc.name)
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
    loc = as_location(where, storage_options=storage_options)
    require_dir(loc)
    if looks_like_checkpoint(loc):
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
