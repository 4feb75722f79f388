"""Loading a committed checkpoint into a live state, in place, without unpickling.

Steps (every rank): verify the files of the checkpoint against the manifest (sizes always, CRC-32
when ``verify``; the work is split over ranks), check the DCP metadata and that every tensor record
in the data files matches it (dtype, size, shape, byte range), read this rank's JSON tree (every
tensor it refers to must be in the metadata), check that the live
state and the checkpoint have the same tensor keys, shapes and dtypes (and let the state check its
own structure), let DCP read the tensors into new buffers (resharding to the live layout), and only
then write the live state. A restore that fails therefore leaves the live state as it was.

In a single process, the data files are not checksummed up front:
:func:`~torch_ckpt.restore._direct_read.load_direct` reads each of them once, placing the tensors into the
new buffers and computing the CRC-32 in the same pass. Nor are the record headers read up front:
``load_direct`` compares each placed record's framing with ``torch.save``'s byte for byte, and
the records it does not place are checked before DCP's reader opens them (also before a
state-mismatch error is raised, so a bad record is reported as corruption). The new values are
written into the live tensors by :func:`torch_ckpt.restore._live_copy.swap_in` (exchanged where a live
tensor is its storage's only user, copied otherwise).

When the caller lends idle, resident host memory (the checkpointer lends its staging arena), the
single-process reader writes large live tensors in place instead, each backed up there first and
put back if anything fails (:mod:`torch_ckpt.restore._targets`): no new memory, and the same
outcome either way.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torch_ckpt import errors as errors_module
from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReadError,
    ConfigError,
    StateMismatchError,
)
from torch_ckpt.format._codec import join_state, logical_key
from torch_ckpt.format._dcp_metadata import check_records, read_metadata, record_problems, tensor_items
from torch_ckpt.format._dcp_read import load_tensors
from torch_ckpt.format._files import read_rank_doc, verify_files
from torch_ckpt.restore._direct_read import DATA_SUFFIX, load_direct
from torch_ckpt.restore._interrupts import InterruptHold
from torch_ckpt.restore._live_copy import copy_tensors, owners_in, restore_buffers, swap_in
from torch_ckpt.restore._plan import local_tensor, plan_restore, staging_like
from torch_ckpt.restore._targets import UndoLog, in_place_keys
from torch_ckpt.root._layout import Manifest
from torch_ckpt.storage._locations import corrupt

__all__ = ["load_into", "copy_into_live", "collector_paused", "RANK_LOCAL_POLICIES"]

log = get_logger(__name__)

RANK_LOCAL_POLICIES = ("error", "keep_live")
_Targets = dict[str, torch.Tensor]


def _assign(target: MutableMapping, loaded: Mapping) -> None:
    for k, v in loaded.items():
        if isinstance(v, Mapping) and isinstance(target.get(k), MutableMapping):
            _assign(target[k], v)
        elif isinstance(v, torch.Tensor) and isinstance(target.get(k), torch.Tensor):
            continue  # loaded in place by DCP
        else:
            target[k] = v


def _on_device_of(live: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``new`` on ``live``'s device (a new tensor there when the devices differ; ``new`` itself otherwise)."""
    return new if live is None or live.device == new.device else new.to(live.device)


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

    :func:`torch_ckpt.restore._live_copy.swap_in` exchanges a plain live tensor's contents with its staged
    buffer's when the buffer is the restore's own (:func:`~torch_ckpt.restore._live_copy.restore_buffers`)
    and nothing else refers to the live tensor or its storage (the live object is kept; the staged
    buffer must not be used afterwards); the others, and DTensor shards, are copied (threaded
    ``memmove`` for host tensors). With ``module``, ``live`` is that module's ``state_dict()``
    (entries share storage with the parameters and buffers): each entry's parameter or buffer
    itself is then the one exchanged, keeping its identity, ``requires_grad`` and ``.grad``;
    the entries then still hold the old values and must be dropped.
    """
    pairs = [(dst, staged[key]) for key, dst in live.items() if key in staged]
    owner, aliases = owners_in(module, live) if module is not None else ({}, {})
    copy_tensors([(local_tensor(d), local_tensor(s)) for d, s in pairs
                  if isinstance(d, DTensor) or isinstance(s, DTensor)])
    swap_in([(owner.get(id(d), d), s) for d, s in pairs if not (isinstance(d, DTensor) or isinstance(s, DTensor))],
            aliases)


def load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
              on_world_size_change: str = "error", allow_cast: bool = False,
              scratch: torch.Tensor | None = None) -> None:
    """Load ``step_dir`` into ``state`` (a ``Stateful`` or a mutable dict) in place.

    Everything is checked before the first write to the live state: files, keys, shapes, dtypes
    and (for states with ``check_load``, such as :class:`~torch_ckpt.TrainState`) the structure of
    every component. Tensors are then read into new buffers (host memory for tensors the state
    already has, about the size of this rank's state); only when every read succeeded are they
    copied into the live state. A failure at any point before that leaves the state as it was.
    With ``scratch``, a single process reads large live tensors in place instead, after copying
    their bytes into ``scratch``, and copies them back on any failure (the same outcome, without
    new memory).

    A state may take part in the checks and in placing tensors it does not hold yet (optimizer
    state of a fresh optimizer) through three optional methods: ``load_optional_key(key) -> bool``
    (a tensor either side may lack), ``load_target(key, shape, dtype) -> Tensor | None`` (a buffer
    for a checkpoint tensor, placed where it will live) and ``check_load(saved, allow_cast=...)``
    (structural checks on the nested checkpoint state, whose tensors are meta tensors), and a
    fourth, ``load_session()``: a context manager held around the whole restore, from
    ``state_dict()`` to ``load_state_dict()``, within which the state may reuse work its hooks
    share (TrainState computes its parameter names once); and a fifth, ``load_in_place(key) -> bool``:
    True when writing the checkpoint's value straight into the tensor ``state_dict()`` returned for
    ``key`` is exactly what its ``load_state_dict`` would end up doing (such keys may be read in
    place when ``scratch`` is given; plain dicts count as True for every key). That promise is the
    state's: for such a key the live tensor already holds the checkpoint's values when
    ``load_state_dict`` runs, and it is handed that very tensor as the loaded value, so a key whose
    value ``load_state_dict`` ignores, converts or stores elsewhere keeps the loaded bytes in the
    tensor anyway (nothing can detect it; only a failed restore puts the old bytes back). A state
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
        scratch: resident host memory (a flat ``torch.uint8`` CPU tensor) nobody else uses during
            the call, e.g. the idle staging arena. In a single process, live tensors that fit are
            then read in place after their bytes are copied there
            (:mod:`torch_ckpt.restore._targets`), and copied back if the restore fails: no new
            memory, no page faults, the same outcome.

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
                   allow_cast=allow_cast, scratch=scratch)


