"""Kill harness for the crash-safety tests: a pre-imported "zygote" that forks savers and SIGKILLs them.

Importing torch costs seconds on a small CI machine, far too much to start a fresh interpreter for
each of a few dozen kills. So the test starts this script once (``python crash_saver.py``); it imports
torch and torch_ckpt *without running any torch op* (no thread pools exist yet, so forking is safe)
and then serves JSON-line commands on stdin, one JSON-line answer each on stdout:

``{"op": "kill", "root": R, "delay": D}``
    fork a saver (:func:`saver_loop`) on root ``R``; once it reports ready (manager built, about to
    save), sleep ``D`` seconds, SIGKILL it and reap it. Answer: ``{"pid", "start_step",
    "killed", "status", "alive_s"}`` (``killed`` is true only when the saver was still running
    and died of SIGKILL, i.e. the kill really interrupted it).
``{"op": "calibrate", "root": R, "steps": N}``
    fork a saver that saves ``N`` steps without being killed and reports timings. Answer:
    ``{"first_s", "cycle_s", "start_step", "last_step"}``.
``{"op": "quit"}``
    exit.

The saver fills every tensor of its state deterministically from the step number (see
:func:`expected_tensor`) so the test can check that a restored checkpoint holds exactly what was
saved for that step. The same module builds the parent's fresh state (:func:`build_state`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback

import torch

# Make the repository root importable when run as a script (tests/_helpers/ -> repo root).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torch_ckpt import CheckpointManager, TrainState  # noqa: E402

KEEP_LAST = 2
_OPT_KEYS = ("exp_avg", "exp_avg_sq", "step")


# -- the state and its deterministic contents --------------------------------------------------
def build_state() -> tuple[TrainState, list[torch.Tensor]]:
    """A small-but-nontrivial TrainState (~6 MB: 4 layers, AdamW moments, StepLR, RNG, extras).

    Returns the state and its tensors in a fixed order (parameters, then per parameter the
    optimizer's ``exp_avg``, ``exp_avg_sq`` and ``step``), all filled with -1.
    """
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    for p in model.parameters():  # the optimizer state AdamW creates on its first step (cheaper than a step)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    state.test_scheduler = sched  # the test's own handle on the scheduler (TrainState keeps it private)
    tensors = list(model.parameters()) + [opt.state[p][k] for p in model.parameters() for k in _OPT_KEYS]
    with torch.no_grad():
        for t in tensors:
            t.fill_(-1.0)
    return state, tensors


_PATTERNS: dict[tuple, torch.Tensor] = {}


def expected_tensor(step: int, index: int, like: torch.Tensor) -> torch.Tensor:
    """What tensor number ``index`` holds in the checkpoint of ``step`` (exact in float32)."""
    key = (tuple(like.shape), like.dtype)
    if key not in _PATTERNS:
        _PATTERNS[key] = (torch.arange(like.numel(), dtype=torch.int64) % 251).to(like.dtype).reshape(like.shape)
    return _PATTERNS[key] + (1000 * step + 7 * index)


def expected_extras(step: int) -> dict:
    """The JSON extras saved with ``step``."""
    return {"saved_step": step, "tag": f"step-{step}", "ratio": step / 8}


def fill_for_step(state: TrainState, tensors: list[torch.Tensor], step: int) -> None:
    """Put the deterministic contents of ``step`` into the live state."""
    with torch.no_grad():
        for i, t in enumerate(tensors):
            t.copy_(expected_tensor(step, i, t))
    state.step = step
    state.epoch = step // 5
    state.extras = expected_extras(step)
    state.test_scheduler.last_epoch = step  # makes the scheduler's state step-dependent


def check_restored(state: TrainState, tensors: list[torch.Tensor], step: int) -> list[str]:
    """Return the differences between the restored state and what was saved for ``step`` (empty: equal)."""
    problems = []
    for i, t in enumerate(tensors):
        if not torch.equal(t, expected_tensor(step, i, t)):
            problems.append(f"tensor #{i} {tuple(t.shape)} differs (first values {t.reshape(-1)[:3].tolist()})")
    if state.step != step:
        problems.append(f"state.step is {state.step!r}")
    if state.epoch != step // 5:
        problems.append(f"state.epoch is {state.epoch!r}")
    if state.extras != expected_extras(step):
        problems.append(f"extras are {state.extras!r}")
    if state.test_scheduler.last_epoch != step:
        problems.append(f"scheduler.last_epoch is {state.test_scheduler.last_epoch!r}")
    return problems


# -- the forked savers ---------------------------------------------------------------------------
def saver_loop(root: str, ready_fd: int) -> None:
    """Save steps latest+1, latest+2, ... asynchronously in a tight loop, forever (until killed)."""
    state, tensors = build_state()
    mgr = CheckpointManager(root, keep_last=KEEP_LAST)
    start = (mgr.latest_step() or 0) + 1
    os.write(ready_fd, json.dumps({"start_step": start}).encode() + b"\n")
    step = start
    while True:
        fill_for_step(state, tensors, step)
        mgr.save(step, state)  # waits for the previous save, stages, hands over to the writer thread
        step += 1


def calibrate(root: str, steps: int, ready_fd: int) -> None:
    """Save ``steps`` steps (not killed) and report the first save's and the steady cycle's duration."""
    state, tensors = build_state()
    with CheckpointManager(root, keep_last=KEEP_LAST) as mgr:
        start = (mgr.latest_step() or 0) + 1
        t0 = time.monotonic()
        fill_for_step(state, tensors, start)
        mgr.save(start, state).wait()
        first = time.monotonic() - t0
        t1 = time.monotonic()
        for step in range(start + 1, start + steps):
            fill_for_step(state, tensors, step)
            mgr.save(step, state)
        mgr.wait()
        cycle = (time.monotonic() - t1) / max(1, steps - 1)
    os.write(ready_fd, json.dumps({"first_s": first, "cycle_s": cycle, "start_step": start,
                                   "last_step": start + steps - 1}).encode() + b"\n")


def _fork(target, *args) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into the command loop
        code = 0
        try:
            os.close(r)
            os.dup2(2, 1)  # keep the command channel (stdout) clean
            torch.set_num_threads(1)
            target(*args, w)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    return pid, r


def _read_line(fd: int, timeout: float) -> dict | None:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        buf += chunk
    return json.loads(buf)


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _kill(root: str, delay: float) -> dict:
    t_fork = time.monotonic()
    pid, r = _fork(saver_loop, root)
    ready = _read_line(r, timeout=60.0)
    t_ready = time.monotonic()
    if ready is None:  # the saver died or hung while starting
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(r)
        return {"pid": pid, "start_step": None, "killed": False, "status": "not ready: " + _status(status),
                "alive_s": 0.0}
    time.sleep(delay)
    exited, status = os.waitpid(pid, os.WNOHANG)
    was_running = exited == 0
    if was_running:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)  # reaped: the process is gone before the test looks at the disk
    os.close(r)
    killed = was_running and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return {"pid": pid, "start_step": ready["start_step"], "killed": killed, "status": _status(status),
            "setup_s": t_ready - t_fork, "alive_s": time.monotonic() - t_ready}


def _calibrate(root: str, steps: int) -> dict:
    pid, r = _fork(calibrate, root, steps)
    result = _read_line(r, timeout=120.0)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    return result if result is not None else {"error": _status(status)}


def _warm_up() -> None:
    """Do the lazy first-use imports of building and flattening a state once, here, single-threaded.

    Forked savers then start in milliseconds instead of ~0.5 s. With one intra-op thread torch
    starts no thread pool, so the process stays single-threaded and safe to fork.
    """
    torch.set_num_threads(1)
    from torch_ckpt.format._files import split_state

    state, tensors = build_state()
    fill_for_step(state, tensors, 1)
    split_state(state.state_dict(), rank_local_keys=state.rank_local_keys)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def main() -> None:
    """Serve commands from stdin (see the module docstring)."""
    _warm_up()
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "kill":
            answer = _kill(cmd["root"], float(cmd["delay"]))
        elif cmd["op"] == "calibrate":
            answer = _calibrate(cmd["root"], int(cmd["steps"]))
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        answer["harness_threads"] = _thread_count()  # 1: forking was safe
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
