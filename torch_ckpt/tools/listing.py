"""Listing, verifying and inspecting checkpoints (``torch-ckpt ls``, ``verify``, ``inspect``).

Local directories and any fsspec URL (``s3://``, ``gs://``, ``memory://``...; credentials in
``storage_options``) alike; the results are JSON-serialisable dicts (the commands' ``--json``).
Every check is the restore's own (:mod:`torch_ckpt.format._files` and :mod:`torch_ckpt.format._records`),
so these views accept exactly what a restore would load; :func:`check_dir` collects every problem
with its file instead of stopping at the first. Nothing here writes to a checkpoint or runs code
from one: ``.metadata`` is read with the restricted unpickler, rank files are JSON, and only the
records' headers of the tensor data are read.

The checkpoints of a root are its subdirectories holding a torch-ckpt ``manifest.json``, whatever
their names (``step_000000010``, Accelerate's ``checkpoint_10``, Lightning's ``epoch=0-step=10.ckpt``);
the step is the manifest's. A symlink to another checkpoint of the root (Lightning's ``last.ckpt``)
is listed as a link to it and not counted twice. Status of an entry (:func:`list_root`):

* ``committed``: the manifest is valid (and names the step of a ``step_N`` directory), lists
  ``.metadata`` and one rank file per rank, and every listed file is a regular file of its size
  (with ``verify=True`` also its CRC-32 and all the checks of :func:`verify_checkpoint`);
* ``partial``: a temporary ``.NAME.tmp[.<id>]`` / ``.NAME.download.tmp[.<id>]`` (a save or download
  in progress, or left by a crash), or a ``step_N`` directory without a manifest (an upload in
  progress or abandoned);
* ``plain-dcp``: a folder written by plain ``dcp.save`` (``.metadata``, no manifest, no rank files);
  ``torch-ckpt import`` adopts it;
* ``corrupt``: one of the checks failed (a restore would refuse it too).

An entry is also ``superseded`` when it belongs to a timeline abandoned by a rollback
(:mod:`torch_ckpt.policy._lineage`): one moved aside as ``.superseded_NAME.<time>``, or one the
root's newest timeline supersedes. Those are listed, never counted in ``counts`` nor chosen.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import re
import time
from collections import defaultdict
from contextlib import suppress
from typing import Any, cast

from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from tqdm import tqdm

from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    UnsafeCheckpointError,
)
from torch_ckpt.format._files import (
    FORMAT_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    MAX_RANK_JSON_BYTES,
    METADATA_NAME,
    RANK_FILE_RE,
    TENSOR_TAG,
    Manifest,
    bytes_written,
    embedded_info,
    load_dcp_metadata_bytes,
    metadata_name,
    metadata_problems,
    parse_rank_doc,
    rank_file_name,
    rank_file_problems,
    read_listed,
    read_manifest,
    read_metadata,
    read_rank_doc,
    record_problems,
    tensor_items,
    verify_files,
    walk_tree,
)
from torch_ckpt.policy._lineage import head_of
from torch_ckpt.root._layout import PARTIAL_PREFIX
from torch_ckpt.storage._locations import Location, PathNotFoundError, as_location
from torch_ckpt.tiers._durable import DurableTier

__all__ = ["COMMITTED", "CORRUPT", "PARTIAL", "PLAIN_DCP", "check_dir", "find_checkpoint", "inspect_checkpoint",
           "is_plain_dcp", "list_root", "looks_like_checkpoint", "plain_dcp_reason", "step_of", "verify_checkpoint",
           "verify_path", "verify_root"]

COMMITTED, PARTIAL, CORRUPT, PLAIN_DCP = "committed", "partial", "corrupt", "plain-dcp"

_STEP_RE = re.compile(r"^step_(\d+)$")
# a temporary of any name (group 1: NAME), and a checkpoint moved aside by a rollback
_TEMP_RE = re.compile(r"^\.(.+?)(?:\.download)?\.tmp(?:\.[0-9a-f]+)?$")
_SUPERSEDED_RE = re.compile(r"^\.superseded_(.+?)\.\d+(?:\.\d+)?$")
_NO_CHECKPOINT = "(a checkpoint is a directory holding a torch-ckpt manifest.json)"


def open_dir(where: str | os.PathLike | Location, storage_options: dict[str, Any] | None) -> Location:
    """``where`` as a :class:`Location`; :class:`PathNotFoundError` unless it is an existing directory."""
    loc = as_location(where, storage_options=storage_options)
    if not loc.exists():
        raise PathNotFoundError(f"{loc.describe()} does not exist")
    if not loc.is_dir():
        raise PathNotFoundError(f"{loc.describe()} is not a directory")
    return loc


def iso_time(ts: float | None) -> str | None:
    """ISO 8601 (UTC, seconds) of a Unix time, or None."""
    return None if ts is None else _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def step_of(name: str) -> tuple[int | None, bool]:
    """``(step, temporary)`` parsed from a ``step_N`` directory name or its temporary; step None for other names."""
    temp = _TEMP_RE.match(name)
    m = _STEP_RE.match(temp.group(1) if temp else name)
    return (int(m.group(1)), temp is not None) if m else (None, False)


def is_plain_dcp(listing: dict[str, dict[str, Any]]) -> bool:
    """Whether a directory's entries are a folder written by plain ``dcp.save``: ``.metadata``, no manifest."""
    return METADATA_NAME in listing and MANIFEST_NAME not in listing and \
        not any(RANK_FILE_RE.match(n) or n.startswith(PARTIAL_PREFIX) for n in listing)


