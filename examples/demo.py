#!/usr/bin/env python
"""The main job, end to end: train, get killed with SIGKILL, resume, and prove the resume was exact.

1. a reference run of ``--steps`` steps, checkpointing every ``--save-every`` steps;
2. the same run in a fresh directory, killed with SIGKILL from outside once its log shows it passed
   ``--kill-after`` (this process polls the log, so the kill lands wherever the run happens to be,
   a background checkpoint write included);
3. the very same command again: it resumes from the newest committed checkpoint and finishes;
4. every step logged after the resume point must have a loss and learning rate bitwise identical to
   the reference run's (compared with ``==`` and by ``repr``), as well as the same epoch and batch.

Exits non-zero when anything differs or when nothing was resumed.

    python examples/demo.py --work-dir demo_run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().with_name("train_gpt.py")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a log; a last line cut short by a SIGKILL (no newline yet) is ignored."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def train_cmd(args: argparse.Namespace, ckpt_dir: Path, log: Path) -> list[str]:
    return [
        sys.executable, str(TRAIN),
        "--steps", str(args.steps),
        "--save-every", str(args.save_every),
        "--keep-last", str(args.keep_last),
        "--seed", str(args.seed),
        "--threads", str(args.threads),
        "--max-windows", str(args.max_windows),
        "--ckpt-dir", str(ckpt_dir),
        "--log-jsonl", str(log),
    ]  # fmt: skip


def run_to_end(cmd: list[str], label: str) -> str:
    print(f"\n== {label}\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"demo: {label} failed with exit code {proc.returncode}")
    return proc.stdout


def last_logged_step(path: Path, offset: int, tail: bytes) -> tuple[int | None, int, bytes]:
    """Read what was appended to ``path`` since ``offset``; return the newest complete step seen."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return None, offset, tail
    data = tail + chunk
    lines = data.split(b"\n")
    step = None
    for line in lines[:-1]:
        if line.strip():
            step = json.loads(line)["step"]
    return step, offset + len(chunk), lines[-1]


