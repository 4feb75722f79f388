"""Exact resume of the main job (examples/train_gpt.py) on its real corpus, in miniature.

The dataset is cut to 48 windows at batch 8, so one epoch is 6 steps and a 20-step run crosses three
epoch boundaries. Every resumed run must log exactly the uninterrupted run's losses, learning rates,
epochs and batch order (compared bit for bit: float ``==`` and ``repr``). The ``--mtbf`` runs (60
steps, a tiny MTBF so that the Young/Daly interval is a few steps) save where the policy decides.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._example_logs import assert_bitwise_equal, read_log

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")]  # torchdata 0.11 noise

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
STEPS = 20
STEPS_PER_EPOCH = 6
SMALL = [
    "--steps", str(STEPS), "--max-windows", "48", "--batch-size", "8", "--block-size", "32",
    "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--warmup", "4",
    "--corpus-chars", "200000", "--seed", "7", "--threads", "1", "--quiet",
]  # fmt: skip


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_gpt = _load_example()


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """main() sets the thread count and deterministic mode for the process; put them back."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def run(tmp: Path, name: str, *extra: str, ckpt: str = "ckpt") -> tuple[dict, list[dict]]:
    """One in-process run of the example; returns its summary and the records it logged."""
    log = tmp / f"{name}.jsonl"
    summary = train_gpt.main([*SMALL, "--ckpt-dir", str(tmp / ckpt), "--log-jsonl", str(log), *extra])
    return summary, read_log(log)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run, without any checkpointing at all."""
    tmp = tmp_path_factory.mktemp("reference")
    summary, records = run(tmp, "ref", "--save-every", "0")
    assert summary["steps"] == STEPS and summary["resumed_from"] is None
    assert len(records) == STEPS and records[-1]["epoch"] == (STEPS - 1) // STEPS_PER_EPOCH
    return records


def test_two_fresh_runs_are_bitwise_identical(tmp_path, reference):
    """Two fresh runs with the same seed log identical losses, LRs and batches (checkpointing on or off)."""
    _, records = run(tmp_path, "again", "--save-every", "5")
    assert_bitwise_equal(records, reference)


@pytest.mark.parametrize(
    ("stop_after", "resume_from"),
    [
        pytest.param(4, 3, id="mid-first-epoch"),
        pytest.param(6, 6, id="end-of-epoch-0"),
        pytest.param(11, 9, id="mid-second-epoch"),
        pytest.param(18, 18, id="end-of-epoch-2"),
    ],
)
def test_stop_and_resume_matches_uninterrupted_run(tmp_path, reference, stop_after, resume_from):
    """Stopping after a step and rerunning resumes from the newest checkpoint and continues bit for bit."""
    first, before = run(tmp_path, "first", "--save-every", "3", "--stop-after-step", str(stop_after))
    assert first["steps"] == stop_after
    assert_bitwise_equal(before, reference[:stop_after])

    second, after = run(tmp_path, "second", "--save-every", "3")
    assert second["resumed_from"] == resume_from
    assert second["steps"] == STEPS
    assert_bitwise_equal(after, reference[resume_from:])


def test_resume_twice_matches_uninterrupted_run(tmp_path, reference):
    """A run interrupted twice (mid-epoch, then at an epoch boundary) still matches bit for bit."""
    run(tmp_path, "a", "--save-every", "2", "--stop-after-step", "5")
    second, mid = run(tmp_path, "b", "--save-every", "2", "--stop-after-step", "12")
    third, tail = run(tmp_path, "c", "--save-every", "2")
    assert (second["resumed_from"], third["resumed_from"]) == (4, 12)
    assert_bitwise_equal(mid, reference[4:12])
    assert_bitwise_equal(tail, reference[12:])


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, reference):
    """A run SIGKILLed right after a save resumes from a committed checkpoint and matches bit for bit."""
    log = tmp_path / "killed.jsonl"
    cmd = [sys.executable, str(EXAMPLE), *SMALL, "--ckpt-dir", str(tmp_path / "ckpt"), "--log-jsonl", str(log),
           "--save-every", "2", "--crash-at-step", "14"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert_bitwise_equal(read_log(log), reference[:14])

    # the save of step 14 may or may not have committed before the kill; an earlier one has
    summary, after = run(tmp_path, "resumed", "--save-every", "2")
    resumed = summary["resumed_from"]
    assert resumed is not None and resumed <= 14 and resumed % 2 == 0
    assert_bitwise_equal(after, reference[resumed:])


def test_finished_run_resumes_and_trains_nothing(tmp_path, reference):
    """Rerunning a finished run restores its last checkpoint and takes no further step."""
    run(tmp_path, "full", "--save-every", "5")
    summary, records = run(tmp_path, "noop", "--save-every", "5")
    assert summary["resumed_from"] == STEPS and summary["steps"] == STEPS
    assert records == []


MTBF_STEPS = 60
MTBF = ["--steps", str(MTBF_STEPS), "--mtbf", "50ms", "--initial-save-cost", "10ms"]  # --steps overrides SMALL's


@pytest.fixture(scope="module")
def mtbf_reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run of the --mtbf tests' length, without any checkpointing."""
    summary, records = run(tmp_path_factory.mktemp("mtbf_reference"), "ref", "--save-every", "0", "--steps",
                           str(MTBF_STEPS))
    assert summary["steps"] == MTBF_STEPS and summary["saves"] == 0 and "schedule" not in summary
    return records


