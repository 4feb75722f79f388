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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointError, CheckpointWriteError
from torch_ckpt.format._dcp_plan import FlatKeysSavePlanner, group_by_first_segment
from torch_ckpt.format._dcp_read import unwrap_dcp_error
from torch_ckpt.format._dcp_write import ChecksumFileSystemWriter
from torch_ckpt.policy._lineage import BASE
from torch_ckpt.root._layout import Manifest, commit_dir, rank_file_name, write_json_durable
from torch_ckpt.root._temporaries import (
    PARTIAL_PREFIX,
    is_reservation,
    new_incarnation,
    partial_path,
    remove_failed_temporaries,
    unreserve,
)

__all__ = ["PersistRequest", "persist_checkpoint", "prepare_partial", "write_shards", "move_extra_entries",
           "check_extra_name", "as_write_error",
           "check_on_disk", "check_owner", "describe_error"]

log = get_logger(__name__)


@dataclass
class PersistRequest:
    """Everything the writer needs for one step (tensors already staged off the live state).

    ``incarnation`` names the temporary directory (``.NAME.tmp.<incarnation>``; only rank 0's
    value is used; None draws a fresh id for this save). ``owner_alive``, when given, is asked
    before the write starts, before the ranks agree on it and right before the commit; once it
    returns False the save fails and nothing is committed (a writer process whose trainer died).
    ``failed`` marks a save whose staging already failed on this rank: the rank still joins every
    collective (so the other ranks learn of it at once instead of waiting for the timeout), writes
    nothing, and the save fails on every rank with this message. ``replace`` lets the commit
    replace an existing committed checkpoint at ``final`` atomically (see
    :func:`torch_ckpt.root._layout.replace_dir`). ``extra_dir`` (rank 0's): a directory whose entries are
    moved into the checkpoint before its manifest is written, so they are committed, replaced and
    removed with it (see :func:`move_extra_entries`). On success ``committed_bytes`` holds the bytes of every
    committed file, so no rank needs to read the committed directory again. ``progress`` (a
    :class:`~torch_ckpt.save._staging.StagingProgress`), when given, means the tensors are still being
    staged: each is written once the copy has marked it, and a failed copy fails the save.
    ``failed_names``: the final names of this checkpointer's earlier saves that failed; the
    coordinator (each node's leader) removes their temporaries before writing (see
    :func:`~torch_ckpt.root._temporaries.remove_failed_temporaries`).
    """

    final: Path
    step: int
    tensors: dict[str, torch.Tensor]
    tree: Any
    tensor_bytes: int
    thread_count: int = 1
    timings: dict[str, float] | None = None
    incarnation: str | None = None
    owner_alive: Callable[[], bool] | None = None
    failed: str | None = None
    replace: bool = False
    extra_dir: Path | None = None
    nodes: Any = None  # the root layout (torch_ckpt.root._layout.SharedRoot or NodeLayout); None: a shared root
    lineage: Any = None  # a Lineage recorded in the manifest (rank 0's); None: the base segment
    committed_bytes: int | None = None  # output: bytes of all committed files (every rank), set on success
    progress: Any = None
    failed_names: tuple[str, ...] = ()  # final names of this checkpointer's earlier failed saves: their temporaries go
    reserved: bool = False  # the saver created ``final`` empty (reserved it); a failed save removes it


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
def check_owner(req: PersistRequest, final: Path) -> None:
    """Raise when the process that requested this save is gone (see ``PersistRequest.owner_alive``)."""
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


