"""The node-loss recovery benchmark, run small: every case really restores from the tier it names."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pyproject's markers: left out by make test-fast
pytest.importorskip("s3fs", reason="the s3 extra (s3fs, moto[server]) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_recovery_benchmark_restores_node1_from_peer_memory_and_durable(tmp_path):
    """16 MB, 1 repeat: node 1 resumes from node 0's replica, its own memory, then S3, and the JSON says so."""
    out = tmp_path / "recovery.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "recovery.py"), "--mb", "16", "--repeats", "1",
                           "--dir", str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cases"]["peer"]["sources"] == ["node0:memory", "node1:memory-peer"]
    assert result["cases"]["memory"]["sources"] == ["node0:memory", "node1:memory"]
    assert result["cases"]["durable"]["sources"] == ["node0:local", "node1:durable-node"]
    assert result["cases"]["peer"]["steps"] == [1] and result["cases"]["durable"]["steps"] == [2]
    assert result["bytes"]["replica_bytes"] >= 16 << 20 and result["ratios"]["peer_over_floor"] > 0
    assert proc.returncode == 0