def plain_dcp_reason(loc: Location, root: Location | None = None) -> str:
    """What ``ls``, ``verify`` and ``inspect`` say of a plain DCP folder: what it is and how to import it."""
    root_text = root.describe() if root is not None else "ROOT"
    return (f"plain DCP checkpoint (not written by torch-ckpt): torch-ckpt import {loc.describe()} {root_text} "
            "--step N")


class _Report:
    """Problems and warnings of one checkpoint directory, each naming its file."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.problems: list[dict[str, str]] = []
        self.warnings: list[dict[str, str]] = []

    def problem(self, file: str, text: str, *, warning: bool = False) -> None:
        text = text.replace(self.loc.describe(file) + ": ", "")  # the report names the file
        (self.warnings if warning else self.problems).append({"file": file, "path": self.loc.describe(file),
                                                              "problem": text})

    def has(self, file: str) -> bool:
        return any(p["file"] == file for p in self.problems)


def _check_structure(loc: Location, manifest: Manifest, listing: dict[str, dict[str, Any]], rep: _Report, *,
                     deep: bool) -> int | None:
    """The metadata and rank files as a restore checks them (``deep``: their contents too; returns the tensor count)."""
    md = None
    if METADATA_NAME not in manifest.files:
        rep.problem(METADATA_NAME, "DCP metadata is not listed in the manifest")
    elif deep and not rep.has(METADATA_NAME):  # else: already missing, truncated or corrupt
        try:
            md = load_dcp_metadata_bytes(read_listed(loc, manifest, METADATA_NAME, MAX_METADATA_BYTES),
                                         loc.describe(METADATA_NAME))
        except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
            rep.problem(METADATA_NAME, str(exc))
    tensors: dict[str, Any] = {}
    if md is not None:
        problems, tensors = metadata_problems(md, manifest)
        for file, text in problems:
            rep.problem(file, text)
        reported = {p["file"] for p in rep.problems}
        for name in sorted({str(info.relative_path) for index, info in md.storage_data.items()
                            if index.fqn in tensors} - reported) if tensors else ():  # records match the metadata
            try:
                for file, text in record_problems(loc, manifest, md, tensors=tensors, files=[name]):
                    rep.problem(file, text)
            except CheckpointCorruptError as exc:
                rep.problem(name, f"cannot be read ({str(exc).replace(loc.describe(name) + ': ', '')})")
        for key, item in md.state_dict_metadata.items() if not problems else ():
            if isinstance(item, BytesStorageMetadata):
                rep.problem(METADATA_NAME, f"item {key!r} is a pickled object; torch-ckpt never writes those and "
                                           "refuses to load them", warning=True)
    rank_problems = rank_file_problems(manifest)
    for file, text in rank_problems:
        rep.problem(file, text)
    if not deep:
        return None
    referenced: set[str] = set()
    trees_read = 0
    for rank in range(manifest.world_size) if not rank_problems or rank_problems[0][0] != MANIFEST_NAME else ():
        name = rank_file_name(rank)
        if name not in manifest.files or name not in listing or rep.has(name):
            continue  # already reported as unlisted, missing, truncated or corrupt
        refs = _tree_refs(loc, manifest, rank, rep, tensors if md is not None else None)
        if refs is not None:
            referenced |= refs
            trees_read += 1
    for name in sorted(manifest.files):
        m = RANK_FILE_RE.match(name)
        if m and int(m.group(1)) >= manifest.world_size:
            rep.problem(name, f"per-rank file beyond the world size {manifest.world_size}", warning=True)
    unreferenced = sorted(set(tensors) - referenced)
    if unreferenced and trees_read == manifest.world_size:  # otherwise the unread trees may refer to them
        rep.problem(METADATA_NAME, f"{len(unreferenced)} tensor(s) are not referenced by any rank's state, e.g. "
                                   f"{unreferenced[:3]}", warning=True)
    return len(tensors)


def _check_node_copy(loc: Location, manifest: Manifest, rep: _Report, *, deep: bool) -> int | None:
    """One node's copy of a node-local checkpoint as a restore on that node checks it (``deep``): its view of the
    DCP metadata, the records of its data files and its ranks' state trees; returns the tensor count."""
    if not deep or rep.problems:
        return None
    name = manifest.nodes.get("metadata") or metadata_name(cast(int, manifest.node))
    try:
        md = read_metadata(loc, manifest)
        tensors = tensor_items(md)
        for file, text in record_problems(loc, manifest, md, tensors=tensors):
            rep.problem(file, text)
    except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
        rep.problem(name, str(exc))
        return None
    for rank in (r for r, n in enumerate(manifest.nodes["rank_node"]) if n == manifest.node):
        _tree_refs(loc, manifest, rank, rep, tensors)
    return len(tensors)


