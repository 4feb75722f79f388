"""Run the frameworks' own test files plain and with our plugins injected; write the comparison table.

``python -m peer_suites.run --suites-dir ../shared/peer-suites --out suites_report`` (what
``make test-suites`` runs). The suites directory holds unmodified copies of Lightning 2.6.5's
``tests/tests_pytorch`` (``lightning-2.6.5/tests``) and Accelerate 1.15's ``tests/``
(``accelerate-1.15/tests``); outside this workplace a checkout of each framework at that tag gives the
same files. They are copied to a temporary directory at run time (their conftests write beside them),
never into the project. Each group of files runs in its own pytest process, once plain and once injected
(``PEER_SUITES_INJECT``), with ``-p peer_suites.inject``, a per-test timeout (pytest-timeout) and a
per-process time limit; then Accelerate's ``external_deps/test_checkpointing.py`` script runs on two
processes (``peer_suites.script``). Output: ``OUT/report.md``, ``OUT/report.json``, and per run the JUnit
XML, the plugin's records and the log under ``OUT/runs/``. See ``docs/test-suites.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from peer_suites import inject, report

REPO = Path(__file__).resolve().parent.parent

# Checkpoint-touching files of Lightning 2.6.5's tests/tests_pytorch (relative to tests/).
LIGHTNING_FILES = [
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_torch_saving.py",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py",
    "tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py",
    "tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py",
    "tests_pytorch/callbacks/test_model_checkpoint_step_interval_val_metric.py",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/callbacks/test_finetuning_callback.py",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py",
    "tests_pytorch/callbacks/test_weight_averaging.py",
    "tests_pytorch/callbacks/test_callbacks.py",
    "tests_pytorch/callbacks/test_timer.py",
    "tests_pytorch/callbacks/test_lambda_function.py",
    "tests_pytorch/callbacks/progress/test_tqdm_progress_bar.py",
    "tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
    "tests_pytorch/trainer/connectors/test_callback_connector.py",
    "tests_pytorch/trainer/connectors/test_signal_connector.py",
    "tests_pytorch/trainer/flags/test_fast_dev_run.py",
    "tests_pytorch/trainer/flags/test_min_max_epochs.py",
    "tests_pytorch/trainer/properties/test_log_dir.py",
    "tests_pytorch/trainer/test_trainer.py",
    "tests_pytorch/tuner/test_lr_finder.py",
    "tests_pytorch/tuner/test_scale_batch_size.py",
    "tests_pytorch/tuner/test_tuning.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/models/test_restore.py",
    "tests_pytorch/models/test_hparams.py",
    "tests_pytorch/models/test_cpu.py",
    "tests_pytorch/core/test_saving.py",
    "tests_pytorch/core/test_datamodules.py",
    "tests_pytorch/loops/test_loops.py",
    "tests_pytorch/loops/test_training_epoch_loop.py",
    "tests_pytorch/loops/test_loop_state_dict.py",
    "tests_pytorch/plugins/test_checkpoint_io_plugin.py",
    "tests_pytorch/plugins/test_async_checkpoint.py",
    "tests_pytorch/loggers/test_logger.py",
    "tests_pytorch/loggers/test_wandb.py",
    "tests_pytorch/loggers/test_mlflow.py",
    "tests_pytorch/loggers/test_tensorboard.py",
    "tests_pytorch/utilities/test_upgrade_checkpoint.py",
    "tests_pytorch/utilities/migration/test_migration.py",
    "tests_pytorch/test_cli.py",
]

# Accelerate 1.15's tests/ (relative to the folder holding tests/).
ACCELERATE_FILES = [
    "tests/test_state_checkpointing.py",
    "tests/test_accelerator.py",
    "tests/test_data_loader.py",
]

# Lightning's own pytest settings (its pyproject.toml at 2.6.5), less the doctest, colour and --ignore options of
# its repository layout and less `error::FutureWarning`: torch 2.13 deprecates `isinstance(treespec, LeafSpec)`,
# which Lightning 2.6 runs in every fit, so that filter fails nearly every test, plain or injected.
LIGHTNING_INI = """[pytest]
addopts = --strict-markers --disable-pytest-warnings
markers =
    cloud: Run the cloud tests for example
xfail_strict = true
"""
ACCELERATE_INI = "[pytest]\n"


@dataclass
class Suite:
    """One framework's copied tests: where they come from, which files, which injection."""

    name: str  # lightning | accelerate
    source: str  # folder under --suites-dir holding tests/
    files: list[str]
    ini: str


SUITES = [Suite("lightning", "lightning-2.6.5", LIGHTNING_FILES, LIGHTNING_INI),
          Suite("accelerate", "accelerate-1.15", ACCELERATE_FILES, ACCELERATE_INI)]


