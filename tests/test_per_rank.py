"""Values that differ per rank come back per rank (issue 26 item 2): extras, plain dicts, Statefuls; tiers, nodes."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointManager, ConfigError, StateMismatchError, TrainState
from torch_ckpt.format._files import read_metadata, tensor_items
from torch_ckpt.root._layout import read_manifest

pytestmark = [pytest.mark.timeout(300)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _ema(rank: int) -> torch.Tensor:
    return torch.full((3 + rank,), 10.0 + rank)  # a shape of its own on every rank, too


def _state(rank: int | None) -> TrainState:
    """The issue's state (rank None: a fresh one to restore into)."""
    if rank is None:
        return TrainState(model=_model(), extras={"ema_loss": torch.zeros(1), "py_loss": 0.0}, rng=False)
    return TrainState(model=_model(), extras={"ema_loss": _ema(rank), "py_loss": 10.0 + rank}, rng=False)


def _check(state: TrainState, rank: int) -> None:
    got = state.extras["ema_loss"]
    assert torch.equal(got, _ema(rank)), (rank, got)
    assert state.extras["py_loss"] == 10.0 + rank


def _save(rank, world, root, persist="thread", **kwargs):
    with CheckpointManager(root, persist=persist, **kwargs) as mgr:
        mgr.save(1, _state(rank)).wait()


def _restore_fresh(rank, world, root, **kwargs):
    fresh = _state(None)
    fresh.extras["ema_loss"] = torch.zeros(3 + rank)
    with CheckpointManager(root, **kwargs) as mgr:
        assert mgr.restore(fresh) == 1
    _check(fresh, rank)


def _round_trip(rank, world, root, persist):
    _save(rank, world, root, persist)
    _restore_fresh(rank, world, root, read_only=True)


@pytest.mark.parametrize("persist", ["thread", "process"])
def test_extras_tensor_comes_back_per_rank_on_two_ranks(tmp_path, persist):
    """2 ranks, a tensor of its own shape and a float per rank in extras: each rank gets its own back."""
    run_distributed(_round_trip, 2, str(tmp_path), persist, daemon=persist == "thread")


@pytest.mark.slow
def test_extras_tensor_comes_back_per_rank_on_four_ranks(tmp_path):
    """4 ranks: each rank gets its own extras tensor back."""
    run_distributed(_round_trip, 4, str(tmp_path), "thread")


def test_per_rank_tensors_are_stored_under_rank_keys(tmp_path):
    """Rank 0's extras tensor keeps its key, rank 1's is stored under __rank1__.; the model once, under its key."""
    run_distributed(_save, 2, str(tmp_path))
    step_dir = tmp_path / "step_000000001"
    keys = set(tensor_items(read_metadata(step_dir, read_manifest(step_dir))))
    assert keys == {"model.weight", "model.bias", "extras.ema_loss", "__rank1__.extras.ema_loss"}


def _plain_dict_and_stateful(rank, world, root):
    class Counter:  # a user Stateful holding a tensor
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"sd": {"count": self.value}}

        def load_state_dict(self, sd):
            self.value = sd["sd"]["count"]

    with CheckpointManager(Path(root) / "dict") as mgr:
        mgr.save(1, {"w": torch.full((2,), float(rank)), "n": rank}).wait()
        live = {"w": torch.zeros(2), "n": -1}
        assert mgr.restore(live) == 1
    assert torch.equal(live["w"], torch.full((2,), float(rank))) and live["n"] == rank
    with CheckpointManager(Path(root) / "stateful") as mgr:
        mgr.save(1, Counter(torch.tensor([rank, rank]))).wait()
        counter = Counter(torch.zeros(2, dtype=torch.int64))
        assert mgr.restore(counter) == 1
    assert counter.value.tolist() == [rank, rank]


def test_plain_dict_and_stateful_tensors_come_back_per_rank(tmp_path):
    """2 ranks: tensors of a plain-dict state and of a user Stateful come back per rank."""
    run_distributed(_plain_dict_and_stateful, 2, str(tmp_path))


class _SharedEma(TrainState):
    replicated_keys = ("model", "optimizer", "extras.ema_loss")


