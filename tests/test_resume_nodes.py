"""restore._resume_nodes: what each node can restore from its own disk, and the plan over nodes and the durable tier.

The collective parts (restore_node_local, check_private_roots) run with several ranks in
test_cluster_tiers.py; here the per-node inventory and the coordinator's plan are checked alone.
"""

from __future__ import annotations

import zlib

from torch_ckpt.policy._naming import StepNaming
from torch_ckpt.restore._resume_nodes import _plan, local_inventory
from torch_ckpt.root._layout import MANIFEST_NAME, Manifest, write_json_durable
from torch_ckpt.root._nodes import NodeLayout

NAMING = StepNaming()
TWO_NODES = NodeLayout(rank_node=(0, 0, 1, 1), rank=0)


def commit(root, step, *, node=None, rank_node=(0, 0, 1, 1), data=b"shard"):
    """A committed copy of ``step``: a node's copy (``node`` set) or a complete one, holding one file."""
    d = root / NAMING.name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(data)
    files = {"__0_0.distcp": {"bytes": len(data), "crc32": zlib.crc32(data)}}
    nodes = {} if node is None else {"rank_node": list(rank_node), "file_node": {"__0_0.distcp": node}}
    write_json_durable(d / MANIFEST_NAME, Manifest(step=step, world_size=len(rank_node), files=files,
                                                   nodes=nodes, node=node).to_json())
    return d


def durable(rank_node=(0, 0, 1, 1)):
    """A durable manifest of a node-local checkpoint written with ``rank_node``."""
    return Manifest(step=0, world_size=len(rank_node), files={},
                    nodes={"rank_node": list(rank_node), "file_node": {}})


def test_inventory_lists_own_node_copies_and_complete_copies(tmp_path):
    """This node's copies count as "node", complete copies as "full"."""
    commit(tmp_path, 1, node=0)
    commit(tmp_path, 2)
    assert local_inventory(tmp_path, NAMING, TWO_NODES) == {1: "node", 2: "full"}


def test_inventory_leaves_out_another_nodes_copy(tmp_path):
    """A copy made for another node is not restorable here."""
    commit(tmp_path, 1, node=1)
    assert local_inventory(tmp_path, NAMING, TWO_NODES) == {}


def test_inventory_leaves_out_a_copy_of_another_layout(tmp_path):
    """A node copy written with another rank layout is not restorable at this layout."""
    commit(tmp_path, 1, node=0, rank_node=(0, 1, 1, 1))
    assert local_inventory(tmp_path, NAMING, TWO_NODES) == {}


def test_inventory_leaves_out_a_truncated_copy(tmp_path):
    """A copy whose listed file is missing or truncated is left out."""
    d = commit(tmp_path, 1, node=0)
    (d / "__0_0.distcp").write_bytes(b"sh")
    assert local_inventory(tmp_path, NAMING, TWO_NODES) == {}


def test_plan_prefers_local_copies_newest_first():
    """Steps every node holds locally are planned newest first, each node reading its own disk."""
    plan = _plan({0: {1: "node", 2: "node"}, 1: {1: "node", 2: "node"}}, {}, TWO_NODES, None)
    assert plan == [(2, {0: "local", 1: "local"}), (1, {0: "local", 1: "local"})]


def test_plan_fills_a_missing_node_from_the_durable_tier_same_layout():
    """A node without a local copy fetches only its own files when the durable copy has this layout;
    the whole step from the durable tier follows, should a local copy fail verification."""
    plan = _plan({0: {4: "node"}, 1: {}}, {4: durable()}, TWO_NODES, None)
    assert plan == [(4, {0: "local", 1: "node"}), (4, {0: "node", 1: "node"})]


def test_plan_fetches_everything_to_reshard_after_a_layout_change():
    """When the durable copy was written with another layout, a node without a copy fetches it whole."""
    plan = _plan({0: {}, 1: {}}, {4: durable((0, 1, 1, 1))}, TWO_NODES, None)
    assert plan == [(4, {0: "full", 1: "full"})]


def test_plan_skips_a_step_some_node_cannot_get():
    """A step one node lacks and the durable tier does not have is skipped for an older complete one."""
    plan = _plan({0: {5: "node", 3: "node"}, 1: {3: "node"}}, {}, TWO_NODES, None)
    assert [s for s, _ in plan] == [3]


def test_plan_for_an_explicit_step_considers_only_that_step():
    """With an explicit step, only it is planned (empty when some node cannot get it)."""
    inventories = {0: {5: "node", 3: "node"}, 1: {5: "node", 3: "node"}}
    assert [s for s, _ in _plan(inventories, {}, TWO_NODES, 3)] == [3]
    assert _plan({0: {3: "node"}, 1: {}}, {}, TWO_NODES, 3) == []
