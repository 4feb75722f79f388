"""Node-local roots: the root layout where each node keeps its own copy of a checkpoint on its own disk.

A node's copy holds the shards its ranks wrote, their per-rank JSON, and DCP metadata pointing
every tensor at data the node holds: replicated tensors, which DCP stores once per job, are stored
once per node, so a node's ranks restore at the same world size from their own disk alone. One copy
of each is uploaded (spread over the nodes holding it, by bytes); the others lie in *replica* files
that never leave their node. ``.metadata`` points every tensor at its uploaded copy: the complete
checkpoint of the durable tier, used to reshard and by replaced nodes.

A rank's node comes from torchrun's environment (``GROUP_RANK``, else ``NODE_RANK``, else
``RANK // LOCAL_WORLD_SIZE``); the ranks agree on the layout once, when the manager is built.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from torch_ckpt.errors import ConfigError
from torch_ckpt.format._dcp_write import ChecksumFileSystemWriter, FlatKeysSavePlanner
from torch_ckpt.root._layout import SharedRoot

__all__ = ["NodeLayout", "choose_layout", "NodeDedupPlanner", "RecordingWriter", "node_views", "env_node",
           "shared_files", "REPLICA_TAG", "is_replica_file"]

REPLICA_TAG = "replica_"
"""Marks a data file holding only a node's extra copies of replicated tensors (``__R_replica_I.distcp``)."""


def is_replica_file(name: str) -> bool:
    """True for a data file holding only a node's extra copies of replicated tensors (never uploaded)."""
    return name.startswith("__") and f"_{REPLICA_TAG}" in name


def env_node(rank: int) -> int:
    """This process's node index from torchrun's environment.

    Raises:
        ConfigError: a node variable is set but is not a non-negative integer (the variable is named).
    """
    for var in ("GROUP_RANK", "NODE_RANK"):
        value = os.environ.get(var)
        if value is not None and value != "":
            if not value.isdigit():
                raise ConfigError(f"environment variable {var}={value!r} must be a non-negative integer node index")
            return int(value)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return rank // int(local)
    return 0


@dataclass(frozen=True)
class NodeLayout:
    """The root layout of node-local roots (see :class:`~torch_ckpt.root._layout.SharedRoot` for the
    interface): the agreed node of every rank, and this rank's place in it.

    Attributes:
        rank_node: node index of each rank (nodes numbered 0..N-1 in order of their lowest rank).
        rank: this process's rank in the checkpoint group.
        persist: the node-local commit protocol, ``persist(req, ctx)``
            (:func:`torch_ckpt.save._persist_nodes.persist_node_local`, given by the manager).
    """

    rank_node: tuple[int, ...]
    rank: int
    persist: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    node_local: ClassVar[bool] = True

    @staticmethod
    def normalise(raw: list[int]) -> tuple[int, ...]:
        """Renumber arbitrary node ids to 0..N-1 in order of each node's lowest rank."""
        order: dict[int, int] = {}
        for n in raw:
            order.setdefault(n, len(order))
        return tuple(order[n] for n in raw)

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.rank_node[self.rank]

    @property
    def node_count(self) -> int:
        """Number of nodes."""
        return max(self.rank_node) + 1

    def ranks_of(self, node: int) -> list[int]:
        """Ranks on ``node``, ascending."""
        return [r for r, n in enumerate(self.rank_node) if n == node]

    def leader_of(self, node: int) -> int:
        """The rank that creates, commits and uploads ``node``'s copy (its lowest rank)."""
        return self.ranks_of(node)[0]

    @property
    def is_leader(self) -> bool:
        """True on the rank that acts for this node (its local rank 0)."""
        return self.leader_of(self.node) == self.rank

    acts = is_leader

    @property
    def commits(self) -> bool:
        """True on node 0's uploader, which commits the durable copy."""
        return self.is_leader and self.node == 0

    def agreed_name(self, final: str | os.PathLike) -> str:
        """The name of ``final`` (each node's root is another directory)."""
        return Path(final).name

    def uploader(self, tier: Any, wait_seconds: float) -> Callable[[Path, Any, Callable[[], bool]], None]:
        """Every node uploads its own files; node 0 commits once every node has (``tier.upload_node``)."""
        commit = self.node == 0

        def upload(local_dir: Path, manifest: Any, abandon: Callable[[], bool]) -> None:
            tier.upload_node(local_dir, manifest, commit=commit, abandon=abandon, wait_seconds=wait_seconds)

        return upload

    def check(self, root: Path, ctx: Any, *, ok: bool = True) -> str | None:
        """Collective: an error message naming ``root`` when a node sees another node's root (a shared
        file system with ``local_root_shared=False`` would let nodes overwrite each other's manifests),
        else None. Each leader writes a probe file; after a barrier it looks for the others'."""
        probe = root / f".node_probe.{self.node}.{secrets.token_hex(8)}"
        error, written = None, False
        if ok and self.is_leader:
            try:
                probe.write_bytes(b"")
                written = True
            except OSError as exc:
                error = f"cannot write {probe}: {exc.strerror}"
        ctx.barrier(what="private root check")
        if ok and self.is_leader and error is None:
            others = [p.name for p in root.glob(".node_probe.*") if not p.name.startswith(f".node_probe.{self.node}.")]
            if others:
                error = (f"{root} is seen by more than one node (it holds {others[0]}): it is a shared directory. Pass "
                         "CheckpointManager(..., local_root_shared=True), or give each node a directory of its own")
        ctx.barrier(what="private root check")
        if written:  # not when the root could not be created (its parent may be a file)
            probe.unlink(missing_ok=True)
        return error


