"""Issue 16: everyday ``save_state``/``load_state`` patterns, each run first as plain Accelerate, then attached.

Each plain-Accelerate test documents what Accelerate itself does with the pattern; its attached twin
checks that the script keeps working (or fails at once with the fix in the message).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from acc_helpers import Counter, make_run, train

from torch_ckpt import CheckpointNotFoundError, ConfigError, StateMismatchError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import run_distributed  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def visible(folder: Path) -> list[str]:
    """The entries of ``folder`` without hidden ones (the manager's ``.lock``, temporaries)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- item 5: main-process-only save (2 processes) ---------------------------------------------------------------
def _main_only_body(rank: int, world: int, folder: str, attach: bool, out: str) -> None:
    from accelerate import Accelerator

    import accelerate_ckpt

    acc = Accelerator(cpu=True)
    ckpt = accelerate_ckpt.attach(acc) if attach else None
    model = acc.prepare(torch.nn.Linear(2, 2))
    outcome = "not called"
    if acc.is_main_process:
        try:
            acc.save_state(folder)
            outcome = "saved"
        except ConfigError as exc:
            outcome = str(exc)
    acc.wait_for_everyone()
    if attach:  # the fix the message names: every process calls save_state
        acc.save_state(folder)
        ckpt.close()
    Path(out, f"rank{rank}.txt").write_text(outcome, encoding="utf-8")
    del model


@pytest.mark.slow
def test_plain_accelerate_saves_from_the_main_process_alone(tmp_path):
    """Plain Accelerate: ``if accelerator.is_main_process: save_state(dir)`` writes the folder on 2 processes."""
    run_distributed(_main_only_body, 2, str(tmp_path / "ck"), False, str(tmp_path))
    assert (tmp_path / "rank0.txt").read_text() == "saved"
    assert any((tmp_path / "ck").iterdir())


@pytest.mark.slow
def test_attached_main_process_only_save_raises_at_once_with_the_fix(tmp_path):
    """Attached: the guarded save raises ConfigError within seconds (the other process never shows up), with the fix."""
    run_distributed(_main_only_body, 2, str(tmp_path / "ck"), True, str(tmp_path), timeout_s=60)
    message = (tmp_path / "rank0.txt").read_text()
    assert "is_main_process" in message and "every process" in message and "[1]" in message
    assert (tmp_path / "rank1.txt").read_text() == "not called"


# -- item 6: partial load -----------------------------------------------------------------------------------
def _save_with_one_object(tmp_path: Path, attach: bool) -> Path:
    run = make_run(None, attach=attach)
    run.accelerator.register_for_checkpointing(Counter())
    train(run, 0, 3)
    folder = tmp_path / "ck"
    run.accelerator.save_state(folder)
    if run.ckpt is not None:
        run.ckpt.close()
    return folder


def _load_with_two_objects(folder: Path, attach: bool) -> tuple[bool, Exception]:
    run = make_run(None, attach=attach, seed=5)
    for _ in range(2):
        run.accelerator.register_for_checkpointing(Counter())
    before = params(run.model)
    with pytest.raises(Exception) as info:
        run.accelerator.load_state(str(folder))
    if run.ckpt is not None:
        run.ckpt.close()
    return same(before, params(run.model)), info.value


def test_plain_accelerate_partial_load_overwrites_the_model_before_failing(tmp_path):
    """Plain Accelerate: 2 registered objects vs a checkpoint holding 1 fails after loading the weights."""
    unchanged, _ = _load_with_two_objects(_save_with_one_object(tmp_path, False), False)
    assert not unchanged


def test_attached_partial_load_validates_everything_before_loading_anything(tmp_path):
    """Attached: the same mismatch raises StateMismatchError naming the counts and leaves the model as it was."""
    unchanged, error = _load_with_two_objects(_save_with_one_object(tmp_path, True), True)
    assert unchanged and isinstance(error, StateMismatchError) and "registered 2" in str(error)


# -- item 7: strict=False -----------------------------------------------------------------------------------
def test_plain_accelerate_strict_false_loads_matching_weights(tmp_path):
    """Plain Accelerate: ``load_state(dir, strict=False)`` loads into a model with an extra buffer."""
    run = make_run(None, attach=False)
    run.accelerator.save_state(tmp_path / "ck")
    saved = params(run.model)
    run = make_run(None, attach=False, seed=3)
    run.model.register_buffer("extra", torch.ones(2))
    run.accelerator.load_state(tmp_path / "ck", strict=False)
    got = params(run.model)
    assert torch.equal(got.pop("extra"), torch.ones(2)) and same(got, saved)


def test_attached_strict_false_is_refused_before_loading_anything(tmp_path):
    """Attached: ``strict=False`` raises ConfigError naming the alternative; nothing is loaded."""
    run = make_run(None)
    run.accelerator.save_state(tmp_path / "ck")
    run.ckpt.close()
    run = make_run(None, seed=3)
    before = params(run.model)
    with pytest.raises(ConfigError, match="strict=False.*load_full_state"):
        run.accelerator.load_state(tmp_path / "ck", strict=False)
    assert same(before, params(run.model))
    run.ckpt.close()


def test_attached_strict_false_message_gives_a_working_recipe(tmp_path):
    """The recipe in the strict=False message loads the saved weights into a model with an extra buffer."""
    import re

    import torch_ckpt

    run = make_run(None)
    run.accelerator.save_state(tmp_path / "ck")
    saved = params(run.model)
    run.ckpt.close()
    run = make_run(None, seed=3)
    with pytest.raises(ConfigError) as info:
        run.accelerator.load_state(tmp_path / "ck", strict=False)
    path = re.search(r"load_full_state\('([^']+)'\)", str(info.value)).group(1)
    run.model.register_buffer("extra", torch.ones(2))
    state, _ = torch_ckpt.load_full_state(path)
    run.model.load_state_dict(state["model"]["0"], strict=False)
    got = params(run.model)
    assert torch.equal(got.pop("extra"), torch.ones(2)) and same(got, saved)
    run.ckpt.close()


# -- item 8: messages -----------------------------------------------------------------------------------------
def test_plain_accelerate_loading_an_empty_folder_fails_obscurely(tmp_path):
    """Plain Accelerate: an empty checkpoint folder (an interrupted save) fails with a file-level error."""
    run = make_run(None, attach=False)
    (tmp_path / "ck").mkdir()
    with pytest.raises(Exception) as info:
        run.accelerator.load_state(tmp_path / "ck")
    assert "incomplete" not in str(info.value)


def test_attached_interrupted_save_is_reported_as_incomplete_naming_the_newest_intact(tmp_path):
    """Attached: an empty ``checkpoint_N`` is an incomplete save; the message names the newest intact one."""
    run = make_run(tmp_path)
    train(run, 0, 2, save_at=(2,))
    run.ckpt.wait()
    empty = tmp_path / "checkpoints" / "checkpoint_5"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"incomplete save.*checkpoint_0"):
        run.accelerator.load_state(empty)
    run.ckpt.close()


