"""lightning_ckpt._callback: MTBFCheckpoint decides, saves, retains, resumes, logs and handles SIGTERM."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning_helpers import TinyModule

import torch_ckpt.save._checkpointer as checkpointer
from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from torch_ckpt import CheckpointWriteError, ConfigError
from torch_ckpt.tools.convert import load_full_state


def committed_steps(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if not p.startswith("."))


def test_saves_at_the_policy_steps_and_at_the_end(make_trainer, tmp_path):
    """save_every_n_steps=3 over 7 steps saves steps 3 and 6, and the final step 7."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=3, keep_last=None)
    make_trainer(max_steps=7, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb]).fit(TinyModule())
    assert committed_steps(tmp_path / "ckpt") == ["step_000000003", "step_000000006", "step_000000007"]


def test_keeps_only_the_newest_committed_checkpoints(make_trainer, tmp_path):
    """keep_last=2 leaves the two newest checkpoints."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=2, keep_last=2)
    make_trainer(max_steps=8, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb]).fit(TinyModule())
    assert committed_steps(tmp_path / "ckpt") == ["step_000000006", "step_000000008"]


def test_last_is_the_newest_committed_checkpoint(tmp_path):
    """ckpt_path (what ckpt_path="last" resolves to) skips temporaries and directories without a manifest."""
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint({"global_step": 4, "state_dict": {}}, tmp_path / "step_000000004")
    io.teardown()
    (tmp_path / ".step_000000009.tmp").mkdir()
    (tmp_path / "step_000000008").mkdir()
    assert MTBFCheckpoint(tmp_path).ckpt_path == str(tmp_path / "step_000000004")


def test_fit_with_ckpt_path_last_resumes_from_the_newest_checkpoint(make_trainer, tmp_path):
    """A second fit with ckpt_path="last" starts from the first fit's final checkpoint."""
    def run(max_steps, **fit_kwargs):
        trainer = make_trainer(max_steps=max_steps, plugins=[AsyncDCPCheckpointIO()],
                               callbacks=[MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=2)])
        trainer.fit(TinyModule(), **fit_kwargs)
        return trainer

    run(5)
    resumed = run(8, ckpt_path="last")
    assert resumed.ckpt_path == str(tmp_path / "ckpt" / "step_000000005") and resumed.global_step == 8


def test_resumed_run_draws_the_same_random_numbers(make_trainer, tmp_path):
    """RNG state is restored per rank before the first resumed batch: draws match the uninterrupted run."""
    def run(name, max_steps, ckpt_path=None):
        module = TinyModule()
        torch.manual_seed(123)
        cb = MTBFCheckpoint(tmp_path / name, mtbf_seconds=None, save_every_n_steps=3, keep_last=None)
        make_trainer(max_steps=max_steps, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb]).fit(
            module, ckpt_path=ckpt_path)
        return module.draws

    uninterrupted = run("a", 6)
    torch.manual_seed(999)  # the resumed process starts from another RNG state
    resumed = run("b", 6, ckpt_path=str(tmp_path / "a" / "step_000000003"))
    assert resumed == uninterrupted[3:]


def test_sigterm_saves_at_the_next_step_boundary_then_stops(make_trainer, tmp_path):
    """SIGTERM during step 3 commits a checkpoint of step 3, then Lightning stops training."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)
    trainer = make_trainer(max_steps=10, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb])
    with pytest.raises(SIGTERMException):
        trainer.fit(TinyModule(sigterm_at_step=3))
    assert trainer.global_step == 3 and committed_steps(tmp_path / "ckpt") == ["step_000000003"]
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "ckpt" / "step_000000003")


def test_with_gradient_accumulation_a_save_waits_for_the_optimizer_step(make_trainer, tmp_path):
    """SIGTERM in the first of two accumulated micro-batches saves after optimizer step 1, not mid-accumulation."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)
    trainer = make_trainer(max_steps=10, accumulate_grad_batches=2, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb])
    with pytest.raises(SIGTERMException):
        trainer.fit(TinyModule(sigterm_at_step=1))
    assert committed_steps(tmp_path / "ckpt") == ["step_000000001"]


