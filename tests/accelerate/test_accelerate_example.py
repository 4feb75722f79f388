"""examples/accelerate_gpt.py on its real corpus: SIGKILL, resume, and continue bit for bit (1 and 2 processes).

The dataset is cut to 48 windows at batch 8 per process: one epoch is 6 steps on one process and 3
steps on two. Every run saves every 2 steps and is SIGKILLed after step 9; the save of step 8 may
still be in flight then, but it waited for step 6 to commit, so the resumed run starts in epoch >= 1.
Its losses (per process), learning rates, epochs and global batches must equal the uninterrupted
run's, compared bit for bit (float ``==`` and ``repr``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._example_logs import read_log

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_gpt.py"
SMALL = [
    "--max-windows", "48", "--batch-size", "8", "--block-size", "32", "--n-layer", "1", "--n-embd", "32",
    "--n-head", "2", "--warmup", "4", "--corpus-chars", "100000", "--seed", "7", "--threads", "1", "--quiet",
]  # fmt: skip
LAUNCH_TIMEOUT_S = 90  # a 2-process launch takes 10-20 s on 2 busy cores; a hang fails here


def launch(tmp: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, str(EXAMPLE), *SMALL, "--project-dir", str(tmp / "project"), "--log-jsonl", str(log),
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_CKPT_CONFIG", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, check=False)
    return proc, read_log(log)


def assert_bitwise_equal(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert [repr(x) for x in g["losses"]] == [repr(x) for x in w["losses"]], f"step {g['step']} losses"
        assert repr(g["lr"]) == repr(w["lr"]), f"step {g['step']} lr"
        assert (g["epoch"], g["batch"]) == (w["epoch"], w["batch"]), f"step {g['step']} data order"


def kill_and_resume(tmp_path: Path, nproc: int, steps: int, steps_per_epoch: int) -> None:
    common = ["--nproc", str(nproc), "--steps", str(steps)]
    ref, reference = launch(tmp_path / "ref", "ref", *common, "--save-every", "0")
    assert ref.returncode == 0, ref.stderr
    assert len(reference) == steps

    killed, before = launch(tmp_path, "killed", *common, "--save-every", "2", "--crash-at-step", "9")
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.stderr  # itself / its launcher
    assert_bitwise_equal(before, reference[:9])

    resumed, after = launch(tmp_path, "resumed", *common, "--save-every", "2")
    assert resumed.returncode == 0, resumed.stderr
    start = after[0]["step"] - 1
    assert start in (6, 8) and start // steps_per_epoch >= 1
    assert_bitwise_equal(after, reference[start:])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_single_process_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    """One process, killed after step 9, resumes from step 6 or 8 (epoch 1) and continues bit for bit."""
    kill_and_resume(tmp_path, nproc=1, steps=16, steps_per_epoch=6)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    """Two gloo processes, killed after step 9, resume from step 6 or 8 (epoch 2) and continue bit for bit."""
    kill_and_resume(tmp_path, nproc=2, steps=12, steps_per_epoch=3)
