"""Loading a committed checkpoint into a live state, in place, without unpickling.

Steps (every rank): verify the files of the checkpoint against the manifest (sizes always, CRC-32
when ``verify``; the work is split over ranks), read this rank's JSON tree, check that the live
state and the checkpoint have the same tensor keys and shapes, let DCP load the tensors in place
(resharding to the live layout), rebuild the nested state and hand it to ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from torch_ckpt._logging import get_logger
from torch_ckpt.codec import TENSOR_TAG, join_state, split_state
from torch_ckpt.dcp_io import load_tensors
from torch_ckpt.dist import DistContext, single_process_quiet
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigError,
    StateMismatchError,
)
from torch_ckpt.format import check_files, read_metadata, read_rank_tree
from torch_ckpt.layout import Manifest

__all__ = ["verify_files", "load_into", "RANK_LOCAL_POLICIES"]

log = get_logger(__name__)

RANK_LOCAL_POLICIES = ("error", "keep_live")


def verify_files(step_dir: Path, manifest: Manifest, *, checksums: bool, part: int = 0, parts: int = 1) -> None:
    """Check every file listed in the manifest (this rank's share when ``parts`` > 1).

    See :func:`torch_ckpt.format.check_files`: regular files inside the checkpoint, listed sizes,
    and CRC-32 when ``checksums``.

    Raises:
        CheckpointCorruptError: a file is missing, a symlink, has the wrong size or the wrong
            CRC-32; the message names the file.
    """
    check_files(step_dir, manifest, checksums=checksums, part=part, parts=parts)


def _tensor_keys(tree: Any) -> set[str]:
    keys: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if len(node) == 1 and TENSOR_TAG in node:
                keys.add(node[TENSOR_TAG])
                return
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tree)
    return keys


_OPAQUE = ("extras", "rng", "dataloader")


def _is_tagged(node: Any) -> bool:
    """True for a codec node (tensor placeholder, tuple, numpy value...) rather than a user dict."""
    return isinstance(node, dict) and len(node) == 1 and next(iter(node)).startswith("__")


def _structure_keys(tree: Any, *, deep: bool) -> set[str]:
    """Dotted paths of the non-tensor structure: top-level keys only (``deep=False``), or every dict path.

    Tensor placeholders are left out (tensor keys are compared on their own), and subtrees that are
    replaced as a whole on load (extras, RNG, dataloader) are not descended into.
    """
    keys: set[str] = set()
    if not isinstance(tree, dict) or _is_tagged(tree):
        return keys

    def walk(node: dict, prefix: str, depth: int) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and len(v) == 1 and TENSOR_TAG in v:
                continue
            path = f"{prefix}{k}"
            if deep and isinstance(v, dict) and not _is_tagged(v) and not (depth == 0 and k in _OPAQUE):
                walk(v, f"{path}.", depth + 1)
            else:
                keys.add(path)

    if deep:
        walk(tree, "", 0)
    else:
        keys.update(k for k, v in tree.items() if not (isinstance(v, dict) and len(v) == 1 and TENSOR_TAG in v))
    return keys


def _read_rank_tree(step_dir: Path, manifest: Manifest, rank: int) -> Any:
    return read_rank_tree(step_dir, manifest, rank)


def _assign(target: MutableMapping, loaded: Mapping) -> None:
    for k, v in loaded.items():
        if isinstance(v, Mapping) and isinstance(target.get(k), MutableMapping):
            _assign(target[k], v)
        elif isinstance(v, torch.Tensor) and isinstance(target.get(k), torch.Tensor):
            continue  # loaded in place by DCP
        else:
            target[k] = v


def load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
              on_world_size_change: str = "error") -> None:
    """Load ``step_dir`` into ``state`` (a ``Stateful`` or a mutable dict) in place.

    Raises:
        CheckpointCorruptError: files fail verification or the structure is inconsistent.
        StateMismatchError: tensor keys or shapes differ (lists missing and unexpected keys).
        ConfigError: the world size changed and ``on_world_size_change`` is "error".
    """
    if on_world_size_change not in RANK_LOCAL_POLICIES:
        raise ConfigError(f"on_world_size_change must be one of {RANK_LOCAL_POLICIES}, got {on_world_size_change!r}")
    same_world = manifest.world_size == ctx.world_size
    err = None
    try:  # every rank's reads and checks are agreed on before any rank loads anything
        verify_files(step_dir, manifest, checksums=verify, part=ctx.rank, parts=ctx.world_size)
        md = read_metadata(step_dir, manifest)
        tree = _read_rank_tree(step_dir, manifest, ctx.rank if same_world else 0)
    except CheckpointError as exc:
        err = exc
    errors = [e for e in ctx.all_gather(None if err is None else str(err), what="verify") if e]
    if err is not None:
        raise err
    if errors:
        raise CheckpointCorruptError(f"{step_dir}: verification failed on another rank: {errors[0]}")

    live_sd = state.state_dict() if hasattr(state, "state_dict") else state
    rank_local = tuple(getattr(state, "rank_local_keys", ()))
    live_tensors, live_tree = split_state(live_sd, rank_local_keys=rank_local)

    if not same_world and rank_local and on_world_size_change == "error":
        raise ConfigError(
            f"{step_dir} was saved with world size {manifest.world_size}, this run has {ctx.world_size}: the "
            f"rank-local state {list(rank_local)} (RNG, dataloader position) cannot be mapped to the new ranks. "
            "Pass on_world_size_change='keep_live' to CheckpointManager to keep this run's own rank-local state.")
    if not same_world:
        for key in rank_local:
            if isinstance(live_tree, dict) and key in live_tree:
                tree[key] = live_tree[key]

    saved_keys = _tensor_keys(tree) | _structure_keys(tree, deep=not hasattr(state, "state_dict"))
    live_keys = set(live_tensors) | _structure_keys(live_tree, deep=not hasattr(state, "state_dict"))
    missing = sorted(live_keys - saved_keys)
    unexpected = sorted(saved_keys - live_keys)
    if missing or unexpected:
        raise StateMismatchError(
            f"{step_dir}: state does not match the checkpoint. Missing from checkpoint: {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected in checkpoint: {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}. Build the same model/optimizer as the saved run.",
            missing=missing, unexpected=unexpected)
    bad = []
    for key, t in live_tensors.items():
        smd = md.state_dict_metadata.get(key)
        if smd is None or not hasattr(smd, "size"):
            raise CheckpointCorruptError(f"{step_dir}: tensor {key!r} is listed in the state but not in DCP metadata")
        if tuple(smd.size) != tuple(t.shape):
            bad.append(f"{key}: checkpoint {tuple(smd.size)} vs live {tuple(t.shape)}")
    if bad:
        raise StateMismatchError(f"{step_dir}: tensor shapes differ: {bad[:20]}", missing=[], unexpected=[])

    if live_tensors:
        with single_process_quiet(not ctx.enabled):
            load_tensors(live_tensors, step_dir, md, set(manifest.files), process_group=ctx.fg if ctx.enabled else None,
                         no_dist=not ctx.enabled)
    full = join_state(tree, live_tensors)
    if hasattr(state, "load_state_dict"):
        state.load_state_dict(full)
    elif isinstance(state, MutableMapping):
        _assign(state, full)
    else:
        raise ConfigError(f"cannot restore into a {type(state).__name__}: pass a dict or an object with "
                          "state_dict()/load_state_dict()")
