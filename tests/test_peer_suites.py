"""The ``make test-suites`` harness itself (peer_suites/): injection, records, JUnit parsing, failure tags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from peer_suites import inject, report, run
from peer_suites.report import Case

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def record():
    """A fresh per-test record of the plugin, as its setup hook makes one."""
    inject._current = inject._TestRecord()
    return inject._current


def test_lightning_injection_adds_the_plugin_and_undo_removes_it(record):
    """Every Trainer built while injected gets AsyncDCPCheckpointIO; undoing restores Lightning's default."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch import Trainer

    from lightning_ckpt import AsyncDCPCheckpointIO

    undo = inject.install_lightning()
    try:
        trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, devices=1)
        assert isinstance(trainer.strategy.checkpoint_io, AsyncDCPCheckpointIO)
        assert record.injected == 1
    finally:
        for u in reversed(undo):
            u()
    plain = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, devices=1)
    assert type(plain.strategy.checkpoint_io) is TorchCheckpointIO


def test_lightning_injection_keeps_a_tests_own_checkpoint_io(record):
    """A Trainer given its own CheckpointIO keeps it, and the reason is recorded."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch import Trainer

    own = TorchCheckpointIO()
    undo = inject.install_lightning()
    try:
        trainer = Trainer(plugins=own, logger=False, enable_checkpointing=False, enable_progress_bar=False, devices=1)
    finally:
        for u in reversed(undo):
            u()
    assert trainer.strategy.checkpoint_io is own
    assert record.injected == 0 and record.own_io == ["plugins has a CheckpointIO (TorchCheckpointIO)"]


def test_accelerate_injection_attaches_every_accelerator(record, monkeypatch):
    """Every Accelerator built while injected has save_state routed through accelerate_ckpt."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_ckpt import ENV_VAR, AccelerateCheckpointer

    monkeypatch.delenv(ENV_VAR, raising=False)
    undo = inject.install_accelerate()
    try:
        acc = Accelerator(cpu=True)
        assert isinstance(acc.save_state.__self__, AccelerateCheckpointer)
        assert record.injected == 1
    finally:
        for u in reversed(undo):
            u()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_lost_paths_counts_a_returned_save_whose_path_is_missing(tmp_path):
    """A saved path missing from an existing folder is lost; a removed or present one is not."""
    (tmp_path / "kept.ckpt").mkdir()
    saved = [str(tmp_path / "kept.ckpt"), str(tmp_path / "gone.ckpt"), str(tmp_path / "removed.ckpt"),
             str(tmp_path / "nofolder" / "x.ckpt"), "memory://bucket/x.ckpt"]
    assert inject.lost_paths(saved, {str(tmp_path / "removed.ckpt")}) == [str(tmp_path / "gone.ckpt")]


def test_plugin_records_zombie_threads_and_lock_conflicts(tmp_path):
    """A pytest run with the plugin writes one record per test with its torch-ckpt threads and lock conflicts."""
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import os
        import threading
        stop = threading.Event()

        def test_leaves_a_writer_thread():
            threading.Thread(target=stop.wait, name="torch_ckpt_writer_0", daemon=True).start()

        def test_lock_conflict():
            raise OSError("checkpoint root /x is in use by another run (pid 1)")

        def test_isfile_of_a_directory(tmp_path):
            assert os.path.isfile(str(tmp_path))

        def test_clean():
            stop.set()
    """), encoding="utf-8")
    rec = tmp_path / "rec.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), inject.ENV_RECORD: str(rec), inject.ENV_INJECT: ""}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_suites.inject",
                    "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, timeout=120, check=False)
    done = {r["nodeid"].split("::")[1]: r for r in map(json.loads, rec.read_text().splitlines())
            if r["event"] == "done"}
    assert done["test_leaves_a_writer_thread"]["zombies"] == ["torch_ckpt_writer_0"]
    assert done["test_lock_conflict"]["lock_conflict"] and done["test_lock_conflict"]["outcome"] == "failed"
    assert done["test_clean"]["zombies"] == [] and not done["test_clean"]["lock_conflict"]
    assert len(done["test_isfile_of_a_directory"]["dirs_at_failure"]) == 1


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests_pytorch.a.test_x" name="test_ok[1]" file="tests_pytorch/a/test_x.py" line="3" />
<testcase classname="tests_pytorch.a.test_x.TestK" name="test_bad" file="tests_pytorch/a/test_x.py" line="9">
<failure message="AssertionError: no">boom</failure></testcase>
<testcase classname="tests_pytorch.a.test_x" name="test_skip" file="tests_pytorch/a/test_x.py" line="12">
<skipped message="s" /></testcase>
</testsuite></testsuites>"""


