"""Issue 16: everyday ``save_state``/``load_state`` patterns, each run first as plain Accelerate, then attached.

Each plain-Accelerate test documents what Accelerate itself does with the pattern; its attached twin
checks that the script keeps working (or fails at once with the fix in the message).
"""

from __future__ import annotations

import copy
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


def test_plain_accelerate_saves_from_the_main_process_alone(tmp_path):
    """Plain Accelerate: ``if accelerator.is_main_process: save_state(dir)`` writes the folder on 2 processes."""
    run_distributed(_main_only_body, 2, str(tmp_path / "ck"), False, str(tmp_path))
    assert (tmp_path / "rank0.txt").read_text() == "saved"
    assert any((tmp_path / "ck").iterdir())


def test_attached_main_process_only_save_raises_at_once_with_the_fix(tmp_path):
    """Attached: the guarded save raises ConfigError at once (no collective wait) naming the guard and the fix."""
    run_distributed(_main_only_body, 2, str(tmp_path / "ck"), True, str(tmp_path), timeout_s=60)
    message = (tmp_path / "rank0.txt").read_text()
    assert "acc.is_main_process" in message and "every process" in message
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
    with pytest.raises(ConfigError, match="strict=False.*load_full_state") as info:
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


def test_plain_accelerate_without_cpu_true_runs_each_process_alone(tmp_path):
    """Under 2 initialised ranks on CPU, ``Accelerator()`` reports one process (independent processes)."""
    run_distributed(_mismatch_body, 2, str(tmp_path), False)
    assert (tmp_path / "rank0.txt").read_text().splitlines()[0] == "1"


def test_attached_world_size_mismatch_warns_with_the_fix(tmp_path):
    """Attached: torch.distributed world size 2 vs Accelerate's 1 process warns, naming ACCELERATE_USE_CPU=1."""
    run_distributed(_mismatch_body, 2, str(tmp_path), True)
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "world size 2" in text and "ACCELERATE_USE_CPU=1" in text and "cpu=True" in text