def _tree_refs(loc: Location, manifest: Manifest, rank: int, rep: _Report, tensors: dict[str, Any] | None
               ) -> set[str] | None:
    """The tensors rank ``rank``'s state tree refers to, each checked against ``tensors`` (the DCP metadata's, when
    read); None when the rank file cannot be parsed (reported)."""
    name = rank_file_name(rank)
    try:
        doc = parse_rank_doc(read_listed(loc, manifest, name, MAX_RANK_JSON_BYTES), loc.describe(name), manifest, rank)
    except CheckpointCorruptError as exc:
        rep.problem(name, str(exc))
        return None
    referenced = set()
    for path, kind, node in walk_tree(doc["tree"]):
        if kind == "tensor":
            referenced.add(node[TENSOR_TAG])
            if tensors is not None and node[TENSOR_TAG] not in tensors:
                rep.problem(name, f"state key {'.'.join(path) or '<root>'!r} refers to tensor {node[TENSOR_TAG]!r}, "
                                  "which the DCP metadata does not hold (as a valid tensor)")
    return referenced


def check_dir(loc: Location, *, checksums: bool, structure: bool,
              progress: bool) -> tuple[dict[str, Any], Manifest | None]:
    """``(the verify_checkpoint dict, the manifest when readable)`` of one checkpoint directory; every problem
    is listed, none raised (only DurableUnavailableError). Without ``structure`` the cheap checks of ``ls``: the
    manifest, one rank file per rank, every listed file a regular file of its size (``checksums``: and CRC-32)."""
    rep = _Report(loc)
    step, _ = step_of(loc.name)
    out: dict[str, Any] = {"checkpoint": loc.describe(), "name": loc.name, "step": step, "ok": False,
                           "checksums": checksums, "structure": structure, "world_size": None, "files": 0,
                           "bytes": 0, "tensors": None, "problems": rep.problems, "warnings": rep.warnings}
    try:
        listing = loc.entries()
    except FileNotFoundError:
        rep.problem("", "the checkpoint directory does not exist")
        return out, None
    manifest = None
    if is_plain_dcp(listing):
        rep.problem(MANIFEST_NAME, plain_dcp_reason(loc))
    elif MANIFEST_NAME not in listing:
        rep.problem(MANIFEST_NAME, "missing: not a committed checkpoint")
    else:
        try:
            manifest = read_manifest(loc)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            rep.problem(MANIFEST_NAME, str(exc))
    if manifest is not None:
        if step is not None and manifest.step != step:
            rep.problem(MANIFEST_NAME, f"says step {manifest.step} but the directory is {loc.name}")
        mine = manifest
        if manifest.partial:  # one node's copy of a node-local checkpoint: that node's files only
            count = max(manifest.nodes["rank_node"]) + 1
            if count > 1:  # the copy of a run of one node holds everything: nothing to say
                out["partial"] = (f"this node's copy of a node-local checkpoint (node {manifest.node} of {count}); "
                                  "the other nodes' copies hold the rest")
            mine = dataclasses.replace(manifest, files=manifest.local_files())
        out.update(step=manifest.step, world_size=manifest.world_size, files=len(mine.files),
                   bytes=sum(i["bytes"] for i in mine.files.values()))
        with tqdm(total=out["bytes"] if checksums else 0, desc=f"verify {loc.name}", unit="B", unit_scale=True,
                  unit_divisor=1024, leave=False, dynamic_ncols=True,
                  disable=None if progress and checksums else True) as bar:  # None: only on a terminal
            found: list[tuple[str, str]] = []
            verify_files(loc, mine, checksums=checksums, collect=found, progress=bar)
        for name, text in found:
            rep.problem(name, text)
        for name, entry in sorted(listing.items()):
            if name != MANIFEST_NAME and name not in mine.files:
                rep.problem(name, f"{entry['type']} not listed in the manifest (ignored on restore)", warning=True)
        out["tensors"] = _check_node_copy(loc, manifest, rep, deep=structure) if manifest.partial else \
            _check_structure(loc, mine, listing, rep, deep=structure)
    out["ok"] = not rep.problems
    return out, manifest


