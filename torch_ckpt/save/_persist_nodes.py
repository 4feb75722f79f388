"""Persisting one checkpoint into node-local roots: every node writes and commits its own copy.

The node-local part of :func:`~torch_ckpt.save._persist.commit_checkpoint`: each node's leader (its
lowest rank) creates the partial in its root; replicated tensors are written once per node
(:class:`~torch_ckpt.root._nodes.NodeDedupPlanner`); rank 0's manifest lists every file, its size,
CRC-32 and node, with every node's DCP metadata; each leader writes its node's metadata and manifest
and checks its node's files before the ranks agree, so a node only ever lists checkpoints that every
rank wrote and verified.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch_ckpt.distributed._context import DistContext
from torch_ckpt.format._files import METADATA_NAME, metadata_name
from torch_ckpt.root._layout import Manifest, write_durable
from torch_ckpt.root._nodes import NodeDedupPlanner, NodeLayout, RecordingWriter, node_views, shared_files
from torch_ckpt.save._persist import SaveRequest, SharedPart, check_on_disk, commit_checkpoint

__all__ = ["persist_node_local"]


class _NodePart(SharedPart):
    def __init__(self, layout: NodeLayout) -> None:
        self.layout = layout
        self.leader = layout.is_leader

    def writer(self, tmp: Path, req: SaveRequest) -> RecordingWriter:
        return RecordingWriter(tmp, thread_count=req.thread_count, sync_files=True, rank_node=self.layout.rank_node,
                               incremental=(req.final, req.step) if req.incremental else None,
                               changed_keys=req.changed_keys, spare=req.spare_dir)

    def planner(self) -> Any:
        return NodeDedupPlanner(self.layout.rank_node)

    def plan(self, req: SaveRequest, ctx: DistContext, writer: Any, gathered: list,
             timings: dict[str, float]) -> tuple[Manifest, Any]:
        rank_node = self.layout.rank_node
        manifest, _ = super().plan(req, ctx, writer, gathered, timings)
        views = node_views(writer.metadata, writer.results, rank_node)
        files = dict(manifest.files)
        file_node = {name: rank_node[r] for r, (_, f) in enumerate(gathered) for name in f}
        for node, data in views.items():
            name = METADATA_NAME if node is None else metadata_name(node)
            files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
            file_node[name] = 0 if node is None else node  # the complete metadata lies on node 0
        nodes = {"rank_node": list(rank_node), "file_node": dict(sorted(file_node.items())),
                 "shared": shared_files(writer.results, rank_node)}
        return replace(manifest, files=dict(sorted(files.items())), nodes=nodes), views

    def finish(self, tmp: Path, manifest: Manifest, views: Any) -> Manifest:
        node = self.layout.node
        write_durable(tmp / metadata_name(node), views[node])
        if node == 0:
            write_durable(tmp / METADATA_NAME, views[None])  # DCP writes none here (RecordingWriter.finish)
        manifest = replace(manifest, node=node)
        check_on_disk(tmp, manifest.local_files())
        return manifest


def persist_node_local(req: SaveRequest, ctx: DistContext) -> tuple[Path, int]:
    """:func:`~torch_ckpt.save._persist.commit_checkpoint` into node-local roots (``req.nodes``, a
    :class:`~torch_ckpt.root._nodes.NodeLayout`); returns this node's committed directory and the bytes of all
    committed files. A node whose rename fails after the agreement raises on every rank (the others hold copies)."""
    assert isinstance(req.nodes, NodeLayout)
    return commit_checkpoint(req, ctx, _NodePart(req.nodes))