def _declared_replicated_disagree(rank, world, root):
    state = _SharedEma(model=_model(), extras={"ema_loss": _ema(rank)}, rng=False)
    with CheckpointManager(root) as mgr:
        with pytest.raises(ConfigError, match=r"'extras.ema_loss' \(rank 0: replicated \[3\] float32, rank 1: "
                                              r"replicated \[4\] float32\)"):
            mgr.save(1, state)
        state.extras["ema_loss"] = torch.full((3,), 7.0)  # now the same shape everywhere: the save commits
        mgr.save(2, state).wait()
        assert mgr.all_steps() == [2]


def test_replicated_tensor_with_different_shapes_is_refused_at_save(tmp_path):
    """A tensor declared replicated with a shape of its own per rank is refused on every rank, naming key and ranks."""
    run_distributed(_declared_replicated_disagree, 2, str(tmp_path))


def _declared_replicated_round_trip(rank, world, root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, _SharedEma(model=_model(), extras={"ema_loss": torch.full((3,), 5.0)}, rng=False)).wait()
        fresh = TrainState(model=_model(), extras={"ema_loss": torch.zeros(3)}, rng=False)
        assert mgr.restore(fresh) == 1  # the checkpoint's tree names the keys: a state declaring less still loads
    assert torch.equal(fresh.extras["ema_loss"], torch.full((3,), 5.0))


def test_declared_replicated_tensor_is_stored_once_and_restores(tmp_path):
    """An extras tensor the state declares replicated is stored once (its plain key) and restores on every rank."""
    run_distributed(_declared_replicated_round_trip, 2, str(tmp_path))
    step_dir = tmp_path / "step_000000001"
    assert set(tensor_items(read_metadata(step_dir, read_manifest(step_dir)))) == {
        "model.weight", "model.bias", "extras.ema_loss"}


def _restore_mismatch(rank, world, root):
    state = TrainState(model=torch.nn.Linear(4, 2 if rank == 0 else 3), rng=False,
                       extras={"ema_loss": torch.zeros(3 + rank), "py_loss": 0.0})
    with CheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(state, step=1)
    if rank == 0:
        assert "rank 1 cannot load this checkpoint" in str(info.value), str(info.value)
        assert "shapes differ" in str(info.value), str(info.value)


def test_state_mismatch_on_one_rank_is_a_mismatch_on_every_rank(tmp_path):
    """Rank 1's live model differs: rank 1 and rank 0 raise StateMismatchError (never 'corrupt'), naming rank 1."""
    run_distributed(_save, 2, str(tmp_path))
    run_distributed(_restore_mismatch, 2, str(tmp_path))


def _restore_resized(rank, world, root):
    fresh = _state(None)
    fresh.extras["ema_loss"] = torch.zeros(3)
    with CheckpointManager(root, read_only=True, on_world_size_change="keep_live") as mgr:
        assert mgr.restore(fresh) == 1
    _check(fresh, 0)


@pytest.mark.slow
def test_world_size_change_gives_every_rank_rank0s_values(tmp_path):
    """Saved on 2 ranks, restored on 1 and on 4: every rank gets rank 0's extras (tensors and floats alike)."""
    run_distributed(_save, 2, str(tmp_path))
    _restore_resized(0, 1, str(tmp_path))
    run_distributed(_restore_resized, 4, str(tmp_path))


def _old_layout_save(rank, world, root):
    class OldLayout(TrainState):  # what every checkpoint before per-rank keys held: one key for every rank
        replicated_keys = ("model", "optimizer", "extras")

    with CheckpointManager(root) as mgr:
        mgr.save(1, OldLayout(model=_model(), extras={"ema_loss": torch.full((3,), 10.0 + rank)}, rng=False)).wait()


def _old_layout_restore(rank, world, root):
    fresh = TrainState(model=_model(), extras={"ema_loss": torch.zeros(3)}, rng=False)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(fresh) == 1
    assert torch.equal(fresh.extras["ema_loss"], torch.full((3,), 10.0))  # the one value such a checkpoint holds


def test_checkpoint_without_rank_keys_still_restores(tmp_path):
    """A checkpoint whose every rank names one shared extras key (the earlier layout) restores on 2 ranks."""
    run_distributed(_old_layout_save, 2, str(tmp_path))
    run_distributed(_old_layout_restore, 2, str(tmp_path))


