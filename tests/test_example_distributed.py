"""Exact resume of the main job (examples/train_gpt.py) at world size 2: DDP on two CPU ranks (gloo).

``--nproc 2`` makes the script start its two ranks itself (torch.multiprocessing, as torchrun would).
The dataset is cut to 48 windows at batch 8 per rank, so one epoch is 3 steps and a 12-step run
crosses three epoch boundaries. A resumed run must log exactly the uninterrupted run's losses (mean
over ranks), learning rates, epochs and global batches (compared bit for bit: float ``==`` and ``repr``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._example_logs import assert_bitwise_equal, read_log

pytestmark = pytest.mark.slow  # see pyproject's markers: left out by make test-fast

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
STEPS = 12
WORLD = 2
STEPS_PER_EPOCH = 48 // (8 * WORLD)
SMALL = [
    "--nproc", str(WORLD), "--steps", str(STEPS), "--max-windows", "48", "--batch-size", "8",
    "--block-size", "32", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--warmup", "4",
    "--corpus-chars", "100000", "--seed", "7", "--threads", "1", "--quiet",
]  # fmt: skip
LAUNCH_TIMEOUT_S = 90  # one launch takes about 10 s on 2 busy cores; a hang fails here, not at the test timeout


def launch(tmp: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """One 2-rank run of the example (checkpoints under ``tmp/ckpt``); returns the process and its log."""
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, str(EXAMPLE), *SMALL, "--ckpt-dir", str(tmp / "ckpt"), "--log-jsonl", str(log), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return proc, read_log(log)


def resumed_from(proc: subprocess.CompletedProcess) -> int | None:
    """The step rank 0 reported resuming from (its final summary line)."""
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"train_gpt: step {STEPS}/"))
    value = line.split("resumed from ")[1].split(",")[0]
    return None if value == "None" else int(value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted 2-rank run, without any checkpointing."""
    proc, records = launch(tmp_path_factory.mktemp("reference"), "ref", "--save-every", "0")
    assert proc.returncode == 0, proc.stderr
    assert resumed_from(proc) is None
    assert len(records) == STEPS and records[-1]["epoch"] == (STEPS - 1) // STEPS_PER_EPOCH
    return records


@pytest.mark.timeout(120)
def test_ranks_read_disjoint_shards_of_each_epoch(reference):
    """Within an epoch the two ranks' batches together cover every window exactly once."""
    for epoch in range(STEPS // STEPS_PER_EPOCH):
        windows = [i for r in reference if r["epoch"] == epoch for i in r["batch"]]
        assert sorted(windows) == list(range(48)), f"epoch {epoch}"


@pytest.mark.timeout(240)
def test_stop_and_resume_at_world_size_two_matches_uninterrupted_run(tmp_path, reference):
    """Both ranks stopping mid-epoch and restarting resume from the newest checkpoint bit for bit."""
    first, before = launch(tmp_path, "first", "--save-every", "2", "--stop-after-step", "7")
    assert first.returncode == 0, first.stderr
    assert_bitwise_equal(before, reference[:7])

    second, after = launch(tmp_path, "second", "--save-every", "2")
    assert second.returncode == 0, second.stderr
    assert resumed_from(second) == 6
    assert_bitwise_equal(after, reference[6:])


@pytest.mark.timeout(240)
def test_sigkill_of_all_ranks_then_resume_matches_uninterrupted_run(tmp_path, reference):
    """Every rank SIGKILLed mid-run resumes from a committed checkpoint and continues bit for bit."""
    killed, before = launch(tmp_path, "killed", "--save-every", "2", "--crash-at-step", "9")
    assert killed.returncode == 128 + 9, killed.stderr  # the launcher reports the rank's SIGKILL
    assert_bitwise_equal(before, reference[:9])

    # the save of step 8 may or may not have committed before the kill; an earlier one has
    resumed, after = launch(tmp_path, "resumed", "--save-every", "2")
    assert resumed.returncode == 0, resumed.stderr
    step = resumed_from(resumed)
    assert step is not None and 2 <= step <= 8 and step % 2 == 0
    assert_bitwise_equal(after, reference[step:])


def test_the_memory_cluster_demo_resumes_a_lost_node_from_its_partners_memory(tmp_path):
    """make demo-cluster-memory, shortened: every rank killed between disk saves, node 1's disk and tmpfs wiped;
    both nodes resume one step from memory (node 1 from node 0's replica) and match the reference run."""
    demo = EXAMPLE.with_name("demo_cluster.py")
    cmd = [sys.executable, str(demo), "--work-dir", str(tmp_path / "work"), "--memory", "--steps", "30",
           "--save-every", "10", "--stop-after", "10", "--max-windows", "200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restored step" in proc.stdout and "from memory-peer" in proc.stdout
