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
from torch_ckpt.format._files import unwrap_dcp_error
from torch_ckpt.policy._lineage import BASE
from torch_ckpt.root._layout import (
    PARTIAL_PREFIX,
    Manifest,
    commit_dir,
    is_reservation,
    new_incarnation,
    partial_path,
    rank_file_name,
    remove_failed_temporaries,
    unreserve,
    write_json_durable,
)

__all__ = ["SaveRequest", "ArenaLayout", "arena_views", "persist_checkpoint", "prepare_partial", "write_shards",
           "move_extra_entries", "check_extra_name", "as_write_error", "check_on_disk", "check_owner", "describe_error"]

log = get_logger(__name__)


@dataclass(frozen=True)
class SaveRequest:
    """One save, as the manager asks for it and as the thread or process writer carries it out.

    The caller fills ``final`` to ``after_commit``; :class:`~torch_ckpt.save._checkpointer.AsyncCheckpointer`
    adds what it staged (``dataclasses.replace``); the writer process gets it without ``tensors`` and
    ``after_commit`` and maps the arena itself.

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
        failed: this rank's staging failed: it joins every collective, writes nothing, and the save
            fails on every rank with this message.
        nodes: a :class:`~torch_ckpt.root._nodes.NodeLayout`: every node commits its own copy.
        failed_names: earlier failed saves whose temporaries go first (``remove_failed_temporaries``).
        reserved: the engine created ``final`` empty; a failed save removes it.
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
    nodes: Any = None
    failed_names: tuple[str, ...] = ()
    reserved: bool = False


#: ``((key, shape, dtype, offset_bytes), ...)``: where each tensor lives in the staging arena.
ArenaLayout = tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]


def arena_views(arena: torch.Tensor, layout: ArenaLayout) -> dict[str, torch.Tensor]:
    """Return ``{key: tensor aliasing its slice of the arena}`` (used by the writer process too).

    Each tensor gets a storage of exactly its own size that aliases the arena's memory (built with
    ``torch.frombuffer``), so writers that copy "views of larger storages" (DCP does, to avoid
    serialising the whole storage) see plain tensors and write them without an extra copy.
    """
    base = arena.numpy()
    out = {}
    for key, shape, dtype, offset in layout:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if n == 0:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(memoryview(base[offset:offset + n]), dtype=torch.uint8)  # type: ignore[arg-type]
        out[key] = flat.view(dtype).view(shape)
    return out


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
    """Compare every written file's size on disk with the bytes written (before anything is committed).

    Raises:
        CheckpointWriteError: a file is missing or has another size (errno EIO).
    """
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
    """Refuse an ``extra_dir`` entry whose name a checkpoint file (or the root lock) uses.

    Raises:
        CheckpointWriteError: ``manifest.json``, ``.metadata``, ``*.distcp``, ``rank_N.json``, ``.lock*``.
    """
    if _RESERVED.match(entry.name) or entry.name.startswith(".lock"):
        raise CheckpointWriteError(f"{entry}: the name {entry.name!r} is reserved for checkpoint files; "
                                   "write framework files under other names")


def move_extra_entries(extra_dir: Path, tmp: Path) -> None:
    """Move every entry of ``extra_dir`` (files and folders a framework hook wrote) into ``tmp``.

    They become part of the checkpoint directory and are committed atomically with it; they are
    not listed in the manifest (verify reports them as unlisted; restore never reads them). A
    missing ``extra_dir`` moves nothing; the emptied ``extra_dir`` is removed.

    Raises:
        CheckpointWriteError: an entry's name collides with a checkpoint file name (``manifest.json``,
            ``.metadata``, ``*.distcp``, ``rank_N.json``) or cannot be moved.
    """
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


def write_shards(req: SaveRequest, ctx: DistContext, final: Path, tmp: Path, make_writer: Callable[[], Any],
                 planner: Any, *, exclude: tuple[str, ...] = ()) -> tuple[Any, BaseException | None, list, list[str],
                                                                          float]:
    """Every rank: write its shards (DCP) and per-rank state into ``tmp``, check them, and agree.

    A rank whose staging failed (``req.failed``) still joins DCP's collectives with nothing to
    write. Each rank checks its files on disk and that its trainer is alive; then one all-gather
    tells every rank every other rank's files and errors.

    Args:
        req: the request (tensors, tree, step).
        ctx: the distributed context (its background group carries the collectives).
        final: the final directory (for the owner check).
        tmp: the temporary directory every rank writes into.
        make_writer: builds this rank's DCP storage writer (called inside the error handling).
        planner: the DCP save planner (a :class:`~torch_ckpt.format._dcp_write.FlatKeysSavePlanner`, so the
            grouped state writes the same metadata as a flat one).
        exclude: file names this rank wrote that are not listed as written (rewritten later).

    Returns:
        ``(writer, error, gathered, failures, write_s)``: the writer (None if it could not be
        built), this rank's error (None on success), every rank's all-gathered ``(error message or
        None, {file: {"bytes", "crc32"}})``, the failure lines ("rank R: message"), and the seconds
        the write took.
    """
    t0 = time.monotonic()
    files: dict[str, dict[str, int]] = {}
    writer = None
    error: BaseException | None = None
    try:
        writer = make_writer()
        # grouped: DCP's per-top-level-key work (0.34 s for 20,000 flat keys) is done a few times only
        dcp.save(group_by_first_segment(req.tensors) if req.failed is None else {}, storage_writer=writer,
                 planner=planner, process_group=ctx.bg if ctx.enabled else None, no_dist=not ctx.enabled)
        if req.failed is not None:
            raise CheckpointWriteError(f"staging step {req.step} failed on rank {ctx.rank}: {req.failed}")
        rank_doc = {"step": req.step, "rank": ctx.rank, "world_size": ctx.world_size, "tree": req.tree}
        size, crc = write_json_durable(tmp / rank_file_name(ctx.rank), rank_doc)
        files = {name: {"bytes": b, "crc32": c} for name, (b, c) in writer.written_files.items()
                 if name not in exclude}
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
    """The acting rank: check ``final`` may be written, reserve it if needed and create the partial ``tmp``.

    Returns:
        True when ``final`` is reserved for this save (by the engine, or created here).

    The leftovers of this checkpointer's earlier failed saves (``req.failed_names``) are removed
    first (:func:`~torch_ckpt.root._layout.remove_failed_temporaries`).

    Raises:
        CheckpointWriteError: ``final`` holds a committed checkpoint and ``req.replace`` is False, or
            it is not a directory.
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
    for stale in final.iterdir():  # another incarnation's partial (its save died): never committed
        if stale.name.startswith(PARTIAL_PREFIX) and stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    if tmp.exists():  # this incarnation's own leftover of an earlier failed attempt
        shutil.rmtree(tmp)
    remove_failed_temporaries(final.parent, tmp, req.failed_names)
    tmp.mkdir()
    return reserved


