"""Restoring from node-local roots: the newest step every node can get, from its own disk or the durable tier
(only its files when the rank layout is unchanged, else the whole checkpoint, to reshard). Only live
copies count (:mod:`torch_ckpt.policy._lineage`), so a stale node's abandoned timeline is never mixed in.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from torch_ckpt.policy._lineage import Lineage, head_of, new_segment, successor
from torch_ckpt.restore._resume import first_usable, set_aside_superseded
from torch_ckpt.root._layout import is_committed, read_manifest, scan_committed, scan_manifests
from torch_ckpt.root._nodes import NodeLayout
from torch_ckpt.storage._locations import DurableUnavailableError, waiting_for_coordinator

__all__ = ["Resumed", "restore_node_local", "local_inventory"]

log = get_logger(__name__)


@dataclass(frozen=True)
class Resumed:
    """The outcome of :func:`restore_node_local` on this rank.

    Attributes:
        step: the restored step; None: no step is complete in any tier although some node holds steps of
            an unfinished timeline (another node lost its copies): the run starts from scratch in a new
            segment, and those steps are set aside at its first save.
        source: "local" (its node's disk), "durable-node" (its node fetched its own files),
            "durable-full" (its node fetched the whole checkpoint) or "none" (``step`` None).
        lineage: the run segment of the next saves; None on the ranks that are not a node's leader.
    """

    step: int | None
    source: str
    lineage: Lineage | None


def local_inventory(root: Path, naming: Any, nodes: NodeLayout) -> dict[int, str]:
    """``{step: "node" | "full"}``: steps this node can restore from its own disk: its copy written
    with the same rank layout ("node"), or a complete copy ("full": downloaded to reshard, or from a
    shared root). Copies with missing or truncated files are left out."""
    found: dict[int, str] = {}
    for step, path in scan_committed(root, naming).items():
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if not is_committed(path):
            log.warning("%s: files are missing or truncated; not used for resume", path)
            continue
        if manifest.node is None:
            found[step] = "full"
        elif manifest.node == nodes.node and tuple(manifest.nodes["rank_node"]) == nodes.rank_node:
            found[step] = "node"
    return found


def _plan(inventories: dict[int, dict[int, str]], durable: dict[int, Any], nodes: NodeLayout,
          step: int | None) -> list[tuple[int, dict[int, str]]]:
    """Rank 0: feasible ``(step, {node: "local"|"node"|"full"})`` newest first, logging why steps are skipped.
    A step also in the durable tier is listed again with every node fetching it, before older steps."""
    candidates = sorted({s for inv in inventories.values() for s in inv} | set(durable), reverse=True)
    if step is not None:
        candidates = [step]
    feasible = []
    for s in candidates:
        actions, missing = {}, []
        d = durable.get(s)
        same_layout = d is not None and d.nodes and tuple(d.nodes["rank_node"]) == nodes.rank_node
        for node in range(nodes.node_count):
            if s in inventories.get(node, {}):
                actions[node] = "local"
            elif d is not None:
                actions[node] = "node" if same_layout else "full"
            else:
                missing.append(node)
        if missing:
            log.warning("step %d is not complete in any tier: node(s) %s hold no copy and the durable tier has none%s",
                        s, missing, "; trying the next older step" if step is None else "")
            continue
        feasible.append((s, actions))
        if d is not None and "local" in actions.values():
            feasible.append((s, {node: "node" if same_layout else "full" for node in range(nodes.node_count)}))
    return feasible


def restore_node_local(nodes: NodeLayout, ctx: DistContext, tier: Any, root: Path, naming: Any,
                       load: Callable[[Path], None], *, step: int | None, read_only: bool,
                       memory: Mapping[int, Lineage] | None = None) -> Resumed | None:
    """:meth:`CheckpointManager.restore` for node-local roots (collective). ``load(directory)`` loads
    (and verifies) a local checkpoint; ``read_only`` never moves a superseded local copy aside;
    ``memory``: the memory tier's ``{step: lineage}``, counted for the head and the newest step.
    Returns None when no tier holds a checkpoint (see :attr:`Resumed.step` for leftovers of one).

    Raises:
        CheckpointNotFoundError: ``step`` was given and no tier can provide it.
        DurableUnavailableError: the durable tier is unreachable (or does not answer for
            ``durable_timeout_seconds``, or its bucket is missing) and no step is on every node's disk.
        CheckpointCorruptError, StateMismatchError: as :meth:`CheckpointManager.restore`.
    """
    inv: dict[int, str] | str | None = None
    lineages: dict[int, Lineage] = {}
    if nodes.is_leader:
        try:
            inv = local_inventory(root, naming, nodes)
            lineages = {s: m.lineage for s, (_, m) in scan_manifests(root, naming).items() if s in inv}
        except (CheckpointError, OSError) as exc:
            inv = f"{type(exc).__name__}: {exc}"
    gathered = ctx.all_gather((nodes.node, inv, lineages), what="restore inventory")
    plan: Any = None
    lineage_view: Any = None
    if ctx.is_coordinator:
        inventories = {n: i for n, i, _ in gathered if isinstance(i, dict)}
        bad = [f"node {n}: {i}" for n, i, _ in gathered if isinstance(i, str)]
        durable: dict[int, Any] = {}
        outage = None
        if tier is not None:
            try:
                durable = tier.listed()
            except DurableUnavailableError as exc:
                outage = exc
        memory = memory or {}
        seen = [*(lin for _, _, lins in gathered for lin in lins.values()), *(m.lineage for m in durable.values()),
                *memory.values()]
        head = head_of(seen)
        node_lins = {n: lins for n, i, lins in gathered if isinstance(i, dict)}  # the leaders' (others send none)
        inventories = {n: {s: kind for s, kind in i.items() if head.holds(s, node_lins[n][s])}
                       for n, i in inventories.items()}
        durable = {s: m for s, m in durable.items() if head.holds(s, m.lineage)}
        newest = max([*durable, *(s for i in inventories.values() for s in i),
                      *(s for s, lin in memory.items() if head.holds(s, lin))], default=None)
        lineage_view = (head, outage is None, newest, new_segment(seen))
        plan = _plan(inventories, durable, nodes, step) if not bad else \
            CheckpointError(f"cannot list the local roots: {'; '.join(bad)}")
        if outage is not None:
            log.warning("%s; resuming from the node-local copies only", outage)
            if not plan and any(not i for i in inventories.values()):
                plan = DurableUnavailableError(f"{outage}. Some node has no local checkpoint: refusing to start "
                                               "from scratch during an outage; retry when the store is reachable")
        if step is not None and plan == [] and outage is not None:  # it may be there: say why it cannot be known
            plan = DurableUnavailableError(f"step {step} is not on every node's disk, and {outage}")
        if step is not None and plan == []:
            plan = CheckpointNotFoundError(f"step {step} is not complete in any tier (node-local roots"
                                           f"{' or ' + tier.url if tier is not None else ''})")
    plan, lineage_view = waiting_for_coordinator(ctx, tier, "listing the node-local roots and the durable tier"
                                                 + (f" {tier.url}" if tier is not None else ""),
                                                 lambda: ctx.broadcast((plan, lineage_view), what="restore plan"))
    if isinstance(plan, BaseException):
        raise plan
    if not plan:
        head, _, newest, fork = lineage_view
        if newest is not None:  # steps some node holds but no tier can complete: a new segment, they go aside
            log.warning("no step is complete on every node%s (newest held: step %d); starting from scratch, and the "
                        "incomplete steps are set aside at the first save", " or in the durable tier"
                        if tier is not None else "", newest)
            return Resumed(None, "none", Lineage(run=fork[0], since=fork[1]) if nodes.is_leader else None)
        log.info("no committed checkpoint on any node%s; starting from scratch",
                 f" (the durable tier {tier.url} answered: no committed step)" if tier is not None else "")
        return None

    def attempt(candidate: tuple[int, dict[int, str]]) -> tuple[int, str]:
        cand, actions = candidate
        action = actions[nodes.node]
        error: tuple[bool, str] | None = None  # (an outage?, message)
        if nodes.is_leader and action != "local":
            try:
                if not read_only:
                    set_aside_superseded(root / naming.name(cand))  # a superseded copy: kept aside, not replaced
                t0 = time.monotonic()
                tier.fetch(cand, root, node=nodes.node if action == "node" else None)
                log.info("[node %d] fetched %d file(s) of step %d from %s in %.3f s", nodes.node,
                         len(tier.last_download), cand, tier.describe(cand), time.monotonic() - t0)
            except (CheckpointError, OSError, ValueError) as exc:
                error = (isinstance(exc, DurableUnavailableError), f"node {nodes.node}: {type(exc).__name__}: {exc}")
        fetching = "" if tier is None else f" (fetching step {cand} from {tier.describe(cand)})"
        errors = [e for e in waiting_for_coordinator(
            ctx, tier, f"restoring step {cand}{fetching}",
            functools.partial(ctx.all_gather, error, what="fetch checkpoint"), whom="the node leaders") if e]
        if any(down for down, _ in errors):
            raise DurableUnavailableError(f"step {cand} could not be fetched: "
                                          f"{next(m for down, m in errors if down)}")
        if errors:
            raise CheckpointCorruptError(f"step {cand} could not be fetched: {errors[0][1]}")
        load(root / naming.name(cand))
        return cand, action

    def fall_back(failed: tuple[int, Any], nxt: tuple[int, Any], exc: BaseException) -> None:
        if nxt[0] == failed[0]:
            log.warning("a local copy of step %d is not usable (%s); taking step %d from the durable tier %s",
                        failed[0], exc, failed[0], tier.describe(failed[0]))
        else:
            log.warning("step %d is not usable (%s); falling back to step %d", failed[0], exc, nxt[0])

    cand, action = first_usable(plan, attempt, fall_back, durable=lambda c: set(c[1].values()) != {"local"})
    local = root / naming.name(cand)
    source = {"local": "local", "node": "durable-node", "full": "durable-full"}[action]
    log.info("[rank %d] restored step %d from %s (%s)", ctx.rank, cand, local, source)
    lineage = None
    if nodes.is_leader:
        head, complete, newest, fork = lineage_view
        restored = read_manifest(local).lineage
        lineage = successor(restored, cand, newest=complete and cand == newest and restored.run == head.run,
                            fork=fork)
    return Resumed(cand, source, lineage)
