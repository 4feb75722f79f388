"""The checks behind ``ls``, ``verify`` and ``inspect``: one checkpoint directory, every problem listed.

:func:`check_dir` runs the checks of the storage/format layer (:mod:`torch_ckpt.format._read`,
:mod:`torch_ckpt.format._read`, :mod:`torch_ckpt.format._read`) on a
 :class:`~torch_ckpt.storage._locations.Location`
and collects every problem with the file it concerns instead of stopping at the first one. With
``structure=False`` (``ls``) only the cheap checks run: the manifest, one rank file per rank, and
every listed file present as a regular file of its size.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from tqdm import tqdm

from torch_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, UnsafeCheckpointError
from torch_ckpt.format._codec import TENSOR_TAG
from torch_ckpt.format._read import (
    MANIFEST_NAME,
    MAX_METADATA_BYTES,
    MAX_RANK_JSON_BYTES,
    METADATA_NAME,
    RANK_FILE_RE,
    Manifest,
    load_dcp_metadata_bytes,
    metadata_problems,
    parse_rank_doc,
    rank_file_name,
    rank_file_problems,
    read_listed,
    read_manifest,
    record_problems,
    verify_files,
    walk_tree,
)
from torch_ckpt.storage._locations import Location, PathNotFoundError

__all__ = ["COMMITTED", "CORRUPT", "PARTIAL", "Report", "check_dir", "dtype_name", "iso_time",
           "require_dir", "step_of"]

COMMITTED, PARTIAL, CORRUPT = "committed", "partial", "corrupt"

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_(\d+)(\.download)?\.tmp(\.[0-9a-f]+)?$")  # old and incarnation-id forms


def require_dir(loc: Location) -> None:
    """Raise :class:`PathNotFoundError` unless ``loc`` is an existing directory."""
    if not loc.exists():
        raise PathNotFoundError(f"{loc.describe()} does not exist")
    if not loc.is_dir():
        raise PathNotFoundError(f"{loc.describe()} is not a directory")


def dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def iso_time(ts: float | None) -> str | None:
    """ISO 8601 (UTC, seconds) of a Unix time, or None."""
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def step_of(name: str) -> tuple[int | None, bool]:
    """``(step, temporary)`` parsed from a directory name; step None for other names."""
    m = _STEP_RE.match(name)
    if m:
        return int(m.group(1)), False
    t = _TMP_RE.match(name)
    if t:
        return int(t.group(1)), True
    return None, False


class Report:
    """Problems and warnings found in one checkpoint directory, each naming its file."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.problems: list[dict[str, str]] = []
        self.warnings: list[dict[str, str]] = []

    def problem(self, file: str, text: str) -> None:
        self.problems.append({"file": file, "path": self.loc.describe(file), "problem": text})

    def warning(self, file: str, text: str) -> None:
        self.warnings.append({"file": file, "path": self.loc.describe(file), "problem": text})


def _strip(loc: Location, name: str, exc: BaseException) -> str:
    """The message of ``exc`` without its leading file name (the report names the file)."""
    return str(exc).replace(loc.describe(name) + ": ", "")


def _check_files(loc: Location, manifest: Manifest, listing: dict[str, dict[str, Any]], rep: Report, *,
                 checksums: bool, bar: Any) -> None:
    """Every listed file (``verify_files``); files the manifest does not list are warnings."""
    found: list[tuple[str, str]] = []
    verify_files(loc, manifest, checksums=checksums, collect=found, progress=bar)
    for name, text in found:
        rep.problem(name, text)
    for name, entry in sorted(listing.items()):
        if name != MANIFEST_NAME and name not in manifest.files:
            rep.warning(name, f"{entry['type']} not listed in the manifest (ignored on restore)")