def prepare(suite: Suite, suites_dir: Path, work: Path) -> Path:
    """Copy the suite's ``tests/`` under ``work`` with its pytest settings; return the new root (rootdir)."""
    src = suites_dir / suite.source / "tests"
    if not src.is_dir():
        raise SystemExit(f"{src}: not found. Set SUITES_DIR to the folder holding {suite.source}/tests "
                         "(a checkout of the framework at its pinned tag; see docs/test-suites.md)")
    root = work / suite.name
    shutil.copytree(src, root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    if suite.name == "lightning":  # the copied conftest's artifact check walks tests/: its root is tests/
        root = root / "tests"
    (root / "pytest.ini").write_text(suite.ini, encoding="utf-8")
    return root


_live: set[subprocess.Popen] = set()  # child process groups, ended if the runner is stopped


def child_env(framework: str, record: Path | None, deps: str | None) -> dict[str, str]:
    """The environment of a test process: our repository and ``deps`` first on PYTHONPATH, the injection."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [deps, env.get("PYTHONPATH")])])
    env[inject.ENV_INJECT] = framework
    if record is not None:
        env[inject.ENV_RECORD] = str(record)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def wait(cmd: list[str], cwd: Path | None, env: dict[str, str], log: Path, timeout: float) -> int | str:
    """Run ``cmd`` in its own process group, output to ``log``; its exit code, or "killed" past ``timeout`` s."""
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        _live.add(proc)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "killed"
        finally:
            _live.discard(proc)


def run_pytest(root: Path, files: list[str], mode: str, framework: str, out: Path, name: str,
               test_timeout: float, process_timeout: float, nice: int, deps: str | None = None) -> dict:
    """One pytest process over ``files``; returns the paths it wrote and how it ended."""
    out.mkdir(parents=True, exist_ok=True)
    junit, record, log = out / f"{name}.xml", out / f"{name}.jsonl", out / f"{name}.log"
    for p in (junit, record):
        p.unlink(missing_ok=True)
    env = child_env(framework if mode == "injected" else "", record, deps)
    cmd = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "pytest", "-q", "-p",
           "no:cacheprovider", "-p", "peer_suites.inject", "--continue-on-collection-errors",
           f"--timeout={test_timeout:g}", "--tb=long",
           "-o", "junit_family=xunit1", f"--junitxml={junit}", f"--basetemp={out / ('tmp_' + name)}", *files]
    start = time.monotonic()
    rc = wait(cmd, root, env, log, process_timeout)
    shutil.rmtree(out / f"tmp_{name}", ignore_errors=True)
    meta = {"files": files, "mode": mode, "rc": rc, "seconds": round(time.monotonic() - start, 1)}
    (out / f"{name}.meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return meta


def chunks(files: list[str], size: int) -> list[list[str]]:
    return [files[i:i + size] for i in range(0, len(files), size)]


def split_by_file(cases: dict[str, report.Case]) -> dict[str, dict[str, report.Case]]:
    by: dict[str, dict[str, report.Case]] = {}
    for nodeid, case in cases.items():
        by.setdefault(nodeid.split("::", 1)[0], {})[nodeid] = case
    return by


def run_suite(suite: Suite, root: Path, out: Path, args: argparse.Namespace) -> None:
    """Every group of the suite's files, plain and injected (``--jobs`` processes at a time)."""
    files = [f for f in suite.files if not args.only or any(s in f for s in args.only)]
    jobs = []
    for i, group in enumerate(chunks(files, args.files_per_process)):
        for mode in ("plain", "injected"):
            jobs.append((group, mode, f"{suite.name}_{i:02d}_{mode}"))

    def one(job):
        meta = run_pytest(root, job[0], job[1], suite.name, out, job[2], args.test_timeout, args.process_timeout,
                          args.nice, args.deps)
        print(f"  {job[2]}: {len(job[0])} files, rc={meta['rc']} in {meta['seconds']:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, jobs))


def collect(suite_name: str, out: Path) -> list[report.FileResult]:
    """The results of every run of a suite found in ``out`` (written by :func:`run_suite`), per file."""
    results = []
    for meta_path in sorted(out.glob(f"{suite_name}_*_plain.meta.json")):
        name = meta_path.name.removesuffix("_plain.meta.json")
        per_mode = {}
        for mode in ("plain", "injected"):
            meta_file = out / f"{name}_{mode}.meta.json"
            meta = json.loads(meta_file.read_text(encoding="utf-8")) if meta_file.exists() else {"rc": "not run"}
            junit = out / f"{name}_{mode}.xml"
            cases = split_by_file(report.parse_junit(junit)) if junit.exists() else None
            per_mode[mode] = (meta, cases, report.read_records(out / f"{name}_{mode}.jsonl"))
        for file in json.loads(meta_path.read_text(encoding="utf-8"))["files"]:
            (_, plain, prec), (_, inj, irec) = per_mode["plain"], per_mode["injected"]
            keep = {k: v for k, v in irec.items() if k.split("::", 1)[0] == file}
            pkeep = {k: v for k, v in prec.items() if k.split("::", 1)[0] == file}
            res = report.compare(f"{suite_name}: {file}", None if plain is None else plain.get(file, {}),
                                 None if inj is None else inj.get(file, {}), keep, pkeep)
            for mode, (meta, cases, _) in per_mode.items():
                if cases is None:
                    why = "killed after its time limit" if meta["rc"] == "killed" else f"wrote no XML (rc {meta['rc']})"
                    res.notes.append(f"{mode} run {why} (log runs/{name}_{mode}.log)")
            results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suites-dir", default=str(REPO.parent / "shared" / "peer-suites"))
    p.add_argument("--out", default="suites_report")
    p.add_argument("--only", nargs="*", default=[], help="run only files whose path contains one of these")
    p.add_argument("--suites", nargs="*", default=["lightning", "accelerate", "script"])
    p.add_argument("--files-per-process", type=int, default=5,
                   help="files per pytest process (each process imports the framework: ~10 s here)")
    p.add_argument("--jobs", type=int, default=2, help="pytest processes at a time")
    p.add_argument("--test-timeout", type=float, default=180.0, help="per test, seconds (pytest-timeout)")
    p.add_argument("--process-timeout", type=float, default=1200.0, help="per pytest process, seconds")
    p.add_argument("--deps", default=os.environ.get("PEER_SUITES_DEPS"),
                   help="folder of the suites' extra packages (peer_suites/requirements.txt), put on their PYTHONPATH")
    p.add_argument("--nice", type=int, default=10, help="nice increment of the test processes (0: none)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report again from the runs already in OUT/runs")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    runs = out / "runs"
    if args.report_only:
        return write_report(out, runs)
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    suites_dir = Path(args.suites_dir).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _main(args, out, runs, suites_dir)
    finally:  # stopped (Ctrl-C, SIGTERM) or done: no test process outlives the runner
        for proc in list(_live):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def _main(args: argparse.Namespace, out: Path, runs: Path, suites_dir: Path) -> int:
    start = time.monotonic()
    extra: dict[str, object] = {"suites dir": str(suites_dir), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                        time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="peer_suites_") as work:
        for suite in SUITES:
            if suite.name in args.suites:
                t0 = time.monotonic()
                print(f"{suite.name}: {suite.source}", flush=True)
                run_suite(suite, prepare(suite, suites_dir, Path(work)), runs, args)
                extra[f"{suite.name} wall time"] = f"{time.monotonic() - t0:.0f} s"
    if "script" in args.suites:
        from peer_suites import script

        t0 = time.monotonic()
        print("accelerate: external_deps/test_checkpointing.py on 2 processes", flush=True)
        script.run_both(runs / "script", args.nice, args.deps)
        extra["script wall time"] = f"{time.monotonic() - t0:.0f} s"
    extra["wall time"] = f"{time.monotonic() - start:.0f} s"
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # what the machine's load does not stretch
    extra["CPU time of the test processes"] = f"{usage.ru_utime + usage.ru_stime:.0f} s"
    extra["load average at the end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    (runs / "run.json").write_text(json.dumps(extra), encoding="utf-8")
    return write_report(out, runs)


def write_report(out: Path, runs: Path) -> int:
    """``OUT/report.md`` and ``OUT/report.json`` from the runs in ``runs``; prints the totals."""
    from peer_suites import script

    results = [r for suite in SUITES for r in collect(suite.name, runs)] + script.collect(runs / "script")
    extra = json.loads((runs / "run.json").read_text(encoding="utf-8")) if (runs / "run.json").exists() else {}
    (out / "report.md").write_text(report.markdown(results, extra), encoding="utf-8")
    (out / "report.json").write_text(report.to_json(results, extra), encoding="utf-8")
    t = report.totals(results)
    print(f"plain {t['plain']}, injected {t['injected']}; plugin-only failures {t['plugin_only']} "
          f"({t['kinds']}); breaks {t['breaks']}; zombies {t['zombies']}, lost {t['lost']}, "
          f"lock conflicts {t['lock_conflicts']}, hangs {t['hangs']}. Report: {out / 'report.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
