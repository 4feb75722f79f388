"""The short chaos runs: SIGKILLs of the real training at random instants (some losing a node), each resumed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pyproject's markers: left out by make test-fast

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_short_chaos_run_never_exposes_partial_and_resumes_exactly(tmp_path):
    """20 random SIGKILLs: no partial checkpoint listed, every kill resumable, every resumed loss exact."""
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--trials", "20",
                           "--work-dir", str(tmp_path / "run"), "--json", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["trials"] == 20
    assert result["partial_exposed"] == 0
    assert result["resumable"] == 20
    assert result["exact_resume"] == 20 and result["mismatched_steps"] == 0
    assert result["final_mismatched_steps"] == 0 and result["finished"]
    assert result["instants"]["during_save"] > 0  # the kills really hit saves in progress
    assert proc.returncode == 0


@pytest.mark.timeout(600)
def test_short_chaos_run_with_process_writer_and_restart_while_orphan(tmp_path):
    """3 kills with persist='process', each restart begun while the stopped orphan lives on: orphans exit, no errors."""
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--trials", "3", "--persist",
                           "process", "--restart-while-orphan", "--no-death-signal", "--work-dir",
                           str(tmp_path / "run"), "--json", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["trials"] == 3 and result["orphans_stopped"] > 0  # orphans really outlived their trainers
    assert result["orphans_survived"] == 0 and result["run_errors"] == 0
    assert result["exact_resume"] == 3 and result["final_mismatched_steps"] == 0
    assert proc.returncode == 0


@pytest.mark.timeout(600)
def test_short_chaos_run_with_node_losses_resumes_from_the_partners_memory(tmp_path):
    """6 kills of a 2-node run with memory saves every step, half losing a node: nothing partial, exact resumes."""
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--nodes", "2", "--memory-every",
                           "1", "--save-every", "10", "--trials", "6", "--steps", "40", "--work-dir",
                           str(tmp_path / "run"), "--json", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["trials"] == 6 and result["node_losses"] > 0
    assert result["partial_exposed"] == 0 and result["resumable"] == 6
    assert result["exact_resume"] == 6 and result["mismatched_steps"] == 0 and result["final_mismatched_steps"] == 0
    assert result["resume_sources"].get("memory-peer", 0) > 0  # a lost node came back from its partner's replica
    assert result["lost_over_bound"] == [] and result["split_resumes"] == 0 and result["finished"]
    assert result["health_checked"] > 0 and result["health_underestimates"] == []  # health() bounded each loss
    assert proc.returncode == 0
