"""Loading a committed checkpoint into a live state, in place, without unpickling.

Steps (every rank): verify the files of the checkpoint against the manifest (sizes always, CRC-32
when ``verify``; the work is split over ranks), check the DCP metadata and that every tensor record
in the data files matches it (dtype, size, shape, byte range), read this rank's JSON tree (every
tensor it refers to must be in the metadata), check that the live
state and the checkpoint have the same tensor keys, shapes and dtypes (and let the state check its
own structure), let DCP read the tensors into new buffers (resharding to the live layout), and only
then write the live state. A restore that fails therefore leaves the live state as it was.

In a single process, the data files are not checksummed up front:
:func:`~torch_ckpt.direct_read.load_direct` reads each of them once, placing the tensors into the
new buffers and computing the CRC-32 in the same pass. Nor are the record headers read up front:
``load_direct`` compares each placed record's framing with ``torch.save``'s byte for byte, and
the records it does not place are checked before DCP's reader opens them (also before a
state-mismatch error is raised, so a bad record is reported as corruption). The new values are
written into the live tensors by :func:`torch_ckpt.host_memory.swap_in` (exchanged where a live
tensor is its storage's only user, copied otherwise).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torch_ckpt._logging import get_logger
from torch_ckpt.bounded import corrupt
from torch_ckpt.codec import TENSOR_TAG, join_state, split_state
from torch_ckpt.dcp_metadata import check_records, read_metadata, record_problems, tensor_items
from torch_ckpt.dcp_read import load_tensors
from torch_ckpt.direct_read import DATA_SUFFIX, load_direct
from torch_ckpt.dist import DistContext
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigError,
    StateMismatchError,
)
from torch_ckpt.format import read_rank_doc, verify_files
from torch_ckpt.host_memory import copy_tensors, owners_in, restore_buffers, swap_in
from torch_ckpt.layout import Manifest
from torch_ckpt.state_tree import tensor_keys

__all__ = ["load_into", "copy_into_live", "collector_paused", "RANK_LOCAL_POLICIES"]

log = get_logger(__name__)

RANK_LOCAL_POLICIES = ("error", "keep_live")
_Targets = dict[str, torch.Tensor]


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


def _assign(target: MutableMapping, loaded: Mapping) -> None:
    for k, v in loaded.items():
        if isinstance(v, Mapping) and isinstance(target.get(k), MutableMapping):
            _assign(target[k], v)
        elif isinstance(v, torch.Tensor) and isinstance(target.get(k), torch.Tensor):
            continue  # loaded in place by DCP
        else:
            target[k] = v


def _staging_like(live: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor (DTensor: local shard, same sharding) to load a checkpoint tensor into."""
    if isinstance(live, DTensor):
        local = torch.empty(live._local_tensor.shape, dtype=dtype, device="cpu")
        spec = live._spec
        if spec.tensor_meta is not None and spec.tensor_meta.dtype != dtype:
            spec = copy.copy(spec)
            spec.tensor_meta = spec.tensor_meta._replace(dtype=dtype)
        return DTensor(local, spec, requires_grad=False)
    return torch.empty(live.shape, dtype=dtype, device="cpu")


def _on_device_of(live: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``new`` on ``live``'s device (a new tensor there when the devices differ; ``new`` itself otherwise)."""
    return new if live is None or live.device == new.device else new.to(live.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _check_records(step_dir: Path, manifest: Manifest, md: Any, tensors: dict[str, Any]) -> None:
    """Raise for the first record of ``tensors`` that does not match the metadata (see :func:`check_records`)."""
    if not tensors:
        return
    problems = record_problems(step_dir, manifest, md, tensors=tensors)
    if problems:
        file, text = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); run torch-ckpt verify)" if len(problems) > 1 else ""
        raise corrupt(str(Path(step_dir) / file), f"{text}{more}")


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block, then restore its previous setting.

    A restore allocates hundreds of thousands of small objects (metadata entries, keys, tensor
    handles) and frees almost none of them, so the collector's allocation counter starts a full
    collection of the whole heap again and again: 4 of them, about half the time of restoring
    20,000 small tensors. Reference counting still frees everything acyclic at once; cycles
    created meanwhile are collected by the first collection after the block. The collector is
    enabled again on the way out, error or not, unless it was already disabled on the way in.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@torch.no_grad()
