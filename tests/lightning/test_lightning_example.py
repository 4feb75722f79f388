"""examples/lightning_gpt.py: a preempted and resumed run reproduces the uninterrupted losses bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_gpt.py"
CONFIG = REPO / "examples" / "lightning" / "config.yaml"

# A small, fast variant of the shipped configuration: a checkpoint every 4 steps, 10 batches per epoch.
SMALL = """
trainer:
  max_steps: 24
  enable_progress_bar: false
  logger: false
  callbacks:
    - class_path: lightning_ckpt.MTBFCheckpoint
      init_args: {dirpath: ckpts, mtbf_seconds: null, save_every_n_steps: 4}
model: {block_size: 32, n_layer: 1, n_embd: 32, total_steps: 24, warmup: 4}
data: {corpus_chars: 20000, block_size: 32, batch_size: 8, max_windows: 80}
"""

DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2"]


def run_example(cwd: Path, *args: str) -> dict[int, float]:
    """Run the example in ``cwd`` with the small configuration; return ``{step: loss}`` of this run."""
    cwd.mkdir(exist_ok=True)
    (cwd / "small.yaml").write_text(SMALL)
    log = cwd / f"losses_{len(list(cwd.glob('losses_*')))}.jsonl"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "fit", "--config", str(CONFIG), "--config", "small.yaml",
                           "--loss_log", str(log), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("world", [[], DDP], ids=["single-device", "ddp-2"])
def test_preempted_then_resumed_run_reproduces_the_uninterrupted_losses(tmp_path, world):
    """SIGTERM after step 13, then --ckpt_path last: every step's loss equals the uninterrupted run's."""
    uninterrupted = run_example(tmp_path / "full", *world)
    before = run_example(tmp_path / "run", *world, "--interrupt_at_step", "13")
    assert sorted(before) == list(range(1, 14)) and (tmp_path / "run" / "ckpts" / "step_000000013").is_dir()
    after = run_example(tmp_path / "run", *world, "--ckpt_path", "last")
    assert sorted(after) == list(range(14, 25))
    assert {**before, **after} == uninterrupted
