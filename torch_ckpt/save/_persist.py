"""Persisting one staged checkpoint: DCP shard writes, per-rank JSON, manifest, atomic commit.

:func:`persist_checkpoint` runs on every rank (in the background writer thread, or inline for
synchronous saves). It only uses the background gloo group of :class:`~torch_ckpt.distributed._context.DistContext`,
and every rank takes part in every collective even when its own part failed, so one failing rank
makes the save fail on all ranks instead of hanging them.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointError, CheckpointWriteError
from torch_ckpt.format._dcp_write import ChecksumFileSystemWriter, FlatKeysSavePlanner, group_by_first_segment
from torch_ckpt.format._files import LINKED_FROM, unwrap_dcp_error
from torch_ckpt.policy._lineage import BASE
from torch_ckpt.root._layout import (
    MANIFEST_NAME,
    PARTIAL_PREFIX,
    Manifest,
    SharedRoot,
    commit_dir,
    is_reservation,
    new_incarnation,
    partial_path,
    rank_file_name,
    remove_failed_temporaries,
    unreserve,
    write_json_durable,
)
from torch_ckpt.root._nodes import NodeLayout

__all__ = ["SaveRequest", "ArenaLayout", "SharedPart", "arena_views", "persist_checkpoint", "commit_checkpoint",
           "write_shards", "check_extra_name", "as_write_error", "check_on_disk", "check_owner", "describe_error"]

log = get_logger(__name__)


@dataclass(frozen=True)
class SaveRequest:
    """One save, as the manager asks for it (``final`` to ``after_commit``), completed by the engine with what it
    staged (``dataclasses.replace``); the writer process gets it without ``tensors`` and ``after_commit``.

    Attributes:
        final: the checkpoint directory (missing or an empty reservation). step: for the manifest.
        replace: ``final`` may hold a committed checkpoint, replaced atomically at commit.
        extra_dir: rank 0's framework files, moved in before the manifest (:func:`move_extra_entries`).
        lineage: the :class:`~torch_ckpt.policy._lineage.Lineage` recorded (None: the base segment).
        after_commit: called on every rank in the writer with the committed directory, before
            ``committed`` resolves; it may return a callable run right after (deletions).
        tensors, tree, tensor_bytes: the staged tensors, the JSON tree of the rest, the tensor bytes.
        thread_count: DCP writer threads per rank. timings: seconds recorded in the manifest.
        incarnation: names the partial ``.torch-ckpt.partial.<id>`` (rank 0's; None: a fresh id).
        owner_alive: asked before the write, the agreement and the commit; False fails the save.
        failed: this rank's staging failed with this message: it joins every collective, writes nothing.
        nodes: the root layout (None: the engine's, a shared root by default). failed_names: earlier failed saves whose
            temporaries go first. reserved: the engine created ``final`` empty; a failed save removes it.
        incremental: tensors unchanged since this root's last committed save are hard-linked, not written
            (:mod:`torch_ckpt.format._dcp_write`).
        spare_dir: a directory of recycled files (the memory tier's): data files are written into them in place,
            so tmpfs pages are reused rather than freed and allocated again
            (:func:`torch_ckpt.format._dcp_write.ChecksumFileSystemWriter`).
        changed_keys: the keys whose live tensors were written in place since the engine's previous capture
            (same data pointer, another version counter); with ``incremental`` they are always written, every
            other tensor is compared with the last save.
    """

    final: Path
    step: int = 0
    replace: bool = False
    extra_dir: Path | None = None
    lineage: Any = None
    after_commit: Callable[[Path], Callable[[], None] | None] | None = field(default=None, compare=False)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)
    tree: Any = None
    tensor_bytes: int = 0
    thread_count: int = 1
    timings: dict[str, float] | None = None
    incarnation: str | None = None
    owner_alive: Callable[[], bool] | None = field(default=None, compare=False)
    failed: str | None = None
    nodes: SharedRoot | NodeLayout | None = None
    failed_names: tuple[str, ...] = ()
    reserved: bool = False
    incremental: bool = False
    changed_keys: frozenset[str] = frozenset()
    spare_dir: Path | None = None


#: ``((key, shape, dtype, offset_bytes), ...)``: where each tensor lives in the staging arena.
ArenaLayout = tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]


def arena_views(arena: torch.Tensor, layout: ArenaLayout) -> dict[str, torch.Tensor]:
    """``{key: tensor aliasing its slice of the arena}``, each with a storage of exactly its own size
    (``torch.frombuffer``): DCP copies views of larger storages, so plain tensors are written without a copy."""
    base = arena.numpy()
    out = {}
    for key, shape, dtype, offset in layout:
        n = nbytes_of(shape, dtype)
        if n == 0:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(memoryview(base[offset:offset + n]), dtype=torch.uint8)  # type: ignore[arg-type]
        out[key] = flat.view(dtype).view(shape)
    return out


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def as_write_error(exc: BaseException, where: Path) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError) and exc.errno is not None:
        hint = {28: "the disk is full; free space or lower keep_last", 13: "permission denied; fix permissions",
                30: "the file system is read-only; choose a writable directory",
                27: "a file exceeds the file-size limit (ulimit -f) or the file system's maximum; raise the limit"
                }.get(exc.errno, "check the location")
        name = f" ({Path(exc.filename).name})" if exc.filename else ""
        return CheckpointWriteError(exc.errno, f"writing checkpoint into {where} failed{name}: {exc.strerror} ({hint})")
    return CheckpointWriteError(f"writing checkpoint into {where} failed: {describe_error(exc)}")


def check_on_disk(directory: Path, files: dict[str, dict[str, int]]) -> None:
    """Raise CheckpointWriteError (EIO) when a written file is missing or its size on disk is not what was written."""
    for name, info in files.items():
        path = directory / name
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointWriteError(errno.EIO, f"{path} vanished after it was written; not committing") from None
        if size != info["bytes"]:
            raise CheckpointWriteError(errno.EIO, f"{path} has {size} bytes on disk but {info['bytes']} were "
                                                  "written; not committing")


def check_owner(req: SaveRequest, final: Path) -> None:
    """Raise when the process that requested this save is gone (see ``SaveRequest.owner_alive``)."""
    if req.owner_alive is not None and not req.owner_alive():
        raise CheckpointWriteError(f"the training process that requested step {req.step} is gone; its checkpoint "
                                   f"writer does not commit {final} (the run's next start cleans up)")


_RESERVED = re.compile(r"^(manifest\.json(\.tmp)?|\.metadata|.*\.distcp|rank_\d+\.json)$")


def check_extra_name(entry: Path) -> None:
    """Raise CheckpointWriteError for an ``extra_dir`` entry named like a checkpoint file (``manifest.json``,
    ``.metadata``, ``*.distcp``, ``rank_N.json``) or the root lock (``.lock*``)."""
    if _RESERVED.match(entry.name) or entry.name.startswith(".lock"):
        raise CheckpointWriteError(f"{entry}: the name {entry.name!r} is reserved for checkpoint files; "
                                   "write framework files under other names")


def move_extra_entries(extra_dir: Path, tmp: Path) -> None:
    """Move every entry of ``extra_dir`` (a framework hook's files, unlisted in the manifest) into ``tmp``, then
    remove ``extra_dir``; raises CheckpointWriteError for a reserved name or an entry that cannot be moved."""
    if not extra_dir.is_dir():
        return
    entries = sorted(extra_dir.iterdir())
    for entry in entries:  # every name is checked before anything is moved
        check_extra_name(entry)
    for entry in entries:
        try:
            shutil.move(str(entry), str(tmp / entry.name))
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot move {entry} into {tmp}: {exc.strerror or exc}") from exc
    shutil.rmtree(extra_dir, ignore_errors=True)


def write_shards(req: SaveRequest, ctx: DistContext, part: SharedPart, final: Path, tmp: Path
                 ) -> tuple[Any, BaseException | None, list, list[str], float]:
    """Every rank: write its shards (DCP; a rank whose staging failed joins with nothing) and per-rank JSON into
    ``tmp``, check them and the owner, and all-gather ``(error message or None, {file: {"bytes", "crc32"}})``.

    Returns:
        ``(writer or None, this rank's error or None, gathered, failure lines "rank R: message", seconds)``.
    """
    t0 = time.monotonic()
    files: dict[str, dict[str, int]] = {}
    writer = None
    error: BaseException | None = None
    try:
        writer = part.writer(tmp, req)
        # grouped: DCP's per-top-level-key work (0.34 s for 20,000 flat keys) is done a few times only
        dcp.save(group_by_first_segment(req.tensors) if req.failed is None else {}, storage_writer=writer,
                 planner=part.planner(), process_group=ctx.bg if ctx.enabled else None, no_dist=not ctx.enabled)
        if req.failed is not None:
            raise CheckpointWriteError(f"staging step {req.step} failed on rank {ctx.rank}: {req.failed}")
        rank_doc = {"step": req.step, "rank": ctx.rank, "world_size": ctx.world_size, "tree": req.tree}
        if writer.record_digests:
            rank_doc["records"] = writer.record_digests
        size, crc = write_json_durable(tmp / rank_file_name(ctx.rank), rank_doc)
        linked = writer.linked_files
        files = {name: {"bytes": b, "crc32": c} for name, (b, c) in writer.written_files.items()}
        for name, step in linked.items():
            files[name][LINKED_FROM] = step
        files[rank_file_name(ctx.rank)] = {"bytes": size, "crc32": crc}
        check_on_disk(tmp, files)
        check_owner(req, final)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # DCP reports a failed write as an opaque CheckpointException; prefer the error behind it
        error = writer.error if writer is not None and writer.error is not None else unwrap_dcp_error(exc)
    gathered = ctx.all_gather((None if error is None else describe_error(error), files), background=True,
                              what="shard write agreement")
    failures = [f"rank {r}: {msg}" for r, (msg, _) in enumerate(gathered) if msg]
    return writer, error, gathered, failures, time.monotonic() - t0


def prepare_partial(req: SaveRequest, final: Path, tmp: Path) -> bool:
    """A leader: check ``final`` may be written, reserve it if needed, remove stale partials and this
    checkpointer's failed temporaries (``req.failed_names``), and create ``tmp``.

    Returns:
        True when ``final`` is reserved for this save (by the engine, or created here).

    Raises:
        CheckpointWriteError: ``final`` holds a committed checkpoint (without ``req.replace``) or is no directory.
        OSError: a directory cannot be created.
    """
    if os.path.lexists(final) and (final.is_symlink() or not final.is_dir()):
        raise CheckpointWriteError(f"{final} exists and is not a directory; refusing to overwrite it")
    if final.exists() and not req.replace and not is_reservation(final):
        raise CheckpointWriteError(f"{final} already exists; refusing to overwrite a checkpoint")
    reserved = req.reserved
    if not final.exists():
        final.mkdir(parents=True)
        reserved = True
    for stale in final.iterdir():  # another incarnation's partial (its save died), or this one's earlier attempt
        if stale.name.startswith(PARTIAL_PREFIX):
            shutil.rmtree(stale, ignore_errors=stale != tmp)  # never committed; ours must go
    remove_failed_temporaries(final.parent, tmp, req.failed_names)
    tmp.mkdir()
    return reserved


class SharedPart:
    """The shared root's part of :func:`commit_checkpoint` (one directory every rank sees): rank 0 prepares the
    partial, writes the manifest of every rank's files and commits. Other layouts' parts derive from it."""

    def __init__(self, ctx: DistContext) -> None:
        self.leader = ctx.is_coordinator  # this rank prepares, finishes and commits a partial in its root

    def writer(self, tmp: Path, req: SaveRequest) -> ChecksumFileSystemWriter:
        return ChecksumFileSystemWriter(tmp, thread_count=req.thread_count, sync_files=True,
                                        incremental=(req.final, req.step) if req.incremental else None,
                                        changed_keys=req.changed_keys, spare=req.spare_dir)

    def planner(self) -> Any:
        return FlatKeysSavePlanner()  # the grouped state writes the same metadata as a flat one

    def plan(self, req: SaveRequest, ctx: DistContext, writer: Any, gathered: list,
             timings: dict[str, float]) -> tuple[Manifest, Any]:
        """Rank 0: the manifest of every gathered file, and what :meth:`finish` needs besides."""
        files: dict[str, dict[str, int]] = {}
        for _, f in gathered:
            files.update(f)
        return Manifest(step=req.step, world_size=ctx.world_size, files=dict(sorted(files.items())),
                        tensor_bytes=req.tensor_bytes, timings=timings, lineage=req.lineage or BASE), None

    def finish(self, tmp: Path, manifest: Manifest, extra: Any) -> Manifest:
        """A leader: write its root's own files into ``tmp``; return the manifest it writes there."""
        return manifest


def _failures(ctx: DistContext, mine: BaseException | None, what: str) -> list[str]:
    """All-gather this rank's error; return every rank's, as ``rank N: message``."""
    gathered = ctx.all_gather(None if mine is None else describe_error(mine), background=True, what=what)
    return [f"rank {r}: {msg}" for r, msg in enumerate(gathered) if msg]


def persist_checkpoint(req: SaveRequest, ctx: DistContext) -> tuple[Path, int]:
    """Write, verify agreement and commit one checkpoint (collective): the root layout's own protocol when it has
    one (``req.nodes.persist``: node-local roots, :mod:`torch_ckpt.save._persist_nodes`), else
    :func:`commit_checkpoint` of the shared root. Returns the committed directory and the bytes of its files."""
    if req.nodes is not None and req.nodes.persist is not None:
        return req.nodes.persist(req, ctx)
    return commit_checkpoint(req, ctx, SharedPart(ctx))


def commit_checkpoint(req: SaveRequest, ctx: DistContext, part: SharedPart) -> tuple[Path, int]:
    """The one commit sequence; every rank takes part in every step even after a failure:

    1. rank 0 names the partial ``NAME/.torch-ckpt.partial.<its incarnation>``; each leader (``part.leader``)
       creates it inside the reserved ``final`` of its root (:func:`prepare_partial`);
    2. every rank writes its shards and per-rank JSON into it and checks them (:func:`write_shards`);
    3. rank 0 plans the manifest (``part.plan``); each leader writes its root's files (``part.finish``),
       rank 0's framework files and the manifest, and looks at the owner once more; the ranks agree;
    4. only then each leader renames its partial to ``final`` (:func:`~torch_ckpt.root._layout.commit_dir`).

    A failed save removes the partial, and ``final`` when this save reserved it.

    Raises:
        CheckpointWriteError: this or another rank failed, or the requesting process is gone; nothing was
            committed. A failed rename after the agreement raises on every rank, naming it.
    """
    final = Path(req.final)
    tmp = final / ctx.broadcast(partial_path(final, req.incarnation or new_incarnation()).name, background=True,
                                what="prepare name")
    error: BaseException | None = None
    reserved = req.reserved
    if part.leader:
        try:
            check_owner(req, final)
            reserved = prepare_partial(req, final, tmp)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank in _write_and_commit
            error = exc
            unreserve(final, tmp, reserved)
    try:
        return _write_and_commit(req, ctx, part, final, tmp, error, reserved)
    except BaseException:
        if part.leader:  # e.g. a collective timed out: no partial directory (nor a reservation) is left
            unreserve(final, tmp, reserved)
        raise


def _write_and_commit(req: SaveRequest, ctx: DistContext, part: SharedPart, final: Path, tmp: Path,
                      error: BaseException | None, reserved: bool) -> tuple[Path, int]:
    failures = _failures(ctx, error, "prepare")
    if failures:
        if error is not None:
            raise as_write_error(error, tmp)
        raise CheckpointWriteError(f"checkpoint step {req.step} could not be prepared: {'; '.join(failures)}")
    writer, error, gathered, failures, write_s = write_shards(req, ctx, part, final, tmp)
    ready_error: BaseException | None = None
    plan: tuple[Manifest, Any] | None = None
    if not failures:
        if ctx.is_coordinator:
            try:
                plan = part.plan(req, ctx, writer, gathered, {**(req.timings or {}), "write_s": write_s})
            except BaseException as exc:  # noqa: BLE001 - reported to every rank by the agreement below
                ready_error = exc
        plan = ctx.broadcast(plan, background=True, what="manifest")
        if part.leader and plan is not None:
            try:
                manifest = part.finish(tmp, *plan)
                if ctx.is_coordinator and req.extra_dir is not None:  # rank 0's framework files
                    move_extra_entries(Path(req.extra_dir), tmp)
                write_json_durable(tmp / MANIFEST_NAME, manifest.to_json())
                check_owner(req, final)  # last look before the rename: never commit for a dead trainer
            except BaseException as exc:  # noqa: BLE001
                ready_error = exc
        failures = _failures(ctx, ready_error, "commit agreement")
    if failures or plan is None:
        if part.leader:
            unreserve(final, tmp, reserved)
        own = error or ready_error
        if own is not None:
            raise as_write_error(own, tmp)
        raise CheckpointWriteError(f"checkpoint step {req.step} was not committed: {'; '.join(failures)}")
    rename_error: BaseException | None = None
    if part.leader:
        try:
            commit_dir(tmp, final, replace=req.replace)
        except BaseException as exc:  # noqa: BLE001
            rename_error = exc
            unreserve(final, tmp, reserved)
    try:
        renamed = _failures(ctx, rename_error, "commit")
    except CheckpointError as exc:
        if not part.leader or rename_error is not None:
            raise
        # the rename is done: this root's copy is committed whatever happened to the others since (a rank killed)
        log.warning("step %d is committed at %s, but hearing from the other ranks failed: %s", req.step, final, exc)
        renamed = []
    if rename_error is not None:
        raise as_write_error(rename_error, tmp)
    if renamed:
        raise CheckpointWriteError(f"checkpoint step {req.step} was agreed by every rank but not committed in every "
                                   f"root ({'; '.join(renamed)}); a root whose rename succeeded holds its copy")
    return final, sum(info["bytes"] for info in plan[0].files.values())