def test_a_background_write_error_surfaces_when_training_ends(make_trainer, tmp_path, write_gate):
    """A failed background write of the final checkpoint makes fit() raise it at teardown."""
    write_gate.fail_with = CheckpointWriteError("disk full (injected)")
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)
    trainer = make_trainer(max_steps=3, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb])
    with pytest.raises(CheckpointWriteError, match="injected"):
        trainer.fit(TinyModule())
    assert not (tmp_path / "ckpt" / "step_000000003").exists()


class WeightsAt(Callback):
    """Records the weights at the end of one step and signals when the next optimizer step is about to run
    (both hooks run before the checkpoint callback's)."""

    def __init__(self, step: int) -> None:
        self.step, self.weights, self.next_step = step, None, threading.Event()

    def on_train_batch_end(self, trainer, pl_module, *_):
        if trainer.global_step == self.step:
            self.weights = pl_module.layer.weight.detach().clone()

    def on_before_optimizer_step(self, trainer, *_):
        if trainer.global_step == self.step:
            self.next_step.set()


def test_a_checkpoint_holds_the_weights_of_its_step_despite_overlapped_staging(make_trainer, tmp_path, monkeypatch):
    """Weights are copied in the background, yet the next optimizer step waits: the checkpoint has step 2's."""
    real_stage = checkpointer.AsyncCheckpointer._stage
    record = WeightsAt(2)

    def late_stage(self, job, handle):
        if threading.current_thread() is not threading.main_thread():
            # the background copy starts only once the next optimizer step is about to run: it must wait for it
            assert record.next_step.wait(timeout=60)
        return real_stage(self, job, handle)

    monkeypatch.setattr(checkpointer.AsyncCheckpointer, "_stage", late_stage)
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=2, keep_last=None)
    make_trainer(max_steps=3, plugins=[AsyncDCPCheckpointIO(overlap_staging=True)], callbacks=[record, cb]).fit(
        TinyModule())
    saved, _ = load_full_state(tmp_path / "ckpt" / "step_000000002")
    assert torch.equal(saved["state_dict"]["layer.weight"], record.weights)


def test_logs_save_statistics_and_the_schedule(make_trainer, tmp_path):
    """Committed saves log ckpt/* statistics and the MTBF schedule through the trainer's loggers."""
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds="1h", save_every_n_steps=2)
    logger = CSVLogger(tmp_path / "logs")
    make_trainer(max_steps=6, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb], logger=logger,
                 log_every_n_steps=1).fit(TinyModule())
    header = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"ckpt/blocking_s", "ckpt/persist_s", "ckpt/gb_per_s", "ckpt/expected_overhead",
            "ckpt/mtbf_s"} <= set(header)


class ProgressBarAtEnd(Callback):
    """Keeps a copy of the progress bar metrics when training ends."""

    def __init__(self) -> None:
        self.metrics: dict = {}

    def on_train_end(self, trainer, pl_module):
        self.metrics = dict(trainer.progress_bar_metrics)


def test_shows_checkpoint_activity_in_the_progress_bar(make_trainer, tmp_path):
    """The progress bar metrics carry the last committed step and whether a save is in flight."""
    cb, bar = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=2), ProgressBarAtEnd()
    make_trainer(max_steps=6, plugins=[AsyncDCPCheckpointIO()], callbacks=[bar, cb]).fit(TinyModule())
    assert bar.metrics["ckpt"] in (2.0, 4.0, 6.0) and "ckpt_saving" in bar.metrics


