"""The memory tier through ``accelerate_ckpt``: memory saves at their cadence from ``should_save``/``save_if_due``,
numbered by save iteration, resumed by ``load_state()`` when newest; the settings file; refusals."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from acc_helpers import bitwise, make_run, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import run_distributed  # noqa: E402

import accelerate_ckpt
from torch_ckpt import ConfigError

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


def _names(root) -> list[str]:
    return sorted((p.name for p in root.iterdir() if (p / "manifest.json").exists()),
                  key=lambda n: int(n.split("_")[1]))


def test_memory_saves_follow_their_cadence_and_take_the_save_iteration(tmp_path):
    """Memory saves at every 2nd step go into memory_root; each takes a save iteration, as save_state() does."""
    run = make_run(tmp_path / "proj", async_save=False, save_every_n_steps=5, memory_root=str(tmp_path / "mem"),
                   memory_every_n_steps=2, memory_keep_last=10)
    saved = [(step, run.ckpt.save_if_due(step) is not None) for step in range(1, 7)]
    run.ckpt.close()
    assert [step for step, done in saved if done] == [2, 4, 5, 6]
    assert _names(tmp_path / "mem") == ["checkpoint_0", "checkpoint_1", "checkpoint_3"]  # steps 2, 4, 6
    assert _names(tmp_path / "proj" / "checkpoints") == ["checkpoint_2"]  # the disk save of step 5
    assert run.accelerator.save_iteration == 4


def test_restart_resumes_the_newest_memory_step_bitwise(tmp_path):
    """A new run's load_state() takes memory step 18 (newer than disk step 10): same weights, optimizer, losses."""
    reference = train(make_run(tmp_path / "ref"), 0, 24)
    settings = {"save_every_n_steps": 10, "memory_root": str(tmp_path / "mem"), "memory_every_n_steps": 3}
    crashed = make_run(tmp_path / "proj", **settings)
    train(crashed, 0, 17, if_due=True)
    crashed.ckpt.wait()  # step 15's save is committed: the one due at step 18 is not put off
    train(crashed, 17, 18, if_due=True)
    crashed.ckpt.wait()
    at_18 = copy.deepcopy((crashed.model.state_dict(), crashed.optimizer.state_dict()))
    train(crashed, 18, 19, if_due=True)
    crashed.ckpt.close()
    run = make_run(tmp_path / "proj", **settings)
    run.accelerator.load_state()
    assert run.ckpt.step == 18 and run.ckpt.manager.restore_source == "memory"
    assert all(torch.equal(v, at_18[0][k]) for k, v in run.model.state_dict().items())
    moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in run.optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for got, want in zip(moments, [(s["exp_avg"], s["exp_avg_sq"]) for s in at_18[1][
        "state"].values()], strict=True) for a, b in zip(got, want, strict=True))
    resumed = train(run, 18, 24)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[18:])


def test_latest_checkpoint_names_the_memory_folder_when_it_is_newest(tmp_path):
    """With only memory saves, latest_checkpoint() is memory_root's newest folder, not None."""
    run = make_run(tmp_path / "proj", async_save=False, memory_root=str(tmp_path / "mem"), memory_every_n_steps=2)
    train(run, 0, 4, if_due=True)
    assert run.ckpt.latest_checkpoint() == (tmp_path / "mem" / "checkpoint_1").absolute()
    run.ckpt.close()


def test_settings_file_alone_enables_memory_saves(tmp_path, monkeypatch):
    """memory_root and memory_every_n_steps from ACCELERATE_CKPT_CONFIG make save_if_due take memory saves."""
    (tmp_path / "ckpt.yaml").write_text(f"memory_root: {tmp_path / 'mem'}\nmemory_every_n_steps: 2\n"
                                        "async_save: false\n", encoding="utf-8")
    monkeypatch.setenv(accelerate_ckpt.ENV_VAR, str(tmp_path / "ckpt.yaml"))
    run = make_run(tmp_path / "proj")
    handles = [run.ckpt.save_if_due(step) for step in range(1, 5)]
    run.ckpt.close()
    assert [h is not None for h in handles] == [False, True, False, True]
    assert _names(tmp_path / "mem") == ["checkpoint_0", "checkpoint_1"]


def test_memory_root_without_automatic_naming_is_refused(tmp_path):
    """memory_root with explicit save_state folders raises ConfigError naming automatic_checkpoint_naming."""
    with pytest.raises(ConfigError, match="memory_root needs .*automatic_checkpoint_naming"):
        make_run(None, memory_root=str(tmp_path / "mem"), memory_every_n_steps=2)


def test_memory_save_with_a_save_state_pre_hook_is_refused(tmp_path):
    """A due memory save with a registered save_state pre-hook raises ConfigError naming the hook kind."""
    run = make_run(tmp_path / "proj", memory_root=str(tmp_path / "mem"), memory_every_n_steps=1)
    run.accelerator.register_save_state_pre_hook(lambda models, weights, folder: None)
    with pytest.raises(ConfigError, match="save_state pre-hooks"):
        run.ckpt.save_if_due(1)
    run.ckpt.close()


def _two_process_body(rank: int, world: int, root: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    def attach():
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root,
                                                                        automatic_checkpoint_naming=True))
        ckpt = accelerate_ckpt.attach(acc, async_save=False, memory_root=f"{root}-mem", memory_every_n_steps=2)
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        return acc, ckpt, *acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))

    acc, ckpt, model, opt = attach()
    for step in range(1, 5):
        acc.backward(model(torch.ones(3, 2) * (rank + step)).sum())
        opt.step()
        opt.zero_grad()
        ckpt.save_if_due(step)
    weights = copy.deepcopy(model.state_dict())
    ckpt.close()
    acc, ckpt, model, opt = attach()
    acc.load_state()
    assert (ckpt.step, ckpt.manager.restore_source) == (4, "memory"), rank
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), rank
    ckpt.close()


@pytest.mark.slow
def test_two_processes_save_to_memory_and_resume_from_it(tmp_path):
    """2 processes: memory saves commit and load_state() resumes memory step 4 with the same weights on both."""
    run_distributed(_two_process_body, 2, str(tmp_path / "proj"), timeout_s=150)
