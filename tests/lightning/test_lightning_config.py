"""examples/lightning/config.yaml: LightningCLI enables the plugin and the callback from YAML alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_shipped_yaml_writes_a_committed_checkpoint(tmp_path):
    """Running the example with the shipped config.yaml (only run length shortened) commits a checkpoint."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "lightning_gpt.py"), "fit",
         "--config", str(REPO / "examples" / "lightning" / "config.yaml"),
         "--trainer.max_steps", "12", "--model.total_steps", "12", "--data.corpus_chars", "20000",
         "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    step_dir = tmp_path / "runs" / "lightning_gpt" / "checkpoints" / "step_000000012"
    assert (step_dir / "manifest.json").is_file()
