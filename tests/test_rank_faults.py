"""After one rank's fault, checkpointing recovers: groups rebuilt, temporaries cleaned (real gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port
from torch_ckpt.root._layout import is_reservation

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "_helpers" / "rank_faults.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_ranks(world: int, scenario: str, root: Path, persist: str, *, timeout_s: float = 150, dies: tuple = (),
              **env: str) -> list:
    """Run ``scenario`` of the helper on ``world`` ranks (plain processes); return each rank's RESULT.

    Ranks in ``dies`` are expected to exit without a result (None in their place).
    """
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        e.update(env)
        procs.append(subprocess.Popen([sys.executable, str(HELPER), scenario, str(root), persist], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout_s)
            if rank in dies:
                results.append(None)
                continue
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"rank {rank} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.parametrize("world,persist,node_local", [(2, "thread", False), (2, "process", False),
                                                     (4, "thread", False), (2, "thread", True)],
                         ids=["2-thread", "2-process", "4-thread", "2-node-local"])
def test_saves_commit_again_after_a_rank_timed_out_in_its_shard_write(tmp_path, world, persist, node_local):
    """Rank 1 is slower than the timeout inside step 3's write: step 3 fails everywhere, steps 4-7 commit."""
    nodes = {"LOCAL_WORLD_SIZE": "1", "FAULT_NODE_LOCAL": "1"} if node_local else {}  # a node per rank, own roots
    results = run_ranks(world, "slow_shard", tmp_path, persist, FAULT="slow_shard", FAULT_TIMEOUT_S="3",
                        FAULT_SLOW_S="5", **nodes)
    for rank, r in enumerate(results):
        outcome = {int(k): v for k, v in r["outcome"].items()}
        assert outcome[3][0] != "ok", f"rank {rank}: step 3 did not fail"
        assert [s for s, v in outcome.items() if v[0] == "ok"] == [1, 2, 4, 5, 6, 7], (rank, outcome)
        assert r["steps"] == [1, 2, 4, 5, 6, 7], (rank, r["steps"])
    # no temporary, partial, or reservation (an empty step_000000003 or one holding only partials) is left
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
            if ".tmp" in p.name or p.name.startswith(".torch-ckpt.") or (p.is_dir() and is_reservation(p))]
    assert not left, left


@pytest.mark.parametrize("scenario,world", [("efbig_download", 2), ("eio_restore", 2), ("eio_restore", 4)])
def test_an_os_error_on_one_rank_of_a_restore_raises_promptly_everywhere(tmp_path, scenario, world):
    """A local OSError on one rank (EFBIG downloading, EIO reading): every rank raises a typed error at once."""
    results = run_ranks(world, scenario, tmp_path, "thread", FAULT_TIMEOUT_S="60")
    for rank, r in enumerate(results):
        assert r["kind"] != "ok" and not r["kind"].startswith("bare"), (rank, r)
        assert "CheckpointError" in r["mro"] and "OSError" in r["mro"] or rank != (0 if "download" in scenario
                                                                                   else 1), (rank, r)
        assert r["elapsed"] < 30, (rank, r)  # not the 60 s collective timeout
        assert str(tmp_path) in r["message"], (rank, r)  # names the path


def test_an_efbig_download_from_s3_raises_promptly_on_every_rank(tmp_path, s3):
    """Rank 0's download from S3 (moto) fails with EFBIG locally: every rank raises a typed error at once."""
    url = f"s3://{s3.new_bucket()}/run"
    results = run_ranks(2, "efbig_download", tmp_path, "thread", FAULT_TIMEOUT_S="60", FAULT_DURABLE_URL=url,
                        FAULT_S3_OPTIONS=json.dumps(s3.options))
    for rank, r in enumerate(results):
        assert r["kind"] == "CheckpointWriteError" and "File too large" in r["message"], (rank, r)
        assert r["elapsed"] < 30 and str(tmp_path) in r["message"], (rank, r)


def test_a_step_committed_when_a_rank_died_after_the_rename_is_replicated_and_retained_at_restart(tmp_path):
    """Rank 1 dies after rank 0's rename of step 3: rank 0 reports it committed, the restart replicates and prunes."""
    first = run_ranks(2, "killed_after_rename", tmp_path, "thread", dies=(1,), FAULT_TIMEOUT_S="10",
                      FAULT_PHASE="run")[0]
    assert first["outcome"] == "committed", first
    assert "step_000000003" in first["listing"] and "step_000000001" in first["listing"], first  # not yet pruned
    again = run_ranks(2, "killed_after_rename", tmp_path, "thread", FAULT_TIMEOUT_S="10", FAULT_PHASE="restart")
    assert again[0]["steps"] == [2, 3] and again[0]["durable"], again[0]
    assert [n for n in again[0]["listing"] if n.startswith("step_")] == ["step_000000002", "step_000000003"], again[0]
    assert "step_000000003" in again[0]["durable_listing"], again[0]