def _ours(child: Location, listing: dict[str, dict[str, Any]]) -> bool:
    """Whether a directory holds a torch-ckpt manifest (an unreadable one counts: ``check_dir`` reports it), or
    a torch-ckpt partial (a save in progress, or left by a crash, under any naming)."""
    if MANIFEST_NAME not in listing:
        return any(n.startswith(PARTIAL_PREFIX) for n in listing)
    try:
        doc = json.loads(child.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES, what="manifest"))
    except (CheckpointError, OSError, ValueError, RecursionError):
        return True
    return not isinstance(doc, dict) or doc.get("format") == FORMAT_NAME


def _link_target(loc: Location, child: Location) -> str | None:
    """For a local symlink: its target's name when that is an entry of ``loc``, else the target's path."""
    if loc.remote or not os.path.islink(child.path):
        return None
    target = os.path.realpath(child.path)
    return os.path.basename(target) if os.path.dirname(target) == os.path.realpath(loc.path) else target


def list_root(root: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
              verify: bool = False, check_tiers: bool = False, progress: bool = False) -> dict[str, Any]:
    """List the checkpoints of a run root with their status, time, size and tiers (see the module doc).

    Args:
        root: a local run root or an fsspec URL of one.
        storage_options: fsspec options for URLs (also for the tiers checked by ``check_tiers``).
        verify: also check every file's CRC-32 and the structure (reads every byte).
        check_tiers: list each durable tier the manifests record and keep only those still holding
            the step (their retention may have removed it).
        progress: show a progress bar for verification on a terminal.

    Returns:
        ``{"root", "verified", "steps": [entry...], "counts": {status: n}, "superseded": n, "disk_bytes"}``
        (``disk_bytes``: what the listed entries occupy together, a file hard-linked into several counted
        once), entries sorted by step. An entry has ``step`` (the manifest's; None when unknown), ``name``,
        ``status``, ``wall_time`` and ``time`` (ISO 8601 UTC: the commit time, else the directory's
        modification time), ``age_s``, ``mtime``, ``files`` and ``bytes`` (the files the manifest
        lists, as ``verify`` and ``inspect`` count them; for a partial entry what is present),
        ``written_bytes`` and ``linked_bytes`` (of those, the bytes its save wrote and those it hard-linked
        from an earlier checkpoint, shared on disk: an incremental save; None unless committed),
        ``disk_bytes`` (every file present), ``tensor_bytes``, ``world_size``, ``tiers`` (``{name:
        info}``: this root's own intact copy as "local" or "durable", plus the copies the manifest
        records), ``problems`` (``[{"file", "path", "problem"}]``), ``reason`` (why partial or
        plain DCP), ``link_to`` (a symlink's target), ``alias_of`` (for a link to another listed
        entry: its name; repeats its step and status, not counted) and ``superseded``.

    Raises:
        PathNotFoundError: ``root`` does not exist or is not a directory.
        CheckpointNotFoundError: ``root`` is itself a plain DCP folder (the message names the import command).
    """
    loc = open_dir(root, storage_options)
    own = "durable" if loc.remote else "local"
    now = time.time()
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    entries = loc.entries()
    if is_plain_dcp(entries):  # the folder itself, not a run root: say what it is and how to adopt it
        raise CheckpointNotFoundError(f"{loc.describe()} is a {plain_dcp_reason(loc)}, not a run root")
    lineages: dict[str, Any] = {}  # name: lineage of each committed checkpoint
    referenced: dict[str, list[int]] = {}  # directory name: steps whose durable manifest references its objects

    @functools.cache
    def tier_steps(url: str) -> set[int] | None:  # None: the tier cannot be listed
        try:
            return set(DurableTier(url, storage_options=loc.storage_options).list_steps())
        except (CheckpointError, OSError, ValueError):
            return None

    for name, info in entries.items():
        temp, aside = _TEMP_RE.match(name), _SUPERSEDED_RE.match(name)
        if info["type"] != "directory" or (name.startswith(".") and temp is None and aside is None):
            continue
        step = step_of(name)[0]
        row = {"step": step, "name": name, "status": PARTIAL, "wall_time": None, "time": None, "age_s": None,
               "mtime": info["mtime"], "files": None, "bytes": None, "written_bytes": None, "linked_bytes": None,
               "disk_bytes": None, "tensor_bytes": None,
               "world_size": None, "tiers": {}, "problems": [], "reason": None, "link_to": None, "alias_of": None,
               "superseded": aside is not None}
        child = loc.child(name)
        row["link_to"] = _link_target(loc, child)
        if row["link_to"] in entries and row["link_to"] != name:  # listed under its own name: not twice
            links.append(row)
            continue
        try:
            listing = child.entries()
        except FileNotFoundError:  # removed while listing (retention, commit rename)
            continue
        plain = temp is None and is_plain_dcp(listing)
        if temp is None and step is None and not plain and not _ours(child, listing):
            continue  # another tool's folder (logs, a framework's checkpoint)
        present = sum(e["size"] for e in listing.values() if e["type"] == "file")
        row.update(bytes=present, disk_bytes=present)
        if temp or MANIFEST_NAME not in listing:
            reserved = bool(listing) and all(n.startswith(PARTIAL_PREFIX) for n in listing)
            row["status"] = PLAIN_DCP if plain else PARTIAL
            row["reason"] = (plain_dcp_reason(child, loc) if plain else
                             "temporary directory: a save or download in progress, or left by a crash" if temp
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
            for where in set(manifest.stored.values()):
                referenced.setdefault(where, []).append(manifest.step)
            row["written_bytes"], row["linked_bytes"] = bytes_written(manifest.files,
                                                                      manifest.stored if loc.remote else None)
            row.update(step=manifest.step, files=result["files"], bytes=result["bytes"], wall_time=manifest.wall_time,
                       time=iso_time(manifest.wall_time), age_s=now - manifest.wall_time,
                       tensor_bytes=manifest.tensor_bytes, world_size=manifest.world_size)
            # this root's copy counts only when intact; copies recorded elsewhere are listed either way
            tiers: dict[str, Any] = {own: {"location": loc.describe()}} if row["status"] == COMMITTED else {}
            for tier, tinfo in manifest.tiers.items():
                if tier == own or not isinstance(tinfo, dict):
                    continue
                tiers[tier] = dict(tinfo)
                if check_tiers and isinstance(tinfo.get("url"), str):
                    steps = tier_steps(tinfo["url"])
                    tiers[tier]["checked"] = steps is not None
                    if steps is not None and manifest.step not in steps:
                        del tiers[tier]
                        row.setdefault("stale_tiers", []).append(tier)
            row["tiers"] = tiers
        rows.append(row)
    head = head_of(lineages.values())
    for row in rows:
        if row["status"] == PARTIAL and row["name"] in referenced:  # a deleted durable step's kept objects
            row["reason"] = (f"no manifest.json: the objects of a deleted step that step(s) "
                             f"{', '.join(map(str, sorted(referenced[row['name']])))} still reference "
                             "(removed with the last of them)")
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
              for s in (COMMITTED, PARTIAL, CORRUPT, PLAIN_DCP)}
    superseded = sum(r["superseded"] and r["alias_of"] is None for r in rows)
    return {"root": loc.describe(), "verified": verify, "steps": rows, "counts": counts, "superseded": superseded,
            "disk_bytes": sum(r["disk_bytes"] or 0 for r in rows if r["alias_of"] is None) if loc.remote else
            _linked_once_bytes(loc, [r["name"] for r in rows if r["alias_of"] is None])}