def test_parse_junit_builds_node_ids_and_outcomes(tmp_path):
    """xunit1 cases become pytest node ids (class included) with their outcomes and failure text."""
    (tmp_path / "j.xml").write_text(JUNIT, encoding="utf-8")
    cases = report.parse_junit(tmp_path / "j.xml")
    assert {k: c.outcome for k, c in cases.items()} == {
        "tests_pytorch/a/test_x.py::test_ok[1]": "passed",
        "tests_pytorch/a/test_x.py::TestK::test_bad": "failed",
        "tests_pytorch/a/test_x.py::test_skip": "skipped"}
    assert cases["tests_pytorch/a/test_x.py::TestK::test_bad"].text.strip() == "boom"


def _tb(test_line: str, error: str, lib_line: str = "    return _open(path)") -> str:
    """A pytest long traceback: the test's frame calling ``test_line``, then a library frame raising ``error``."""
    return (f"    def test_it(tmp_path):\n>       {test_line}\n\ntests_pytorch/a/test_x.py:12: \n"
            f"_ _ _\n\n>   {lib_line}\nE   {error}\n\n/venv/lib/torch/serialization.py:99: {error.split(':')[0]}\n")


@pytest.mark.parametrize(("message", "text", "kind"), [
    ("IsADirectoryError: [Errno 21] Is a directory", _tb("ckpt = torch.load(path)", "IsADirectoryError: x"),
     "FORMAT"),
    ("IsADirectoryError: [Errno 21] Is a directory", _tb("trainer.fit(model, ckpt_path=path)",
                                                         "IsADirectoryError: x"), "BREAK"),
    ("AssertionError: Expected 'save' to have been called once. Called 0 times.",
     "    @mock.patch('torch.save')\n    def test_it(save):\n>       save.assert_called_once()\n\n"
     "tests_pytorch/a/test_x.py:5: AssertionError\n", "FORMAT"),

    ("AssertionError: assert ['a.ckpt', '.lock'] == ['a.ckpt']", "", "OUR_FILES"),
    ("EOFError", "ckpt_path = '/tmp/a/checkpoints/.lock'\n\n    def test_it(tmp_path):\n>       trainer.validate("
     "ckpt_path=ckpt_path)\n\ntests_pytorch/a/test_x.py:12: \n\npath = '/tmp/a/checkpoints/.lock'\n\n>   raise "
     "EOFError\nE   EOFError\n\n/venv/lib/torch/_weights_only_unpickler.py:9: EOFError\n", "OUR_FILES"),
    ("AssertionError: Test left zombie thread: <Thread(torch_ckpt_writer_0, started 1)>",
     "E   AssertionError: Test left zombie thread: <Thread(torch_ckpt_writer_0, started 1)>", "ZOMBIE"),
    ("Failed: Timeout (>180.0s) from pytest-timeout.", "", "HANG"),
    ("CheckpointWriteError: checkpoint root /tmp/a is in use by another run (pid 3)", "", "LOCK_CONFLICT"),
    ("LostCheckpoint: exit code 0 but epoch_0 is not a complete checkpoint", "", "LOST"),
    ("TypeError: save_checkpoint does not support storage_options", "", "BREAK"),
])
def test_tag_classifies_sample_failures(message, text, kind):
    """Each sample failure gets the tag its rule gives (reads/mocks/isfile in the test's own frame are FORMAT)."""
    assert report.tag(Case("tests_pytorch/a/test_x.py::test_it", "failed", message, text)).kind == kind


ISFILE = Case("tests_pytorch/a/test_x.py::test_it", "failed", "AssertionError: assert False",
              "    def test_it(p):\n>       assert os.path.isfile(p)\nE   assert False\n\n"
              "tests_pytorch/a/test_x.py:5: AssertionError\n")


def test_a_failed_isfile_is_format_only_where_a_directory_was_there():
    """`assert isfile(path)` is FORMAT if the plugin saw a directory at the path; nothing there is a break."""
    assert report.tag(ISFILE, {"dirs_at_failure": ["/tmp/x/epoch=0.ckpt"]}).kind == "FORMAT"
    assert report.tag(ISFILE, {"dirs_at_failure": []}).kind == "BREAK"
    moved = Case(ISFILE.nodeid, "failed", ISFILE.message,  # the test changed directory: pytest prints it absolute
                 ISFILE.text.replace("tests_pytorch/a/test_x.py:5", "/tmp/copy/tests/tests_pytorch/a/test_x.py:5"))
    assert report.tag(moved, {"dirs_at_failure": ["/tmp/x/epoch=0.ckpt"]}).kind == "FORMAT"


def test_known_differences_win_and_do_not_count_as_breaks(monkeypatch):
    """A listed test id (with or without params) is tagged KNOWN with its reason and is no break."""
    monkeypatch.setitem(report.KNOWN_DIFFERENCES, "tests_pytorch/a/test_x.py::test_it", "by design")
    t = report.tag(Case("tests_pytorch/a/test_x.py::test_it[1]", "failed", "TypeError: x", ""))
    assert (t.kind, t.detail, t.is_break) == ("KNOWN", "by design", False)


