"""Multi-process tests: 2 and 4 CPU ranks with gloo (DDP, FSDP2 resharding, failures, timeouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from torch_ckpt import CheckpointError, CheckpointManager, TrainState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH = 32


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, 4))


def _train(model, opt, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, WIDTH, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Full (unsharded) model and optimizer tensors, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from torch_ckpt.format._files import split_state

    msd, osd = get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True))
    tensors, _ = split_state({"model": msd, "optimizer": osd})
    return {k: v.clone() for k, v in tensors.items()}


def _fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _save_sharded(rank, world, root, kind):
    model = _model()
    if kind == "fsdp":
        model = _fsdp(model)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    state = TrainState(model=model, optimizer=opt)
    with CheckpointManager(root) as mgr:
        mgr.save(2, state).wait()
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, Path(root) / "reference.pt")


def _load_and_compare(rank, world, root, kind):
    model = _model(seed=99)
    if kind == "fsdp":
        model = _fsdp(model)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizer=opt)
    with CheckpointManager(root, on_world_size_change="keep_live") as mgr:
        assert mgr.restore(state) == 2
    got = _full_state(model, opt)
    ref = torch.load(Path(root) / "reference.pt", weights_only=True)
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def _load_single(root):
    """Load on one process without a process group and compare to the reference."""
    model = _model(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, on_world_size_change="keep_live") as mgr:
        assert mgr.restore(TrainState(model=model, optimizer=opt)) == 2
    got = _full_state(model, opt)
    ref = torch.load(Path(root) / "reference.pt", weights_only=True)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_fsdp2_two_ranks_reshards_to_one_and_four(tmp_path):
    """FSDP2 on 2 ranks loads bit-exactly on 1 rank and into FSDP2 on 4 ranks."""
    run_distributed(_save_sharded, 2, str(tmp_path), "fsdp")
    _load_single(str(tmp_path))
    run_distributed(_load_and_compare, 4, str(tmp_path), "fsdp")


def test_ddp_two_ranks_spreads_writes_and_loads_on_one(tmp_path):
    """DDP on 2 ranks: replicated tensors are written once, spread over both ranks; loads on 1 rank."""
    run_distributed(_save_sharded, 2, str(tmp_path), "ddp")
    step_dir = tmp_path / "step_000000002"
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    shard_bytes = {name: info["bytes"] for name, info in files.items() if name.endswith(".distcp")}
    per_rank = {r: sum(b for n, b in shard_bytes.items() if n.startswith(f"__{r}_")) for r in (0, 1)}
    assert all(b > 0 for b in per_rank.values())  # both ranks wrote part of the data
    model = _model()  # the same state saved by one process: the bytes a single copy takes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with CheckpointManager(tmp_path / "single") as mgr:
        mgr.save(2, TrainState(model=model, optimizer=opt)).wait()
    single = json.loads((tmp_path / "single" / "step_000000002" / "manifest.json").read_text())["files"]
    one_copy = sum(f["bytes"] for n, f in single.items() if n.endswith(".distcp"))
    assert abs(sum(shard_bytes.values()) - one_copy) < 0.1 * one_copy  # written once in total, not per rank
    _load_single(str(tmp_path))
    run_distributed(_load_and_compare, 2, str(tmp_path), "ddp")


def test_single_process_checkpoint_loads_into_fsdp2(tmp_path):
    """A checkpoint saved by one process loads into FSDP2 on 2 ranks."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, TrainState(model=model, optimizer=opt)).wait()
    torch.save(_full_state(model, opt), tmp_path / "reference.pt")
    run_distributed(_load_and_compare, 2, str(tmp_path), "fsdp")


def _one_rank_fails(rank, world, root):
    import torch_ckpt.save._persist as persist_mod

    if rank == 1:
        real = persist_mod.write_json_durable

        def broken(path, obj):
            if "rank_" in str(path):
                raise OSError(28, "No space left on device")
            return real(path, obj)

        persist_mod.write_json_durable = broken
    model = torch.nn.parallel.DistributedDataParallel(_model())
    with CheckpointManager(root) as mgr:
        mgr.save(1, TrainState(model=model))
        try:
            mgr.wait()
        except CheckpointError as exc:
            assert "rank 1" in str(exc) or exc.errno == 28, str(exc)
        else:
            raise AssertionError(f"rank {rank}: the failed save did not raise")
        assert mgr.all_steps() == []
        assert not list(Path(root).glob(".step_*"))


def test_one_failing_rank_fails_the_save_everywhere(tmp_path):
    """A write error on rank 1 means no commit and an error on every rank, not a hang."""
    run_distributed(_one_rank_fails, 2, str(tmp_path))


def _lonely_save(rank, world, root):
    model = _model()
    with CheckpointManager(root, timeout_seconds=5) as mgr:
        if rank == 0:
            try:
                mgr.save(1, TrainState(model=model))
                mgr.wait()
            except CheckpointError as exc:
                assert any(s in str(exc) for s in ("timed out", "failed across ranks", "not committed")), str(exc)
            else:
                raise AssertionError("a save on one rank only did not fail")
        dist.barrier()