def _linked_once_bytes(loc: Location, names: list[str]) -> int:
    """Bytes the entries ``names`` of the local ``loc`` occupy together: a file hard-linked into several of
    them (an incremental save) counted once (an object store has no links: the entries' sizes add up)."""
    seen: dict[tuple[int, int], int] = {}
    for name in names:
        with suppress(OSError), os.scandir(loc.path_of(name)) as it:
            for entry in it:
                with suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def looks_like_checkpoint(loc: Location) -> bool:
    """True for a step directory's name or a directory holding a manifest (rather than a run root)."""
    return step_of(loc.name)[0] is not None or loc.exists(MANIFEST_NAME)


def find_checkpoint(where: str | os.PathLike | Location, *, step: int | None = None,
                    storage_options: dict[str, Any] | None = None) -> tuple[Location, str | None]:
    """The checkpoint directory meant by ``where``, and a note when several checkpoints matched.

    ``where`` is a checkpoint directory, or a root: then its newest committed checkpoint, or the
    one whose manifest says ``step``. When several committed checkpoints hold the chosen step
    (Lightning's ``epoch=0-step=10.ckpt`` beside a ``last.ckpt`` copy) the one modified last is
    chosen and the note names them all; links to another checkpoint of the root are not candidates.

    Raises:
        PathNotFoundError: ``where`` does not exist.
        ConfigError: ``step`` was given with a checkpoint directory.
        CheckpointNotFoundError: the root has no committed checkpoint (of that step); a plain DCP
            folder, or a root holding one, is named with the ``torch-ckpt import`` command. A ``step`` the
            root holds no checkpoint of at all (none corrupt either) is a :class:`PathNotFoundError`, a
            bad argument (the CLI's exit code 2).
    """
    loc = open_dir(where, storage_options)
    if loc.exists(METADATA_NAME) and is_plain_dcp(loc.entries()):
        raise CheckpointNotFoundError(f"{loc.describe()} is a {plain_dcp_reason(loc)}")
    if looks_like_checkpoint(loc):
        if step is not None:
            raise ConfigError(f"{loc.describe()} is a checkpoint directory; a step applies to a run root only")
        return loc, None
    rows = list_root(loc)["steps"]
    listing = [r for r in rows if r["status"] == COMMITTED and r["alias_of"] is None and not r["superseded"]
               and (step is None or r["step"] == step)]
    if not listing:
        plain = [r for r in rows if r["status"] == PLAIN_DCP]
        corrupt = [r for r in rows if r["status"] == CORRUPT and (step is None or r["step"] == step)]
        others = [r["step"] for r in rows if r["status"] == COMMITTED and r["alias_of"] is None
                  and not r["superseded"]]
        missing = PathNotFoundError if step is not None and not plain and not corrupt else CheckpointNotFoundError
        raise missing(f"{loc.describe()} has no committed checkpoint" +
                                      (f" of step {step}" if step is not None else "") +
                                      (f"; {plain[0]['name']} is a {plain[0]['reason']}" if plain else
                                       f"; {len(corrupt)} failed its checks, the newest ({corrupt[-1]['name']}): "
                                       f"{corrupt[-1]['problems'][0]['problem'] if corrupt[-1]['problems'] else '?'}"
                                       " (`torch-ckpt verify` lists every problem)" if corrupt else
                                       f"; its committed steps: {', '.join(map(str, others))}" if others else
                                       f" {_NO_CHECKPOINT}"))
    chosen_step = listing[-1]["step"]
    same = sorted((r for r in listing if r["step"] == chosen_step),
                  key=lambda r: (r["mtime"] or 0.0, r["wall_time"] or 0.0, r["name"]))
    note = None if len(same) == 1 else (
        f"step {chosen_step} is held by {len(same)} checkpoints ({', '.join(r['name'] for r in same)}); "
        f"using the one modified last: {same[-1]['name']}")
    return loc.child(same[-1]["name"]), note