def test_break_reasons_are_grouped_without_paths_or_numbers():
    """Messages differing only in paths, numbers and addresses group as one reason."""
    a = report.normalise("OSError: [Errno 39] Directory not empty: '/tmp/a1/checkpoints' at 0x7f12")
    assert a == report.normalise("OSError: [Errno 40] Directory not empty: '/tmp/b22/checkpoints' at 0x7f99")


def test_compare_counts_only_plugin_only_failures_and_records():
    """Plugin-only failures are the tests failing injected that passed plain; records add zombies, lost, hangs."""
    plain = {"f::a": Case("f::a", "passed"), "f::b": Case("f::b", "failed", "X: y"), "f::c": Case("f::c", "passed")}
    injected = {"f::a": Case("f::a", "failed", "TypeError: z"), "f::b": Case("f::b", "failed", "X: y"),
                "f::c": Case("f::c", "passed")}
    records = {"f::a": {"event": "done", "zombies": ["torch_ckpt_writer_0"], "lock_conflict": False,
                        "lost": ["/p"], "own_io": [], "injected": 1, "outcome": "failed"},
               "f::d": {"event": "start"}}
    res = report.compare("f", plain, injected, records, {"f::a": {"lost": []}})
    assert list(res.plugin_only) == ["f::a"] and res.plugin_only["f::a"].startswith("BREAK")
    assert (res.zombies, res.lost, res.hangs) == (1, 1, 1)
    assert report.totals([res])["breaks"] == 1


def test_prepare_copies_the_suite_and_names_a_missing_one(tmp_path):
    """The suite's tests/ is copied with its pytest.ini into the work folder; a missing suite says what to set."""
    src = tmp_path / "suites" / "lightning-2.6.5" / "tests" / "tests_pytorch"
    src.mkdir(parents=True)
    (src / "test_a.py").write_text("def test_a(): pass\n", encoding="utf-8")
    root = run.prepare(run.SUITES[0], tmp_path / "suites", tmp_path / "work")
    assert (root / "tests_pytorch" / "test_a.py").exists() and (root / "pytest.ini").exists()
    with pytest.raises(SystemExit, match="SUITES_DIR"):
        run.prepare(run.SUITES[1], tmp_path / "suites", tmp_path / "work")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_suites_runs_the_harness_and_make_test_does_not(tmp_path):
    """`make test-suites` runs peer_suites.run on ../shared/peer-suites by default; `make test` never does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".deps-installed").touch()

    def plan(target: str) -> str:
        return subprocess.run(["make", "-n", "-s", "-C", str(REPO), target, f"VENV={venv}"], capture_output=True,
                              text=True, env=env, timeout=60, check=True).stdout

    suites = plan("test-suites")
    assert "-m peer_suites.run --suites-dir ../shared/peer-suites --out suites_report" in suites
    assert "peer_suites" not in plan("test")


def test_standins_give_what_the_accelerate_script_uses():
    """The hub stand-ins tokenize, pad, classify with a loss, schedule and score as the script calls them."""
    code = textwrap.dedent("""
        import torch
        from datasets import load_dataset
        import evaluate
        from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                                  get_linear_schedule_with_warmup, set_seed)
        set_seed(0)
        tok = AutoTokenizer.from_pretrained("bert-base-cased")
        ds = load_dataset("nyu-mll/glue", "mrpc").map(
            lambda ex: tok(ex["sentence1"], ex["sentence2"], truncation=True, max_length=None), batched=True,
            remove_columns=["idx", "sentence1", "sentence2"], load_from_cache_file=False)
        ds = ds.rename_column("label", "labels")
        batch = tok.pad([ds["train"][i] for i in range(4)], padding="longest", return_tensors="pt").to("cpu")
        out = AutoModelForSequenceClassification.from_pretrained("bert-base-cased", return_dict=True)(**batch)
        opt = torch.optim.AdamW(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=4)
        opt.step(); sched.step()
        metric = evaluate.load("glue", "mrpc")
        metric.add_batch(predictions=out.logits.argmax(-1), references=batch["labels"])
        assert out.loss.ndim == 0 and out.logits.shape == (4, 2) and sched.get_last_lr() == [0.75]
        print(sorted(batch), 0 <= metric.compute()["accuracy"] <= 1)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "peer_suites" / "standins")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['attention_mask',", "'input_ids',", "'labels']", "True"]


def test_script_counts_a_folder_complete_only_with_its_files(tmp_path):
    """An Accelerate folder with model and optimizer files is complete; an empty or missing one is not."""
    from peer_suites import script

    (tmp_path / "a").mkdir()
    assert not script.complete(tmp_path / "a") and not script.complete(tmp_path / "missing")
    for name in ("model.safetensors", "optimizer.bin"):
        (tmp_path / "a" / name).write_bytes(b"x")
    assert script.complete(tmp_path / "a")
