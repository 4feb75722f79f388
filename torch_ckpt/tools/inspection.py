"""What a checkpoint holds (``torch-ckpt inspect``), per component, from its metadata and rank trees.

The checks are a restore's (:mod:`torch_ckpt.format._files`), all but the CRC-32; nothing runs code
from the checkpoint (restricted metadata unpickler, JSON trees, only the records' headers read).
"""

from __future__ import annotations

import math
import os
from typing import Any

from tqdm import tqdm

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.format._codec import TENSOR_TAG
from torch_ckpt.format._dcp_metadata import MAX_METADATA_BYTES, metadata_problems, record_problems
from torch_ckpt.format._dcp_read import load_dcp_metadata_bytes
from torch_ckpt.format._files import METADATA_NAME, rank_file_problems, read_listed, read_rank_doc, verify_files
from torch_ckpt.format._manifest import rank_file_name, read_manifest
from torch_ckpt.format._state_tree import embedded_info, walk_tree
from torch_ckpt.storage._locations import Location
from torch_ckpt.tools.listing import dtype_name, find_checkpoint, iso_time

__all__ = ["inspect_checkpoint"]


def _component() -> dict[str, Any]:
    return {"bytes": 0, "tensor_bytes": 0, "tensors": 0, "dtypes": {}, "rank_local_tensors": 0, "arrays": 0,
            "array_bytes": 0, "values": 0}


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
    if METADATA_NAME not in manifest.files:
        raise CheckpointCorruptError(f"{loc.describe(METADATA_NAME)}: DCP metadata is not listed in the manifest")
    problems: list[tuple[str, str]] = []  # the listed files must be what a restore reads: regular files, listed sizes
    verify_files(loc, manifest, checksums=False, collect=problems)
    tensors: dict[str, Any] = {}
    if not problems:
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
    comps: dict[str, dict[str, Any]] = {}
    key_rows: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(top: str, key: str, shape: list[int], dtype: str, nbytes: int, kind: str, **where: Any) -> None:
        comp = comps.setdefault(top, _component())
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
        add(top, key, list(tmd.size), dtype_name(tmd.properties.dtype),
            math.prod(tmd.size) * tmd.properties.dtype.itemsize, "tensor", chunks=len(tmd.chunks))

    with tqdm(total=manifest.world_size, desc=f"inspect {loc.name}", unit="rank", leave=False, dynamic_ncols=True,
              disable=None if progress and manifest.world_size > 8 else True) as bar:  # None: only on a terminal
        for rank in range(manifest.world_size):
            tree = read_rank_doc(loc, manifest, rank)["tree"]
            for top, sub in tree.items() if isinstance(tree, dict) else [("<root>", tree)]:
                comps.setdefault(top, _component())
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
                    elif kind != "tensor" and rank == 0:
                        comps[top]["values"] += 1
            bar.update(1)
    for key in (k for k in tensors if k not in seen):
        add_dcp("(not in state)", key)
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
        "wall_time": manifest.wall_time, "time": iso_time(manifest.wall_time), "torch_version": manifest.torch_version,
        "format_version": manifest.format_version, "files": len(manifest.files),
        "file_bytes": sum(i["bytes"] for i in manifest.files.values()),
        "manifest_tensor_bytes": manifest.tensor_bytes, "components": components, "totals": totals,
        "note": note,
    }
    if keys:
        out["keys"] = key_rows
    return out
