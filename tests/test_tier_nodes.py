"""Node-local checkpoints on the durable tier: which files are uploaded, and which a node fetches back.

Only the pure manifest functions are covered here; uploads through a durable tier are in test_cluster_tiers.py.
"""

from __future__ import annotations

import pytest

from torch_ckpt.root._layout import Manifest
from torch_ckpt.root._nodes import is_replica_file
from torch_ckpt.tiers._durable import durable_manifest, fetch_set, node_fetch_manifest

INFO = {"bytes": 1, "crc32": 0}


def node_local_manifest() -> Manifest:
    """Two nodes of two ranks each: own shards, one replica file per node, per-node metadata."""
    file_node = {".metadata": 0, "node_00000.metadata": 0, "node_00001.metadata": 1,
                 "__0_0.distcp": 0, "__1_0.distcp": 0, "__2_0.distcp": 1, "__3_0.distcp": 1,
                 "__2_replica_0.distcp": 1, "rank_00000.json": 0, "rank_00002.json": 1}
    return Manifest(step=5, world_size=4, files={n: dict(INFO) for n in file_node},
                    nodes={"rank_node": [0, 0, 1, 1], "file_node": file_node, "shared": ["__1_0.distcp"]},
                    node=1, tiers={"durable": {"url": "s3://b"}})


@pytest.mark.parametrize("name,expected", [("__2_replica_0.distcp", True), ("__0_0.distcp", False),
                                           ("replica_0.distcp", False), ("x_replica_0.distcp", False),
                                           ("rank_00000.json", False)])
def test_is_replica_file(name, expected):
    """Only DCP data files carrying the replica tag are replica files."""
    assert is_replica_file(name) is expected


def test_durable_manifest_drops_replicas_and_node_metadata():
    """The durable copy lists every file but replica files and per-node metadata, as a complete copy."""
    durable = durable_manifest(node_local_manifest())
    assert sorted(durable.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
                                     "rank_00000.json", "rank_00002.json"]
    assert set(durable.nodes["file_node"]) == set(durable.files)
    assert durable.node is None and durable.tiers == {} and durable.nodes["shared"] == ["__1_0.distcp"]


def test_fetch_set_is_own_files_plus_shared_plus_metadata():
    """A node fetches its own uploaded files, the shared ones and the complete .metadata."""
    durable = durable_manifest(node_local_manifest())
    assert fetch_set(durable, 1) == [".metadata", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "rank_00002.json"]


def test_node_fetch_manifest_marks_the_held_files():
    """The fetched copy of a node is that node's copy, holding its fetch set and loading with .metadata."""
    durable = durable_manifest(node_local_manifest())
    fetched = node_fetch_manifest(durable, 1, "s3://b/step_5")
    assert fetched.node == 1 and fetched.nodes["held"] == fetch_set(durable, 1)
    assert fetched.nodes["metadata"] == ".metadata"
    assert sorted(fetched.local_files()) == fetch_set(durable, 1)


def test_node_fetch_manifest_of_a_shared_root_checkpoint_is_refused():
    """A checkpoint without node copies raises ValueError naming where it is."""
    with pytest.raises(ValueError, match="s3://b/step_5 was written to a shared root"):
        node_fetch_manifest(Manifest(step=5, world_size=1, files={}), 0, "s3://b/step_5")