def run_and_kill(cmd: list[str], log: Path, kill_after: int) -> tuple[int, float]:
    """Start ``cmd``, SIGKILL it from outside once its log shows a step >= ``kill_after``."""
    print(f"\n== run to be killed once it logs step >= {kill_after}\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd)
    offset, tail, seen = 0, b"", 0
    t0 = time.perf_counter()
    while True:
        step, offset, tail = last_logged_step(log, offset, tail)
        seen = step if step is not None else seen
        if seen >= kill_after:
            proc.send_signal(signal.SIGKILL)
            killed_at = time.perf_counter() - t0
            break
        if proc.poll() is not None:
            raise SystemExit(f"demo: the run exited ({proc.returncode}) before it could be killed")
        time.sleep(0.005)
    rc = proc.wait()
    if rc != -signal.SIGKILL:
        raise SystemExit(f"demo: expected the run to die of SIGKILL, got exit code {rc}")
    step, _, _ = last_logged_step(log, offset, tail)
    last = step if step is not None else seen
    print(f"demo: SIGKILL sent after {killed_at:.1f} s; the log's last step is {last}", flush=True)
    return last, killed_at


def same_float(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and a == b and repr(a) == repr(b)


def compare(ref: dict[int, dict], records: list[dict], loss_rtol: float = 0.0) -> list[str]:
    """Mismatch descriptions for ``records`` against the reference run (empty: all the same).

    The lr, epoch and batch must be identical; the loss too (bitwise) unless ``loss_rtol`` > 0
    allows that relative difference (e.g. 1e-5 when the ranks' reduction order may differ).
    """
    problems = []
    for rec in records:
        want = ref.get(rec["step"])
        if want is None:
            problems.append(f"step {rec['step']}: not in the reference log")
            continue
        loss_ok = (abs(rec["loss"] - want["loss"]) <= loss_rtol * abs(want["loss"]) if loss_rtol
                   else same_float(rec["loss"], want["loss"]))
        if not loss_ok:
            problems.append(f"step {rec['step']}: loss {rec['loss']!r} != reference {want['loss']!r}")
        if not same_float(rec["lr"], want["lr"]):
            problems.append(f"step {rec['step']}: lr {rec['lr']!r} != reference {want['lr']!r}")
        for key in ("epoch", "batch"):
            if rec.get(key) != want.get(key):
                problems.append(f"step {rec['step']}: {key} {rec.get(key)!r} != reference {want.get(key)!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, required=True, help="scratch directory (emptied first)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--kill-after", type=int, default=None,
        help="SIGKILL once the log shows this step; default: the first save step at or after steps // 2, so the "
        "kill lands while that checkpoint is being staged or written in the background",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--max-windows", type=int, default=1920,
        help="dataset windows (1920 / batch 16 = 120 steps per epoch, so the run crosses epoch boundaries)",
    )  # fmt: skip
    args = p.parse_args(argv)
    kill_after = args.kill_after
    if kill_after is None:
        kill_after = -(-(args.steps // 2) // args.save_every) * args.save_every if args.save_every else args.steps // 2
    if not 0 < kill_after < args.steps:
        p.error(f"--kill-after must be between 1 and {args.steps - 1}")
    t_start = time.perf_counter()

    work = args.work_dir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ref_log, run_log, resume_log = work / "ref.jsonl", work / "run.jsonl", work / "resume.jsonl"
    run_ckpt = work / "run_ckpt"

    # (a) the reference: one uninterrupted run
    run_to_end(train_cmd(args, work / "ref_ckpt", ref_log), "reference run")

    # (b) the same run, killed from outside mid-way
    last_before_kill, _ = run_and_kill(train_cmd(args, run_ckpt, run_log), run_log, kill_after)
    print(f"demo: {run_ckpt} after the kill: {sorted(os.listdir(run_ckpt)) if run_ckpt.exists() else 'missing'}")

    # (c) the very same command again: resumes from the newest committed checkpoint
    out = run_to_end(train_cmd(args, run_ckpt, resume_log), "the same command again (resume)")
    m = re.search(r"resumed from (\d+|None)", out.splitlines()[-1] if out.strip() else "")
    resumed = int(m.group(1)) if m and m.group(1) != "None" else None

    # (d) compare with the reference, bit for bit
    ref = {rec["step"]: rec for rec in read_jsonl(ref_log)}
    before = read_jsonl(run_log)
    after = read_jsonl(resume_log)
    problems = []
    if len(ref) != args.steps:
        problems.append(f"the reference logged {len(ref)} steps, expected {args.steps}")
    if resumed is None:
        problems.append("the rerun did not resume from a checkpoint")
    elif not after or after[0]["step"] != resumed + 1:
        first = after[0]["step"] if after else None
        problems.append(f"the rerun resumed from {resumed} but its first logged step is {first}")
    if resumed is not None and resumed > last_before_kill:
        problems.append(f"resumed from step {resumed}, beyond the last step {last_before_kill} the killed run logged")
    if not after or after[-1]["step"] != args.steps:
        problems.append(f"the resumed run did not reach step {args.steps}")
    post = compare(ref, after)
    pre = compare(ref, before)

    total = time.perf_counter() - t_start
    print("\n== report")
    print(f"killed run: logged steps 1..{last_before_kill}; SIGKILL sent once its log showed step {kill_after}")
    note = ""
    if resumed is not None and args.save_every:
        in_flight = [s for s in range(resumed + 1, last_before_kill + 1) if s % args.save_every == 0]
        if in_flight:
            note = f" (the save of step {in_flight[-1]} had not committed when the kill landed)"
    print(f"resumed from step {resumed}{note}")
    n_same = len(after) - len({msg.split(':')[0] for msg in post})
    print(f"post-resume steps bitwise identical to the reference (loss, lr, epoch, batch): {n_same}/{len(after)}")
    n_pre_same = len(before) - len({msg.split(':')[0] for msg in pre})
    print(f"pre-kill steps identical to the reference: {n_pre_same}/{len(before)}")
    for msg in (problems + post + pre)[:20]:
        print(f"MISMATCH: {msg}")
    ok = not problems and not post and not pre and len(after) > 0
    print(f"demo: {'PASS' if ok else 'FAIL'} in {total:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
