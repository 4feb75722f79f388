"""What dcp.save is handed (format._dcp_plan): grouped top-level keys, unchanged checkpoint keys and metadata."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from torch_ckpt.format._dcp_write import FlatKeysSavePlanner, group_by_first_segment
from torch_ckpt.format._files import read_dcp_metadata


def _flat() -> dict:
    return {"model.layer.0.weight": torch.ones(3), "model.layer.0.bias": torch.zeros(2), "step": torch.tensor(4),
            "optim.state.0.exp_avg": torch.full((3,), 2.0), "x.": torch.ones(1), ".y": torch.ones(1),
            "a..b": torch.ones(1), "lists.l": [torch.ones(1), torch.zeros(1)]}


def test_grouping_keeps_every_checkpoint_key_and_value():
    """DCP's flattening of the grouped view gives exactly the flat dict's keys, holding the same tensors."""
    flat = _flat()
    grouped = group_by_first_segment(flat)
    assert len(grouped) < len(flat)
    a, _ = flatten_state_dict(flat)
    b, _ = flatten_state_dict(grouped)
    assert list(a) == list(b) and all(a[k] is b[k] for k in a)


@pytest.mark.parametrize("flat", [
    {"a": torch.ones(1), "a.b": torch.ones(1)},
    {"a.b": torch.ones(1), "a": torch.ones(1)},
    {"a.b": torch.ones(1), 3: torch.ones(1)},
], ids=["key-then-prefix", "prefix-then-key", "non-string-key"])
def test_keys_that_grouping_could_change_leave_the_dict_flat(flat):
    """A key that is also another key's first segment, or a non-string key, disables grouping."""
    assert group_by_first_segment(flat) == flat


def test_a_callers_dict_value_is_never_extended():
    """A value that is itself a dict under a bare key is not merged with 'key.rest' entries (flat instead)."""
    inner = {"c": torch.ones(1)}
    flat = {"a": inner, "a.b": torch.ones(1)}
    assert group_by_first_segment(flat) == flat and list(inner) == ["c"]


def test_grouped_save_writes_the_same_metadata_as_a_flat_one(tmp_path):
    """Same tensor keys, same planner_data ((fqn,) per key) in .metadata as DCP's default planner on the flat dict."""
    flat = {k: v for k, v in _flat().items() if not isinstance(v, list)}
    dcp.save(flat, checkpoint_id=str(tmp_path / "flat"), planner=DefaultSavePlanner(), no_dist=True)
    dcp.save(group_by_first_segment(flat), checkpoint_id=str(tmp_path / "grouped"), planner=FlatKeysSavePlanner(),
             no_dist=True)
    a, b = read_dcp_metadata(tmp_path / "flat" / ".metadata"), read_dcp_metadata(tmp_path / "grouped" / ".metadata")
    assert a.state_dict_metadata.keys() == b.state_dict_metadata.keys() == flat.keys()
    assert a.planner_data == b.planner_data == {k: (k,) for k in flat}
    back = {k: torch.empty_like(v) for k, v in flat.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "grouped"), no_dist=True)
    assert all(torch.equal(back[k], flat[k]) for k in flat)


def _local_plan(state):
    planner = FlatKeysSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return planner, planner.create_local_plan()


def test_one_ranks_plan_is_not_deduplicated_again():
    """A single rank's plan is taken as it is (nothing to deduplicate)."""
    planner, plan = _local_plan({"a": torch.ones(2)})
    assert planner._dedup_save_plans([plan])[0] is plan


def test_two_ranks_plans_are_still_deduplicated():
    """A tensor two ranks hold is written by one of them."""
    planner, plan = _local_plan({"a": torch.ones(2)})
    assert sum(len(p.items) for p in planner._dedup_save_plans([plan, plan])) == 1
