"""Listing a run root (``torch-ckpt ls``) and resolving a checkpoint argument.

The functions behind ``torch-ckpt ls``, ``inspect`` and ``verify``, usable from Python. They work on
local directories and on any fsspec URL (``s3://``, ``gs://``, ``memory://``...; credentials and
endpoints in ``storage_options``), and return JSON-serialisable dicts (the commands' ``--json``
output).

Every check goes through :mod:`torch_ckpt.format._read`, the validation path restore uses too, so these
views accept exactly what a restore would load. Nothing here writes to a checkpoint, and nothing
executes code from one: DCP's ``.metadata`` is read
with torch-ckpt's restricted unpickler (:func:`torch_ckpt.format._read.read_dcp_metadata`), the per-rank
trees are JSON, and tensor payloads are never loaded (sizes come from the metadata).

The checkpoints of a root are its subdirectories that hold a torch-ckpt ``manifest.json``, whatever
their naming (``step_000000010``, Accelerate's ``checkpoint_10``, Lightning's ``epoch=0-step=10.ckpt``);
the step is the manifest's. A symbolic link to another checkpoint of the same root (Lightning's
``last.ckpt``) is listed as a link to it and not counted twice.

Status of an entry of a root (:func:`list_root`):

* ``committed``: ``manifest.json`` is valid (and names the step of a ``step_N`` directory), lists
  ``.metadata`` and one rank file per rank, and every file it lists is a regular file present with
  its size (and, with ``verify=True``, its CRC-32 and all the checks of :func:`verify_checkpoint`);
* ``partial``: a temporary ``.NAME.tmp[.<id>]`` or ``.NAME.download.tmp[.<id>]`` (a save or download
  in progress, or left by a crash), or a ``step_N`` directory without a manifest (on an object store:
  an upload in progress or abandoned);
* ``corrupt``: one of those checks failed (what a restore would refuse too).

Apart from its status, an entry is ``superseded`` when it belongs to a timeline abandoned by a
rollback (:mod:`torch_ckpt.policy._lineage`, decided from the lineage records of the root's manifests):
a checkpoint moved aside as ``.superseded_NAME.<time>``, or one still under its name that the
root's newest timeline supersedes. Superseded entries are listed but never counted in ``counts``
(``superseded`` counts them) and never chosen as a root's checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from torch_ckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from torch_ckpt.format._read import FORMAT_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES
from torch_ckpt.policy._lineage import head_of
from torch_ckpt.root._temporaries import PARTIAL_PREFIX
from torch_ckpt.storage._locations import Location, as_location
from torch_ckpt.tiers._durable import DurableTier
from torch_ckpt.tools.checks import COMMITTED, CORRUPT, PARTIAL, check_dir, iso_time, require_dir, step_of

__all__ = ["find_checkpoint", "list_root", "looks_like_checkpoint", "resolve_checkpoint"]

# a temporary checkpoint directory of any name: ``.NAME.tmp``, ``.NAME.tmp.<id>`` and the durable
# tier's ``.NAME.download.tmp`` forms; group 1 is NAME
_TEMP_RE = re.compile(r"^\.(.+?)(?:\.download)?\.tmp(?:\.[0-9a-f]+)?$")
# a checkpoint moved aside by a rollback (policy._lineage): ``.superseded_NAME.<time>[.<n>]``, local or durable
_SUPERSEDED_RE = re.compile(r"^\.superseded_(.+?)\.\d+(?:\.\d+)?$")


def _tier_steps(url: str, storage_options: dict[str, Any], cache: dict[str, set[int] | None]) -> set[int] | None:
    if url not in cache:
        try:
            cache[url] = set(DurableTier(url, storage_options=storage_options).list_steps())
        except (CheckpointError, OSError, ValueError):
            cache[url] = None
    return cache[url]


def _ours(child: Location, listing: dict[str, dict[str, Any]]) -> bool:
    """Whether a directory of another name than ``step_N`` holds a torch-ckpt manifest.

    A ``manifest.json`` that parses as JSON without torch-ckpt's ``format`` belongs to another tool
    (not listed); one that cannot be read or parsed is ours, and ``check_dir`` reports it corrupt.
    """
    if MANIFEST_NAME not in listing:
        return False
    try:
        doc = json.loads(child.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES, what="manifest"))
    except (CheckpointError, OSError, ValueError, RecursionError):
        return True
    return not isinstance(doc, dict) or doc.get("format") == FORMAT_NAME


def _link_target(loc: Location, child: Location) -> str | None:
    """For a local symlink: the name of its target when that is an entry of ``loc``, else the target's path."""
    if loc.remote or not os.path.islink(child.path):
        return None
    target = os.path.realpath(child.path)
    if os.path.dirname(target) == os.path.realpath(loc.path):
        return os.path.basename(target)
    return target