@pytest.mark.timeout(120)
def test_mtbf_saves_where_the_reported_interval_says(tmp_path, mtbf_reference, capsys):
    """With --mtbf each save comes at least the policy's interval after the previous one, as reported."""
    summary, records = run(tmp_path, "mtbf", *MTBF)
    assert_bitwise_equal(records, mtbf_reference)  # choosing when to save changes nothing in training
    saves, sched = summary["save_steps"], summary["schedule"]
    assert len(saves) >= 3 and sched["saves"] == summary["saves"] == len(saves)
    decisions = sched["decisions"]
    assert [d["step"] for d in decisions] == saves
    for d in decisions:
        assert 1 <= d["interval_steps"] <= d["steps_since_save"], d
    assert [b - a for a, b in zip(saves, saves[1:])] == [d["steps_since_save"] for d in decisions[1:]]
    # the final report is the decision at the last step: consistent with the last save it counts from
    assert sched["step"] == MTBF_STEPS and sched["policy"] == "YoungDaly" and sched["mtbf_s"] == 0.05
    if sched["decision"]:  # the last step was itself a save
        assert saves[-1] == MTBF_STEPS
    else:
        assert sched["steps_since_save"] == MTBF_STEPS - saves[-1] < sched["interval_steps"]
    for key in ("cost_s", "step_time_s", "expected_overhead", "expected_lost_work_s"):
        assert sched[key] > 0, key
    out = capsys.readouterr().out
    assert f"train_gpt: save policy YoungDaly (daly), MTBF 50 ms: every {sched['interval_steps']} steps" in out
    assert f"{len(saves)} saves at steps {saves}" in out


@pytest.mark.timeout(120)
def test_mtbf_run_resumes_from_its_last_save_bitwise(tmp_path, mtbf_reference):
    """A --mtbf run stopped mid-way resumes from the last step its policy saved and continues bit for bit."""
    first, before = run(tmp_path, "first", *MTBF, "--stop-after-step", "40")
    assert first["steps"] == 40 and first["save_steps"], first
    assert_bitwise_equal(before, mtbf_reference[:40])

    second, after = run(tmp_path, "second", *MTBF)
    assert second["resumed_from"] == first["save_steps"][-1]
    assert second["steps"] == MTBF_STEPS
    assert_bitwise_equal(after, mtbf_reference[second["resumed_from"]:])
