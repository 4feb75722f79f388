"""Verification of checkpoints (``torch-ckpt verify``): sizes, CRC-32 and structure, naming each bad file.

Nothing executes code from a checkpoint: DCP's ``.metadata`` is read with the restricted unpickler
and tensor payloads are never loaded (only the records' headers are read). The checks are those of
:func:`torch_ckpt.tools.checks.check_dir`, the restore's own validation path.
"""

from __future__ import annotations

import os
from typing import Any

from torch_ckpt.storage._locations import Location, as_location
from torch_ckpt.tools.checks import PARTIAL, check_dir, require_dir
from torch_ckpt.tools.listing import list_root, looks_like_checkpoint

__all__ = ["verify_checkpoint", "verify_path", "verify_root"]


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
    loc = as_location(where, storage_options=storage_options)
    require_dir(loc)
    return check_dir(loc, checksums=checksums, structure=True, progress=progress)[0]


def verify_root(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Verify every checkpoint of a run root (see :func:`~torch_ckpt.tools.listing.list_root`).

    Partial entries, superseded ones (see :func:`~torch_ckpt.tools.listing.list_root`), and links
    to another checkpoint of the root (verified under its own name), are skipped and listed.

    Returns:
        ``{"target", "kind": "root", "ok", "checkpoints": [verify_checkpoint results], "skipped":
        [{"name", "step", "reason", "link_to"}], "problems": total count, "general_problems": [str]}``
        (``link_to``: the target of a skipped link, else None). A root without any checkpoint to
        verify is not ok (one general problem).

    Raises:
        PathNotFoundError: ``where`` does not exist.
    """
    loc = as_location(where, storage_options=storage_options)
    listing = list_root(loc)
    results, skipped = [], []
    for row in listing["steps"]:
        if row["alias_of"] is not None:
            skipped.append({"name": row["name"], "step": row["step"], "link_to": row["alias_of"],
                            "reason": f"link to {row['alias_of']}, verified under that name"})
            continue
        if row.get("superseded"):
            skipped.append({"name": row["name"], "step": row["step"], "link_to": None,
                            "reason": "superseded: a step of a timeline abandoned by a rollback (never resumed)"})
            continue
        if row["status"] == PARTIAL:
            skipped.append({"name": row["name"], "step": row["step"], "reason": row["reason"], "link_to": None})
            continue
        results.append(check_dir(loc.child(row["name"]), checksums=checksums, structure=True, progress=progress)[0])
    return _summary(loc, "root", results, skipped)


def _summary(loc: Location, kind: str, results: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> dict[str, Any]:
    general = [] if results else [f"{loc.describe()} holds no checkpoint to verify (a checkpoint is a directory "
                                  "holding a torch-ckpt manifest.json)"]
    problems = sum(len(r["problems"]) for r in results) + len(general)
    return {"target": loc.describe(), "kind": kind, "ok": problems == 0, "checkpoints": results, "skipped": skipped,
            "problems": problems, "general_problems": general}


def verify_path(where: str | os.PathLike | Location, *, storage_options: dict[str, Any] | None = None,
                checksums: bool = True, progress: bool = False) -> dict[str, Any]:
    """Verify a checkpoint directory or every checkpoint of a root (see :func:`verify_root`).

    Returns:
        The :func:`verify_root` shape in both cases (``kind`` is "checkpoint" or "root").
    """
    loc = as_location(where, storage_options=storage_options)
    require_dir(loc)
    if looks_like_checkpoint(loc):
        return _summary(loc, "checkpoint", [check_dir(loc, checksums=checksums, structure=True, progress=progress)[0]],
                        [])
    return verify_root(loc, checksums=checksums, progress=progress)
