"""Node-local checkpoints on the durable tier: what goes up, how it is committed, what a node fetches.

With node-local roots (:mod:`torch_ckpt.root._nodes`) each node holds its own copy of a checkpoint, with
its own extra copies of replicated tensors in *replica* files. The durable copy holds every tensor
once: each node uploads the files it is the uploader of (:func:`durable_manifest` lists them all),
verifies them, and writes an upload record; the committing node (node 0) waits for every node's
record, checks it against the manifest, and writes the durable manifest last
(:func:`upload_node`). A node replaced later fetches only what its ranks load at the same rank
layout (:func:`fetch_set`, :func:`node_fetch_manifest`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_ckpt.format._read import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    MAX_MANIFEST_INT_DIGITS,
    METADATA_NAME,
    Manifest,
)
from torch_ckpt.storage._bounded import corrupt, loads_bounded

if TYPE_CHECKING:
    from torch_ckpt.tiers._durable import DurableTier

__all__ = ["REPLICA_TAG", "durable_manifest", "fetch_set", "is_replica_file", "node_fetch_manifest", "upload_node"]

REPLICA_TAG = "replica_"
"""Marks a data file holding only a node's extra copies of replicated tensors (``__R_replica_I.distcp``)."""
_MARKER = "_uploaded_node_{:05d}.json"
"""Name of the upload record a node writes into a step's prefix once its files are uploaded and verified."""


def is_replica_file(name: str) -> bool:
    """True for a data file holding only a node's extra copies of replicated tensors (never uploaded)."""
    return name.startswith("__") and f"_{REPLICA_TAG}" in name


def durable_manifest(manifest: Manifest) -> Manifest:
    """The manifest of the durable copy of a node-local checkpoint: every file except the nodes'
    replica files and per-node metadata (node 0's ``.metadata`` is the complete one); ``node`` None."""
    keep = {n: i for n, i in manifest.files.items()
            if not is_replica_file(n) and not (n.startswith("node_") and n.endswith(".metadata"))}
    nodes = {"rank_node": manifest.nodes["rank_node"],
             "file_node": {n: v for n, v in manifest.nodes["file_node"].items() if n in keep},
             "shared": list(manifest.nodes.get("shared", []))}
    return dataclasses.replace(manifest, files=keep, nodes=nodes, node=None, tiers={})


def fetch_set(manifest: Manifest, node: int) -> list[str]:
    """Files a node fetches from the durable copy to restore its ranks at the same layout: its
    ranks' uploaded files, the files holding replicated tensors, and the complete ``.metadata``."""
    own = {n for n, v in manifest.nodes["file_node"].items() if v == node}
    return sorted(own | set(manifest.nodes.get("shared", [])) | {METADATA_NAME})


def node_fetch_manifest(manifest: Manifest, node: int, where: str) -> Manifest:
    """The manifest of ``node``'s copy fetched from the durable ``manifest`` (``held``: :func:`fetch_set`).

    Raises:
        ValueError: the checkpoint was written to a shared root (it has no node copies); names ``where``.
    """
    if not manifest.nodes:
        raise ValueError(f"{where} was written to a shared root: it has no node copies")
    return dataclasses.replace(manifest, node=node, nodes={**manifest.nodes, "held": fetch_set(manifest, node),
                                                           "metadata": METADATA_NAME})


def upload_node(tier: DurableTier, local_dir: Path, manifest: Manifest, *, commit: bool,
                wait_seconds: float = 600.0, poll_seconds: float = 0.2,
                abandon: Callable[[], bool] = lambda: False) -> None:
    """Upload one node's copy of a node-local checkpoint; on the committing node, also commit it.

    Every node uploads and verifies the files it holds (:meth:`DurableTier.put_all`), then writes an
    upload record listing them. The committing node then waits for every node's record, checks each
    against the manifest, and writes the manifest last: a step whose uploader died midway never gets
    a manifest, so the durable tier never shows it (its prefix is removed as an abandoned upload).

    Args:
        tier: the durable tier.
        local_dir: this node's committed copy.
        manifest: its manifest (``node`` set).
        commit: write the durable manifest once every node's record is there.
        wait_seconds: how long the committing node waits for the other nodes' records (seconds).
        poll_seconds: first delay between looks for records (doubles up to 5 s).
        abandon: returns True when waiting is pointless (a newer step is queued).

    Raises:
        ValueError: ``manifest`` is not one node's copy.
        CheckpointCorruptError: an upload or a node's record does not match the manifest (named).
        TimeoutError: a node's record did not appear within ``wait_seconds`` (or ``abandon``).
    """
    if manifest.node is None:
        raise ValueError("upload_node() needs one node's copy (manifest.node is set)")
    step, node, loc = manifest.step, manifest.node, tier.location(manifest.step)
    tier.make_step_dir(loc.path)
    durable = durable_manifest(manifest)  # without the nodes' extra copies: each tensor is uploaded once
    file_node = durable.nodes["file_node"]
    mine = {name: info for name, info in durable.files.items() if file_node[name] == node}
    tier.put_all(local_dir, step, mine)
    tier.fs.pipe_file(f"{loc.path}/{_MARKER.format(node)}", json.dumps({"node": node, "files": mine}).encode())
    tier.refresh()
    if not commit:
        return
    nodes = max(manifest.nodes["rank_node"]) + 1
    deadline, delay, missing = time.monotonic() + wait_seconds, poll_seconds, list(range(nodes))
    while True:
        tier.refresh()
        missing = [n for n in missing if not loc.exists(_MARKER.format(n))]
        if not missing:
            break
        if abandon() or time.monotonic() > deadline:
            raise TimeoutError(f"durable tier {tier.url}: step {step} is not committed: node(s) {missing} have "
                               f"not finished uploading their shards")
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
    for n in range(nodes):
        source = loc.describe(_MARKER.format(n))
        doc: Any = loads_bounded(loc.read_bytes(_MARKER.format(n), MAX_MANIFEST_BYTES, what="upload record"), source,
                                 what="upload record", max_depth=MAX_MANIFEST_DEPTH,
                                 max_int_digits=MAX_MANIFEST_INT_DIGITS)
        expected = {k: v for k, v in durable.files.items() if file_node[k] == n}
        if not isinstance(doc, dict) or doc.get("files") != expected:
            raise corrupt(source, f"node {n}'s upload record of step {step} does not match the manifest")
    data = json.dumps(durable.to_json(), separators=(",", ":")).encode()
    tier.fs.pipe_file(f"{loc.path}/{MANIFEST_NAME}", data)
    tier.refresh()