# -- item 9: world size mismatch (torchrun on CPU without cpu=True) ------------------------------------------
def _mismatch_body(rank: int, world: int, out: str, attach: bool) -> None:
    from accelerate import Accelerator

    import accelerate_ckpt

    acc = Accelerator()  # no cpu=True on a CPU machine: Accelerate runs each process alone
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if attach:
            accelerate_ckpt.attach(acc).close()
    Path(out, f"rank{rank}.txt").write_text(
        f"{acc.num_processes}\n" + "\n".join(str(w.message) for w in seen), encoding="utf-8")


@pytest.mark.slow
def test_plain_accelerate_without_cpu_true_runs_each_process_alone(tmp_path):
    """Under 2 initialised ranks on CPU, ``Accelerator()`` reports one process (independent processes)."""
    run_distributed(_mismatch_body, 2, str(tmp_path), False)
    if (tmp_path / "rank0.txt").read_text().splitlines()[0] == "2":
        pytest.skip("this Accelerate version joins the initialised process group without cpu=True (1.0.x)")
    assert (tmp_path / "rank0.txt").read_text().splitlines()[0] == "1"


@pytest.mark.slow
def test_attached_world_size_mismatch_warns_with_the_fix(tmp_path):
    """Attached: torch.distributed world size 2 vs Accelerate's 1 process warns, naming ACCELERATE_USE_CPU=1."""
    run_distributed(_mismatch_body, 2, str(tmp_path), True)
    for rank in (0, 1):
        processes, *warned = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        text = "\n".join(warned)
        if processes == "2":  # Accelerate joined the group itself (1.0.x): nothing to warn about
            assert "world size" not in text
        else:
            assert "world size 2" in text and "ACCELERATE_USE_CPU=1" in text and "cpu=True" in text