def test_requires_the_async_dcp_plugin(make_trainer, tmp_path):
    """Without AsyncDCPCheckpointIO in the trainer's plugins, fit raises ConfigError."""
    with pytest.raises(ConfigError, match="AsyncDCPCheckpointIO"):
        make_trainer(callbacks=[MTBFCheckpoint(tmp_path)]).fit(TinyModule())


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"mtbf_seconds": "-1h"}, {"save_every_n_steps": 0}],
                         ids=["keep_last", "mtbf", "save_every_n_steps"])
def test_invalid_arguments_are_rejected_at_construction(kwargs, tmp_path):
    """Out-of-range arguments raise ConfigError when the callback is built (before any training)."""
    with pytest.raises(ConfigError):
        MTBFCheckpoint(tmp_path, **kwargs)


class OddHyperParameters(TinyModule):
    """Saves a hyper-parameter that only pickling could store (a SimpleNamespace), and records steps."""

    def __init__(self) -> None:
        super().__init__()
        self.hparams["odd"] = SimpleNamespace(a=1)


def test_unstorable_hyper_parameters_are_refused_at_setup(make_trainer, tmp_path):
    """With unsafe_values='error', a hyper-parameter that needs pickling raises ConfigError naming it before the first
    step."""
    module = OddHyperParameters()
    trainer = make_trainer(plugins=[AsyncDCPCheckpointIO(unsafe_values="error")],
                           callbacks=[MTBFCheckpoint(tmp_path, mtbf_seconds=None)])
    with pytest.raises(ConfigError, match=r"hyper_parameters\.odd"):
        trainer.fit(module)
    assert module.draws == [] and not list(tmp_path.glob("step_*"))


def test_path_hyper_parameters_are_saved_and_loaded_back_as_paths(make_trainer, tmp_path):
    """save_hyperparameters() with a pathlib.Path trains, saves, and loads it back as a Path."""
    module = TinyModule(lr=0.1)
    module.hparams["data_dir"] = Path("/data/set")
    make_trainer(max_steps=2, plugins=[AsyncDCPCheckpointIO()],
                 callbacks=[MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)]).fit(module)
    loaded = AsyncDCPCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "step_000000002")
    assert loaded["hyper_parameters"]["data_dir"] == Path("/data/set")


@pytest.mark.parametrize("kwargs", [{"timeout_seconds": float("inf")}, {"async_save": "no"},
                                    {"timeout_seconds": float("nan")}], ids=["inf-timeout", "str-async", "nan-timeout"])
def test_plugin_arguments_are_validated_at_construction(kwargs):
    """An infinite/NaN timeout or a non-bool flag raises ConfigError when the plugin is built."""
    with pytest.raises(ConfigError):
        AsyncDCPCheckpointIO(**kwargs)


def _fit(make_trainer, root, max_steps, ckpt_path=None, **kwargs):
    cb = MTBFCheckpoint(root, mtbf_seconds=None, save_every_n_steps=2, keep_last=None, **kwargs)
    trainer = make_trainer(max_steps=max_steps, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb])
    trainer.fit(TinyModule(), ckpt_path=ckpt_path)
    return trainer, cb


def test_resuming_an_older_checkpoint_supersedes_the_abandoned_newer_ones(make_trainer, tmp_path):
    """After a resume from step 2 of a run that reached step 6, "last" follows the new branch (step 4), not 6."""
    _fit(make_trainer, tmp_path / "ckpt", 6)
    _fit(make_trainer, tmp_path / "ckpt", 4, ckpt_path=str(tmp_path / "ckpt" / "step_000000002"))
    assert committed_steps(tmp_path / "ckpt") == ["step_000000002", "step_000000004"]
    assert MTBFCheckpoint(tmp_path / "ckpt").ckpt_path == str(tmp_path / "ckpt" / "step_000000004")


