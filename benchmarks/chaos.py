#!/usr/bin/env python
"""Chaos test of the main job: SIGKILL the training at random instants, resume every time, prove nothing broke.

    python benchmarks/chaos.py --trials 200 --json OUT.json

One run directory is shared by all trials: each trial resumes the example training
(``examples/train_gpt.py``) from the newest committed checkpoint and is SIGKILLed after a random
delay (seeded), so kills land during staging, shard writes, the manifest, the rename, retention and
plain training steps. After every kill the script checks, with a fresh manager, that no partial
checkpoint is listed and that the newest one verifies (sizes and CRC-32 of every file). At the end
a final run finishes the training, and every logged step of every run is compared bit for bit with
an uninterrupted reference run.

Reported (JSON): ``trials``, ``partial_exposed`` (must be 0), ``resumable`` (must equal trials),
``exact_resume`` (trials whose post-resume losses equal the reference), ``mismatched_steps``,
``instants`` (where kills landed: ``during_save`` when a temporary directory existed, else
``between_saves``; plus ``no_checkpoint_yet``), ``kill_delays_s`` (min/median/max) and ``wall_s``.

Children are forked from this pre-imported process (importing torch costs seconds per trial
otherwise); the parent never runs a torch op, so forking is safe.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import train_gpt  # noqa: E402  (imports torch and torch_ckpt once, before any fork)

from torch_ckpt.layout import read_manifest, scan_committed  # noqa: E402
from torch_ckpt.restore import verify_files  # noqa: E402


def _run_child(argv: list[str], *, kill_after_s: float | None, after_first_step: bool = False) -> tuple[bool, float]:
    """Fork a child running ``train_gpt.main(argv)``; SIGKILL it ``kill_after_s`` after it starts (or, with
    ``after_first_step``, after it logged its first step). Returns (killed, alive_s)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(os.open(str(argv[argv.index("--log-jsonl") + 1]) + ".stderr", os.O_WRONLY | os.O_CREAT, 0o644), 2)
            train_gpt.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    if kill_after_s is None:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"training child failed with status {os.waitstatus_to_exitcode(status)}")
        return False, time.monotonic() - t0
    log = Path(argv[argv.index("--log-jsonl") + 1])
    start = t0
    if after_first_step:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return False, time.monotonic() - t0
            if log.exists() and log.stat().st_size > 0:
                start = time.monotonic()
                break
            time.sleep(0.002)
    deadline = start + kill_after_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return False, time.monotonic() - t0
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, time.monotonic() - t0


def _read_log(path: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    if not path.exists():
        return out
    text = path.read_text()
    text = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(rec["step"], rec)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--steps", type=int, default=0, help="training steps (default: enough for the trials)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--max-delay", type=float, default=1.0,
                   help="longest random kill delay after the run's first step (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path("chaos_run"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    t_start = time.monotonic()
    rng = random.Random(args.seed)
    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    steps = args.steps or max(300, args.trials * 40)
    common = ["--steps", str(steps), "--save-every", str(args.save_every), "--seed", "7", "--keep-last", "2",
              "--max-windows", "640", "--n-layer", "1", "--n-embd", "32", "--quiet"]

    _run_child(common + ["--ckpt-dir", str(work / "ref_ckpt"), "--log-jsonl", str(work / "ref.jsonl")],
               kill_after_s=None)
    reference = _read_log(work / "ref.jsonl")

    ckpt = work / "ckpt"
    result = {"trials": 0, "partial_exposed": 0, "resumable": 0, "exact_resume": 0, "mismatched_steps": 0,
              "instants": {"during_save": 0, "between_saves": 0, "no_checkpoint_yet": 0}, "killed": 0}
    delays = []
    for trial in range(args.trials):
        log = work / f"run_{trial:04d}.jsonl"
        early = trial % 10 == 0  # every tenth kill lands during start-up / restore
        delay = rng.uniform(0.0, 0.3) if early else rng.uniform(0.0, args.max_delay)
        killed, _ = _run_child(common + ["--ckpt-dir", str(ckpt), "--log-jsonl", str(log)], kill_after_s=delay,
                               after_first_step=not early)
        delays.append(delay)
        result["trials"] += 1
        result["killed"] += int(killed)
        if any(ckpt.glob(".step_*.tmp")):
            result["instants"]["during_save"] += 1
        elif not scan_committed(ckpt):
            result["instants"]["no_checkpoint_yet"] += 1
        else:
            result["instants"]["between_saves"] += 1
        committed = scan_committed(ckpt)
        exposed = [d for d in ckpt.glob("step_*") if d.is_dir() and int(d.name[5:]) not in committed]
        result["partial_exposed"] += len(exposed)
        try:
            if committed:
                newest = committed[max(committed)]
                verify_files(newest, read_manifest(newest), checksums=True)
            result["resumable"] += 1
        except Exception as exc:  # noqa: BLE001 - counted, reported
            print(f"trial {trial}: newest checkpoint does not verify: {exc}", file=sys.stderr)
        got = _read_log(log)
        bad = [s for s, rec in got.items() if s in reference and (rec["loss"] != reference[s]["loss"]
                                                                   or rec["lr"] != reference[s]["lr"])]
        result["mismatched_steps"] += len(bad)
        result["exact_resume"] += int(not bad)
        if os.environ.get("CHAOS_VERBOSE"):
            print(f"trial {trial}: delay {delay:.3f}s killed={killed} logged={len(got)} bad={len(bad)}")

    _run_child(common + ["--ckpt-dir", str(ckpt), "--log-jsonl", str(work / "final.jsonl")], kill_after_s=None)
    final = _read_log(work / "final.jsonl")
    result["final_steps_checked"] = len(final)
    result["final_mismatched_steps"] = sum(1 for s, r in final.items()
                                           if r["loss"] != reference[s]["loss"] or r["lr"] != reference[s]["lr"])
    logged = max([max(_read_log(f), default=0) for f in work.glob("run_*.jsonl")] + [max(final, default=0)])
    result["finished"] = logged == steps
    result["kill_delays_s"] = {"min": min(delays), "median": statistics.median(delays), "max": max(delays)}
    result["wall_s"] = time.monotonic() - t_start
    result["ok"] = (result["partial_exposed"] == 0 and result["resumable"] == result["trials"]
                    and result["mismatched_steps"] == 0 and result["final_mismatched_steps"] == 0
                    and result["finished"])
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
