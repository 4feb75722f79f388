"""persist_checkpoint: a save writes only its own incarnation's temporary and never commits for a dead owner."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointWriteError
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.root._layout import read_manifest, scan_committed
from torch_ckpt.save import AsyncCheckpointer
from torch_ckpt.save._persist import SaveRequest, persist_checkpoint


def _request(root: Path, *, step: int = 1, incarnation: str | None = "abcd", owner_alive=None) -> SaveRequest:
    return SaveRequest(final=root / f"step_{step:09d}", step=step, tensors={"w": torch.arange(1000.0)},
                          tree={"w": None}, tensor_bytes=4000, incarnation=incarnation, owner_alive=owner_alive)


class _Owner:
    """An ``owner_alive`` callable that records the root's entries at each call and dies after ``alive_for`` calls."""

    def __init__(self, root: Path, alive_for: int = 1 << 30) -> None:
        self.root, self.alive_for, self.seen = root, alive_for, []

    def __call__(self) -> bool:
        self.seen.append(sorted(os.listdir(self.root)) if self.root.exists() else [])
        return len(self.seen) <= self.alive_for


def test_save_writes_into_its_own_incarnations_temporary(tmp_path):
    """While step 1 is being written, the root shows only its reserved name (the partial is inside it)."""
    owner = _Owner(tmp_path / "step_000000001")
    persist_checkpoint(_request(tmp_path, owner_alive=owner), DistContext())
    assert owner.seen[-1] == [".torch-ckpt.partial.abcd"]  # the look right before the rename
    assert os.listdir(tmp_path) == ["step_000000001"]


@pytest.mark.parametrize("alive_for, phase", [(0, "before the write"), (1, "after the write"),
                                              (2, "right before the rename")])
def test_dead_owner_commits_nothing(tmp_path, alive_for, phase):
    """Once the owner is gone (before, during or at the end of the save) nothing is committed or left behind."""
    owner = _Owner(tmp_path, alive_for=alive_for)
    with pytest.raises(CheckpointWriteError, match="is gone"):
        persist_checkpoint(_request(tmp_path, owner_alive=owner), DistContext())
    assert len(owner.seen) == alive_for + 1, phase
    assert os.listdir(tmp_path) == []


def test_commit_never_touches_another_incarnations_temporary(tmp_path):
    """A temporary of the same step from another incarnation is neither written, renamed nor removed."""
    other = tmp_path / ".step_000000001.tmp.ffff"
    other.mkdir()
    (other / "manifest.json").write_bytes(b"the other incarnation's")
    persist_checkpoint(_request(tmp_path, incarnation="abcd"), DistContext())
    assert (other / "manifest.json").read_bytes() == b"the other incarnation's"
    assert os.listdir(other) == ["manifest.json"]
    assert read_manifest(tmp_path / "step_000000001").step == 1


def test_each_checkpointer_has_its_own_incarnation(tmp_path):
    """Two checkpointers (e.g. a run and its restart) name their temporaries with different ids."""
    with AsyncCheckpointer() as a, AsyncCheckpointer() as b:
        assert a.incarnation != b.incarnation


def test_checkpointer_commits_the_temporary_named_with_its_incarnation(tmp_path, monkeypatch):
    """AsyncCheckpointer.save commits `NAME/.torch-ckpt.partial.<its incarnation>` (process writer: elsewhere)."""
    import torch_ckpt.save._persist as persist_mod

    renamed: list[str] = []
    original = persist_mod.commit_dir
    monkeypatch.setattr(persist_mod, "commit_dir", lambda tmp, final, **kw: (renamed.append(Path(tmp).name),
                                                                         original(tmp, final)))
    with AsyncCheckpointer(thread_count=1) as ckpt:
        ckpt.save(tmp_path / "step_000000001", {"w": torch.ones(10)}, step=1).wait()
        assert renamed == [f".torch-ckpt.partial.{ckpt.incarnation}"]
    assert os.listdir(tmp_path) == ["step_000000001"]


def _two_ranks(rank: int, world_size: int, root: str, dead_rank: int | None) -> None:
    root_p = Path(root)
    ctx = DistContext(timeout_seconds=60)
    # each rank has its own incarnation; all write into rank 0's temporary
    req = replace(_request(root_p, incarnation=f"{rank + 10:x}", owner_alive=lambda: rank != dead_rank),
                  tensors={f"w{rank}": torch.full((100,), float(rank))})
    if dead_rank is None:
        assert persist_checkpoint(req, ctx)[0] == root_p / "step_000000001"
        assert set(read_manifest(root_p / "step_000000001").files) >= {"rank_00000.json", "rank_00001.json"}
    else:
        with pytest.raises(CheckpointWriteError):
            persist_checkpoint(req, ctx)
        ctx.barrier()
        assert scan_committed(root_p) == {} and os.listdir(root_p) == []
    ctx.destroy()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_write_into_rank0s_temporary(tmp_path):
    """With two ranks (gloo), each with its own incarnation id, both write into rank 0's temporary and it commits."""
    run_distributed(_two_ranks, 2, str(tmp_path), None)
    assert os.listdir(tmp_path) == ["step_000000001"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_commit_nothing_when_one_owner_is_gone(tmp_path):
    """With two ranks, rank 1's dead owner fails the save on both ranks; nothing is committed or left."""
    run_distributed(_two_ranks, 2, str(tmp_path), 1)
