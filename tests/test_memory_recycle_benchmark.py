"""The memory-recycling benchmark, run small: the recycled case writes over retired files, the deleted one never."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_memory_recycle_benchmark_writes_over_retired_files_only_when_recycling(tmp_path):
    """32 MB, 6 saves, 1 round: the JSON times both cases, and only the recycled one reused files."""
    out = tmp_path / "recycle.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_recycle.py"), "--mb", "32", "--saves",
                           "6", "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert cases["recycled"]["files_written_over"] > 0 and cases["deleted"]["files_written_over"] == 0
    assert cases["recycled"]["median_s"] > 0 and cases["deleted"]["median_s"] > 0