def _row(step: int | None, name: str, mtime: float | None) -> dict[str, Any]:
    return {"step": step, "name": name, "status": PARTIAL, "wall_time": None, "time": None, "age_s": None,
            "mtime": mtime, "files": None, "bytes": None, "disk_bytes": None, "tensor_bytes": None,
            "world_size": None, "tiers": {}, "problems": [], "reason": None, "link_to": None, "alias_of": None,
            "superseded": False}


def list_root(root: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
              verify: bool = False, check_tiers: bool = False, progress: bool = False) -> dict[str, Any]:
    """List the checkpoints of a run root with their status, time, size and tiers.

    The checkpoints are the subdirectories holding a torch-ckpt ``manifest.json`` whatever their
    names, ``step_N`` directories without one, and temporaries ``.NAME.tmp[.<id>]``; other entries
    are not listed.

    Args:
        root: a local run root or an fsspec URL of one.
        storage_options: fsspec options for URLs (also used for the tiers checked by ``check_tiers``).
        verify: also check every file's CRC-32 and the structure (reads every byte).
        check_tiers: list each durable tier recorded in the manifests and keep only the tiers that
            still hold the step (retention on the durable tier may have removed it since).
        progress: show a progress bar for verification on a terminal.

    Returns:
        ``{"root", "verified", "steps": [entry...], "counts": {status: n}}``, entries sorted by step.
        Each entry has ``step`` (the manifest's; None when unknown), ``name``, ``status``,
        ``wall_time`` and ``time`` (ISO 8601, UTC; the commit time, or the directory's modification
        time for other entries when known), ``age_s``, ``mtime`` (the directory's modification time,
        Unix s), ``files`` and ``bytes`` (the files the manifest lists, the manifest itself excluded:
        the figures ``verify`` and ``inspect`` print; for a partial entry, what is present),
        ``disk_bytes`` (every file present now, manifest included), ``tensor_bytes``,
        ``world_size``, ``tiers`` (``{name: info}``: this root's own copy as "local" or "durable",
        plus the copies the manifest records), ``problems`` (``[{"file", "path", "problem"}]``),
        ``reason`` (why an entry is partial), ``link_to`` (a symlink's target: an entry name of this
        root, or a path) and ``alias_of`` (for a link to another listed entry: that entry's name; such
        an entry repeats its target's step and status and is not counted), ``superseded`` (True for a
        step of an abandoned timeline, see the module doc). ``superseded`` (top level) counts those.

    Raises:
        PathNotFoundError: ``root`` does not exist or is not a directory.
    """
    loc = as_location(root, storage_options=storage_options)
    require_dir(loc)
    own = "durable" if loc.remote else "local"
    now = time.time()
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    tier_cache: dict[str, set[int] | None] = {}
    entries = loc.entries()
    lineages: dict[str, Any] = {}  # name: lineage of each committed checkpoint (the lineage rule)
    for name, info in entries.items():
        temp = _TEMP_RE.match(name)
        aside = _SUPERSEDED_RE.match(name)
        if info["type"] != "directory" or (name.startswith(".") and temp is None and aside is None):
            continue
        step = step_of(temp.group(1))[0] if temp else step_of(name)[0]
        row = _row(step, name, info["mtime"])
        child = loc.child(name)
        row["link_to"] = _link_target(loc, child)
        if row["link_to"] in entries and row["link_to"] != name:  # listed under its own name: not twice
            links.append(row)
            continue
        try:
            listing = child.entries()
        except FileNotFoundError:  # removed while listing (retention, commit rename)
            continue
        if temp is None and step is None and not _ours(child, listing):
            continue  # another tool's folder (logs, a plain-framework checkpoint)
        row["superseded"] = aside is not None
        present = sum(e["size"] for e in listing.values() if e["type"] == "file")
        row.update(bytes=present, disk_bytes=present)
        if temp or MANIFEST_NAME not in listing:
            reserved = bool(listing) and all(n.startswith(PARTIAL_PREFIX) for n in listing)
            row["reason"] = ("temporary directory: a save or download in progress, or left by a crash" if temp
                             else "reserved name: a save in progress, or left by a crash" if reserved or not listing
                             else "no manifest.json: an upload or copy in progress, or abandoned")
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
        if manifest is not None:
            lineages[name] = manifest.lineage
            row.update(step=manifest.step, files=result["files"], bytes=result["bytes"], wall_time=manifest.wall_time,
                       time=iso_time(manifest.wall_time), age_s=now - manifest.wall_time,
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
    head = head_of(lineages.values())
    for row in rows:
        if row["name"] in lineages and not head.holds(row["step"], lineages[row["name"]]):
            row["superseded"] = True
    by_name = {r["name"]: r for r in rows}
    for link in links:
        target = by_name.get(link["link_to"])
        if target is not None:  # a link to a listed checkpoint: shown beside it, not counted
            rows.append({**target, "name": link["name"], "mtime": link["mtime"], "problems": [],
                         "link_to": target["name"], "alias_of": target["name"]})
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["alias_of"] is not None, r["name"]))
    counts = {s: sum(r["status"] == s and r["alias_of"] is None and not r["superseded"] for r in rows)
              for s in (COMMITTED, PARTIAL, CORRUPT)}
    superseded = sum(r["superseded"] and r["alias_of"] is None for r in rows)
    return {"root": loc.describe(), "verified": verify, "steps": rows, "counts": counts, "superseded": superseded}