def _check_structure(loc: Location, manifest: Manifest, listing: dict[str, dict[str, Any]], rep: Report) -> int:
    """DCP metadata and per-rank trees, with the checks a restore makes; returns the number of DCP tensors."""
    md = None
    if METADATA_NAME not in manifest.files:
        rep.problem(METADATA_NAME, "DCP metadata is not listed in the manifest")
    elif not any(p["file"] == METADATA_NAME for p in rep.problems):  # else: already missing, truncated or corrupt
        try:
            md = load_dcp_metadata_bytes(read_listed(loc, manifest, METADATA_NAME, MAX_METADATA_BYTES),
                                         loc.describe(METADATA_NAME))
        except (UnsafeCheckpointError, CheckpointCorruptError) as exc:
            rep.problem(METADATA_NAME, _strip(loc, METADATA_NAME, exc))
    tensors: dict[str, Any] = {}
    if md is not None:
        problems, tensors = metadata_problems(md, manifest)
        for file, text in problems:
            rep.problem(file, text)
        if tensors:  # empty when the metadata is malformed as a whole
            _check_records(loc, manifest, md, tensors, rep)
        if not problems:
            for key, item in md.state_dict_metadata.items():
                if isinstance(item, BytesStorageMetadata):
                    rep.warning(METADATA_NAME, f"item {key!r} is a pickled object; torch-ckpt never writes those and "
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
            doc = parse_rank_doc(read_listed(loc, manifest, name, MAX_RANK_JSON_BYTES), loc.describe(name), manifest,
                                 rank)
        except CheckpointCorruptError as exc:
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
        m = RANK_FILE_RE.match(name)
        if m and int(m.group(1)) >= manifest.world_size:
            rep.warning(name, f"per-rank file beyond the world size {manifest.world_size}")
    unreferenced = sorted(set(tensors) - referenced)
    if unreferenced and trees_read == manifest.world_size:  # otherwise the unread trees may refer to them
        rep.warning(METADATA_NAME, f"{len(unreferenced)} tensor(s) are not referenced by any rank's state, e.g. "
                               f"{unreferenced[:3]}")
    return len(tensors)


def _check_manifest_consistency(manifest: Manifest, rep: Report) -> None:
    """What the manifest alone shows a restore would refuse: DCP metadata unlisted, not one rank file per rank."""
    if METADATA_NAME not in manifest.files:
        rep.problem(METADATA_NAME, "DCP metadata is not listed in the manifest")
    for file, text in rank_file_problems(manifest):
        rep.problem(file, text)


def _check_records(loc: Location, manifest: Manifest, md: Any, tensors: dict[str, Any], rep: Report) -> None:
    """Every chunk's record in the data files that passed the file checks matches the metadata."""
    reported = {p["file"] for p in rep.problems}
    files = sorted({str(info.relative_path) for index, info in md.storage_data.items()
                    if index.fqn in tensors} - reported)
    for name in files:
        try:
            for file, text in record_problems(loc, manifest, md, tensors=tensors, files=[name]):
                rep.problem(file, text)
        except CheckpointCorruptError as exc:
            rep.problem(name, f"cannot be read ({_strip(loc, name, exc)})")


def check_dir(loc: Location, *, checksums: bool, structure: bool,
              progress: bool) -> tuple[dict[str, Any], Manifest | None]:
    """Check one checkpoint directory; never raises for a damaged checkpoint (every problem is listed).

    Args:
        loc: the checkpoint directory.
        checksums: compare every file's CRC-32 (reads every byte).
        structure: also check the DCP metadata, the tensor records and every rank's file (else only
            the cheap checks of ``ls``).
        progress: show a progress bar over the checksummed bytes on a terminal.

    Returns:
        ``(result, manifest)``: the :func:`~torch_ckpt.tools.verification.verify_checkpoint` dict, and
        the manifest when it could be read.

    Raises:
        DurableUnavailableError: the store cannot be reached.
    """
    rep = Report(loc)
    step, _ = step_of(loc.name)
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
            manifest = read_manifest(loc)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
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


