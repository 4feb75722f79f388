"""Planning a restore: check the live state against the checkpoint and allocate what to read into.

:func:`plan_restore` compares the live state's tensor keys, shapes and dtypes, and the structure of
its other values, with the checkpoint's (and lets the state check its own structure), then
allocates one new buffer per checkpoint tensor (or asks the state for one, ``load_target``). It
writes nothing live: every refusal it raises leaves the state as it was.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointCorruptError, ConfigError, StateMismatchError
from torch_ckpt.format._codec import ODICT_TAG, TENSOR_TAG, is_per_rank_key, join_state, logical_key, split_state
from torch_ckpt.format._state_tree import tensor_keys
from torch_ckpt.root._layout import Manifest

__all__ = ["plan_restore", "staging_like", "local_tensor"]

log = get_logger(__name__)

_OPAQUE = ("extras", "rng", "dataloader")


def _is_tagged(node: Any) -> bool:
    """True for a codec node (tensor placeholder, tuple, numpy value...) rather than a user dict."""
    return isinstance(node, dict) and len(node) == 1 and next(iter(node)).startswith("__")


def _mapping(node: Any) -> Any:
    """The items of an encoded OrderedDict (compared as a dict's, as in checkpoints written before its tag)."""
    while isinstance(node, dict) and len(node) == 1 and ODICT_TAG in node:
        node = node[ODICT_TAG]
    return node


def _structure_keys(tree: Any, *, deep: bool) -> set[str]:
    """Dotted paths of the non-tensor structure: top-level keys only (``deep=False``), or every dict path.

    Tensor placeholders are left out (tensor keys are compared on their own), and subtrees that are
    replaced as a whole on load (extras, RNG, dataloader) are not descended into.
    """
    keys: set[str] = set()
    tree = _mapping(tree)
    if not isinstance(tree, dict) or _is_tagged(tree):
        return keys

    def walk(node: dict, prefix: str, depth: int) -> None:
        for k, v in node.items():
            v = _mapping(v)
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


def staging_like(live: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor (DTensor: local shard, same sharding) to load a checkpoint tensor into."""
    if isinstance(live, DTensor):
        local = torch.empty(live._local_tensor.shape, dtype=dtype, device="cpu")
        spec = live._spec
        if spec.tensor_meta is not None and spec.tensor_meta.dtype != dtype:
            spec = copy.copy(spec)
            spec.tensor_meta = spec.tensor_meta._replace(dtype=dtype)
        return DTensor(local, spec, requires_grad=False)
    return torch.empty(live.shape, dtype=dtype, device="cpu")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` (a shard, for a DTensor) share memory (a stride 0 over more than one)."""
    t = local_tensor(t)
    if t.layout != torch.strided or t.numel() <= 1:
        return False
    probe = getattr(torch, "_debug_has_internal_overlap", None)  # 0: no, 1: yes, 2: too hard to tell
    if probe is not None:
        return probe(t) == 1
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def plan_restore(state: Any, step_dir: Path, manifest: Manifest, md: Any, tree: Any, ctx: DistContext, *,
                 on_world_size_change: str, allow_cast: bool
                 ) -> tuple[dict[str, torch.Tensor], Any, dict[str, torch.Tensor], bool]:
    """Check ``state`` against the checkpoint and allocate the buffers to read into; writes nothing live.

    Returns:
        ``(live tensors, tree, {key: new buffer}, whether the state copies the buffers itself)``.

    Raises:
        StateMismatchError, ConfigError, CheckpointCorruptError: see :func:`load_into`.
    """
    same_world = manifest.world_size == ctx.world_size
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

    saved_tensor_keys = tensor_keys(tree)
    # a per-rank tensor of rank r > 0 is stored as __rank<r>__.<key>: the live tensor of <key> takes that name,
    # so checks, buffers and the read use the checkpoint's key (the tree that was read names it)
    own = {logical_key(k): k for k in saved_tensor_keys if is_per_rank_key(k)}
    if own:
        live_tensors = {own.get(k, k): t for k, t in live_tensors.items()}
    optional = getattr(state, "load_optional_key", None)
    is_optional = (lambda key: optional(logical_key(key))) if callable(optional) else (lambda key: False)
    saved_keys = saved_tensor_keys | _structure_keys(tree, deep=not hasattr(state, "state_dict"))
    live_keys = set(live_tensors) | _structure_keys(live_tree, deep=not hasattr(state, "state_dict"))
    missing = sorted(k for k in live_keys - saved_keys if not is_optional(k))
    unexpected = sorted(k for k in saved_keys - live_keys if not is_optional(k))
    if missing or unexpected:
        raise StateMismatchError(
            f"{step_dir}: state does not match the checkpoint. Missing from checkpoint: {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected in checkpoint: {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}. Build the same model/optimizer as the saved run.",
            missing=missing, unexpected=unexpected)
    saved_meta: dict[str, torch.Tensor] = {}
    for key in sorted(saved_tensor_keys):
        smd = md.state_dict_metadata.get(key)
        if smd is None or not hasattr(smd, "size") or not isinstance(getattr(smd.properties, "dtype", None),
                                                                     torch.dtype):
            raise CheckpointCorruptError(f"{step_dir}: tensor {key!r} is listed in the state but not in DCP metadata")
        saved_meta[key] = torch.empty(tuple(smd.size), dtype=smd.properties.dtype, device="meta")
    bad_shape, bad_dtype, casts = [], [], []
    for key, t in live_tensors.items():
        meta = saved_meta.get(key)
        if meta is None:
            continue
        if tuple(meta.shape) != tuple(t.shape):
            bad_shape.append(f"{key}: checkpoint {tuple(meta.shape)} vs live {tuple(t.shape)}")
        elif meta.dtype != t.dtype:
            (casts if allow_cast else bad_dtype).append(f"{key}: checkpoint {meta.dtype}, live {t.dtype}")
    if bad_shape:
        raise StateMismatchError(f"{step_dir}: tensor shapes differ: {bad_shape[:20]}", missing=[], unexpected=[])
    inference = sorted(k for k, t in live_tensors.items() if k in saved_meta and local_tensor(t).is_inference())
    if inference:  # they cannot be written in place: refuse before the first write
        raise StateMismatchError(
            f"{step_dir}: live tensors created under torch.inference_mode() cannot be restored in place: "
            f"{inference[:20]}{' ...' if len(inference) > 20 else ''}. Build the model/optimizer outside "
            "inference_mode (torch.no_grad() is fine), restore, then enter inference_mode.", missing=[], unexpected=[])
    if bad_dtype:
        raise StateMismatchError(
            f"{step_dir}: tensor dtypes differ (restore never casts silently): {bad_dtype[:20]}"
            f"{' ...' if len(bad_dtype) > 20 else ''}. Build the state with the saved dtypes, or pass "
            "allow_cast=True to cast them.", missing=[], unexpected=[])
    check = getattr(state, "check_load", None)
    staged_aware = callable(check)
    if staged_aware or not hasattr(state, "load_state_dict"):  # the restore itself writes the live tensors
        overlapping = sorted(k for k, t in live_tensors.items() if k in saved_meta and _overlaps_itself(t))
        if overlapping:  # copying into them fails half way through the write: refuse before the first write
            raise StateMismatchError(
                f"{step_dir}: live tensors whose elements share memory (e.g. expand() views) cannot receive "
                f"the saved values: {overlapping[:20]}{' ...' if len(overlapping) > 20 else ''}. Put a tensor "
                "with its own memory (e.g. .clone()) in the state.", missing=[], unexpected=[])
    if staged_aware:
        casts += check(join_state(tree, saved_meta), allow_cast=allow_cast)

    make_target = getattr(state, "load_target", None)
    targets: dict[str, torch.Tensor] = {}
    for key, meta in saved_meta.items():
        target = make_target(logical_key(key), tuple(meta.shape), meta.dtype) if callable(make_target) else None
        if target is None:
            if key not in live_tensors:  # an optional key the state cannot place: not loadable here
                raise StateMismatchError(f"{step_dir}: unexpected in checkpoint: [{key!r}]", unexpected=[key])
            target = staging_like(live_tensors[key], meta.dtype)
        targets[key] = target
    logged: set[str] = set()
    for line in casts:  # a key may be reported by the tensor check and by the state's own check: log it once
        key = line.split(":", 1)[0]
        if key not in logged:
            logged.add(key)
            log.warning("%s: casting %s (allow_cast=True)", step_dir, line)

    return live_tensors, tree, targets, staged_aware