# -- item 1: default naming after resume ------------------------------------------------------------------------
def _twelve_saves(tmp_path: Path, attach: bool):
    run = make_run(tmp_path, total_limit=2, attach=attach)
    for step in range(1, 13):
        train(run, step - 1, step)
        run.accelerator.save_state()
    if run.ckpt is not None:
        run.ckpt.close()


def test_plain_accelerate_forgets_its_save_iteration_after_load(tmp_path):
    """Plain Accelerate: after 12 saves, a new process's load_state() leaves save_iteration at 0."""
    _twelve_saves(tmp_path, attach=False)
    run = make_run(tmp_path, total_limit=2, attach=False)
    run.accelerator.load_state()
    assert run.accelerator.save_iteration == 0


def test_attached_save_after_resume_is_checkpoint_12(tmp_path):
    """Attached: after 12 saves, a new process's load_state() then save_state() writes checkpoint_12."""
    _twelve_saves(tmp_path, attach=True)
    run = make_run(tmp_path, total_limit=2)
    run.accelerator.load_state()
    assert run.accelerator.save_iteration == 12
    assert run.accelerator.save_state().name == "checkpoint_12"
    run.ckpt.close()
    assert visible(tmp_path / "checkpoints") == ["checkpoint_11", "checkpoint_12"]


def test_attached_log_line_names_save_iteration_and_training_step_apart(tmp_path, caplog):
    """Attached: a folder save at training step 6 logs 'save iteration 0, training step 6', never 'step 0'."""
    run = make_run(None)
    with caplog.at_level("INFO", logger="accelerate_ckpt"):
        run.accelerator.save_state(tmp_path / "ck", step=6)
    run.ckpt.close()
    assert "save iteration 0, training step 6" in caplog.text


def test_attached_load_restores_the_training_step_not_the_save_iteration(tmp_path):
    """Attached: after saves at training steps 3 and 5, load_state() sets ckpt.step 5 and save_iteration 2."""
    run = make_run(tmp_path)
    train(run, 0, 5, save_at=(3, 5))
    run.ckpt.close()
    run = make_run(tmp_path)
    run.accelerator.load_state()
    assert (run.ckpt.step, run.accelerator.save_iteration) == (5, 2)
    run.ckpt.close()


# -- item 2: the same explicit folder saved repeatedly ---------------------------------------------------------
def _rolling(tmp_path: Path, attach: bool) -> tuple[dict, dict]:
    run = make_run(None, attach=attach)
    for step in (2, 4):
        train(run, step - 2, step)
        run.accelerator.save_state(tmp_path / "latest")
    saved = params(run.model)
    if run.ckpt is not None:
        run.ckpt.close()
    run = make_run(None, attach=attach, seed=3)
    run.accelerator.load_state(tmp_path / "latest")
    loaded = params(run.model)
    if run.ckpt is not None:
        run.ckpt.close()
    return saved, loaded


def test_plain_accelerate_overwrites_a_reused_folder(tmp_path):
    """Plain Accelerate: save_state('latest') twice overwrites; loading gives the second save."""
    saved, loaded = _rolling(tmp_path, attach=False)
    assert same(saved, loaded)


