"""A write that fails as on a full disk is never committed: every writer thread/process, retention, warn, durable tier.

Each case runs in a subprocess that ignores SIGXFSZ and sets a soft RLIMIT_FSIZE of 32 KiB after a
good step 1, so writes past 32 KiB fail with EFBIG (in the writer process too, via prlimit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import json, resource, signal, sys, uuid
    import psutil, torch
    from torch_ckpt import CheckpointManager, CheckpointWriteError
    from torch_ckpt.tiers._durable import DurableTier

    def limit(nbytes):
        lim = (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        resource.setrlimit(resource.RLIMIT_FSIZE, lim)
        for child in psutil.Process().children(recursive=True):  # the writer process of persist="process"
            resource.prlimit(child.pid, resource.RLIMIT_FSIZE, lim)

    def main():
        root, persist, threads, case = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited by the spawned writer process
        unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        url = f"memory://fsize-{uuid.uuid4().hex[:8]}/run" if case == "durable" else None
        out = {}
        with CheckpointManager(root, keep_last=1, persist=persist, thread_count=threads, durable_url=url,
                               on_write_error="warn" if case == "warn" else "raise") as mgr:
            mgr.save(1, {"w": torch.full((65536,), 1.)})
            mgr.wait()
            if url:
                assert mgr.wait_durable(60)
            limit(32 * 1024)
            try:
                mgr.save(2, {"w": torch.full((65536,), 2.)})
                mgr.wait()
                out["error"] = None
            except CheckpointWriteError as exc:
                out["error"], out["errno"] = str(exc), exc.errno
            limit(unlimited)
            out["steps"] = mgr.all_steps()
            out["failed_saves"] = [f["step"] for f in mgr.checkpointer.failed_saves]
            if url:
                mgr.wait_durable(60)
                out["durable_steps"] = sorted(DurableTier(url).list_steps())
            target = {"w": torch.zeros(65536)}
            out["restored"] = mgr.restore(target)
            out["value"] = float(target["w"][0])
        print("RESULT " + json.dumps(out))

    if __name__ == "__main__":
        main()
""")


def _run(tmp_path: Path, persist: str, threads: int, case: str) -> tuple[dict, str]:
    script = tmp_path / "fsize_case.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), persist, str(threads), case],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("persist", ["thread", "process"])
def test_file_size_limit_fails_the_save_and_keeps_the_last_good_step(tmp_path, persist, threads):
    """EFBIG in any writer is raised once as CheckpointWriteError; step 1 survives keep_last=1 and restores."""
    out, stderr = _run(tmp_path, persist, threads, "keep_last")
    assert out["errno"] == 27 and "File too large" in out["error"]
    assert out["steps"] == [1] and out["restored"] == 1 and out["value"] == 1.0
    assert not list((tmp_path / "run").glob(".step_*"))
    assert "Traceback" not in stderr and "Exception in thread" not in stderr
    assert sum("checkpoint step 2 failed" in ln for ln in stderr.splitlines()) == 1


@pytest.mark.slow
def test_warn_policy_counts_the_file_size_failure(tmp_path):
    """With on_write_error='warn' the EFBIG save is counted in failed_saves and step 1 stays restorable."""
    out, _ = _run(tmp_path, "thread", 2, "warn")
    assert out["error"] is None and out["failed_saves"] == [2]
    assert out["steps"] == [1] and out["restored"] == 1 and out["value"] == 1.0


@pytest.mark.slow
def test_failed_save_is_never_replicated_to_the_durable_tier(tmp_path):
    """A save that failed locally is not uploaded; the durable tier keeps step 1 only."""
    out, _ = _run(tmp_path, "thread", 2, "durable")
    assert out["errno"] == 27 and out["steps"] == [1] and out["durable_steps"] == [1]