def test_save_on_one_rank_only_times_out(tmp_path):
    """A rank calling save() alone fails within the configured timeout with a clear error."""
    run_distributed(_lonely_save, 2, str(tmp_path), timeout_s=90)


def _rank_local_state(rank, world, root):
    torch.manual_seed(1000 + rank)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    with CheckpointManager(root) as mgr:
        mgr.save(1, TrainState(model=model)).wait()
    expected = torch.rand(3)
    torch.manual_seed(0)
    with CheckpointManager(root) as mgr:
        mgr.restore(TrainState(model=model))
    assert torch.equal(torch.rand(3), expected), f"rank {rank} RNG not restored per rank"


def test_rng_is_restored_per_rank(tmp_path):
    """Each rank gets its own RNG stream back, not rank 0's."""
    run_distributed(_rank_local_state, 2, str(tmp_path))


def test_world_size_change_with_rank_local_state_is_an_error(tmp_path):
    """Loading a 2-rank TrainState on 1 rank names the on_world_size_change option."""
    run_distributed(_save_sharded, 2, str(tmp_path), "ddp")
    model = _model()
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointError, match="on_world_size_change"):
        mgr.restore(TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters())))


def _back_to_back(rank, world, root):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizer=opt)
    with CheckpointManager(root, keep_last=3) as mgr:
        for step in range(1, 11):
            _train(model, opt, steps=1)
            mgr.save(step, state)
            dist.barrier()  # a collective on the training group while the save is in flight
        mgr.wait()
        assert mgr.all_steps() == [8, 9, 10]


def test_ten_back_to_back_async_saves_with_training_barriers(tmp_path):
    """Ten async saves on 2 ranks interleaved with training-group barriers all commit without a hang."""
    run_distributed(_back_to_back, 2, str(tmp_path))


def _rank0_alone(rank, world, root):
    from torch_ckpt.save import AsyncCheckpointer

    if rank == 0:
        with AsyncCheckpointer(distributed=False) as ck:
            ck.save(Path(root) / "solo", {"w": torch.arange(4.0)}, step=1).wait()
            target = {"w": torch.zeros(4)}
            ck.load(Path(root) / "solo", target)
            assert torch.equal(target["w"], torch.arange(4.0))
    dist.barrier()


def test_non_collective_checkpointer_saves_on_one_rank(tmp_path):
    """AsyncCheckpointer(distributed=False) lets one rank of a job save and load alone, without a hang."""
    run_distributed(_rank0_alone, 2, str(tmp_path), timeout_s=90)


# -- agreement before a save is submitted (issue 13 item 5) -------------------------------------------
def _one_rank_refuses_a_value(rank, world, root, async_save, persist="thread"):
    import numpy as np

    from torch_ckpt import ConfigError

    model = torch.nn.parallel.DistributedDataParallel(_model())
    with CheckpointManager(root, timeout_seconds=20, async_save=async_save, persist=persist) as mgr:
        state = {"model": model.state_dict(), "extra": {"v": np.array([None, 0.5]) if rank == 1 else 1}}
        try:
            mgr.save(1, state)
        except ConfigError as exc:
            assert ("extra.v" in str(exc)) if rank == 1 else ("rank 1" in str(exc) and "extra.v" in str(exc)), str(exc)
        else:
            raise AssertionError(f"rank {rank}: save(1) did not raise although rank 1 could not prepare it")
        dist.barrier()  # a training-group collective in between, as a training step would do
        mgr.save(2, {"model": model.state_dict(), "extra": {"v": 2}})
        mgr.wait()
        assert mgr.all_steps() == [2] and mgr.latest_step() == 2
        assert not list(Path(root).glob(".step_*"))


@pytest.mark.parametrize("async_save,persist", [(True, "thread"), (False, "thread")], ids=["async", "sync"])
def test_a_rank_failing_inside_save_makes_every_rank_raise_and_later_saves_work(tmp_path, async_save, persist):
    """Rank 1 refuses a value in save(1): both ranks raise for step 1 at once; save(2) then commits normally."""
    run_distributed(_one_rank_refuses_a_value, 2, str(tmp_path), async_save, persist, timeout_s=120)


def _ranks_pass_different_steps(rank, world, root):
    from torch_ckpt import ConfigError

    with CheckpointManager(root, timeout_seconds=20) as mgr:
        try:
            mgr.save(1 + rank, {"w": torch.ones(2)})
        except ConfigError as exc:
            assert "disagree" in str(exc) and "rank 1: step 2" in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: different steps were not refused")
        mgr.save(3, {"w": torch.ones(2)}).wait()
        assert mgr.all_steps() == [3]


def test_ranks_saving_different_steps_are_refused_on_every_rank(tmp_path):
    """save(1) on rank 0 and save(2) on rank 1 raise ConfigError on both ranks; nothing is committed."""
    run_distributed(_ranks_pass_different_steps, 2, str(tmp_path), timeout_s=120)


