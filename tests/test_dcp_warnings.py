"""DCP's single-process warning is filtered once at import (dcp_io, dcp_read), never per call from a thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointManager

_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch_ckpt import CheckpointManager, load_full_state
    root, persist = sys.argv[1], sys.argv[2]
    with CheckpointManager(root, persist=persist) as mgr:
        mgr.save(1, {"w": torch.arange(3.0)}).wait()
        state = {"w": torch.zeros(3)}
        mgr.restore(state)
    assert torch.equal(state["w"], torch.arange(3.0))
    load_full_state(root + "/step_000000001")
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("persist", ["thread", "process"])
def test_single_process_save_restore_and_convert_raise_no_dcp_warning(tmp_path, persist):
    """With DCP's single-process warning turned into an error, save, restore and load_full_state still work."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-W", "error:torch.distributed is:UserWarning", "-c", _SCRIPT,
                          str(tmp_path / "root"), persist], capture_output=True, text=True, timeout=110, env=env)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_filter_is_needed_for_that(tmp_path):
    """Control: without torch-ckpt's filter the same save does emit DCP's single-process warning."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # in front of every filter, torch-ckpt's included
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    assert any("assuming the intent is to save in a single process" in str(w.message) for w in caught)


def test_no_torch_ckpt_code_uses_catch_warnings(tmp_path, monkeypatch):
    """A background save and a restore never enter warnings.catch_warnings from torch-ckpt code (not thread-safe)."""
    real = warnings.catch_warnings
    callers: list[str] = []

    def recording(*args, **kwargs):
        callers.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return real(*args, **kwargs)

    monkeypatch.setattr(warnings, "catch_warnings", recording)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        mgr.restore({"w": torch.zeros(4)})
    assert [c for c in callers if c.startswith("torch_ckpt")] == []
