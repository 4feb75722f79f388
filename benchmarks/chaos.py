#!/usr/bin/env python
"""Chaos test of the main job: SIGKILL the training at random instants, resume every time, prove nothing broke.

    python benchmarks/chaos.py --trials 200 --json OUT.json

One run directory is shared by all trials: each trial resumes the example training
(``examples/train_gpt.py``) from the newest committed checkpoint and is SIGKILLed after a random
delay (seeded), so kills land during staging, shard writes, the manifest, the rename, retention and
plain training steps; every fourth kill, after its delay, waits for the next save in flight (a
temporary directory in the root), since the small model's saves take only milliseconds. After
every kill the script checks, with a fresh manager, that no partial
checkpoint is listed and that the newest one verifies (sizes and CRC-32 of every file). At the end
a final run finishes the training, and every logged step of every run is compared bit for bit with
an uninterrupted reference run.

Reported (JSON): ``trials``, ``partial_exposed`` (must be 0), ``resumable`` (must equal trials),
``exact_resume`` (trials whose post-resume losses equal the reference), ``mismatched_steps``,
``instants`` (where kills landed: ``during_save`` when a temporary directory existed, else
``between_saves``; plus ``no_checkpoint_yet``), ``kill_delays_s`` (min/median/max) and ``wall_s``.

With ``--persist process`` the training saves through a writer process per rank, and every kill
also checks that the killed trainer's writer exits and commits nothing afterwards:
``writers_seen`` (writer processes alive at the kill), ``writers_survived`` (still running
``--orphan-bound`` seconds later; must be 0; they are then killed), ``writer_exit_s``
(min/median/max seconds from the kill until they were gone) and ``committed_after_death`` (steps
that appeared after the trainer was reaped; must be 0).

``--restart-while-orphan`` (with ``--persist process``) stands in for an immediate restart while
the old writer is slow: each kill after start-up waits for a save in flight, the writer is SIGSTOPped
before its trainer is SIGKILLed, the next run
starts at once, and the old writer is SIGCONTed at a random instant of that restarted run.
``--no-death-signal`` starts writers without Linux's parent-death signal (standing in for other
platforms), so that such an orphan really lives on and only its own liveness check and the
incarnation-id temporaries protect the root. Reported: ``orphans_stopped`` (writers that were
still alive when the restart began), ``orphans_survived`` (alive ``--orphan-bound`` seconds after
being resumed; must be 0), ``orphan_exit_after_resume_s`` and ``run_errors`` (runs whose stderr
holds a traceback, e.g. a restarted run's failed save; must be 0).

``--nodes N`` (e.g. ``--nodes 2 --memory-every 1``) runs the training as N simulated nodes of one gloo rank, each
with its own disk root (``ckpt/nodeK``, a save every ``--save-every`` steps) and memory tier (``mem/nodeK``, a save
every ``--memory-every`` steps, each node's newest memory step replicated to the next node). Every kill takes the
whole run (its process group); every fifth lands in the first 5 s (start-up, restore, a node's repair), every
fourth waits for a disk save in flight and every fourth for a replica being received. After half of the kills
(seeded) a random node is lost: its disk root and memory root (with the replicas it held) are wiped. After every
kill every tier of every node is audited (disk roots, memory roots and ``.peers/node-*`` replica folders): each
``step_*`` directory is a reservation or a committed checkpoint whose files verify, and nothing else is listed.
Each restart's restore is read from the ranks' ``restored step S from SOURCE`` lines; the steps lost per kill
(the newest step trained before it minus the step resumed) must be at most ``--memory-every + 1`` (the memory
interval plus the save in flight), or, after a node loss, at most what the lost node's ``health()`` said just
before the kill (``lost_steps_if_node_lost`` plus the steps trained since its record: replication fell behind
the cadence, counted in ``replication_lag_kills``). A run killed before it resumed may lose a second node:
when every node was lost that way (``job_losses``) the estimate is ``lost_steps_if_job_lost``.
``health_checked`` / ``health_exact`` count the node losses whose estimate was known / equal to the loss;
``health_underestimates`` lists those that lost more (must be empty); ``health_estimate_minus_lost`` is
``{estimate - lost: kills}`` (a round that finished between the last record and the kill makes the estimate
larger). Every logged step is compared with a reference run: lr, epoch and batch
exactly, the loss to float32 rounding (it is all-reduced over gloo ranks, see ``examples/demo_cluster.py``).
Reported besides the fields above: ``node_losses``, ``resumes`` / ``resumes_after_node_loss``,
``resume_sources`` (per node restore: ``memory``, ``memory-peer``, ``local``, ... and ``fresh`` runs),
``split_resumes`` (nodes resuming different steps; must be 0), ``lost_steps`` / ``lost_steps_node_loss``
(``{steps lost: kills}``), ``lost_over_bound`` (the details of every kill that lost more; must be empty),
``exposed`` (what the audits found) and ``instants`` as ``during_disk_save`` / ``during_memory_save`` /
``during_replication`` (not exclusive), ``between_saves``, ``no_checkpoint_yet``.

Children are forked from this pre-imported process (importing torch costs seconds per trial
otherwise); the parent never runs a torch op, so forking is safe.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import psutil  # noqa: E402
import train_gpt  # noqa: E402  (imports torch and torch_ckpt once, before any fork)
from _common import emit_json  # noqa: E402
from demo import compare  # noqa: E402

from torch_ckpt.format._files import verify_files  # noqa: E402
from torch_ckpt.root._layout import (  # noqa: E402
    is_reservation,  # noqa: E402
    read_manifest,
    scan_committed,
)
from torch_ckpt.save import _writer_process as writer_process  # noqa: E402


def _matches(root: Path, *patterns: str) -> bool:
    """Something under ``root`` matches one of the glob ``patterns`` (listed again when a directory that the
    running training removes, e.g. a step retention deletes, vanished while it was listed)."""
    while True:
        try:
            return any(any(root.glob(pattern)) for pattern in patterns)
        except FileNotFoundError:
            continue


def _save_in_flight(root: Path) -> bool:
    """A save is being written under ``root``: its partial inside a reserved name, or a commit-side temporary."""
    return _matches(root, "step_*/.torch-ckpt.partial.*", ".torch-ckpt.tmp.*", ".step_*.tmp*")


def _writers(pid: int) -> list[psutil.Process]:
    """The checkpoint writer processes (spawned children) of process ``pid``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def _status(proc: psutil.Process) -> str | None:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return None