def choose_layout(ctx: Any, shared: bool | None, *, persist: Callable[..., Any] | None = None
                  ) -> SharedRoot | NodeLayout:
    """The root layout, agreed by every rank of ``ctx`` (collective): node-local roots unless
    ``shared`` (``local_root_shared``; None: private when there is more than one node); ``persist``
    becomes :attr:`NodeLayout.persist`.

    Raises:
        ConfigError: ``shared`` is not a bool or None, or a node variable is malformed on some rank.
    """
    if shared is not None and not isinstance(shared, bool):
        raise ConfigError(f"local_root_shared must be True, False or None, got {shared!r}")
    try:
        mine: Any = env_node(ctx.rank)
    except ConfigError as exc:
        mine = str(exc)
    votes = ctx.all_gather(mine, what="node layout")
    bad = next((v for v in votes if isinstance(v, str)), None)
    if bad is not None:
        raise ConfigError(bad)
    rank_node = NodeLayout.normalise(votes)
    if shared is True or (shared is None and max(rank_node) == 0):
        return SharedRoot(ctx.rank)
    return NodeLayout(rank_node=rank_node, rank=ctx.rank, persist=persist)


class NodeDedupPlanner(FlatKeysSavePlanner):
    """DCP save planner that writes a tensor several ranks hold once per node holding it (balanced
    over that node's ranks), not once per job; :func:`node_views` points each node's metadata at it."""

    def __init__(self, rank_node: tuple[int, ...]) -> None:
        super().__init__()
        self._rank_node = rank_node

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        deduped: list[SavePlan | None] = [None] * len(all_plans)
        nodes = sorted(set(self._rank_node))
        for node in nodes:
            ranks = [r for r, n in enumerate(self._rank_node) if n == node]
            for r, plan in zip(ranks, self._dedup_save_plans([all_plans[r] for r in ranks])):
                deduped[r] = plan
        global_plan = cast(list[SavePlan], list(deduped))  # every rank is on a node: none left None
        # every chunk listed once (as a job-wide dedup would; one node's plans are deduplicated already);
        # node_views places each node's copies
        _, metadata = create_default_global_save_plan(
            self._dedup_save_plans(global_plan) if len(nodes) > 1 else global_plan)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        return global_plan, metadata


@dataclass
class _NodePrefix(_StoragePrefix):
    """A rank's file prefix, and the items it writes only as its node's extra copy (``replicas``)."""

    replicas: frozenset = frozenset()


