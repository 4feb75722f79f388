"""Issue 16 "done when": three everyday Accelerate checkpointing scripts, ported by adding ``attach``.

Each script (``examples/accelerate/``) runs as plain Accelerate and attached. The attached run is
SIGKILLed after step 7 and restarted the script's own way; the restart must continue bit for bit
(losses, learning rates, batches) and end with the checkpoint folders plain Accelerate keeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "accelerate"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run(script: str, log: Path, *args: str, attach: bool = True, killed: bool = False) -> list[dict]:
    cmd = [sys.executable, str(EXAMPLES / script), "--log", str(log), *args] + (["--attach"] if attach else [])
    if killed:
        cmd += ["--kill-at", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_CKPT_CONFIG", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == (-signal.SIGKILL if killed else 0), proc.stderr
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def check_resume(tmp_path: Path, script: str, where: str, resume_args) -> None:
    """Plain and attached full runs, then an attached run killed after step 7 and restarted."""
    plain = run(script, tmp_path / "plain.jsonl", where, str(tmp_path / "plain"), attach=False)
    reference = run(script, tmp_path / "ref.jsonl", where, str(tmp_path / "ref"))
    assert reference == plain  # attaching changes no loss, learning rate or batch
    killed = run(script, tmp_path / "killed.jsonl", where, str(tmp_path / "run"), killed=True)
    assert killed == reference[:7]
    resumed = run(script, tmp_path / "resumed.jsonl", where, str(tmp_path / "run"), *resume_args(tmp_path / "run"))
    start = resumed[0]["step"] - 1
    assert start in (4, 6) and resumed == reference[start:]


def test_by_feature_checkpointing_loop_resumes_bitwise_and_keeps_every_step_folder(tmp_path):
    """checkpointing.py: resumed from the newest committed step_N folder, bit for bit; step_2..step_12 as plain
    Accelerate. The save the kill interrupted keeps its reserved name (issue 27, Accelerate 5), so the restart
    skips a folder torch_ckpt.is_committed() rejects, as loading it raises CheckpointNotFoundError."""
    from torch_ckpt import is_committed

    def newest(out: Path) -> list[str]:
        folders = sorted(out.glob("step_*"), key=lambda p: int(p.name[5:]))
        return ["--resume-from-checkpoint", str([p for p in folders if is_committed(p)][-1])]

    check_resume(tmp_path, "checkpointing.py", "--output-dir", newest)
    assert visible(tmp_path / "run") == visible(tmp_path / "plain") == [f"step_{n}" for n in (10, 12, 2, 4, 6, 8)]


def test_automatic_naming_loop_resumes_bitwise_and_keeps_plain_accelerates_last_two(tmp_path):
    """automatic_naming.py: load_state() resumes bit for bit; total_limit=2 keeps checkpoint_4 and 5 like plain."""
    check_resume(tmp_path, "automatic_naming.py", "--project-dir", lambda _: [])
    for project in ("run", "plain"):
        assert visible(tmp_path / project / "checkpoints") == ["checkpoint_4", "checkpoint_5"]


def test_rolling_folder_loop_resumes_bitwise_and_keeps_one_folder(tmp_path):
    """rolling.py: the restart loads OUT/latest and continues bit for bit; only 'latest' remains, as in plain."""
    check_resume(tmp_path, "rolling.py", "--output-dir", lambda _: [])
    assert visible(tmp_path / "run") == visible(tmp_path / "plain") == ["latest"]