def _gone(proc: psutil.Process) -> bool:
    """True once ``proc`` exited (an unreaped zombie counts as exited)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], bound_s: float) -> tuple[float, list[psutil.Process]]:
    """Wait up to ``bound_s`` for ``procs`` to exit; returns (seconds waited, survivors)."""
    t0 = time.monotonic()
    while True:
        alive = [p for p in procs if not _gone(p)]
        if not alive or time.monotonic() - t0 > bound_s:
            return time.monotonic() - t0, alive
        time.sleep(0.005)


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _run_child(argv: list[str], *, kill_after_s: float | None, after_first_step: bool = False,
               stop_writers: bool = False, event: tuple[float, object] | None = None,
               in_save_of: Path | None = None, in_flight: Callable[[], bool] | None = None,
               group: bool = False) -> tuple[bool, float, list[psutil.Process]]:
    """Fork a child running ``train_gpt.main(argv)``; SIGKILL it ``kill_after_s`` after it starts (or, with
    ``after_first_step``, after it logged its first step). ``stop_writers``: SIGSTOP its writer processes just
    before the kill. ``event``: ``(seconds, callable)`` called once that long after the start (or the first
    step), or when the child ends if earlier. ``in_save_of``: after the delay, wait (up to 5 s) until a save
    is in flight in that checkpoint root (:func:`_save_in_flight`), then kill: saves of the small
    model take milliseconds, so purely random instants may all miss them; ``in_flight``: the same with any
    condition. ``group``: SIGKILL the child's whole process group (its ranks too) and wait until all are gone.
    The child's stdout goes to ``<log>.stdout``. Returns (killed, alive_s, the child's writers at the kill)."""
    if in_save_of is not None:
        in_flight = functools.partial(_save_in_flight, in_save_of)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setpgid(0, 0)  # a process group of its own: ranks and all, killed at once with ``group``
            log_name = str(argv[argv.index("--log-jsonl") + 1])
            os.dup2(os.open(log_name + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 1)
            os.dup2(os.open(log_name + ".stderr", os.O_WRONLY | os.O_CREAT, 0o644), 2)
            train_gpt.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    log = Path(argv[argv.index("--log-jsonl") + 1])
    pending = [event] if event is not None else []

    def fire(now_from: float | None) -> None:
        if pending and (now_from is None or time.monotonic() - now_from >= pending[0][0]):
            pending.pop()[1]()

    def finished_early() -> tuple[bool, float, list]:
        fire(None)
        return False, time.monotonic() - t0, []

    start = t0
    if after_first_step or kill_after_s is None:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if kill_after_s is None and os.waitstatus_to_exitcode(status) != 0:
                    fire(None)
                    raise SystemExit(f"training child failed with status {os.waitstatus_to_exitcode(status)}")
                return finished_early()
            if log.exists() and log.stat().st_size > 0:
                start = time.monotonic()
                break
            time.sleep(0.002)
    if kill_after_s is None:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                fire(None)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise SystemExit(f"training child failed with status {os.waitstatus_to_exitcode(status)}")
                return False, time.monotonic() - t0, []
            fire(start)
            time.sleep(0.002)
    deadline = start + kill_after_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return finished_early()
        fire(start)
        time.sleep(0.002)
    if in_flight is not None:
        give_up = time.monotonic() + 5.0
        while time.monotonic() < give_up and not in_flight():
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return finished_early()
            fire(start)
            time.sleep(0.0002)
    writers = _writers(pid)
    if stop_writers:
        for w in writers:
            try:
                w.suspend()
            except psutil.NoSuchProcess:
                pass
        until = time.monotonic() + 2.0  # SIGSTOP lands asynchronously: the trainer dies only once they are stopped
        while time.monotonic() < until and any(not _gone(w) and _status(w) != psutil.STATUS_STOPPED for w in writers):
            time.sleep(0.001)
    ranks = psutil.Process(pid).children(recursive=True) if group else []
    if group:
        os.killpg(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if stop_writers:  # the kernel sends SIGHUP and SIGCONT to a stopped process group its leader's death orphaned
        for w in writers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.suspend()
    _wait_gone(ranks, 30.0)
    fire(None)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, time.monotonic() - t0, writers


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


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _audit(root: Path) -> list[str]:
    """Problems of one checkpoint root (or replica folder): a listed step whose directory is not a final
    ``step_*`` name, or a ``step_*`` directory that is neither a reservation nor a committed checkpoint whose files
    all verify (sizes and CRC-32)."""
    committed = scan_committed(root)
    problems = [f"{d}: listed, but a temporary name" for d in committed.values() if not d.name.startswith("step_")]
    for d in sorted(root.glob("step_*")):
        if not d.is_dir() or is_reservation(d):
            continue
        try:
            if int(d.name[5:]) not in committed:
                raise ValueError("partial data under a final name")
            verify_files(d, read_manifest(d), checksums=True)
        except Exception as exc:  # noqa: BLE001 - counted, reported
            problems.append(f"{d}: {exc}")
    return problems


_RESTORED = re.compile(r"node (\d+) \(rank \d+\) restored step (\d+) from (memory-peer|memory|local|durable-\w+)")


def node_chaos(args: argparse.Namespace, rng: random.Random, work: Path) -> dict:
    """The ``--nodes`` mode: kills of the whole multi-node run, half of them also losing a node; the result."""
    nproc = args.nodes
    steps = args.steps or max(60, args.trials * 5)
    common = ["--steps", str(steps), "--save-every", str(args.save_every), "--seed", "7", "--keep-last", "2",
              "--max-windows", "640", "--n-layer", "1", "--n-embd", "32", "--quiet", "--nproc", str(nproc),
              "--simulate-nodes", str(args.nodes), "--memory-every", str(args.memory_every)]  # fmt: skip
    _run_child(common + ["--ckpt-dir", str(work / "ref_ckpt"), "--memory-root", str(work / "ref_mem"),
                         "--log-jsonl", str(work / "ref.jsonl")], kill_after_s=None)
    reference = _read_log(work / "ref.jsonl")
    ckpt, mem = work / "ckpt", work / "mem"
    disks = [ckpt / f"node{k}" for k in range(args.nodes)]
    memories = [mem / f"node{k}" for k in range(args.nodes)]
    bound = args.memory_every + 1  # the memory interval plus the one save in flight at the kill
    result: dict = {"nodes": args.nodes, "memory_every": args.memory_every, "save_every": args.save_every,
                    "trials": 0, "killed": 0, "partial_exposed": 0, "exposed": [], "resumable": 0, "exact_resume": 0,
                    "mismatched_steps": 0, "run_errors": 0, "node_losses": 0, "resumes": 0,
                    "resumes_after_node_loss": 0, "resume_sources": {}, "split_resumes": 0,
                    "instants": {"during_disk_save": 0, "during_memory_save": 0, "during_replication": 0,
                                 "between_saves": 0, "no_checkpoint_yet": 0},
                    "lost_steps_bound": bound, "lost_steps": {}, "lost_steps_node_loss": {}, "lost_over_bound": [],
                    "replication_lag_kills": 0, "job_losses": 0, "health_checked": 0, "health_exact": 0,
                    "health_underestimates": [], "health_estimate_minus_lost": {}}
    delays: list[float] = []
    logs: list[Path] = []  # the trials' logs, newest first
    progress, pending = 0, None  # the newest step trained; (killed trial, progress then, node lost) to resume

    def replicating() -> bool:
        return _matches(mem, "node*/.peers/node-*/.incoming.*")

    def run(log: Path, **kw) -> tuple[bool, dict[int, dict], int]:
        killed = _run_child(common + ["--ckpt-dir", str(ckpt), "--memory-root", str(mem), "--log-jsonl", str(log)],
                            group=True, **kw)[0]
        err = Path(str(log) + ".stderr")
        if err.exists() and "Traceback" in err.read_text(errors="replace"):
            result["run_errors"] += 1
            print(f"{log.name}: traceback in {err}", file=sys.stderr)
        got = _read_log(log)
        bad = compare(reference, list(got.values()), loss_rtol=1e-5)  # loss: float32 rounding over gloo ranks
        restored = {int(k): (int(s), src) for k, s, src in _RESTORED.findall(Path(str(log) + ".stdout").read_text())}
        resumed = None
        if restored:
            resumed = min(st for st, _ in restored.values())
            result["split_resumes"] += int(len({st for st, _ in restored.values()}) > 1)
            for _, src in restored.values():
                result["resume_sources"][src] = result["resume_sources"].get(src, 0) + 1
        elif got:
            resumed = min(got) - 1
            result["resume_sources"]["fresh"] = result["resume_sources"].get("fresh", 0) + int(resumed == 0)
        nonlocal progress, pending
        if resumed is not None and pending is not None:
            trial, at_kill, lost_node, estimate = pending
            lost = at_kill - resumed
            result["resumes"] += 1
            result["resumes_after_node_loss"] += int(lost_node is not None)
            job_lost = lost_node is not None and len(lost_node) == args.nodes  # every node replaced before a resume
            result["job_losses"] += int(job_lost)
            for key in ("lost_steps",) + (("lost_steps_node_loss",) if lost_node is not None else ()):
                result[key][str(lost)] = result[key].get(str(lost), 0) + 1
            kill = {"killed_trial": trial, "killed_after_step": at_kill,
                    "nodes_lost": sorted(lost_node) if lost_node is not None else None,
                    "resumed_step": resumed, "estimated_lost_steps": estimate,
                    "sources": {k: v[1] for k, v in restored.items()}}
            if estimate is not None:  # health() said, just before the kill, what losing that node costs
                result["health_checked"] += 1
                result["health_exact"] += int(lost == estimate)
                gap = result["health_estimate_minus_lost"]
                gap[str(estimate - lost)] = gap.get(str(estimate - lost), 0) + 1
                if lost > estimate:
                    result["health_underestimates"].append(kill)
            if lost < 0 or (lost > bound and (estimate is None or lost > estimate)):
                result["lost_over_bound"].append(kill)
            elif lost > bound and not job_lost:  # replication fell behind the cadence: health() said so
                result["replication_lag_kills"] += 1
            pending = None
        progress = max(got) if got else (resumed if resumed is not None else progress)
        return killed, got, len(bad)

    for trial in range(args.trials):
        log = work / f"run_{trial:04d}.jsonl"
        early = trial % 5 == 0  # every fifth kill lands in the run's first 5 s: start-up, restore, a node's repair
        wait_for = {1: functools.partial(_save_in_flight, disks[0]), 3: replicating}.get(trial % 4)
        delay = rng.uniform(0.0, 5.0) if early else rng.uniform(0.0, args.max_delay)
        killed, _, bad = run(log, kill_after_s=delay, after_first_step=not early, in_flight=wait_for)
        result["mismatched_steps"] += bad
        result["exact_resume"] += int(not bad)
        delays.append(delay)
        result["trials"] += 1
        result["killed"] += int(killed)
        inst = result["instants"]
        flags = {"during_disk_save": any(map(_save_in_flight, disks)),
                 "during_memory_save": any(map(_save_in_flight, memories)), "during_replication": replicating()}
        for key, hit in flags.items():
            inst[key] += int(hit)
        if not any(flags.values()):
            inst["no_checkpoint_yet" if not any(scan_committed(r) for r in disks + memories) else "between_saves"] += 1
        lost_node = rng.randrange(args.nodes) if rng.random() < 0.5 else None
        logs.insert(0, log)
        lost_nodes = {lost_node} if lost_node is not None else None
        if pending is not None and pending[2] is not None:  # the kill before never resumed: that loss stands
            lost_nodes = pending[2] | (lost_nodes or set())
        pending = (trial, progress, lost_nodes, _estimate(logs, lost_nodes, progress, args.nodes))
        if lost_node is not None:  # a replaced node: its disk and its RAM (with the replicas it held) are gone
            result["node_losses"] += 1
            shutil.rmtree(disks[lost_node], ignore_errors=True)
            shutil.rmtree(memories[lost_node], ignore_errors=True)
        problems = [x for r in disks + memories + sorted(mem.glob("node*/.peers/node-*")) for x in _audit(r)]
        result["partial_exposed"] += len(problems)
        result["exposed"] += [f"trial {trial}: {x}" for x in problems]
        result["resumable"] += int(not problems)
        if os.environ.get("CHAOS_VERBOSE"):
            print(f"trial {trial}: delay {delay:.3f}s killed={killed} progress={progress} node_lost={lost_node} "
                  f"{flags} sources={result['resume_sources']}")

    _, final, result["final_mismatched_steps"] = run(work / "final.jsonl", kill_after_s=None)
    result["final_steps_checked"] = len(final)
    result["finished"] = max(final, default=progress) == steps
    result["kill_delays_s"] = _spread(delays)
    result["ok"] = (result["partial_exposed"] == 0 and result["resumable"] == result["trials"]
                    and result["mismatched_steps"] == 0 and result["final_mismatched_steps"] == 0
                    and result["finished"] and result["run_errors"] == 0
                    and result["split_resumes"] == 0 and not result["lost_over_bound"]
                    and not result["health_underestimates"])
    return result


def _estimate(logs: list[Path], nodes: set[int] | None, progress: int, count: int) -> int | None:
    """Steps the loss of ``nodes`` costs at ``progress`` per the last ``health()`` record each lost node wrote
    (in ``logs``, newest first): ``lost_steps_if_node_lost``, or ``lost_steps_if_job_lost`` when every node is
    lost, plus the steps trained after it; the largest. None: no node lost, or no record."""
    if not nodes:
        return None
    key = "lost_steps_if_job_lost" if len(nodes) == count else "lost_steps_if_node_lost"
    found = []
    for node in nodes:
        for log in logs:
            path = Path(f"{log}.node{node}.health")
            records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] \
                if path.exists() else []
            if records:
                if records[-1][key] is not None:
                    found.append(int(records[-1][key]) + progress - int(records[-1]["step"]))
                break
    return max(found) if found else None


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
    p.add_argument("--persist", choices=("thread", "process"), default="thread",
                   help="the training's writer: a thread (default) or a writer process")
    p.add_argument("--restart-while-orphan", action="store_true",
                   help="SIGSTOP the writer before each kill, restart at once, SIGCONT it during the restarted run")
    p.add_argument("--no-death-signal", action="store_true",
                   help="start writer processes without the parent-death signal (stands in for non-Linux)")
    p.add_argument("--orphan-bound", type=float, default=30.0,
                   help="seconds an orphaned writer may take to exit before it counts as survived")
    p.add_argument("--nodes", type=int, default=1,
                   help="N > 1: N simulated nodes of one rank (gloo), each with its disk root and memory tier; half "
                        "of the kills also lose a random node (its disk and memory wiped)")
    p.add_argument("--memory-every", type=int, default=1, help="with --nodes: memory saves every K steps")
    args = p.parse_args(argv)
    if args.nodes > 1 and (args.persist != "thread" or args.restart_while_orphan):
        p.error("--nodes goes with the default writer (no --persist process, no --restart-while-orphan)")
    if args.restart_while_orphan and args.persist != "process":
        p.error("--restart-while-orphan needs --persist process")
    if args.no_death_signal:
        writer_process._PARENT_DEATH_SIGNAL = None  # inherited by the forked trainers
    t_start = time.monotonic()
    rng = random.Random(args.seed)
    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.nodes > 1:
        result = node_chaos(args, rng, work)
        result["wall_s"] = time.monotonic() - t_start
        emit_json(result, args.json)
        return result
    steps = args.steps or max(300, args.trials * 40)
    common = ["--steps", str(steps), "--save-every", str(args.save_every), "--seed", "7", "--keep-last", "2",
              "--max-windows", "640", "--n-layer", "1", "--n-embd", "32", "--quiet", "--persist", args.persist]

    _run_child(common + ["--ckpt-dir", str(work / "ref_ckpt"), "--log-jsonl", str(work / "ref.jsonl")],
               kill_after_s=None)
    reference = _read_log(work / "ref.jsonl")

    ckpt = work / "ckpt"
    result = {"persist": args.persist, "restart_while_orphan": args.restart_while_orphan,
              "death_signal": not args.no_death_signal, "trials": 0, "partial_exposed": 0, "resumable": 0,
              "exact_resume": 0, "mismatched_steps": 0,
              "instants": {"during_save": 0, "between_saves": 0, "no_checkpoint_yet": 0}, "killed": 0,
              "writers_seen": 0, "writers_survived": 0, "committed_after_death": 0, "orphans_stopped": 0,
              "orphans_survived": 0, "run_errors": 0}
    delays: list[float] = []
    exit_times: list[float] = []
    resume_exit_times: list[float] = []
    orphans: list[psutil.Process] = []  # stopped writers of the previous trial (--restart-while-orphan)

    def resume_orphans_event(stopped: list[psutil.Process]) -> tuple[float, object] | None:
        """An event for the restarted run: SIGCONT the stopped orphans at a random instant of it."""
        if not stopped:
            return None
        resumed_at: list[float] = []

        def resume() -> None:
            resumed_at.append(time.monotonic())
            for o in stopped:
                try:
                    o.resume()
                except psutil.NoSuchProcess:
                    pass

        resume.resumed_at = resumed_at  # type: ignore[attr-defined]
        return rng.uniform(0.0, args.max_delay), resume

    def settle_orphans(stopped: list[psutil.Process], event) -> None:
        """After the restarted run: every resumed orphan must have exited (counted, then killed if not)."""
        if not stopped:
            return
        waited, survivors = _wait_gone(stopped, args.orphan_bound)
        t_resumed = event[1].resumed_at[0] if event[1].resumed_at else time.monotonic()
        resume_exit_times.append(time.monotonic() - t_resumed)
        result["orphans_survived"] += len(survivors)
        _kill_all(survivors)

    def count_errors(log: Path) -> None:
        err = Path(str(log) + ".stderr")
        if err.exists() and "Traceback" in err.read_text(errors="replace"):
            result["run_errors"] += 1
            print(f"{log.name}: traceback in {err}", file=sys.stderr)

    for trial in range(args.trials):
        log = work / f"run_{trial:04d}.jsonl"
        early = trial % 10 == 0  # every tenth kill lands during start-up / restore
        # every fourth kill waits for a save in flight after its delay; with --restart-while-orphan every one
        # after start-up does, so that the writers stopped at the kill are busy ones (orphans to outlive it)
        in_save = trial % 4 == 1 or (args.restart_while_orphan and not early)
        delay = rng.uniform(0.0, 0.3) if early else rng.uniform(0.0, args.max_delay)
        event = resume_orphans_event(orphans)
        killed, _, writers = _run_child(common + ["--ckpt-dir", str(ckpt), "--log-jsonl", str(log)],
                                        kill_after_s=delay, after_first_step=not early,
                                        stop_writers=args.restart_while_orphan, event=event,
                                        in_save_of=ckpt if in_save else None)
        settle_orphans(orphans, event)
        count_errors(log)
        delays.append(delay)
        result["trials"] += 1
        result["killed"] += int(killed)
        result["writers_seen"] += len(writers)
        if args.restart_while_orphan:
            orphans = [w for w in writers if not _gone(w)]
            result["orphans_stopped"] += len(orphans)
        elif writers:
            at_death = set(scan_committed(ckpt))
            waited, survivors = _wait_gone(writers, args.orphan_bound)
            exit_times.append(waited)
            result["writers_survived"] += len(survivors)
            _kill_all(survivors)
            result["committed_after_death"] += len(set(scan_committed(ckpt)) - at_death)
        if _save_in_flight(ckpt):
            result["instants"]["during_save"] += 1
        elif not scan_committed(ckpt):
            result["instants"]["no_checkpoint_yet"] += 1
        else:
            result["instants"]["between_saves"] += 1
        committed = scan_committed(ckpt)
        # a final name holding data that is not a committed checkpoint; a reservation (nothing but hidden
        # partials, or empty: a save in flight at the kill) is never listed or loaded, so it is not exposed
        exposed = [d for d in ckpt.glob("step_*") if d.is_dir() and int(d.name[5:]) not in committed
                   and not is_reservation(d)]
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

    event = resume_orphans_event(orphans)
    _run_child(common + ["--ckpt-dir", str(ckpt), "--log-jsonl", str(work / "final.jsonl")], kill_after_s=None,
               event=event)
    settle_orphans(orphans, event)
    count_errors(work / "final.jsonl")
    final = _read_log(work / "final.jsonl")
    result["final_steps_checked"] = len(final)
    result["final_mismatched_steps"] = sum(1 for s, r in final.items()
                                           if r["loss"] != reference[s]["loss"] or r["lr"] != reference[s]["lr"])
    logged = max([max(_read_log(f), default=0) for f in work.glob("run_*.jsonl")] + [max(final, default=0)])
    result["finished"] = logged == steps
    result["kill_delays_s"] = _spread(delays)
    result["writer_exit_s"] = _spread(exit_times)
    result["orphan_exit_after_resume_s"] = _spread(resume_exit_times)
    result["wall_s"] = time.monotonic() - t_start
    result["ok"] = (result["partial_exposed"] == 0 and result["resumable"] == result["trials"]
                    and result["mismatched_steps"] == 0 and result["final_mismatched_steps"] == 0
                    and result["finished"] and result["writers_survived"] == 0
                    and result["committed_after_death"] == 0 and result["orphans_survived"] == 0
                    and result["run_errors"] == 0)
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