def _save_durable(rank, world, root, url):
    _save(rank, world, root, durable_url=url)
    with CheckpointManager(root, durable_url=url) as mgr:
        assert mgr.wait_durable(60)


@pytest.mark.slow
def test_per_rank_values_come_back_from_a_file_durable_tier(tmp_path):
    """2 ranks, local copy deleted: each rank gets its own extras back from the file:// durable tier."""
    url = (tmp_path / "durable").as_uri()
    run_distributed(_save_durable, 2, str(tmp_path / "local"), url)
    shutil.rmtree(tmp_path / "local")
    run_distributed(functools.partial(_restore_fresh, durable_url=url), 2, str(tmp_path / "local"))


def _as_nodes(rank, world, per_node, fn, *args, **kwargs):
    os.environ.update(LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      GROUP_RANK=str(rank // per_node))
    fn(rank, world, *args, **kwargs)


def _node_save(rank, world, base, url, options):
    root = Path(base) / f"node{rank // 2}"
    with CheckpointManager(root, durable_url=url, storage_options=options) as mgr:
        mgr.save(1, _state(rank)).wait()
        assert mgr.wait_durable(60)


def _node_restore(rank, world, base, url, options):
    _restore_fresh(rank, world, str(Path(base) / f"node{rank // 2}"), durable_url=url, storage_options=options)


@pytest.mark.slow
def test_per_rank_values_come_back_on_node_local_roots_and_from_s3(tmp_path, s3):
    """4 ranks as 2 nodes with S3: each rank gets its own extras back; node 1's disk lost, again from S3."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    url = f"s3://{s3.new_bucket()}/run"
    run_distributed(_as_nodes, 4, 2, _node_save, str(tmp_path), url, s3.options, timeout_s=240)
    run_distributed(_as_nodes, 4, 2, _node_restore, str(tmp_path), url, s3.options, timeout_s=240)
    shutil.rmtree(tmp_path / "node1")
    run_distributed(_as_nodes, 4, 2, _node_restore, str(tmp_path), url, s3.options, timeout_s=240)


def test_split_state_names_per_rank_tensors_by_rank():
    """Rank 1's tensors outside replicated_keys get __rank1__. keys (placeholders too); replicated ones keep theirs."""
    from torch_ckpt.format._files import split_state

    sd = {"model": {"w": torch.zeros(2)}, "extras": {"e": torch.ones(1)}}
    tensors, tree = split_state(sd, replicated_keys=("model",), rank=1)
    assert set(tensors) == {"model.w", "__rank1__.extras.e"}
    assert tree["extras"]["e"] == {"__tensor__": "__rank1__.extras.e"}
    assert set(split_state(sd, replicated_keys=("model",), rank=0)[0]) == {"model.w", "extras.e"}


def test_logical_key_strips_the_rank_prefix_only():
    """logical_key undoes rank_key for every rank and leaves other keys alone."""
    from torch_ckpt.format._files import logical_key, rank_key

    assert [logical_key(rank_key("extras.e", r)) for r in (0, 1, 12)] == ["extras.e"] * 3
    assert logical_key("__rank__.x") == "__rank__.x" and logical_key("__rankx__.y") == "__rankx__.y"


def test_reserved_rank_prefix_in_a_state_key_is_refused():
    """A state key starting with __rank<N>__. is refused in save(), naming it."""
    from torch_ckpt.format._files import split_state

    with pytest.raises(ConfigError, match=r"__rank3__\.x"):
        split_state({"__rank3__": {"x": torch.zeros(1)}}, replicated_keys=(), rank=0)


def test_load_full_state_lists_each_ranks_extras(tmp_path):
    """load_full_state of a 2-rank checkpoint: per_rank[r]['extras'] holds rank r's own tensor and float."""
    from torch_ckpt import load_full_state

    run_distributed(_save, 2, str(tmp_path))
    state, _ = load_full_state(tmp_path / "step_000000001")
    assert torch.equal(state["extras"]["ema_loss"], _ema(0))
    for rank in (0, 1):
        assert torch.equal(state["per_rank"][rank]["extras"]["ema_loss"], _ema(rank))
        assert state["per_rank"][rank]["extras"]["py_loss"] == 10.0 + rank