def _load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
               on_world_size_change: str, allow_cast: bool, scratch: torch.Tensor | None) -> None:
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
    except OSError as exc:  # e.g. EIO or EACCES on this rank: typed, and shared so no rank waits for the timeout
        where = exc.filename or step_dir
        err = CheckpointReadError(exc.errno, f"reading checkpoint {step_dir} failed on rank {ctx.rank}: "
                                             f"{exc.strerror or exc} ({where})")
        err.__cause__ = exc
    votes = [e for e in ctx.all_gather(None if err is None else (type(err).__name__, str(err)), what="verify") if e]
    unreadable = [msg for kind, msg in votes if kind == CheckpointReadError.__name__]
    if unreadable and not isinstance(err, CheckpointReadError):  # every rank raises the same class (no fallback)
        raise CheckpointReadError(errno.EIO, f"{step_dir}: reading failed on another rank: {unreadable[0]}")
    if err is not None:
        raise err
    if votes:
        raise CheckpointCorruptError(f"{step_dir}: verification failed on another rank: {votes[0][1]}")

    try:
        live_tensors, tree, targets, staged_aware = plan_restore(
            state, step_dir, manifest, md, tree, ctx, on_world_size_change=on_world_size_change, allow_cast=allow_cast)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below, before any rank reads
        if direct and isinstance(exc, CheckpointError):  # the records were not checked up front: a record that
            _check_records(step_dir, manifest, md, tensor_items(md))  # disagrees with the metadata explains it better
        _agree_on_plan(ctx, step_dir, exc)
        raise
    _agree_on_plan(ctx, step_dir, None)

    undo = None
    if direct and scratch is not None:  # live tensors read in place, backed up in the scratch memory first
        allowed = _in_place_policy(state)
        keys = in_place_keys(live_tensors, {k: (t.dtype, tuple(t.shape)) for k, t in targets.items()
                                            if k in live_tensors and allowed(k)}, scratch.numel())
        if keys:
            undo = UndoLog(scratch, {k: live_tensors[k] for k in keys})
            targets.update(undo.tensors)
    hold = InterruptHold()  # a Ctrl-C while the live state is written is raised once it is written
    try:
        try:
            _read_and_write(state, step_dir, manifest, md, ctx, live_tensors, tree, targets, staged_aware,
                            direct=direct, verify=verify, undo=undo, hold=hold)
        except BaseException:
            if undo is not None:
                undo.put_back()  # the live tensors read in place hold their old bytes again
            raise
        if undo is not None:
            undo.bump_versions()
        if direct:
            _log_memory_used(undo, scratch, len(targets))
    finally:  # also when a second Ctrl-C (raised at once while one is held) lands in put_back or bump_versions
        hold.release()