def _ranks_pass_different_directories(rank, world, root):
    from torch_ckpt import ConfigError
    from torch_ckpt.save import AsyncCheckpointer

    with AsyncCheckpointer(timeout_seconds=20) as ck:
        try:
            ck.save(Path(root) / f"rank{rank}" / "payload", {"w": torch.ones(2)}, step=1)
        except ConfigError as exc:
            assert "disagree" in str(exc) and "rank1" in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: different directories were not refused")
        ck.save(Path(root) / "shared", {"w": torch.ones(2)}, step=1).wait()
    assert not (Path(root) / "rank0" / "payload").exists() and (Path(root) / "shared" / "manifest.json").exists()


def test_ranks_saving_into_different_directories_are_refused_on_every_rank(tmp_path):
    """AsyncCheckpointer.save into a per-rank directory (the Accelerate case) raises on every rank; nothing written."""
    run_distributed(_ranks_pass_different_directories, 2, str(tmp_path), timeout_s=120)


def _new_run_below_earlier_steps(rank, world, root):
    from torch_ckpt import ConfigError

    with CheckpointManager(root) as mgr:
        mgr.save(5, {"w": torch.ones(2)}).wait()
    with CheckpointManager(root) as mgr:
        try:
            mgr.save(1, {"w": torch.ones(2)})
        except ConfigError as exc:
            assert "[5]" in str(exc) and "on_existing_newer" in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: saving below an earlier run's step 5 was not refused")
        assert mgr.all_steps() == [5]
    with CheckpointManager(root, on_existing_newer="supersede") as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        assert mgr.all_steps() == [1]


def test_new_run_below_an_earlier_runs_step_is_refused_on_every_rank(tmp_path):
    """Rank 0 finds the earlier run's step 5: both ranks raise ConfigError; on_existing_newer='supersede' saves."""
    run_distributed(_new_run_below_earlier_steps, 2, str(tmp_path), timeout_s=120)
def _fsdp2_initial_save_and_fresh_restore(rank, world, root):
    ref_model = _fsdp(_model())
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _train(ref_model, ref_opt)
    model = _fsdp(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root) as mgr:
        mgr.save(0, TrainState(model=model, optimizer=opt)).wait()  # before the first step
        assert not opt.state
        _train(model, opt)
        mgr.save(2, TrainState(model=model, optimizer=opt)).wait()
    ref, got = _full_state(ref_model, ref_opt), _full_state(model, opt)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    fresh = _fsdp(_model(seed=99))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)  # no state: restored state is placed as DTensors
    with CheckpointManager(root) as mgr:
        assert mgr.restore(TrainState(model=fresh, optimizer=fresh_opt)) == 2
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    _train(model, opt, steps=1)
    _train(fresh, fresh_opt, steps=1)
    ref, got = _full_state(model, opt), _full_state(fresh, fresh_opt)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_fsdp2_initial_save_changes_nothing_and_fresh_optimizer_restores(tmp_path):
    """FSDP2, 2 ranks: a save before the first step changes nothing later; a fresh optimizer restores the state."""
    run_distributed(_fsdp2_initial_save_and_fresh_restore, 2, str(tmp_path))


def _background_staging_fails_on_rank1(rank, world, root):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt)
    # a collective timeout far beyond the run's own (120 s below): a rank that waited for it fails as hung
    with CheckpointManager(root, timeout_seconds=3600, overlap_staging=True) as mgr:
        ck = mgr.checkpointer
        if rank == 1:
            def broken(job, handle):
                raise RuntimeError("simulated copy failure on rank 1")
            ck._stage = broken
        handle = mgr.save(1, TrainState(model=model, optimizer=opt))
        with pytest.raises(CheckpointError, match="rank 1"):
            mgr.wait()
        assert handle.committed.exception() is not None
        if rank == 1:
            del ck._stage
        mgr.save(2, TrainState(model=model, optimizer=opt)).wait()
        assert mgr.all_steps() == [2]


def test_background_staging_failure_on_one_rank_fails_every_rank_at_once(tmp_path):
    """overlap_staging: rank 1's background copy fails; both ranks fail step 1, not at the timeout; step 2 commits."""
    run_distributed(_background_staging_fails_on_rank1, 2, str(tmp_path), timeout_s=120)


def _one_rank_without_tensors(rank, world, root):
    def build(v):  # rank 1's state has values only: it has no tensor to read
        return {"a": torch.full((5000,), float(v))} if rank == 0 else {"meta": {"x": v}}

    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, build(1))
    fresh = build(-1)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(fresh) == 1
    dist.barrier()  # paired with a rank still inside the collective read, this would fail
    assert (torch.equal(fresh["a"], torch.full((5000,), 1.0)) if rank == 0 else fresh == {"meta": {"x": 1}})


def test_a_rank_without_tensors_still_joins_the_collective_read(tmp_path):
    """A rank whose state holds no tensors restores with the others from a shared root (it joins DCP's read)."""
    run_distributed(_one_rank_without_tensors, 2, str(tmp_path), timeout_s=120)
