"""The files of a checkpoint directory, checked against its manifest, and the per-rank state files.

Part of the one validation path every reader uses (restore, ``verify``, ``inspect``, ``convert``,
the durable tier); see also :mod:`torch_ckpt.format._manifest` and :mod:`torch_ckpt.format._dcp_metadata`.
What a reader may rely on once a check here passed:

* **Files** (:func:`verify_files`): only files the manifest lists are ever opened; each must be a
  regular file inside the checkpoint (``O_NOFOLLOW``: a symlink, FIFO or directory is refused),
  with the listed size and, when checksums are on, the listed CRC-32.
* **Per-rank JSON** (``rank_00000.json`` ...; :func:`read_rank_doc`): one per rank of the world
  size (counted against the manifest's file list before anything is allocated), at most
  :data:`MAX_RANK_JSON_BYTES`, parsed with bounded nesting (:data:`MAX_STATE_DEPTH`) and integer
  length; ``rank`` is the file's own and ``step``/``world_size`` agree with the manifest; every node
  of the tree is well formed (:func:`torch_ckpt.format._state_tree.walk_tree`).

Any violation raises :class:`~torch_ckpt.errors.CheckpointCorruptError` naming the file, or, with
``collect=``, is appended to a list instead (``verify`` reports every problem).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Any

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.format._codec import TENSOR_TAG
from torch_ckpt.format._manifest import MANIFEST_NAME, Manifest, rank_file_name
from torch_ckpt.format._state_tree import walk_tree
from torch_ckpt.storage._locations import (
    DurableUnavailableError,
    Location,
    Malformed,
    as_location,
    corrupt,
    loads_bounded,
    open_regular,
    short_repr,
)

__all__ = [
    "MAX_RANK_JSON_BYTES",
    "MAX_STATE_DEPTH",
    "MAX_STATE_INT_DIGITS",
    "METADATA_NAME",
    "NODE_METADATA_RE",
    "RANK_FILE_RE",
    "open_listed",
    "parse_rank_doc",
    "rank_file_problems",
    "read_listed",
    "read_rank_doc",
    "verify_files",
]

MAX_RANK_JSON_BYTES = 4 << 30
"""Largest per-rank JSON file read (bytes)."""
MAX_STATE_DEPTH = 400
"""Deepest nesting of containers in a per-rank JSON file (the saved state's nesting plus tags).

``codec.split_state`` refuses states nested deeper than ``codec.MAX_DEPTH`` (100) containers; one
container encodes to at most 3 JSON levels (tag object, item list, key/value pair), plus the document's
own wrapper, so everything ``save()`` accepts stays below this bound and restores."""
MAX_STATE_INT_DIGITS = 4300
"""Longest integer in a per-rank JSON file (digits): Python's default int/str conversion limit."""
METADATA_NAME = ".metadata"
RANK_FILE_RE = re.compile(r"^rank_(\d+)\.json$")
NODE_METADATA_RE = re.compile(r"^node_\d{5,}\.metadata$")


def open_listed(step_dir: str | os.PathLike, manifest: Manifest, name: str, *, allow_symlinks: bool = False) -> int:
    """Open the manifest-listed file ``name`` of a local checkpoint as a regular file; returns the descriptor.

    Raises:
        CheckpointCorruptError: ``name`` is not listed, is missing, or is not a regular file inside
            the checkpoint.
    """
    path = Path(step_dir) / name
    if name not in manifest.files:
        raise corrupt(str(path), "is not listed in the manifest; refusing unverified data")
    try:
        return open_regular(path, allow_symlinks=allow_symlinks, what="file listed in the manifest")
    except FileNotFoundError:
        raise corrupt(str(path), "listed in the manifest but missing") from None
    except OSError as exc:
        raise corrupt(str(path), f"file listed in the manifest cannot be read ({exc.strerror})") from None


def read_listed(where: str | os.PathLike | Location, manifest: Manifest, name: str, limit: int, *,
                allow_symlinks: bool = False) -> bytes:
    """All bytes of the manifest-listed file ``name`` (at most ``limit``; its size must be the listed one).

    Raises:
        CheckpointCorruptError: not listed, larger than ``limit``, missing, not a regular file,
            unreadable, or not of the listed size; the message names it.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    source = loc.describe(name)
    if name not in manifest.files:
        raise corrupt(source, "is not listed in the manifest; refusing unverified data")
    if manifest.files[name]["bytes"] > limit:
        raise corrupt(source, f"is {manifest.files[name]['bytes']} bytes, more than the {limit} accepted")
    try:
        data = loc.read_bytes(name, limit)
    except (FileNotFoundError, NotADirectoryError):
        raise corrupt(source, "listed in the manifest but missing") from None
    except (CheckpointCorruptError, DurableUnavailableError):
        raise
    except OSError as exc:
        raise corrupt(source, f"file listed in the manifest cannot be read ({exc.strerror or exc})") from None
    if len(data) != manifest.files[name]["bytes"]:
        raise corrupt(source, f"size {len(data)} bytes, manifest says {manifest.files[name]['bytes']}")
    return data


def verify_files(where: str | os.PathLike | Location, manifest: Manifest, *, checksums: bool, part: int = 0,
                 parts: int = 1, allow_symlinks: bool = False, collect: list[tuple[str, str]] | None = None,
                 progress: Any = None, store_digests: Mapping[str, str] | None = None) -> int:
    """Check every file the manifest lists (this reader's share when ``parts`` > 1).

    Each must be a regular file inside the checkpoint with the listed size, and with ``checksums``
    the listed CRC-32 (read in chunks through :func:`torch_ckpt.storage._crc.crc32`). One node's copy of a
    node-local checkpoint is checked for that node's files. The same function checks local
    checkpoints, checkpoints on a store, uploads to the durable tier and files fetched from it, with
    the same messages.

    Store digests: with ``checksums`` and ``store_digests`` (``{file name: digest}``), a file whose
    stored object reports exactly that digest (:meth:`~torch_ckpt.storage._locations.Location.stat`, e.g. the
    MD5 ETag an S3-compatible store computed over the bytes it received) passes without being read.
    The caller vouches that each digest is of bytes with the listed CRC-32 (the durable tier
    computes it from the local file in the same pass as that file's CRC-32). Any other file is read
    and its CRC-32 compared, so a digest that cannot match (SSE-KMS ETags) costs a read, never a
    false alarm.

    Args:
        where: the checkpoint directory (local path or :class:`~torch_ckpt.storage._locations.Location`).
        manifest: its manifest.
        checksums: also compare every file's CRC-32 (reads every byte not vouched for by ``store_digests``).
        part: this reader's index when ``parts`` readers split the files.
        parts: how many readers split the files.
        allow_symlinks: follow symlinked files.
        collect: append ``(file name, problem)`` for every problem instead of raising the first.
        progress: an object with ``update(bytes)`` (a progress bar), advanced as files are checked.
        store_digests: expected store digests of some files (see above).

    Returns:
        Bytes read to compare CRC-32s (0 without ``checksums``).

    Raises:
        CheckpointCorruptError: (without ``collect``) a file is missing, a symlink, not a regular
            file, unreadable, or has the wrong size or CRC-32; the message names it.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    read = 0

    def bad(name: str, text: str) -> None:
        if collect is None:
            raise corrupt(loc.describe(name), text)
        collect.append((name, text))

    for i, (name, info) in enumerate(sorted(manifest.local_files().items())):
        if i % parts != part:
            continue
        try:
            size, digest = loc.stat(name)
            if size != info["bytes"]:
                bad(name, f"size {size} bytes, manifest says {info['bytes']} (truncated or overwritten)")
            elif checksums and not (digest is not None and store_digests and digest == store_digests.get(name)):
                size, crc = loc.checksum(name, progress)
                read += size
                if size != info["bytes"]:
                    bad(name, f"read {size} bytes, manifest says {info['bytes']}")
                elif crc != info["crc32"]:
                    bad(name, f"CRC-32 {crc:#010x} does not match the manifest ({info['crc32']:#010x}); the "
                              "file is corrupt")
                continue
        except (FileNotFoundError, NotADirectoryError):
            bad(name, "listed in the manifest but missing")
        except CheckpointCorruptError as exc:  # a symlink, directory or FIFO
            if collect is None:
                raise
            bad(name, str(exc).removeprefix(loc.describe(name) + ": "))
        except DurableUnavailableError:
            raise
        except OSError as exc:
            bad(name, f"cannot be read ({exc.strerror or exc})")
        if checksums and progress is not None:
            progress.update(info["bytes"])
    return read


def rank_file_problems(manifest: Any) -> list[tuple[str, str]]:
    """``[(file, problem)]`` when the manifest does not list exactly one JSON file per rank.

    Counts the listed rank files before anything is done per rank, so a manifest declaring a huge
    world size costs no more than its file list.
    """
    listed = sum(1 for name in manifest.files if RANK_FILE_RE.match(name))
    if manifest.world_size > listed:  # checked first: never loop over a declared (untrusted) world size
        missing = next(r for r in range(listed + 1) if rank_file_name(r) not in manifest.files)
        return [(MANIFEST_NAME, f"world size {manifest.world_size} but the manifest lists {listed} per-rank state "
                                f"file(s); {rank_file_name(missing)} is not listed")]
    problems = []
    for r in range(manifest.world_size):
        if rank_file_name(r) not in manifest.files:
            problems.append((rank_file_name(r), f"per-rank state file of rank {r} is not listed in the manifest "
                                                f"(world size {manifest.world_size})"))
    return problems


def parse_rank_doc(raw: bytes, source: str, manifest: Manifest, rank: int, *,
                   tensor_keys: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Parse and validate the per-rank JSON document of ``rank`` (bounded; see the module docstring).

    Args:
        raw: the file's bytes.
        source: its path or URL, for messages.
        manifest: the checkpoint's manifest (step and world size must agree).
        rank: the rank the file belongs to.
        tensor_keys: when given, every tensor placeholder must satisfy it (be a DCP tensor).

    Returns:
        The document ``{"step", "rank", "world_size", "tree"}``.

    Raises:
        CheckpointCorruptError: too large, not bounded JSON, fields that disagree with the manifest,
            or a malformed tree node (named by its dotted path).
    """
    if len(raw) > MAX_RANK_JSON_BYTES:
        raise corrupt(source, f"per-rank state file is {len(raw)} bytes, more than the {MAX_RANK_JSON_BYTES} "
                               "accepted")
    doc = loads_bounded(raw, source, what="per-rank state file", max_depth=MAX_STATE_DEPTH,
                        max_int_digits=MAX_STATE_INT_DIGITS)
    if not isinstance(doc, dict) or "tree" not in doc:
        raise corrupt(source, "per-rank state file has no 'tree'")
    got = doc.get("rank")
    if type(got) is not int or got != rank:
        raise corrupt(source, f"per-rank state file of rank {rank} says rank {short_repr(got)} (renamed or copied from "
                               "another rank)")
    manifest_source = source[: len(source) - len(PurePath(source).name)] + MANIFEST_NAME
    for field, want in (("step", manifest.step), ("world_size", manifest.world_size)):
        got = doc.get(field)
        if type(got) is not int or got != want:
            raise corrupt(source, f"{field} {short_repr(got)} in this per-rank state file disagrees with {field} "
                                  f"{want} in {manifest_source}: one of the two files was altered, or they come from "
                                  "different checkpoints")
    try:
        for where, kind, node in walk_tree(doc["tree"]):
            if kind == "tensor" and tensor_keys is not None and not tensor_keys(node[TENSOR_TAG]):
                raise Malformed(f"{'.'.join(where) or '<root>'}: refers to tensor {node[TENSOR_TAG]!r}, which the "
                                 "DCP metadata does not hold")
    except Malformed as exc:
        raise corrupt(source, f"malformed state tree ({exc})") from None
    return doc


def read_rank_doc(where: str | os.PathLike | Location, manifest: Manifest, rank: int, *, allow_symlinks: bool = False,
                  tensor_keys: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The validated per-rank document ``{"step", "rank", "world_size", "tree"}`` of ``rank``.

    The one reader of per-rank files, local or on a store; see :func:`parse_rank_doc` for the checks.

    Raises:
        CheckpointCorruptError: the rank files are not one per rank, or this one is missing, not a
            regular file, or malformed; the message names the file.
        DurableUnavailableError: the store cannot be reached.
    """
    loc = as_location(where, allow_symlinks=allow_symlinks)
    problems = rank_file_problems(manifest)
    if problems:
        raise corrupt(loc.describe(problems[0][0]), problems[0][1])
    name = rank_file_name(rank)
    raw = read_listed(loc, manifest, name, MAX_RANK_JSON_BYTES)
    return parse_rank_doc(raw, loc.describe(name), manifest, rank, tensor_keys=tensor_keys)