def copy_into_live(live: Mapping[str, torch.Tensor], staged: Mapping[str, torch.Tensor],
                   module: torch.nn.Module | None = None) -> None:
    """Give each live tensor the staged tensor of the same key, in place (shard-locally for DTensors).

    :func:`torch_ckpt.host_memory.swap_in` exchanges a plain live tensor's contents with its staged
    buffer's when the buffer is the restore's own (:func:`~torch_ckpt.host_memory.restore_buffers`)
    and nothing else refers to the live tensor or its storage (the live object is kept; the staged
    buffer must not be used afterwards); the others, and DTensor shards, are copied (threaded
    ``memmove`` for host tensors). With ``module``, ``live`` is that module's ``state_dict()``
    (entries share storage with the parameters and buffers): each entry's parameter or buffer
    itself is then the one exchanged, keeping its identity, ``requires_grad`` and ``.grad``;
    the entries then still hold the old values and must be dropped.
    """
    pairs = [(dst, staged[key]) for key, dst in live.items() if key in staged]
    owner, aliases = owners_in(module, live) if module is not None else ({}, {})
    copy_tensors([(_local(d), _local(s)) for d, s in pairs if isinstance(d, DTensor) or isinstance(s, DTensor)])
    swap_in([(owner.get(id(d), d), s) for d, s in pairs if not (isinstance(d, DTensor) or isinstance(s, DTensor))],
            aliases)


def _plan(state: Any, step_dir: Path, manifest: Manifest, md: Any, tree: Any, ctx: DistContext, *,
          on_world_size_change: str, allow_cast: bool) -> tuple[dict[str, torch.Tensor], Any, _Targets, bool]:
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

    optional = getattr(state, "load_optional_key", None)
    is_optional = optional if callable(optional) else (lambda key: False)
    saved_tensor_keys = tensor_keys(tree)
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
    inference = sorted(k for k, t in live_tensors.items() if k in saved_meta and _local(t).is_inference())
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
    if staged_aware:
        casts += check(join_state(tree, saved_meta), allow_cast=allow_cast)

    make_target = getattr(state, "load_target", None)
    targets: dict[str, torch.Tensor] = {}
    for key, meta in saved_meta.items():
        target = make_target(key, tuple(meta.shape), meta.dtype) if callable(make_target) else None
        if target is None:
            if key not in live_tensors:  # an optional key the state cannot place: not loadable here
                raise StateMismatchError(f"{step_dir}: unexpected in checkpoint: [{key!r}]", unexpected=[key])
            target = _staging_like(live_tensors[key], meta.dtype)
        targets[key] = target
    logged: set[str] = set()
    for line in casts:  # a key may be reported by the tensor check and by the state's own check: log it once
        key = line.split(":", 1)[0]
        if key not in logged:
            logged.add(key)
            log.warning("%s: casting %s (allow_cast=True)", step_dir, line)

    return live_tensors, tree, targets, staged_aware


def load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
              on_world_size_change: str = "error", allow_cast: bool = False) -> None:
    """Load ``step_dir`` into ``state`` (a ``Stateful`` or a mutable dict) in place.

    Everything is checked before the first write to the live state: files, keys, shapes, dtypes
    and (for states with ``check_load``, such as :class:`~torch_ckpt.TrainState`) the structure of
    every component. Tensors are then read into new buffers (host memory for tensors the state
    already has, about the size of this rank's state); only when every read succeeded are they
    copied into the live state. A failure at any point before that leaves the state as it was.

    A state may take part in the checks and in placing tensors it does not hold yet (optimizer
    state of a fresh optimizer) through three optional methods: ``load_optional_key(key) -> bool``
    (a tensor either side may lack), ``load_target(key, shape, dtype) -> Tensor | None`` (a buffer
    for a checkpoint tensor, placed where it will live) and ``check_load(saved, allow_cast=...)``
    (structural checks on the nested checkpoint state, whose tensors are meta tensors), and a
    fourth, ``load_session()``: a context manager held around the whole restore, from
    ``state_dict()`` to ``load_state_dict()``, within which the state may reuse work its hooks
    share (TrainState computes its parameter names once). A state
    with ``load_state_dict`` receives the new buffers (moved to its tensors' devices when those are
    not CPU) and copies them itself, so a ``load_state_dict`` that refuses them changes nothing it
    did not change itself; with DTensors and no ``check_load``, and for a plain dict, the buffers
    are copied into the live tensors (the dict's own entries are then replaced). Python's cyclic
    garbage collector is paused meanwhile (:func:`collector_paused`).

    Args:
        state: the live state.
        step_dir: the committed checkpoint directory.
        manifest: its manifest.
        ctx: ranks taking part.
        verify: check CRC-32 of every file (sizes are always checked).
        on_world_size_change: "error" or "keep_live" (rank-local state when the world size changed).
        allow_cast: load tensors whose dtype differs from the live tensor's by casting them (each
            such key is logged once); otherwise a dtype difference is a StateMismatchError.

    Raises:
        CheckpointCorruptError: files fail verification or the structure is inconsistent (a tensor
            record that disagrees with the metadata, a tree referring to a tensor it lacks).
        StateMismatchError: tensor keys, shapes or dtypes differ (lists missing and unexpected keys).
        ConfigError: the world size changed and ``on_world_size_change`` is "error".
    """
    if on_world_size_change not in RANK_LOCAL_POLICIES:
        raise ConfigError(f"on_world_size_change must be one of {RANK_LOCAL_POLICIES}, got {on_world_size_change!r}")
    session = getattr(state, "load_session", None)  # e.g. TrainState: work shared by its hooks, once per restore
    with collector_paused(), (session() if callable(session) else nullcontext()):
        _load_into(state, step_dir, manifest, ctx, verify=verify, on_world_size_change=on_world_size_change,
                   allow_cast=allow_cast)


