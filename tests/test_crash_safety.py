"""Crash safety: SIGKILL a saving process at random instants; the last good checkpoint must survive.

A helper process (``tests/_helpers/crash_saver.py``) imports torch once (single-threaded) and forks a fresh saver per
kill. Each saver builds a ~6 MB ``TrainState`` (4 layers, AdamW moments, StepLR, RNG, JSON extras),
fills every tensor deterministically from the step number, and saves step after step
asynchronously with ``keep_last=2``; after a seeded random delay it is SIGKILLed (and reaped).
The delays span a few save cycles, measured on this machine first, so kills land in staging, shard
writes, ``.metadata``, per-rank JSON, manifest, rename and retention alike.

After every kill the test process opens a fresh ``CheckpointManager`` on the *same* directory
(earlier checkpoints must survive later kills) and records what it sees; the tests below each
check one property over all records of the campaign (which runs once per module).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from torch_ckpt import CheckpointManager

_HELPER_PATH = Path(__file__).parent / "_helpers" / "crash_saver.py"
_spec = importlib.util.spec_from_file_location("_crash_saver_helper", _HELPER_PATH)
saver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(saver)

KILLS = 30
FIRST_SAVE_KILLS = 8
SEED = 20240607
_TMP_RE = re.compile(r"^\.step_\d+\.tmp(\.[0-9a-f]+)?$")
_SIDE_RE = re.compile(r"^\.torch-ckpt\.tmp\.[0-9a-f]+$")  # a commit between its renames, or retention's trash
_PARTIAL = ".torch-ckpt.partial."  # a save in progress, inside its reserved final directory
_FINAL_RE = re.compile(r"^step_(\d+)$")


def _is_temporary(name: str) -> bool:
    return bool(_TMP_RE.match(name) or _SIDE_RE.match(name)) or name.startswith(".trash_")


class _Zygote:
    """The kill harness process (see the helper's docstring for its JSON-line protocol)."""

    def __init__(self, log_path: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(_HELPER_PATH)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1)
        hello = self.proc.stdout.readline()
        assert hello, f"kill harness did not start:\n{self.stderr()}"

    def stderr(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"kill harness died:\n{self.stderr()}"
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class _RestoreLog(logging.Handler):
    """Records the directories the manager restores from (its INFO line names them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.dirs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "restored" in record.getMessage() and isinstance(record.args, tuple):
            self.dirs += [str(a) for a in record.args if isinstance(a, (str, os.PathLike)) and os.sep in str(a)]


def _snapshot(root: Path) -> dict[str, list[str]]:
    """``{entry: sorted file names inside}`` of the checkpoint root (a partial's files as ``PARTIAL/file``)."""
    out = {}
    for entry in sorted(os.listdir(root)):
        p = root / entry
        names = sorted(os.listdir(p)) if p.is_dir() else []
        out[entry] = [f"{n}/{f}" for n in names for f in sorted(os.listdir(p / n))] \
            if names and all(n.startswith(_PARTIAL) for n in names) else names
    return out


def _phase(before: dict[str, list[str]]) -> str:
    """Which part of a save the kill interrupted, judged from what it left on disk."""
    sides = [files for n, files in before.items() if _SIDE_RE.match(n)]
    if any(n.startswith(".trash_") for n in before) or any("manifest.json" not in files for files in sides):
        return "retention"
    if sides:
        return "manifest written, between the commit's renames"
    tmps = [[f.split("/", 1)[1] for f in files if "/" in f] for n, files in before.items()
            if _FINAL_RE.match(n) and any(f.startswith(_PARTIAL) for f in files)]
    if not tmps:
        return "staging / between saves / after rename"
    files = tmps[0]
    if "manifest.json" in files:
        return "manifest written, before rename"
    if any(f.startswith("rank_") for f in files):
        return "per-rank JSON written, before manifest"
    if ".metadata" in files:
        return ".metadata written"
    if any(f.endswith(".distcp") for f in files):
        return "shard write"
    return "temporary directory created"


def _inspect(root: Path) -> dict:
    """What a fresh process sees in ``root`` after a kill (run in this, the parent, process)."""
    before = _snapshot(root)
    handler = _RestoreLog()
    mlog = logging.getLogger("torch_ckpt.manager._manager")
    old_level = mlog.level
    mlog.setLevel(logging.INFO)
    mlog.addHandler(handler)
    rec: dict = {"before": before, "phase": _phase(before), "restored": {}}
    try:
        with CheckpointManager(root, keep_last=saver.KEEP_LAST) as mgr:
            rec["after"] = _snapshot(root)
            rec["steps"] = mgr.all_steps()
            rec["latest"] = mgr.latest_step()
            state, tensors = saver.build_state()
            try:
                got = mgr.restore(state)
                rec["restore_latest"] = got
                rec["restored"][got] = saver.check_restored(state, tensors, got) if got is not None else []
            except Exception as exc:  # noqa: BLE001 - recorded, asserted by the tests
                rec["restore_latest"] = f"{type(exc).__name__}: {exc}"
            for step in rec["steps"]:
                if step in rec["restored"]:
                    continue
                state, tensors = saver.build_state()
                try:
                    assert mgr.restore(state, step=step) == step
                    rec["restored"][step] = saver.check_restored(state, tensors, step)
                except Exception as exc:  # noqa: BLE001
                    rec["restored"][step] = [f"{type(exc).__name__}: {exc}"]
    finally:
        mlog.removeHandler(handler)
        mlog.setLevel(old_level)
    rec["restore_dirs"] = handler.dirs
    return rec


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = _Zygote(tmp_path_factory.mktemp("harness") / "stderr.log")
    yield z
    z.close()


@pytest.fixture(scope="module")
def timings(zygote, tmp_path_factory):
    """First-save and steady save-cycle durations of the saver on this machine (seconds)."""
    root = tmp_path_factory.mktemp("calibrate") / "ckpt"
    t = zygote.call(op="calibrate", root=str(root), steps=6)
    assert "error" not in t, f"calibration failed ({t}):\n{zygote.stderr()}"
    return t


@pytest.fixture(scope="module")
def campaign(zygote, timings, tmp_path_factory):
    """Run KILLS seeded random kills against ONE checkpoint directory; return the records."""
    root = tmp_path_factory.mktemp("campaign") / "ckpt"
    seeded = zygote.call(op="calibrate", root=str(root), steps=2)  # the run has committed history to lose
    assert "error" not in seeded, f"seeding failed ({seeded}):\n{zygote.stderr()}"
    rng = random.Random(SEED)
    window = timings["first_s"] + 4.0 * timings["cycle_s"]
    # Mostly uniform over a few save cycles; every tenth kill within 5 ms of the saver starting
    # (while it stages its first step, before any file of it exists).
    delays = [rng.uniform(0.0, 0.005) if i % 10 == 5 else rng.uniform(0.0, window) for i in range(KILLS)]
    records = []
    t0 = time.monotonic()
    for i, delay in enumerate(delays):
        answer = zygote.call(op="kill", root=str(root), delay=delay)
        rec = _inspect(root)
        rec.update(index=i, delay=delay, harness=answer)
        records.append(rec)
    phases = Counter(r["phase"] for r in records)
    print(f"\n{KILLS} kills in {time.monotonic() - t0:.1f} s; window {window:.3f} s; "
          f"steps {seeded['last_step']} -> {records[-1]['latest']}; phases covered: {dict(phases)}")
    return {"root": root, "records": records, "seed_latest": seeded["last_step"], "zygote": zygote}


def _describe(rec: dict) -> str:
    keys = ("index", "delay", "harness", "phase", "steps", "latest", "restore_latest", "restored", "restore_dirs")
    return json.dumps({k: rec.get(k) for k in keys} | {"before": rec["before"], "after": rec.get("after")},
                      default=str, indent=1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_saver_was_running_at_every_kill(campaign):
    """Every kill hit a live saver (it had not died on its own), so each record is a real crash."""
    for rec in campaign["records"]:
        assert rec["harness"]["harness_threads"] in (1, -1), \
            f"the harness forked while multi-threaded: {rec['harness']}"
        assert rec["harness"]["killed"], (
            f"saver was not SIGKILLed while running:\n{_describe(rec)}\n{campaign['zygote'].stderr()}")


@pytest.mark.timeout(180)
def test_latest_step_restores_the_values_saved_for_it(campaign):
    """After every kill, latest_step() names a checkpoint that restores exactly what was saved for it."""
    for rec in campaign["records"]:
        assert rec["latest"] is not None, f"the committed history was lost:\n{_describe(rec)}"
        assert rec["restore_latest"] == rec["latest"], f"restore() did not load latest_step():\n{_describe(rec)}"
        assert rec["restored"][rec["latest"]] == [], f"restored values differ:\n{_describe(rec)}"


@pytest.mark.timeout(180)
def test_every_listed_checkpoint_is_complete(campaign):
    """Every step all_steps() lists restores its own values, and every final-named directory is listed."""
    for rec in campaign["records"]:
        for step in rec["steps"]:
            assert rec["restored"].get(step) == [], f"listed step {step} is not complete:\n{_describe(rec)}"
        finals = sorted(int(m.group(1)) for n in rec["after"] if (m := _FINAL_RE.match(n)))
        assert finals == rec["steps"], f"a final-named directory is not a committed checkpoint:\n{_describe(rec)}"


@pytest.mark.timeout(180)
def test_temporaries_are_never_listed_or_restored(campaign):
    """No .step_*.tmp or .trash_* directory is ever listed by all_steps() or read by restore()."""
    for rec in campaign["records"]:
        final_steps = {int(m.group(1)) for n in rec["before"] if (m := _FINAL_RE.match(n))}
        assert set(rec["steps"]) <= final_steps, f"a step only present as a temporary is listed:\n{_describe(rec)}"
        assert rec["restore_dirs"], f"restore logged no directory:\n{_describe(rec)}"
        for d in rec["restore_dirs"]:
            assert _FINAL_RE.match(Path(d).name) and not _is_temporary(Path(d).name), (
                f"restored from a non-committed directory {d}:\n{_describe(rec)}")


@pytest.mark.timeout(180)
def test_stale_temporaries_are_removed_when_the_manager_starts(campaign):
    """A fresh CheckpointManager removes the .step_*.tmp / .trash_* directories a killed save left."""
    left = [rec for rec in campaign["records"] if any(_is_temporary(n) or any(f.startswith(_PARTIAL) for f in files)
                                                      for n, files in rec["before"].items())]
    assert left, "no kill left a temporary directory behind; the kill window misses the writes"
    for rec in campaign["records"]:
        stale = [n for n in rec["after"] if _is_temporary(n)]
        assert not stale, f"temporaries {stale} survived the manager's start:\n{_describe(rec)}"


@pytest.mark.timeout(180)
def test_earlier_checkpoints_survive_later_kills(campaign):
    """The newest checkpoint never goes backwards, and one is only gone once two newer ones replaced it."""
    prev_latest, prev_steps = campaign["seed_latest"], None
    for rec in campaign["records"]:
        assert rec["latest"] is not None and rec["latest"] >= prev_latest, (
            f"latest went back from {prev_latest}:\n{_describe(rec)}")
        newer = [s for s in rec["steps"] if s > prev_latest]
        assert prev_latest in rec["steps"] or len(newer) >= saver.KEEP_LAST, (
            f"step {prev_latest} (previous latest) vanished without {saver.KEEP_LAST} newer ones:\n{_describe(rec)}")
        if prev_steps is not None:
            gone = [s for s in prev_steps if s not in rec["steps"]]
            assert all(len([s for s in rec["steps"] if s > g]) >= saver.KEEP_LAST for g in gone), (
                f"steps {gone} vanished without being superseded:\n{_describe(rec)}")
        prev_latest, prev_steps = rec["latest"], rec["steps"]
    progressed = sum(1 for i, rec in enumerate(campaign["records"])
                     if rec["latest"] > (campaign["records"][i - 1]["latest"] if i else campaign["seed_latest"]))
    assert progressed >= KILLS // 5, f"only {progressed} of {KILLS} lives committed anything; the window is too short"


@pytest.mark.timeout(180)
def test_kills_interrupt_different_phases_of_a_save(campaign):
    """The seeded kills land both inside writes (temporary present) and outside them, in several phases."""
    phases = Counter(rec["phase"] for rec in campaign["records"])
    inside = sum(n for p, n in phases.items() if p != "staging / between saves / after rename")
    assert inside >= 3, f"too few kills interrupted a write: {dict(phases)}"
    assert len(phases) >= 2, f"kills covered only {dict(phases)}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kill_during_the_first_save_leaves_nothing_or_a_complete_checkpoint(zygote, timings, tmp_path):
    """A kill during the very first save leaves latest_step() None (restore returns None) or a complete step 1."""
    rng = random.Random(SEED + 1)
    outcomes = Counter()
    for i in range(FIRST_SAVE_KILLS):
        root = tmp_path / f"first_{i}"
        delay = rng.uniform(0.0, timings["first_s"])
        answer = zygote.call(op="kill", root=str(root), delay=delay)
        assert answer["killed"] and answer["start_step"] == 1, f"{answer}\n{zygote.stderr()}"
        rec = _inspect(root)
        rec.update(index=i, delay=delay, harness=answer)
        outcomes[rec["phase"] if rec["latest"] is None else f"committed {rec['steps']}"] += 1
        assert not [n for n in rec["after"] if _is_temporary(n)], _describe(rec)
        if rec["latest"] is None:
            assert rec["steps"] == [] and rec["restore_latest"] is None, _describe(rec)
        else:
            assert rec["restore_latest"] == rec["latest"] and rec["restored"][rec["latest"]] == [], _describe(rec)
    print(f"\nfirst-save kills: {dict(outcomes)}")
    assert any(not k.startswith("committed") for k in outcomes), f"no kill landed inside the first save: {outcomes}"
