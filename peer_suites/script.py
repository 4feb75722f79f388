"""Accelerate's ``test_utils/scripts/external_deps/test_checkpointing.py`` on two CPU processes, plain and injected.

The script ships with the installed ``accelerate``; it is run unmodified, the way Accelerate's own test
(``tests/deepspeed/test_deepspeed.py::test_checkpointing``) runs it: first ``--partial_train_epoch=1``
(train one epoch, ``save_state(OUT/epoch_0)``, evaluate, ``end_training()``), then
``--resume_from_checkpoint=OUT/epoch_0`` (``load_state``, evaluate, assert accuracy, scheduler and optimizer
learning rates and epoch equal what the first run recorded). Its hub model and data set are replaced by the
small local stand-ins in ``standins/`` (no network here). Injected: ``accelerate_ckpt.attach()`` on the
script's Accelerator, by running the script through this module (``python -m torch.distributed.run ...
peer_suites/script.py SCRIPT ARGS`` with ``PEER_SUITES_INJECT=accelerate``).

Per run, two cases: ``train`` (exit 0 and ``epoch_0`` a complete checkpoint afterwards; exit 0 without it is
a lost checkpoint) and ``resume`` (exit 0).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

from peer_suites import inject, report

NAME = "accelerate: test_utils/scripts/external_deps/test_checkpointing.py (2 processes)"
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*)$")
STANDINS = Path(__file__).resolve().parent / "standins"


def script_path() -> Path:
    import accelerate

    return Path(accelerate.__file__).parent / "test_utils" / "scripts" / "external_deps" / "test_checkpointing.py"


def complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint: a committed torch-ckpt one or Accelerate's own files."""
    from torch_ckpt import is_committed

    if not folder.is_dir():
        return False
    if is_committed(folder):
        return True
    names = {p.name for p in folder.iterdir()}
    return bool(names & {"model.safetensors", "pytorch_model.bin"}) and "optimizer.bin" in names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, mode: str, args: list[str], log: Path, timeout: float, nice: int,
            deps: str | None) -> tuple[object, str]:
    from peer_suites.run import child_env, wait

    env = child_env("accelerate" if mode == "injected" else "", None, deps)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), env["PYTHONPATH"]])
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    cmd = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__,
           str(script_path()), f"--output_dir={out}", *args]
    rc = wait(cmd, None, env, log, timeout)
    lines = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    errors = [m[1] for ln in lines if (m := _ERROR_LINE.match(ln)) and "ChildFailedError" not in ln]
    return rc, (errors or lines or ["(no output)"])[0]


def run_mode(out: Path, mode: str, timeout: float = 600.0, nice: int = 10,
             deps: str | None = None) -> dict[str, report.Case]:
    """Both phases in ``mode``; the two cases by name."""
    folder = out / mode
    folder.mkdir(parents=True, exist_ok=True)
    cases: dict[str, report.Case] = {}
    rc, last = _launch(folder, mode, ["--partial_train_epoch=1"], out / f"{mode}_train.log", timeout, nice,
                       deps)
    ok = complete(folder / "epoch_0")
    if rc == 0 and ok:
        cases["train"] = report.Case("train", "passed")
    elif rc == 0:
        said = [ln for ln in (out / f"{mode}_train.log").read_text(encoding="utf-8").splitlines() if "failed" in ln]
        cases["train"] = report.Case("train", "failed", "LostCheckpoint: exit code 0 but epoch_0 is not a "
                                     "complete checkpoint" + (f" (the log says: {said[0].strip()})" if said else ""))
    elif rc == "killed":
        cases["train"] = report.Case("train", "failed", f"Failed: Timeout (>{timeout:g}s) from pytest-timeout.")
    else:
        cases["train"] = report.Case("train", "failed", f"exit code {rc}: {last}")
    rc, last = _launch(folder, mode, [f"--resume_from_checkpoint={folder / 'epoch_0'}"], out / f"{mode}_resume.log",
                       timeout, nice, deps)
    if rc == 0:
        cases["resume"] = report.Case("resume", "passed")
    elif rc == "killed":
        cases["resume"] = report.Case("resume", "failed", f"Failed: Timeout (>{timeout:g}s) from pytest-timeout.")
    else:
        cases["resume"] = report.Case("resume", "failed", f"exit code {rc}: {last}")
    return cases


def run_both(out: Path, nice: int = 10, deps: str | None = None) -> None:
    """The script plain, then injected; the cases go to ``out/cases.json`` (read by :func:`collect`)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    plain = run_mode(out, "plain", nice=nice, deps=deps)
    injected = run_mode(out, "injected", nice=nice, deps=deps)
    (out / "cases.json").write_text(json.dumps({
        "seconds": round(time.monotonic() - start), "plain": {k: asdict(c) for k, c in plain.items()},
        "injected": {k: asdict(c) for k, c in injected.items()}}), encoding="utf-8")


def collect(out: Path) -> list[report.FileResult]:
    """The script's table row from ``out/cases.json`` (none if it did not run)."""
    if not (out / "cases.json").exists():
        return []
    data = json.loads((out / "cases.json").read_text(encoding="utf-8"))
    plain, injected = ({k: report.Case(**c) for k, c in data[m].items()} for m in ("plain", "injected"))
    res = report.compare(NAME, plain, injected)
    res.lost = sum(c.message.startswith("LostCheckpoint") for c in injected.values())
    res.hangs = sum("Timeout (>" in c.message for c in injected.values())
    res.notes.append(f"{data['seconds']} s; logs in runs/script/")
    return [res]


def _entry() -> None:
    """Run as a torchrun worker: ``script.py SCRIPT ARGS...``, attaching our adapter when injected."""
    if os.environ.get(inject.ENV_INJECT) == "accelerate":
        inject.install_accelerate()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    _entry()