# ---------------------------------------------------------------------------------------------
# resolving a checkpoint argument


def looks_like_checkpoint(loc: Location) -> bool:
    """True for a step directory's name or a directory holding a manifest (rather than a run root)."""
    step, _ = step_of(loc.name)
    return step is not None or loc.exists(MANIFEST_NAME)


def find_checkpoint(where: str | os.PathLike | Location, *, step: int | None = None,
                    storage_options: dict[str, Any] | None = None) -> tuple[Location, str | None]:
    """The checkpoint directory meant by ``where``, and a note when several checkpoints matched.

    ``where`` is a checkpoint directory, or a root: then its newest committed checkpoint, or the
    one whose manifest says ``step``. When several committed checkpoints of a root hold the chosen
    step (Lightning's ``epoch=0-step=10.ckpt`` beside a ``last.ckpt`` copy), the one modified last
    is chosen and the note names them all; links to another checkpoint of the root are not candidates.

    Returns:
        ``(location, note)``; ``note`` is None unless several checkpoints held the step.

    Raises:
        PathNotFoundError: ``where`` does not exist.
        ConfigError: ``step`` was given with a checkpoint directory.
        CheckpointNotFoundError: the root has no committed checkpoint (of that step).
    """
    loc = as_location(where, storage_options=storage_options)
    require_dir(loc)
    if looks_like_checkpoint(loc):
        if step is not None:
            raise ConfigError(f"{loc.describe()} is a checkpoint directory; a step applies to a run root only")
        return loc, None
    listing = [r for r in list_root(loc)["steps"]
               if r["status"] == COMMITTED and r["alias_of"] is None and not r["superseded"]]
    if step is not None:
        listing = [r for r in listing if r["step"] == step]
        if not listing:
            raise CheckpointNotFoundError(f"{loc.describe()} has no committed checkpoint of step {step} (a "
                                          "checkpoint is a directory holding a torch-ckpt manifest.json)")
    if not listing:
        raise CheckpointNotFoundError(f"{loc.describe()} holds no committed checkpoint (a checkpoint is a "
                                      "directory holding a torch-ckpt manifest.json)")
    chosen_step = listing[-1]["step"]
    same = sorted((r for r in listing if r["step"] == chosen_step),
                  key=lambda r: (r["mtime"] or 0.0, r["wall_time"] or 0.0, r["name"]))
    note = None
    if len(same) > 1:
        note = (f"step {chosen_step} is held by {len(same)} checkpoints ({', '.join(r['name'] for r in same)}); "
                f"using the one modified last: {same[-1]['name']}")
    return loc.child(same[-1]["name"]), note


def resolve_checkpoint(where: str | os.PathLike | Location, *, step: int | None = None,
                       storage_options: dict[str, Any] | None = None) -> Location:
    """The checkpoint directory meant by ``where`` (see :func:`find_checkpoint`, without its note).

    Raises:
        PathNotFoundError: ``where`` does not exist.
        ConfigError: ``step`` was given with a checkpoint directory.
        CheckpointNotFoundError: the root has no committed checkpoint (of that step).
    """
    return find_checkpoint(where, step=step, storage_options=storage_options)[0]
