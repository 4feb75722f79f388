"""The memory tier through MTBFCheckpoint: memory saves at their cadence, ``ckpt_path="last"`` resuming the newest
memory step exactly, the LightningCLI YAML route, and bad values."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from tests._dist import run_distributed
from torch_ckpt import ConfigError


def steps(directory) -> list[int]:
    return sorted(int(p.split("_")[1]) for p in os.listdir(directory) if p.startswith("step_"))


def test_memory_saves_follow_their_cadence_into_memory_root(make_trainer, tmp_path):
    """memory_every_n_steps=2 over 7 steps saves 2, 4 and 6 into memory_root; the disk save of 5 goes to dirpath."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=5, save_on_train_end=False,
                        memory_root=str(tmp_path / "mem"), memory_every_n_steps=2, memory_keep_last=10)
    make_trainer(max_steps=7, plugins=[AsyncDCPCheckpointIO(async_save=False)], callbacks=[cb]).fit(TinyModule())
    assert steps(tmp_path / "mem") == [2, 4, 6] and steps(tmp_path / "ckpt") == [5]


def test_memory_every_seconds_saves_once_the_time_has_passed(make_trainer, tmp_path):
    """memory_every_seconds=1 ms (shorter than a step) saves every step after the first into memory_root."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_on_train_end=False,
                        memory_root=str(tmp_path / "mem"), memory_every_seconds=0.001, memory_keep_last=10)
    make_trainer(max_steps=4, plugins=[AsyncDCPCheckpointIO(async_save=False)], callbacks=[cb]).fit(TinyModule())
    assert steps(tmp_path / "mem") == [2, 3, 4] and steps(tmp_path / "ckpt") == []  # the clock starts at step 1


def _fit(make_trainer, tmp_path, name, max_steps, seed, **kwargs):
    torch.manual_seed(0)
    module = TinyModule()
    torch.manual_seed(seed)
    trainer = make_trainer(max_steps=max_steps, plugins=[AsyncDCPCheckpointIO(async_save=False)], callbacks=[
        MTBFCheckpoint(tmp_path / name, mtbf_seconds=None, save_on_train_end=False, **kwargs)])
    trainer.fit(module, ckpt_path="last")
    return trainer, module


@pytest.mark.parametrize(("memory_every", "disk_every", "crash_at", "newest"), [(3, 4, 7, 6), (16, None, 18, 16)],
                         ids=["mid_epoch", "epoch_end"])
def test_last_resumes_the_newest_memory_step_bitwise(make_trainer, tmp_path, memory_every, disk_every, crash_at,
                                                     newest):
    """A restart with ckpt_path="last" resumes the memory step newer than every disk step: same draws and weights."""
    _, reference = _fit(make_trainer, tmp_path, "ref", newest + 4, 123)
    settings = {"save_every_n_steps": disk_every, "memory_root": str(tmp_path / "mem"),
                "memory_every_n_steps": memory_every}
    _fit(make_trainer, tmp_path, "run", crash_at, 123, **settings)  # ends after `newest` without a disk save there
    trainer, resumed = _fit(make_trainer, tmp_path, "run", newest + 4, 999, **settings)
    cb = next(c for c in trainer.callbacks if isinstance(c, MTBFCheckpoint))
    assert trainer.ckpt_path == str(tmp_path / "mem" / f"step_{newest:09d}") and cb._manager.restore_source == "memory"
    assert resumed.draws == reference.draws[newest:]
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in resumed.state_dict().items())


def _two_rank_body(rank: int, world: int, root: str) -> None:
    import lightning as L

    def fit(max_steps: int) -> L.Trainer:
        cb = MTBFCheckpoint(Path(root) / "ckpt", mtbf_seconds=None, save_on_train_end=False,
                            memory_root=str(Path(root) / "mem"), memory_every_n_steps=2)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            plugins=[AsyncDCPCheckpointIO(async_save=False)], callbacks=[cb])
        trainer.fit(TinyModule(), ckpt_path="last")
        return trainer

    fit(5)
    resumed = fit(7)
    assert (resumed.ckpt_path, resumed.global_step) == (str(Path(root) / "mem" / "step_000000004"), 7)


@pytest.mark.slow
def test_two_ranks_save_to_memory_and_resume_from_it(tmp_path):
    """On 2 DDP ranks memory saves commit and ckpt_path="last" resumes memory step 4 on both ranks."""
    run_distributed(_two_rank_body, 2, str(tmp_path), timeout_s=240)


def test_lightning_cli_yaml_enables_memory_saves(tmp_path):
    """The callback's memory_* init_args in a LightningCLI YAML file take memory saves into memory_root."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(f"""trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  logger: false
  enable_progress_bar: false
  default_root_dir: {tmp_path}
  plugins:
    - class_path: lightning_ckpt.AsyncDCPCheckpointIO
      init_args:
        async_save: false
  callbacks:
    - class_path: lightning_ckpt.MTBFCheckpoint
      init_args:
        dirpath: {tmp_path / 'ckpt'}
        mtbf_seconds: null
        save_on_train_end: false
        memory_root: {tmp_path / 'mem'}
        memory_every_n_steps: 2
""", encoding="utf-8")
    LightningCLI(TinyModule, save_config_callback=None, args=["fit", "--config", str(config)])
    assert steps(tmp_path / "mem") == [2, 4]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"memory_root": "/dev/shm/run", "memory_every_n_steps": 0}, "memory_every_n_steps"),
    ({"memory_root": "/dev/shm/run", "memory_every_seconds": "soon"}, "memory_every_seconds"),
    ({"memory_root": "/dev/shm/run", "memory_keep_last": 0}, "memory_keep_last"),
    ({"memory_every_n_steps": 5}, "memory_root"),
], ids=["every_n_steps", "every_seconds", "keep_last", "no_root"])
def test_bad_memory_values_name_the_field(tmp_path, kwargs, field):
    """An out-of-range memory setting (or a cadence without memory_root) raises ConfigError naming the field."""
    with pytest.raises(ConfigError, match=field):
        MTBFCheckpoint(tmp_path, **kwargs)


def test_memory_root_inside_dirpath_is_refused_at_fit(make_trainer, tmp_path):
    """A memory_root inside the callback's dirpath raises ConfigError naming memory_root before the first step."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", memory_root=str(tmp_path / "ckpt" / "mem"), memory_every_n_steps=1)
    with pytest.raises(ConfigError, match="memory_root"):
        make_trainer(plugins=[AsyncDCPCheckpointIO()], callbacks=[cb]).fit(TinyModule())