class RecordingWriter(ChecksumFileSystemWriter):
    """The checksumming writer for node-local saves.

    An item several nodes write is a *replica* on every node but its uploader's: a rank writes its
    replicas into files of their own (``__R_replica_I.distcp``), never uploaded. The coordinator
    keeps every rank's write results (to build each node's metadata).
    """

    results: list[list[Any]] | None = None
    metadata: Metadata | None = None

    def __init__(self, *args: Any, rank_node: tuple[int, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rank_node = rank_node

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:  # noqa: D102
        # the uploaded copy of a tensor several nodes hold is spread over those nodes by bytes, so
        # that replicated weights do not all go up through one node
        if len(set(self._rank_node)) == 1:  # one node: it uploads every chunk
            return [dataclasses.replace(plan, storage_data=_NodePrefix(f"__{r}_")) for r, plan in enumerate(plans)]
        holders: dict[MetadataIndex, set[int]] = {}
        size: dict[MetadataIndex, int] = {}
        for r, plan in enumerate(plans):
            for item in plan.items:
                holders.setdefault(item.index, set()).add(self._rank_node[r])
                size[item.index] = item.tensor_storage_size() or 1
        load = dict.fromkeys(self._rank_node, 0)
        owner: dict[MetadataIndex, int] = {}
        for key in sorted(holders, key=lambda k: (-size[k], k.fqn, tuple(k.offset or ()))):
            owner[key] = min(holders[key], key=lambda n: (load[n], n))
            load[owner[key]] += size[key]
        return [dataclasses.replace(plan, storage_data=_NodePrefix(
            f"__{r}_", frozenset(i.index for i in plan.items if owner[i.index] != self._rank_node[r])))
            for r, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: Any) -> Any:  # noqa: D102
        replicas: frozenset[MetadataIndex] = getattr(plan.storage_data, "replicas", frozenset())
        own = [i for i in plan.items if i.index not in replicas]
        extra = [i for i in plan.items if i.index in replicas]
        prefix = plan.storage_data.prefix
        results: list[Any] = []
        for items, pre in ((own, prefix), (extra, prefix + REPLICA_TAG)):
            if items:
                part = dataclasses.replace(plan, items=items, storage_data=_StoragePrefix(pre))
                results += super().write_data(part, planner).wait()
        done: Any = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:  # noqa: D102
        # DCP's own .metadata is not written: node_views pickles every copy's (the leaders write them)
        metadata.version, metadata.storage_meta = CURRENT_DCP_VERSION, self.storage_meta()
        self.results, self.metadata = results, metadata


def shared_files(results: list[list[Any]], rank_node: tuple[int, ...]) -> list[str]:
    """Uploaded data files holding a tensor that more than one node holds (a replaced node fetches them)."""
    nodes_of: dict[MetadataIndex, set[int]] = {}
    for r, res in enumerate(results):
        for wr in res:
            nodes_of.setdefault(wr.index, set()).add(rank_node[r])
    return sorted({str(wr.storage_data.relative_path) for res in results for wr in res
                   if len(nodes_of[wr.index]) > 1 and not is_replica_file(str(wr.storage_data.relative_path))})


def node_views(metadata: Metadata, results: list[list[Any]], rank_node: tuple[int, ...]) -> dict[int | None, bytes]:
    """``{node: pickled DCP metadata}``: each lists every chunk once, pointing it at that node's copy
    when it holds one, else at the uploaded copy; under None the complete metadata (uploaded copies only).

    Args:
        metadata: the global metadata of a :class:`NodeDedupPlanner` save.
        results: every rank's DCP write results (rank order).
        rank_node: node of each rank.
    """
    views: dict[int | None, bytes] = {}
    sdm: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and len(item.chunks) > 1:  # each chunk listed once
            unique = {(tuple(c.offsets), tuple(c.sizes)): c for c in item.chunks}
            item = dataclasses.replace(item, chunks=list(unique.values()))
        sdm[fqn] = item
    uploaded: dict[MetadataIndex, Any] = {}
    for res in results:
        for wr in res:
            if not is_replica_file(str(wr.storage_data.relative_path)):
                uploaded[wr.index] = wr.storage_data
    for node in [None, *sorted(set(rank_node))]:
        # this node's replicas win (MetadataIndex ignores its index hint); its other copies are the uploaded ones
        # (one owner per chunk), so a node without replicas has the complete view, pickled once
        extra = {wr.index: wr.storage_data for r, res in enumerate(results) if rank_node[r] == node for wr in res
                 if is_replica_file(str(wr.storage_data.relative_path))}
        if node is not None and not extra:
            views[node] = views[None]
            continue
        view = Metadata(state_dict_metadata=sdm, planner_data=metadata.planner_data, storage_data={**uploaded, **extra},
                        storage_meta=metadata.storage_meta, version=getattr(metadata, "version", None))
        views[node] = pickle.dumps(view)
    return views