def _load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
               on_world_size_change: str, allow_cast: bool) -> None:
    """The body of :func:`load_into` (same arguments and errors), run with the collector paused."""
    same_world = manifest.world_size == ctx.world_size
    direct = not ctx.enabled  # one process reads every file itself: checksum while placing the tensors
    err = None
    try:  # every rank's reads and checks are agreed on before any rank loads anything
        part, parts = (0, 1) if direct else (ctx.rank, ctx.world_size)
        if manifest.node is not None and same_world and not direct:  # one node's copy: checked by its ranks
            mates = [r for r, n in enumerate(manifest.nodes["rank_node"]) if n == manifest.node]
            part, parts = (mates.index(ctx.rank), len(mates)) if ctx.rank in mates else (0, 1)
        if direct:  # data files: sizes now, CRC-32 while load_direct reads them (one read per byte)
            verify_files(step_dir, manifest, checksums=False)
            small = {n: i for n, i in manifest.local_files().items() if not n.endswith(DATA_SUFFIX)}
            verify_files(step_dir, dataclasses.replace(manifest, files=small), checksums=verify)
        else:
            verify_files(step_dir, manifest, checksums=verify, part=part, parts=parts)
        md = read_metadata(step_dir, manifest)
        if not direct:  # direct: records are compared while load_direct reads them (no scattered header reads)
            check_records(step_dir, manifest, md, part=part, parts=parts)
        tree = read_rank_doc(step_dir, manifest, ctx.rank if same_world else 0,
                             tensor_keys=tensor_items(md).__contains__)["tree"]
    except CheckpointError as exc:
        err = exc
    errors = [e for e in ctx.all_gather(None if err is None else str(err), what="verify") if e]
    if err is not None:
        raise err
    if errors:
        raise CheckpointCorruptError(f"{step_dir}: verification failed on another rank: {errors[0]}")

    try:
        live_tensors, tree, targets, staged_aware = _plan(state, step_dir, manifest, md, tree, ctx,
                                                          on_world_size_change=on_world_size_change,
                                                          allow_cast=allow_cast)
    except CheckpointError:
        if direct:  # the records were not checked up front: a record that disagrees with the metadata
            _check_records(step_dir, manifest, md, tensor_items(md))  # explains a mismatch better
        raise

    rest = set(targets)
    if direct:
        if rest:
            rest = load_direct(targets, step_dir, md, manifest, verify=verify)
        # a placed tensor's record was compared byte for byte with torch.save's framing for its
        # declared dtype and shape; every other record is checked before DCP's reader opens it
        _check_records(step_dir, manifest, md, {k: v for k, v in tensor_items(md).items()
                                                if k in rest or k not in targets})
    if rest:
        load_tensors({k: targets[k] for k in rest}, step_dir, md, set(manifest.files),
                     process_group=ctx.fg if ctx.enabled else None, no_dist=not ctx.enabled)
    # every read succeeded: from here on the live state is written; the buffers are ours to swap
    with restore_buffers(targets.values()):
        _write_live(state, live_tensors, tree, targets, staged_aware)


def _write_live(state: Any, live_tensors: dict[str, torch.Tensor], tree: Any, targets: _Targets,
                staged_aware: bool) -> None:
    """Write the loaded ``targets`` into ``state`` (the last step of :func:`load_into`; every check passed)."""
    if staged_aware:
        live_tensors.clear()  # aliases of the live tensors (state_dict() entries): gone, so those can be exchanged
        state.load_state_dict(join_state(tree, targets))
        return
    if hasattr(state, "load_state_dict") and not any(isinstance(t, DTensor) for t in live_tensors.values()):
        # the state gets the new buffers (on its tensors' devices) and copies them itself, so a
        # load_state_dict that refuses them (e.g. other optimizer param groups) leaves it unchanged
        state.load_state_dict(join_state(tree, {k: _on_device_of(live_tensors.get(k), t) for k, t in targets.items()}))
        return
    copy_into_live(live_tensors, targets)
    full = join_state(tree, live_tensors)
    if hasattr(state, "load_state_dict"):
        state.load_state_dict(full)
    elif isinstance(state, MutableMapping):
        _assign(state, full)
    else:
        raise ConfigError(f"cannot restore into a {type(state).__name__}: pass a dict or an object with "
                          "state_dict()/load_state_dict()")
