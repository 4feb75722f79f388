"""A trainer with ``persist="process"`` for the orphaned-writer tests (``tests/test_writer_process.py``).

    python orphan_trainer.py ROOT --steps 1,2 --value 0.5 [--no-death-signal] [--thread-count N] [--hold]

It builds a ``CheckpointManager(ROOT, persist="process")``, restores the newest checkpoint, then
saves each step of ``--steps`` asynchronously (a ~4 MB state whose tensor holds
``1000 * step + value`` everywhere, so a restored checkpoint shows which run wrote it) and closes
the manager. Progress is reported as JSON lines on stdout: ``{"pid", "writer_pid", "incarnation"}``
once the manager is built, ``{"restored": step}``, ``{"saving": step}`` after each ``save()``
returned, ``{"done": true}`` after ``close()``. With ``--hold`` it waits for the last save to
commit, reports ``{"committed": step}`` and then idles (reading stdin) until killed, before ``close()``.

``--no-death-signal`` starts the writer without a parent-death signal, standing in for platforms
where only the writer's own liveness check protects against an orphaned writer.

With the environment variable ``ORPHAN_TRAINER_STOP_AT_STEP=N`` the *writer process* stops itself
(SIGSTOP) right before it writes the manifest of step ``N``: its shards and per-rank JSON are on
disk, the commit has not happened, and the test decides when (and whether) it continues. The
writer process imports this script as ``__mp_main__`` (spawn), which is where that hook is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch

# Make the repository root importable when run as a script (tests/_helpers/ -> repo root).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torch_ckpt import CheckpointManager  # noqa: E402
from torch_ckpt.save import _persist as persist  # noqa: E402
from torch_ckpt.save import _writer_process as writer_process  # noqa: E402

STOP_ENV = "ORPHAN_TRAINER_STOP_AT_STEP"
NUMEL = 1 << 20  # 4 MiB of float32


def expected_value(step: int, value: float) -> float:
    """What every element of the saved tensor holds for ``step`` written with ``--value value``."""
    return 1000.0 * step + value


def new_state() -> dict:
    """The state this trainer saves (also the test's restore target)."""
    return {"w": torch.zeros(NUMEL), "value": -1.0, "step": -1}


def _stop_before_manifest(step: int) -> None:
    """Make this (writer) process SIGSTOP itself right before writing ``manifest.json`` of ``step``."""
    original = persist.write_json_durable

    def write_json_durable(path, obj):
        if os.path.basename(os.fspath(path)) == "manifest.json" and obj.get("step") == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(path, obj)

    persist.write_json_durable = write_json_durable


if __name__ == "__mp_main__" and os.environ.get(STOP_ENV):  # inside the spawned writer process
    _stop_before_manifest(int(os.environ[STOP_ENV]))


def _emit(**obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Run the trainer (see the module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--steps", required=True, help="comma-separated steps to save")
    p.add_argument("--value", type=float, default=0.0)
    p.add_argument("--thread-count", type=int, default=2)
    p.add_argument("--no-death-signal", action="store_true")
    p.add_argument("--hold", action="store_true")
    args = p.parse_args()
    if args.no_death_signal:
        writer_process._PARENT_DEATH_SIGNAL = None
    torch.set_num_threads(1)
    state = new_state()
    mgr = CheckpointManager(args.root, persist="process", keep_last=10, thread_count=args.thread_count)
    _emit(pid=os.getpid(), writer_pid=mgr.checkpointer._process_writer.pid, incarnation=mgr.checkpointer.incarnation)
    _emit(restored=mgr.restore(state))
    for step in (int(s) for s in args.steps.split(",")):
        state["w"].fill_(expected_value(step, args.value))
        state["value"], state["step"] = args.value, step
        mgr.save(step, state)
        _emit(saving=step)
    if args.hold:
        mgr.wait()
        _emit(committed=mgr.latest_step())
        sys.stdin.read()  # idle until the test kills this process (or closes stdin)
    mgr.close()
    _emit(done=True)


if __name__ == "__main__":
    main()
