"""The node-read benchmark, run small: two ranks of one node restore its memory copy, DCP loads it too."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(150)
def test_node_read_benchmark_times_the_restore_dcp_and_the_floor(tmp_path):
    """2 ranks, 32 MB, 1 repeat: the JSON holds both cases, the floor and their ratios."""
    out = tmp_path / "node_read.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "node_read.py"), "--ranks", "2", "--mb", "32",
                           "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cases"]["torch_ckpt"]["median_s"] > 0 and result["cases"]["dcp_load"]["median_s"] > 0
    assert result["floors"]["tmpfs_read_s"]["median_s"] > 0 and result["bytes"] >= 32 << 20
    assert result["ratios"]["torch_ckpt_over_floor"] > 0