def _agree_on_plan(ctx: DistContext, step_dir: Path, error: BaseException | None) -> None:
    """Every rank learns whether every rank's live state fits the checkpoint, before any rank starts reading.

    Without it a rank whose state does not fit raises while the others enter DCP's collective
    read, which then fails there (or waits for the timeout). A rank raises its own error; the
    others raise the failing rank's error class (a ``StateMismatchError`` stays one, never a
    ``CheckpointCorruptError`` for a healthy checkpoint), naming the rank.
    """
    if not ctx.enabled:
        return
    mine = None if error is None else (type(error).__name__, str(error))
    votes = ctx.all_gather(mine, what="restore plan agreement")
    if error is not None:
        return
    failed = [(rank, vote) for rank, vote in enumerate(votes) if vote is not None]
    if not failed:
        return
    rank, (kind, text) = failed[0]
    others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    message = f"{step_dir}: not restored: rank {rank}{others} cannot load this checkpoint: {kind}: {text}"
    if kind == "StateMismatchError":
        raise StateMismatchError(message)
    cls = getattr(errors_module, kind, None) if kind in errors_module.__all__ else None
    raise (cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else CheckpointError)(message)


def _log_memory_used(undo: UndoLog | None, scratch: torch.Tensor | None, count: int) -> None:
    """Say (INFO) how many of a single-process restore's ``count`` tensors were read in place, and why none were."""
    if undo is not None and undo.tensors:
        mib = sum(t.numel() * t.element_size() for t in undo.tensors.values()) / 2**20
        log.info("restore: %d live tensors (%.1f MiB) read in place, backed up in the staging arena; %d into "
                 "new buffers", len(undo.tensors), mib, count - len(undo.tensors))
    elif scratch is None:
        log.info("restore: %d tensors read into new buffers (no staging arena to read in place with: this "
                 "manager has not saved in this process, or its saves exceeded staging_budget_bytes)", count)
    else:
        log.info("restore: %d tensors read into new buffers (none of the live tensors can be read in place: "
                 "CPU, at least 256 KiB, alone in its memory, fitting in the staging arena, marked by the state's "
                 "load_in_place)", count)


def _in_place_policy(state: Any) -> Callable[[str], bool]:
    """Which keys' live tensors may be read into directly: where that is exactly what the load would do.

    A state says so with ``load_in_place(key) -> bool`` (:class:`~torch_ckpt.TrainState`: parameters,
    buffers and optimizer state); a plain dict's tensors are all written in place anyway; any other
    state decides in its own ``load_state_dict`` what happens to each value, so none of its keys.
    """
    ask = getattr(state, "load_in_place", None)
    if callable(ask):
        return lambda key: ask(logical_key(key))  # the state's own key, also for a per-rank __rank<r>__. key
    if not hasattr(state, "load_state_dict") and isinstance(state, MutableMapping):
        return lambda key: True
    return lambda key: False


def _read_and_write(state: Any, step_dir: Path, manifest: Manifest, md: Any, ctx: DistContext,
                    live_tensors: dict[str, torch.Tensor], tree: Any, targets: _Targets, staged_aware: bool, *,
                    direct: bool, verify: bool, undo: UndoLog | None, hold: InterruptHold) -> None:
    """Read every target (checking records and checksums), then write the live state (:func:`_load_into`).

    ``hold`` is started before the first write to the live state: from there on a Ctrl-C is
    raised only after the whole state is written (by the caller), never half way.
    """
    rest = set(targets)
    if direct:
        if rest:
            rest = load_direct(targets, step_dir, md, manifest, verify=verify, undo=undo)
        back = [k for k in rest if undo is not None and k in undo]
        if back:  # live tensors this reader did not place: their old bytes back, DCP reads into new buffers
            undo.put_back(back)
            undo.forget(back)
            targets.update({k: staging_like(live_tensors[k], targets[k].dtype) for k in back})
        # a placed tensor's record was compared byte for byte with torch.save's framing for its
        # declared dtype and shape; every other record is checked before DCP's reader opens it
        _check_records(step_dir, manifest, md, {k: v for k, v in tensor_items(md).items()
                                                if k in rest or k not in targets})
    if rest:
        load_tensors({k: targets[k] for k in rest}, step_dir, md, set(manifest.files),
                     process_group=ctx.fg if ctx.enabled else None, no_dist=not ctx.enabled)
    # every read succeeded: from here on the live state is written; the new buffers are ours to swap
    hold.start()
    with restore_buffers(t for k, t in targets.items() if undo is None or k not in undo):
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