def write_shards(req: PersistRequest, ctx: DistContext, final: Path, tmp: Path, make_writer: Callable[[], Any],
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
        planner: the DCP save planner (a :class:`~torch_ckpt.format._dcp_plan.FlatKeysSavePlanner`, so the
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


def prepare_partial(req: PersistRequest, final: Path, tmp: Path) -> None:
    """The acting rank: check ``final`` may be written, reserve it if needed and create the partial ``tmp``.

    The leftovers of this checkpointer's earlier failed saves (``req.failed_names``) are removed
    first (:func:`~torch_ckpt.root._temporaries.remove_failed_temporaries`).

    Raises:
        CheckpointWriteError: ``final`` holds a committed checkpoint and ``req.replace`` is False, or
            it is not a directory.
        OSError: a directory cannot be created.
    """
    if os.path.lexists(final) and (final.is_symlink() or not final.is_dir()):
        raise CheckpointWriteError(f"{final} exists and is not a directory; refusing to overwrite it")
    if final.exists() and not req.replace and not is_reservation(final):
        raise CheckpointWriteError(f"{final} already exists; refusing to overwrite a checkpoint")
    if not final.exists():
        final.mkdir(parents=True)
        req.reserved = True
    for stale in final.iterdir():  # another incarnation's partial (its save died): never committed
        if stale.name.startswith(PARTIAL_PREFIX) and stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    if tmp.exists():  # this incarnation's own leftover of an earlier failed attempt
        shutil.rmtree(tmp)
    remove_failed_temporaries(final.parent, tmp, req.failed_names)
    tmp.mkdir()


def persist_checkpoint(req: PersistRequest, ctx: DistContext) -> Path:
    """Write, verify agreement and commit one checkpoint; collective over ``ctx``'s background group.

    The files are written into rank 0's partial ``NAME/.torch-ckpt.partial.<incarnation>`` inside
    the reserved ``final`` (created here when the caller did not) and only that directory is
    committed as ``final`` (:func:`~torch_ckpt.root._layout.commit_dir`); a failed save removes it, and
    ``final`` too when this save reserved it. A partial of another incarnation is never committed. With
    A root layout with a commit protocol of its own (``req.nodes.persist``: node-local roots) runs that
    instead (:func:`torch_ckpt.save._persist_nodes.persist_node_local`).

    Returns:
        The committed directory (same on every rank).

    Raises:
        CheckpointWriteError: this or another rank failed, or the requesting process is gone;
            nothing was committed.
    """
    if getattr(req.nodes, "persist", None) is not None:
        return req.nodes.persist(req, ctx)
    final = Path(req.final)
    tmp = partial_path(final, req.incarnation or new_incarnation())
    error: BaseException | None = None
    if ctx.is_coordinator:
        try:
            check_owner(req, final)
            prepare_partial(req, final, tmp)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
            unreserve(final, tmp, req.reserved)
    try:
        return _write_and_commit(req, ctx, final, tmp, error)
    except BaseException:
        if ctx.is_coordinator:  # e.g. a collective timed out: no partial directory (nor a reservation) is left
            unreserve(final, tmp, req.reserved)
        raise


def _write_and_commit(req: PersistRequest, ctx: DistContext, final: Path, tmp: Path,
                      error: BaseException | None) -> Path:
    # every rank writes into rank 0's partial directory (its name carries rank 0's incarnation id)
    prepared = ctx.broadcast(("ok", tmp.name) if error is None else ("error", describe_error(error)), background=True,
                             what="prepare")
    if prepared[0] != "ok":
        raise as_write_error(error, tmp) if error is not None else CheckpointWriteError(
            f"rank 0 could not prepare {tmp}: {prepared[1]}")
    tmp = final / prepared[1]

    def make_writer() -> ChecksumFileSystemWriter:
        return ChecksumFileSystemWriter(tmp, thread_count=req.thread_count, sync_files=True,
                                        wait_for=req.progress.wait if req.progress is not None else None)

    writer, error, gathered, failures, write_s = write_shards(req, ctx, final, tmp, make_writer, FlatKeysSavePlanner())

    commit_error: str | None = None
    if ctx.is_coordinator:
        if failures:
            unreserve(final, tmp, req.reserved)
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
                unreserve(final, tmp, req.reserved)
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
        req.committed_bytes = sum(f["bytes"] for _, files_of_rank in gathered for f in files_of_rank.values())
        return final
    if error is not None:
        raise as_write_error(error, tmp)
    detail = "; ".join(outcome[1]) if isinstance(outcome[1], list) else str(outcome[1])
    raise CheckpointWriteError(f"checkpoint step {req.step} was not committed: {detail}")