@pytest.mark.parametrize("attached", [True, False])
def test_a_relative_ckpt_path_is_read_from_the_working_directory(make_trainer, tmp_path, monkeypatch, attached):
    """fit(ckpt_path="ckpt/step_2"), relative to the working directory, resumes that step, attached or not."""
    _fit(make_trainer, tmp_path / "ckpt", 2)
    monkeypatch.chdir(tmp_path)
    relative = os.path.join("ckpt", "step_000000002")
    if attached:  # the callback's manager has the root tmp_path/ckpt: the path must not be taken relative to it
        trainer, _ = _fit(make_trainer, tmp_path / "ckpt", 4, ckpt_path=relative)
    else:
        trainer = make_trainer(max_steps=4, plugins=[AsyncDCPCheckpointIO()])
        trainer.fit(TinyModule(), ckpt_path=relative)
    assert trainer.global_step == 4 and trainer.ckpt_path == relative


def _corrupt(step_dir: Path) -> None:
    shard = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, wrong CRC
    shard.write_bytes(bytes(data))


def test_last_falls_back_from_a_corrupt_newest_checkpoint_with_a_warning(make_trainer, tmp_path, caplog):
    """ckpt_path="last" with a corrupt newest checkpoint resumes the previous one and names the bad one."""
    _fit(make_trainer, tmp_path / "ckpt", 4)
    _corrupt(tmp_path / "ckpt" / "step_000000004")
    trainer, _ = _fit(make_trainer, tmp_path / "ckpt", 6, ckpt_path="last")
    assert trainer.global_step == 6 and "step_000000004" in caplog.text


def test_an_explicit_corrupt_checkpoint_raises(make_trainer, tmp_path):
    """An explicit ckpt_path that fails verification raises CheckpointCorruptError (no fallback)."""
    from torch_ckpt import CheckpointCorruptError

    _fit(make_trainer, tmp_path / "ckpt", 4)
    _corrupt(tmp_path / "ckpt" / "step_000000004")
    with pytest.raises(CheckpointCorruptError):
        _fit(make_trainer, tmp_path / "ckpt", 6, ckpt_path=str(tmp_path / "ckpt" / "step_000000004"))


def test_each_committed_save_is_logged_once_including_the_final_one(make_trainer, tmp_path):
    """ckpt/blocking_s appears in exactly one metrics row per committed save, the final save's included."""
    import csv

    logger = CSVLogger(tmp_path / "logs")
    cb = MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None, save_every_n_steps=3)
    make_trainer(max_steps=7, plugins=[AsyncDCPCheckpointIO()], callbacks=[cb], logger=logger,
                 log_every_n_steps=1).fit(TinyModule())
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").open()))
    assert len([r for r in rows if r.get("ckpt/blocking_s")]) == 3  # steps 3, 6 and the final 7


def test_a_fresh_fit_emits_no_misleading_warning(make_trainer, tmp_path):
    """A fresh fit(model) with the plugin and MTBFCheckpoint warns neither about ckpt_path nor from lightning_ckpt."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(max_steps=2, plugins=[AsyncDCPCheckpointIO()],
                     callbacks=[MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)]).fit(TinyModule())
    ours = [str(w.message) for w in caught if "ckpt_path" in str(w.message) or "lightning_ckpt" in w.filename
            or "AsyncDCPCheckpointIO" in str(w.message) or "MTBFCheckpoint" in str(w.message)]
    assert ours == []
    assert committed_steps(tmp_path / "ckpt") == ["step_000000002"]


def test_fit_without_ckpt_path_still_resumes_an_existing_checkpoint(make_trainer, tmp_path):
    """Once MTBFCheckpoint has a checkpoint, fit(model) without ckpt_path resumes from it (Lightning's rule)."""
    def trainer(max_steps):
        return make_trainer(max_steps=max_steps, plugins=[AsyncDCPCheckpointIO()],
                            callbacks=[MTBFCheckpoint(tmp_path / "c", mtbf_seconds=None, keep_last=None)])

    trainer(2).fit(TinyModule())
    module, resumed = TinyModule(), trainer(3)
    resumed.fit(module)
    assert resumed.global_step == 3 and len(module.draws) == 1