def test_attached_reused_folder_is_replaced_and_loads_the_newest_save(tmp_path):
    """Attached: save_state('latest') twice commits twice; loading gives the second save."""
    saved, loaded = _rolling(tmp_path, attach=True)
    assert same(saved, loaded)


def test_attached_reused_folder_keeps_the_previous_save_loadable_until_the_new_one_commits(tmp_path, monkeypatch):
    """Attached: while the second save of 'latest' is in flight, 'latest' still holds the first, complete save."""
    import threading

    import torch_ckpt
    import torch_ckpt.save._checkpointer as engine

    release, real = threading.Event(), engine.persist_checkpoint
    monkeypatch.setattr(engine, "persist_checkpoint", lambda req, ctx: (release.wait(30), real(req, ctx))[1])
    release.set()
    run = make_run(None)
    train(run, 0, 2)
    run.accelerator.save_state(tmp_path / "latest", step=2)
    run.ckpt.wait()
    first = params(run.model)
    train(run, 2, 4)
    release.clear()
    run.accelerator.save_state(tmp_path / "latest", step=4)
    state, manifest = torch_ckpt.load_full_state(tmp_path / "latest")  # what another process would load now
    assert manifest.step == 2 and same({k: v for k, v in state["model"]["0"].items()}, first)
    release.set()
    run.ckpt.close()


def _rolling_two_processes(rank: int, world: int, folder: str, out: str) -> None:
    from accelerate import Accelerator

    import accelerate_ckpt

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    ckpt = accelerate_ckpt.attach(acc)
    model = acc.prepare(torch.nn.Linear(3, 3))
    weight = acc.unwrap_model(model).weight
    for step in (1, 2):
        with torch.no_grad():
            weight.fill_(float(step))
        acc.save_state(folder, step=step)
    with torch.no_grad():
        weight.zero_()
    acc.load_state(folder)
    Path(out, f"rank{rank}.txt").write_text(f"{weight[0, 0].item()} {ckpt.step}", encoding="utf-8")
    ckpt.close()


@pytest.mark.slow
def test_attached_reused_folder_on_two_processes_loads_the_newest_save(tmp_path):
    """Attached, 2 gloo processes: a folder saved twice is replaced and both processes load the second save."""
    run_distributed(_rolling_two_processes, 2, str(tmp_path / "latest"), str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["2.0 2", "2.0 2"]


# -- item 3: rollback and a corrupt newest checkpoint ----------------------------------------------------------
def _three_saves(tmp_path: Path, attach: bool) -> None:
    run = make_run(tmp_path, attach=attach)
    train(run, 0, 6, save_at=(2, 4, 6) if attach else ())
    if not attach:
        for _ in range(3):
            run.accelerator.save_state()
    if run.ckpt is not None:
        run.ckpt.close()


def test_plain_accelerate_cannot_save_after_rolling_back_in_a_new_process(tmp_path):
    """Plain Accelerate: a new process loading checkpoint_0 (of 0-2) fails its next save_state()."""
    _three_saves(tmp_path, attach=False)
    run = make_run(tmp_path, attach=False)
    run.accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    with pytest.raises(ValueError, match="already exists"):
        run.accelerator.save_state()


def test_attached_rollback_supersedes_newer_checkpoints_at_the_next_save(tmp_path):
    """Attached: after load_state(checkpoint_0) of 0-2, the next save is checkpoint_1 and becomes the latest."""
    _three_saves(tmp_path, attach=True)
    run = make_run(tmp_path)
    run.accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    assert run.ckpt.step == 2
    train(run, 2, 3)
    assert run.accelerator.save_state(step=3).name == "checkpoint_1"
    run.ckpt.close()
    run = make_run(tmp_path)
    assert run.ckpt.latest_checkpoint().name == "checkpoint_1"
    run.accelerator.load_state()
    assert run.ckpt.step == 3
    run.ckpt.close()


def _flip_a_bit(folder: Path, suffix: str) -> None:
    victim = max((p for p in folder.iterdir() if p.name.endswith(suffix)), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))


