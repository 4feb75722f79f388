"""torch_ckpt.root._nodes: the node of each rank (from torchrun's environment) and the agreed NodeLayout."""

from __future__ import annotations

import pytest

from torch_ckpt.errors import ConfigError
from torch_ckpt.format._files import metadata_name
from torch_ckpt.root._nodes import NodeLayout, env_node

NODE_VARS = ("GROUP_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Start every test without torchrun's node variables."""
    for var in NODE_VARS:
        monkeypatch.delenv(var, raising=False)


def test_group_rank_comes_first(monkeypatch):
    """GROUP_RANK wins over NODE_RANK and LOCAL_WORLD_SIZE."""
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert env_node(0) == 3


def test_node_rank_when_no_group_rank(monkeypatch):
    """Without GROUP_RANK (or with it empty), NODE_RANK gives the node."""
    monkeypatch.setenv("GROUP_RANK", "")
    monkeypatch.setenv("NODE_RANK", "2")
    assert env_node(0) == 2


def test_rank_over_local_world_size(monkeypatch):
    """Without node variables, the node is rank // LOCAL_WORLD_SIZE."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert [env_node(r) for r in (0, 3, 4, 9)] == [0, 0, 1, 2]


@pytest.mark.parametrize("local", ["", "0", "x"])
def test_no_usable_variable_means_node_zero(monkeypatch, local):
    """Without any usable variable every rank is on node 0 (a single machine)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert env_node(7) == 0


@pytest.mark.parametrize("var,value", [("GROUP_RANK", "-1"), ("NODE_RANK", "one"), ("GROUP_RANK", "1.5")])
def test_malformed_node_variable_is_a_config_error(monkeypatch, var, value):
    """A node variable that is not a non-negative integer raises ConfigError naming it."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var}={value!r}"):
        env_node(0)


def test_normalise_numbers_nodes_by_their_lowest_rank():
    """Arbitrary node ids become 0..N-1 in the order their first rank appears."""
    assert NodeLayout.normalise([7, 7, 2, 9, 2]) == (0, 0, 1, 2, 1)


def test_layout_of_interleaved_ranks():
    """node, node_count, ranks_of and leader_of follow rank_node even when nodes interleave."""
    layout = NodeLayout(rank_node=(0, 1, 0, 1), rank=3)
    assert layout.node == 1 and layout.node_count == 2
    assert layout.ranks_of(1) == [1, 3] and layout.leader_of(1) == 1


def test_leader_is_the_lowest_rank_of_its_node():
    """Only the lowest rank of a node is its leader."""
    rank_node = (0, 1, 0, 1)
    assert [NodeLayout(rank_node, r).is_leader for r in range(4)] == [True, True, False, False]


def test_metadata_name_is_per_node_and_sortable():
    """Each node's metadata file has its own zero-padded name."""
    assert metadata_name(3) == "node_00003.metadata" and metadata_name(3) != metadata_name(30)


def test_a_node_local_root_that_cannot_be_created_is_a_write_error_naming_it(tmp_path):
    """A node-local root whose parent is a file is refused with CheckpointWriteError naming the root."""
    from torch_ckpt import CheckpointManager, CheckpointWriteError

    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(CheckpointWriteError, match=r"cannot create checkpoint root .*afile/run"):
        CheckpointManager(tmp_path / "afile" / "run", local_root_shared=False, async_save=False)


def _one_node_save(path):
    """A one-rank DCP save with the node-local writer and planner; returns the writer."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torch_ckpt.root._nodes import NodeDedupPlanner, RecordingWriter

    writer = RecordingWriter(path, rank_node=(0,))
    dcp.save({"a": torch.ones(3), "b": torch.zeros(2)}, storage_writer=writer, planner=NodeDedupPlanner((0,)),
             no_dist=True)
    return writer


def test_the_node_local_writer_leaves_the_metadata_to_the_leaders(tmp_path):
    """A node-local save's DCP pass writes no .metadata (each leader writes its node's views instead)."""
    writer = _one_node_save(tmp_path)
    assert writer.metadata is not None and not (tmp_path / ".metadata").exists()


def test_node_views_carry_the_dcp_version_and_storage_meta(tmp_path):
    """The complete view records DCP's format version and this save's storage meta, as DCP's own file did."""
    import pickle

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from torch_ckpt.root._nodes import node_views

    writer = _one_node_save(tmp_path)
    view = pickle.loads(node_views(writer.metadata, writer.results, (0,))[None])
    assert view.version == CURRENT_DCP_VERSION and view.storage_meta.checkpoint_id == writer.checkpoint_id


def test_a_node_without_replicas_shares_the_complete_view_pickled_once(tmp_path, monkeypatch):
    """One node holds no replicas: its view is the complete one, and it is pickled once."""
    import pickle

    from torch_ckpt.root import _nodes

    writer = _one_node_save(tmp_path)
    calls = []
    dumps = pickle.dumps
    monkeypatch.setattr(_nodes.pickle, "dumps", lambda obj: calls.append(obj) or dumps(obj))
    views = _nodes.node_views(writer.metadata, writer.results, (0,))
    assert views[0] == views[None] and len(calls) == 1
