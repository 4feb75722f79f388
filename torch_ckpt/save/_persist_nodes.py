"""Persisting one checkpoint into node-local roots: every node writes and commits its own copy.

Collective over the background group; every rank takes part in every step even after a failure,
so a failing rank fails the step everywhere instead of hanging the others:

1. rank 0 draws the partial's name; each node's leader (its lowest rank) creates it in its root;
2. every rank writes its DCP shards (replicated tensors once per node,
   :class:`~torch_ckpt.root._nodes.NodeDedupPlanner`) and its per-rank JSON, and checks them on disk;
3. the ranks gather who wrote what; rank 0 builds the global manifest (every file, its size, CRC-32
   and node) and every node's DCP metadata;
4. each leader writes its node's metadata and manifest and checks its node's files; the ranks agree
   that every node is ready: the global commit decision;
5. only then does each leader rename its partial to the final name, so a node only ever lists
   checkpoints that every rank wrote and verified.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointError, CheckpointWriteError
from torch_ckpt.format._files import METADATA_NAME, metadata_name
from torch_ckpt.policy._lineage import BASE
from torch_ckpt.root._layout import (
    MANIFEST_NAME,
    Manifest,
    commit_dir,
    new_incarnation,
    partial_path,
    unreserve,
    write_durable,
    write_json_durable,
)
from torch_ckpt.root._nodes import NodeDedupPlanner, NodeLayout, RecordingWriter, node_views, shared_files
from torch_ckpt.save._persist import (
    SaveRequest,
    as_write_error,
    check_on_disk,
    check_owner,
    describe_error,
    move_extra_entries,
    prepare_partial,
    write_shards,
)

__all__ = ["persist_node_local"]

log = get_logger("torch_ckpt.save._persist")


def _fail_all(ctx: DistContext, mine: BaseException | None, what: str) -> list[str]:
    """All-gather this rank's error; return every rank's, as ``rank N: message``."""
    gathered = ctx.all_gather(None if mine is None else describe_error(mine), background=True, what=what)
    return [f"rank {r}: {msg}" for r, msg in enumerate(gathered) if msg]


def persist_node_local(req: SaveRequest, ctx: DistContext) -> tuple[Path, int]:
    """Write, agree on and commit one checkpoint whose root is private to each node (see module doc).

    Returns:
        The committed directory on this rank's node and the bytes of all committed files.

    Raises:
        CheckpointWriteError: this or another rank failed, or the requesting process is gone;
            no node committed anything. After the global decision, a node whose rename fails raises
            on every rank naming it (the other nodes hold their copies).
    """
    layout: NodeLayout = req.nodes
    final = Path(req.final)
    name = ctx.broadcast(partial_path(final, req.incarnation or new_incarnation()).name, background=True,
                         what="prepare name")
    tmp = final / name
    error: BaseException | None = None
    reserved = req.reserved
    if layout.is_leader:
        try:
            check_owner(req, final)
            reserved = prepare_partial(req, final, tmp)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank in _persist
            error = exc
            unreserve(final, tmp, reserved)
    try:
        return _persist(req, ctx, layout, final, tmp, error, reserved)
    except BaseException:
        if layout.is_leader:  # e.g. a collective timed out: no partial (nor a reservation) is left in this node's root
            unreserve(final, tmp, reserved)
        raise


def _persist(req: SaveRequest, ctx: DistContext, layout: NodeLayout, final: Path, tmp: Path,
             error: BaseException | None, reserved: bool) -> tuple[Path, int]:
    failures = _fail_all(ctx, error, "prepare")
    if failures:
        if error is not None:
            raise as_write_error(error, tmp)
        raise CheckpointWriteError(f"a node could not prepare step {req.step}: {'; '.join(failures)}")

    writer, error, gathered, failures, write_s = write_shards(
        req, ctx, final, tmp,
        lambda: RecordingWriter(tmp, thread_count=req.thread_count, sync_files=True, rank_node=layout.rank_node),
        NodeDedupPlanner(layout.rank_node), exclude=(METADATA_NAME,))  # .metadata is rewritten below (node_views)

    plan: tuple[str, Any, Any] | None = None
    if ctx.is_coordinator and not failures:
        try:
            views = node_views(writer.metadata, writer.results, layout.rank_node)
            all_files: dict[str, dict[str, int]] = {}
            file_node: dict[str, int] = {}
            for r, (_, f) in enumerate(gathered):
                all_files.update(f)
                file_node.update({n: layout.rank_node[r] for n in f})
            for node, data in views.items():
                name = METADATA_NAME if node is None else metadata_name(node)
                all_files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
                file_node[name] = 0 if node is None else node  # the complete metadata lies on node 0
            timings = dict(req.timings or {})
            timings["write_s"] = write_s
            manifest = Manifest(step=req.step, world_size=ctx.world_size, files=dict(sorted(all_files.items())),
                                tensor_bytes=req.tensor_bytes, timings=timings, lineage=req.lineage or BASE,
                                nodes={"rank_node": list(layout.rank_node),
                                       "file_node": dict(sorted(file_node.items())),
                                       "shared": shared_files(writer.results, layout.rank_node)})
            plan = ("ok", manifest.to_json(), views)
        except BaseException as exc:  # noqa: BLE001
            error = exc
            plan = ("error", describe_error(exc), None)
    plan = ctx.broadcast(plan if ctx.is_coordinator else None, background=True, what="manifest")

    ready_error: BaseException | None = None
    if layout.is_leader and not failures and plan[0] == "ok":
        try:
            doc, views = plan[1], plan[2]
            write_durable(tmp / metadata_name(layout.node), views[layout.node])
            if layout.node == 0:
                write_durable(tmp / METADATA_NAME, views[None])  # replaces DCP's own (every copy listed)
            manifest = Manifest.from_json({**doc, "node": layout.node}, str(tmp / MANIFEST_NAME))
            check_on_disk(tmp, manifest.local_files())
            if ctx.is_coordinator and req.extra_dir is not None:  # framework files: node 0's copy, as rank 0 reads them
                move_extra_entries(Path(req.extra_dir), tmp)
            write_json_durable(tmp / MANIFEST_NAME, manifest.to_json())
            check_owner(req, final)
        except BaseException as exc:  # noqa: BLE001
            ready_error = exc
    ready = _fail_all(ctx, ready_error, "commit agreement")
    commit = not failures and plan[0] == "ok" and not ready
    rename_error: BaseException | None = None
    if layout.is_leader:
        if commit:
            try:
                commit_dir(tmp, final, replace=req.replace)
            except BaseException as exc:  # noqa: BLE001
                rename_error = exc
                unreserve(final, tmp, reserved)
        else:
            unreserve(final, tmp, reserved)
    if commit:
        try:
            renamed = _fail_all(ctx, rename_error, "commit")
        except CheckpointError as exc:
            if not layout.is_leader or rename_error is not None:
                raise
            # this node's rename is done: its copy is committed whatever happened to the others since
            log.warning("step %d is committed at %s, but hearing from the other nodes failed: %s", req.step, final, exc)
            renamed = []
        if renamed:
            raise CheckpointWriteError(f"step {req.step} was agreed by every rank but not recorded on every node "
                                       f"({'; '.join(renamed)}); the other nodes hold their copies")
        return final, sum(i["bytes"] for i in plan[1]["files"].values())
    own = error or ready_error
    if own is not None:
        raise as_write_error(own, tmp)
    detail = "; ".join(failures or ready or [str(plan[1])])
    raise CheckpointWriteError(f"checkpoint step {req.step} was not committed: {detail}")