def test_plain_accelerate_loads_a_corrupt_newest_checkpoint_silently(tmp_path):
    """Plain Accelerate: one flipped bit in the newest checkpoint's weights loads without an error."""
    _three_saves(tmp_path, attach=False)
    _flip_a_bit(tmp_path / "checkpoints" / "checkpoint_2", ".safetensors")
    run = make_run(tmp_path, attach=False)
    run.accelerator.load_state()  # no error: the damaged value is loaded


def test_attached_corrupt_newest_checkpoint_falls_back_with_a_warning_naming_it(tmp_path, caplog):
    """Attached: a flipped bit in checkpoint_2 makes load_state() warn naming it and resume checkpoint_1."""
    _three_saves(tmp_path, attach=True)
    _flip_a_bit(tmp_path / "checkpoints" / "checkpoint_2", ".distcp")
    run = make_run(tmp_path)
    with caplog.at_level("WARNING"):
        run.accelerator.load_state()
    assert run.ckpt.step == 4 and "checkpoint_2" in caplog.text
    assert run.accelerator.save_state().name == "checkpoint_2"  # the damaged one is moved aside, not reused
    run.ckpt.close()


# -- item 4: existing plain-Accelerate checkpoints -------------------------------------------------------------
def _root_lock(path: Path) -> bool:
    """The manager's root lock files (``.lock``, which filelock leaves in place, and ``.lock.owner``)."""
    return path.name in (".lock", ".lock.owner")


def _names(folder: Path) -> list[str]:
    """Sorted names in ``folder`` besides the root lock files."""
    return sorted(p.name for p in folder.iterdir() if not _root_lock(p))


def _plain_checkpoints(tmp_path: Path) -> list[str]:
    run = make_run(tmp_path, total_limit=3, attach=False)
    for step in range(1, 4):
        train(run, step - 1, step)
        run.accelerator.save_state()
    return visible(tmp_path / "checkpoints")


def test_plain_accelerate_new_process_deletes_checkpoint_0_and_reuses_its_name(tmp_path):
    """Plain Accelerate: a new process's save_state() deletes checkpoint_0 and writes its state under that name."""
    before = _plain_checkpoints(tmp_path)
    marker = tmp_path / "checkpoints" / "checkpoint_0" / "marker.txt"
    marker.write_text("the first run's checkpoint_0", encoding="utf-8")
    run = make_run(tmp_path, total_limit=3, attach=False)
    assert str(run.accelerator.save_state()).endswith("checkpoint_0")
    assert visible(tmp_path / "checkpoints") == before and not marker.exists()


def test_attached_save_never_writes_into_or_deletes_plain_accelerate_folders(tmp_path):
    """Attached: checkpoint_0-2 of plain Accelerate are refused (ConfigError), never written into or deleted."""
    before = _plain_checkpoints(tmp_path)
    snapshot = {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("checkpoint_*/**/*")}
    run = make_run(tmp_path, total_limit=3)
    with pytest.raises(ConfigError, match="checkpoint_0 exists but is not a torch-ckpt checkpoint"):
        run.accelerator.save_state()
    run.ckpt.close()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("checkpoint_*/**/*")} == snapshot
    assert visible(tmp_path / "checkpoints") == before


def test_attached_loading_a_plain_checkpoint_keeps_its_save_iteration_and_retention_spares_it(tmp_path):
    """Attached: loading plain checkpoint_2 continues at checkpoint_3; keep_last=3 counts only torch-ckpt ones."""
    _plain_checkpoints(tmp_path)
    run = make_run(tmp_path, total_limit=3)
    run.accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_2", allow_unsafe_accelerate_folder=True)
    names = [run.accelerator.save_state().name for _ in range(4)]
    run.ckpt.close()
    assert names == ["checkpoint_3", "checkpoint_4", "checkpoint_5", "checkpoint_6"]
    assert visible(tmp_path / "checkpoints") == [
        "checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_4", "checkpoint_5", "checkpoint_6"]