def verify_checkpoint(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                      checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Check one checkpoint directory: files and structure.

    Every file of the manifest must be present with its size and (``checksums``) CRC-32; the DCP
    metadata must be readable with the restricted unpickler, its storage entries inside listed
    files and covering each tensor, and every chunk's record must match its declared byte range,
    dtype, size and shape (headers only); every rank's JSON file must be listed, readable and
    consistent with the manifest, its tensor placeholders tensors of the metadata.

    Returns:
        ``{"checkpoint", "name", "step", "ok", "checksums", "structure", "world_size", "files",
        "bytes", "tensors", "problems": [{"file", "path", "problem"}], "warnings": [...]}``.

    Raises:
        PathNotFoundError: ``where`` does not exist.
    """
    loc = open_dir(where, storage_options)
    return check_dir(loc, checksums=checksums, structure=True, progress=progress)[0]


def verify_root(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Verify every checkpoint of a run root; partial, plain DCP and superseded entries, and links to
    another checkpoint of the root (verified under its own name), are skipped and listed.

    Returns:
        ``{"target", "kind": "root", "ok", "checkpoints": [verify_checkpoint results], "skipped":
        [{"name", "step", "reason", "link_to"}], "problems": total count, "general_problems": [str]}``.
        A root without any checkpoint to verify is not ok (one general problem).

    Raises:
        PathNotFoundError: ``where`` does not exist.
    """
    loc = as_location(where, storage_options=storage_options)
    results, skipped = [], []
    for row in list_root(loc)["steps"]:
        reason = (f"link to {row['alias_of']}, verified under that name" if row["alias_of"] is not None else
                  "superseded: a step of a timeline abandoned by a rollback (never resumed)" if row["superseded"]
                  else row["reason"] if row["status"] in (PARTIAL, PLAIN_DCP) else None)
        if reason is None:
            results.append(check_dir(loc.child(row["name"]), checksums=checksums, structure=True,
                                     progress=progress)[0])
        else:
            skipped.append({"name": row["name"], "step": row["step"], "reason": reason, "link_to": row["alias_of"],
                            "plain_dcp": row["status"] == PLAIN_DCP})
    return _summary(loc, "root", results, skipped)


def _summary(loc: Location, kind: str, results: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> dict[str, Any]:
    partial = not results and not skipped and any(n.startswith(PARTIAL_PREFIX) for n in loc.entries())
    general = [] if results else [
        f"{loc.describe()} is an incomplete save (a torch-ckpt partial and no manifest: a save still being written, or "
        "one a crash interrupted, which the run removes when it next opens this root); nothing to verify" if partial
        else f"{loc.describe()} holds no checkpoint to verify {_NO_CHECKPOINT}"]
    problems = sum(len(r["problems"]) for r in results) + len(general)
    return {"target": loc.describe(), "kind": kind, "ok": problems == 0, "checkpoints": results, "skipped": skipped,
            "problems": problems, "general_problems": general}


def verify_path(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Verify a checkpoint directory, or every checkpoint of a root (:func:`verify_root`'s shape both
    times; ``kind`` is "checkpoint" or "root"); a plain DCP folder fails with the import command."""
    loc = open_dir(where, storage_options)
    if looks_like_checkpoint(loc) or (loc.exists(METADATA_NAME) and is_plain_dcp(loc.entries())):
        return _summary(loc, "checkpoint", [check_dir(loc, checksums=checksums, structure=True, progress=progress)[0]],
                        [])
    return verify_root(loc, checksums=checksums, progress=progress)


def inspect_checkpoint(where: str | os.PathLike | Location, *, step: int | None = None,
                       storage_options: dict[str, Any] | None = None, keys: bool = False,
                       progress: bool = False) -> dict[str, Any]:
    """What a checkpoint holds, per component (top-level key of the saved state).

    Sizes come from the DCP metadata (global shapes, so a sharded tensor counts once at full size)
    and the per-rank trees (rank-local tensors count on every rank). A restore's checks are made
    except checksums: only the records' headers are read.

    Args:
        where: a checkpoint directory, or a run root (its newest committed checkpoint, or ``step``'s;
            see :func:`~torch_ckpt.tools.listing.find_checkpoint`).
        keys: also list every tensor and array with its shape and dtype.
        progress: show a progress bar over the ranks' files on a terminal.

    Returns:
        ``{"checkpoint", "step", "world_size", "wall_time", "time", "torch_version", "format_version",
        "files", "file_bytes"`` (the files the manifest lists, as ``ls`` and ``verify`` count them)
        ``, "written_bytes", "linked_bytes"`` (of those, written by its save and hard-linked from an earlier one)
        ``, "manifest_tensor_bytes", "components", "totals", "note"`` (which checkpoint was chosen
        when several held the step)``}`` and with ``keys`` ``"keys"``. A component is ``{"name",
        "bytes"`` (tensors + arrays) ``, "tensor_bytes", "tensors", "dtypes": {dtype: count},
        "rank_local_tensors", "arrays", "array_bytes", "values"`` (other leaves of rank 0)``}``; a
        key ``{"key", "component", "kind"`` ("tensor", "ndarray") ``, "storage"`` ("dcp", "json")
        ``, "rank"`` (json) ``, "shape", "dtype", "bytes", "chunks"`` (dcp)``}``.

    Raises:
        PathNotFoundError: ``where`` does not exist.
        CheckpointNotFoundError: not a committed checkpoint (a plain DCP folder: named so).
        CheckpointCorruptError: a check of :mod:`torch_ckpt.format._files` fails, or the state refers
            to a tensor the metadata lacks.
        UnsafeCheckpointError: the DCP metadata references code (refused, not executed).
    """
    loc, note = find_checkpoint(where, step=step, storage_options=storage_options)
    manifest = read_manifest(loc)
    # one node's copy of a node-local checkpoint (a node root, a memory root): its files, its ranks' values
    mine = dataclasses.replace(manifest, files=manifest.local_files()) if manifest.partial else manifest
    if not manifest.partial and METADATA_NAME not in manifest.files:
        raise CheckpointCorruptError(f"{loc.describe(METADATA_NAME)}: DCP metadata is not listed in the manifest")
    problems: list[tuple[str, str]] = []  # the listed files must be what a restore reads: regular files, listed sizes
    verify_files(loc, mine, checksums=False, collect=problems)
    tensors: dict[str, Any] = {}
    if not problems and manifest.partial:
        md = read_metadata(loc, manifest)  # the node's view of the DCP metadata, validated
        tensors = tensor_items(md)
    elif not problems:
        md = load_dcp_metadata_bytes(read_listed(loc, manifest, METADATA_NAME, MAX_METADATA_BYTES),
                                     loc.describe(METADATA_NAME))
        problems, tensors = metadata_problems(md, manifest)
        problems += rank_file_problems(manifest)
    if not problems:  # the tensor records must match the metadata (headers only: no payload is read)
        problems = record_problems(loc, manifest, md, tensors=tensors)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise CheckpointCorruptError(f"{loc.describe(file)}: {text}{more}")
    comps: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "bytes": 0, "tensor_bytes": 0, "tensors": 0, "dtypes": {}, "rank_local_tensors": 0, "arrays": 0,
        "array_bytes": 0, "values": 0})
    key_rows: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(top: str, key: str, shape: list[int], dtype: str, nbytes: int, kind: str, **where: Any) -> None:
        comp = comps[top]
        if kind == "ndarray":
            comp["arrays"] += 1
            comp["array_bytes"] += nbytes
        else:
            comp["tensors"] += 1
            comp["tensor_bytes"] += nbytes
            comp["dtypes"][dtype] = comp["dtypes"].get(dtype, 0) + 1
            comp["rank_local_tensors"] += int("rank" in where)
        if keys:
            key_rows.append({"key": key, "component": top, "kind": kind, "storage": "json" if "rank" in where else
                             "dcp", **where, "shape": shape, "dtype": dtype, "bytes": nbytes})

    def add_dcp(top: str, key: str) -> None:
        tmd = tensors[key]
        add(top, key, list(tmd.size), str(tmd.properties.dtype).removeprefix("torch."),
            math.prod(tmd.size) * tmd.properties.dtype.itemsize, "tensor", chunks=len(tmd.chunks))

    ranks = [r for r, n in enumerate(manifest.nodes["rank_node"]) if n == manifest.node] if manifest.partial \
        else range(manifest.world_size)
    with tqdm(total=len(ranks), desc=f"inspect {loc.name}", unit="rank", leave=False, dynamic_ncols=True,
              disable=None if progress and len(ranks) > 8 else True) as bar:  # None: only on a terminal
        for rank in ranks:
            tree = read_rank_doc(loc, manifest, rank)["tree"]
            for top, sub in tree.items() if isinstance(tree, dict) else [("<root>", tree)]:
                comps[top]  # a component is listed even when empty
                for path, kind, node in walk_tree(sub, (top,)):  # validated by read_rank_doc
                    if kind == "tensor" and node[TENSOR_TAG] not in seen:
                        seen.add(node[TENSOR_TAG])
                        if node[TENSOR_TAG] not in tensors:
                            raise CheckpointCorruptError(
                                f"{loc.describe(rank_file_name(rank))}: state key {'.'.join(path)!r} refers to tensor "
                                f"{node[TENSOR_TAG]!r}, which the DCP metadata does not hold")
                        add_dcp(top, node[TENSOR_TAG])
                    elif kind in ("inline", "ndarray"):
                        add(top, ".".join(path), *embedded_info(kind, node),
                            "tensor" if kind == "inline" else "ndarray", rank=rank)
                    elif kind != "tensor" and rank == ranks[0]:
                        comps[top]["values"] += 1
            bar.update(1)
    for key in (k for k in tensors if k not in seen and not manifest.partial):  # a node copy: others' ranks' keys
        add_dcp("(not in state)", key)
    if manifest.partial and max(manifest.nodes["rank_node"]) > 0:  # several nodes: this copy is part of it
        note = " ".join(filter(None, [note, f"node {manifest.node}'s copy of a node-local checkpoint: the values of "
                                            f"its ranks {list(ranks)}, and the tensors their state refers to"]))
    components = [{"name": name, **c, "bytes": c["tensor_bytes"] + c["array_bytes"],
                   "dtypes": dict(sorted(c["dtypes"].items()))} for name, c in comps.items()]
    totals = {k: sum(c[k] for c in components)
              for k in ("bytes", "tensor_bytes", "tensors", "rank_local_tensors", "arrays", "array_bytes", "values")}
    totals["dcp_tensor_bytes"] = sum(math.prod(t.size) * t.properties.dtype.itemsize for t in tensors.values())
    out: dict[str, Any] = {
        "checkpoint": loc.describe(), "step": manifest.step, "world_size": manifest.world_size,
        "wall_time": manifest.wall_time, "time": iso_time(manifest.wall_time), "torch_version": manifest.torch_version,
        "format_version": manifest.format_version, "files": len(mine.files),
        "file_bytes": sum(i["bytes"] for i in mine.files.values()),
        "written_bytes": bytes_written(mine.files, manifest.stored if loc.remote else None)[0],
        "linked_bytes": bytes_written(mine.files, manifest.stored if loc.remote else None)[1],
        "manifest_tensor_bytes": manifest.tensor_bytes, "components": components, "totals": totals,
        "note": note,
    }
    if keys:
        out["keys"] = key_rows
    return out