def persist_checkpoint(req: SaveRequest, ctx: DistContext) -> tuple[Path, int]:
    """Write, verify agreement and commit one checkpoint; collective over ``ctx``'s background group.

    The files are written into rank 0's partial ``NAME/.torch-ckpt.partial.<incarnation>`` inside
    the reserved ``final`` (created here when the caller did not) and only that directory is
    committed as ``final`` (:func:`~torch_ckpt.root._layout.commit_dir`); a failed save removes it, and
    ``final`` too when this save reserved it. A partial of another incarnation is never committed. With
    A root layout with a commit protocol of its own (``req.nodes.persist``: node-local roots) runs that
    instead (:func:`torch_ckpt.save._persist_nodes.persist_node_local`).

    Returns:
        The committed directory (same on every rank) and the bytes of all its committed files.

    Raises:
        CheckpointWriteError: this or another rank failed, or the requesting process is gone;
            nothing was committed.
    """
    if getattr(req.nodes, "persist", None) is not None:
        return req.nodes.persist(req, ctx)
    final = Path(req.final)
    tmp = partial_path(final, req.incarnation or new_incarnation())
    error: BaseException | None = None
    reserved = req.reserved
    if ctx.is_coordinator:
        try:
            check_owner(req, final)
            reserved = prepare_partial(req, final, tmp)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
            unreserve(final, tmp, reserved)
    try:
        return _write_and_commit(req, ctx, final, tmp, error, reserved)
    except BaseException:
        if ctx.is_coordinator:  # e.g. a collective timed out: no partial directory (nor a reservation) is left
            unreserve(final, tmp, reserved)
        raise


def _write_and_commit(req: SaveRequest, ctx: DistContext, final: Path, tmp: Path,
                      error: BaseException | None, reserved: bool) -> tuple[Path, int]:
    # every rank writes into rank 0's partial directory (its name carries rank 0's incarnation id)
    prepared = ctx.broadcast(("ok", tmp.name) if error is None else ("error", describe_error(error)), background=True,
                             what="prepare")
    if prepared[0] != "ok":
        raise as_write_error(error, tmp) if error is not None else CheckpointWriteError(
            f"rank 0 could not prepare {tmp}: {prepared[1]}")
    tmp = final / prepared[1]

    def make_writer() -> ChecksumFileSystemWriter:
        return ChecksumFileSystemWriter(tmp, thread_count=req.thread_count, sync_files=True)

    writer, error, gathered, failures, write_s = write_shards(req, ctx, final, tmp, make_writer, FlatKeysSavePlanner())

    commit_error: str | None = None
    if ctx.is_coordinator:
        if failures:
            unreserve(final, tmp, reserved)
        else:
            try:
                all_files: dict[str, dict[str, int]] = {}
                for _, f in gathered:
                    all_files.update(f)
                timings = dict(req.timings or {})
                timings["write_s"] = write_s
                if req.extra_dir is not None:
                    move_extra_entries(Path(req.extra_dir), tmp)
                manifest = Manifest(step=req.step, world_size=ctx.world_size, files=dict(sorted(all_files.items())),
                                    tensor_bytes=req.tensor_bytes, timings=timings, lineage=req.lineage or BASE)
                write_json_durable(tmp / "manifest.json", manifest.to_json())
                check_owner(req, final)  # last look before the rename: never commit for a dead trainer
                commit_dir(tmp, final, replace=req.replace)
            except BaseException as exc:  # noqa: BLE001
                commit_error = describe_error(exc)
                error = error or exc
                unreserve(final, tmp, reserved)
    committed = ctx.is_coordinator and not failures and commit_error is None
    try:
        outcome = ctx.broadcast(("failed", failures) if failures else (("commit-failed", commit_error) if commit_error
                                                                        else ("ok", None)),
                                background=True, what="commit")
    except CheckpointError as exc:
        if not committed:
            raise
        # the rename is done: the step is committed whatever happened to the others since (a rank killed now)
        log.warning("step %d is committed at %s, but telling the other ranks failed: %s", req.step, final, exc)
        outcome = ("ok", None)
    if outcome[0] == "ok":
        return final, sum(f["bytes"] for _, files_of_rank in gathered for f in files_of_rank.values())
    if error is not None:
        raise as_write_error(error, tmp)
    detail = "; ".join(outcome[1]) if isinstance(outcome[1], list) else str(outcome[1])
    raise CheckpointWriteError(f"checkpoint step {req.step} was not committed: {detail}")
