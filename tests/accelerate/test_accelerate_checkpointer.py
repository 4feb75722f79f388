"""``accelerate_ckpt.attach``: asynchronous save_state, exact load_state, naming, retention, hooks, trackers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from acc_helpers import Counter, bitwise, make_run, train
from accelerate.tracking import GeneralTracker

import accelerate_ckpt
from torch_ckpt import CheckpointNotFoundError, CheckpointWriteError, ConfigError, EveryNSteps

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture
def gate(monkeypatch):
    """Holds every background write until ``gate.set()`` (saves stay in flight while the test looks)."""
    import torch_ckpt.save._checkpointer as engine

    event = threading.Event()
    real = engine.persist_checkpoint

    def held(req, ctx):
        assert event.wait(30), "test never released the writer"
        return real(req, ctx)

    monkeypatch.setattr(engine, "persist_checkpoint", held)
    yield event
    event.set()


def committed(project: Path) -> list[str]:
    root = project / "checkpoints"
    return sorted((p.name for p in root.iterdir() if (p / "manifest.json").exists()),
                  key=lambda n: int(n.split("_")[1]))


def test_save_state_returns_after_staging_and_commits_in_background(tmp_path, gate):
    """save_state() returns with the state staged while the write is still in flight; wait() commits it."""
    run = make_run(tmp_path)
    train(run, 0, 2)
    folder = run.accelerator.save_state()
    handle = run.ckpt.last_handle
    assert handle.staged.done() and not handle.committed.done()
    assert folder.is_dir() and not (folder / "manifest.json").exists()  # the name is reserved, not committed
    gate.set()
    run.ckpt.wait()
    assert (folder / "manifest.json").exists() and handle.stats.mode == "async"
    run.ckpt.close()


@pytest.mark.parametrize("settings", [{}, {"overlap_staging": True},
                                      pytest.param({"persist": "process"}, marks=pytest.mark.slow)],
                         ids=["thread", "overlap_staging", "process_writer"])
def test_resume_matches_the_uninterrupted_run_bit_for_bit_across_epochs(tmp_path, settings):
    """Loading the step-8 checkpoint (epoch 1) and training on gives the reference run's losses and batches."""
    ref_run = make_run(tmp_path / "a", **settings)
    reference = train(ref_run, 0, 20, save_at=(8,))
    ref_run.ckpt.close()
    run = make_run(tmp_path / "a", **settings)
    run.accelerator.load_state()
    assert run.ckpt.step == 8
    resumed = train(run, run.ckpt.step, 20)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[8:])


def test_stateful_dataloader_resumes_mid_epoch_exactly(tmp_path):
    """With use_stateful_dataloader the loader's own position is restored: no skip_first_batches needed."""
    ref_run = make_run(tmp_path, stateful=True)
    reference = train(ref_run, 0, 16, save_at=(9,), skip=False)
    ref_run.ckpt.close()
    run = make_run(tmp_path, stateful=True)
    run.accelerator.load_state()
    resumed = train(run, run.ckpt.step, 16, skip=False)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[9:])


def test_dataloader_epoch_is_restored(tmp_path):
    """load_state() puts each prepared dataloader back in the epoch it was in (its shuffle seed)."""
    run = make_run(tmp_path)
    train(run, 0, 8, save_at=(8,))  # 6 batches per epoch: step 8 is in epoch 1
    run.ckpt.close()
    run = make_run(tmp_path)
    assert run.loader.iteration == 0
    run.accelerator.load_state()
    assert run.loader.iteration == 1
    run.ckpt.close()


def test_load_state_twice_is_harmless(tmp_path):
    """A second load_state() of the same checkpoint leaves the run exactly where one load puts it."""
    ref_run = make_run(tmp_path)
    reference = train(ref_run, 0, 12, save_at=(5,))
    ref_run.ckpt.close()
    run = make_run(tmp_path)
    run.accelerator.load_state()
    train(run, 5, 7)  # move on, then load again
    run.accelerator.load_state()
    run.accelerator.load_state()
    resumed = train(run, run.ckpt.step, 12)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[5:])


def test_load_state_in_the_process_that_saved_keeps_the_parameters_and_resumes_exactly(tmp_path):
    """load_state() after save_state() in one process keeps the parameter objects and resumes exactly."""
    run = make_run(tmp_path)
    reference = train(run, 0, 12, save_at=(5, 8))
    params = list(run.model.parameters())
    run.accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))  # step 5
    assert all(a is b for a, b in zip(run.model.parameters(), params))
    resumed = train(run, run.ckpt.step, 12)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[5:])


def _scaled_steps(run, scaler, n: int, overflow_at: int) -> None:
    for i in range(n):
        x = torch.randn(4, 4)
        loss = run.model(x).pow(2).mean() * (float("inf") if i == overflow_at else 1.0)
        run.optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(run.optimizer.optimizer)
        scaler.update()


def test_grad_scaler_state_round_trips_exactly(tmp_path):
    """The GradScaler's scale and growth tracker (after an overflow) come back exactly."""
    run = make_run(tmp_path)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    run.accelerator.scaler = scaler
    _scaled_steps(run, scaler, 4, overflow_at=1)  # scale 2**9, growth tracker 2
    saved = scaler.state_dict()
    run.accelerator.save_state(step=5)
    _scaled_steps(run, scaler, 3, overflow_at=0)
    assert scaler.state_dict() != saved
    run.accelerator.load_state()
    assert scaler.state_dict() == saved
    run.ckpt.close()


@pytest.mark.cuda
def test_grad_scaler_of_fp16_accelerator_round_trips_exactly(tmp_path):
    """With mixed_precision='fp16' on CUDA, Accelerate's own GradScaler is saved and restored exactly."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(mixed_precision="fp16", project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    ckpt = accelerate_ckpt.attach(acc)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for i in range(4):
        with acc.autocast():
            loss = model(torch.randn(4, 8, device=acc.device)).pow(2).mean() * (float("inf") if i == 1 else 1.0)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    saved = acc.scaler.state_dict()
    acc.save_state(step=4)
    acc.scaler.update(new_scale=3.0)
    acc.load_state()
    assert acc.scaler.state_dict() == saved
    ckpt.close()


def test_total_limit_after_12_saves_keeps_checkpoint_10_and_11(tmp_path):
    """Retention orders by number (not string): 12 saves with total_limit=2 keep checkpoint_10 and _11."""
    run = make_run(tmp_path, total_limit=2)
    for _ in range(12):
        run.accelerator.save_state()
    run.ckpt.wait()
    assert committed(tmp_path) == ["checkpoint_10", "checkpoint_11"]
    assert run.ckpt.latest_checkpoint().name == "checkpoint_11"
    run.ckpt.close()


def test_checkpoint_in_flight_is_never_deleted_and_the_last_good_one_survives_until_commit(tmp_path, gate):
    """total_limit=1: while checkpoint_1 is in flight checkpoint_0 stays; once 1 commits, 0 goes."""
    gate.set()
    run = make_run(tmp_path, total_limit=1)
    run.accelerator.save_state(step=9)
    run.ckpt.wait()
    gate.clear()
    run.accelerator.save_state(step=10)
    assert committed(tmp_path) == ["checkpoint_0"]
    assert not (tmp_path / "checkpoints" / "checkpoint_1" / "manifest.json").exists()  # reserved, in flight
    gate.set()
    run.ckpt.wait()
    assert committed(tmp_path) == ["checkpoint_1"]
    run.ckpt.close()


def test_load_state_picks_the_newest_committed_checkpoint_not_a_crashed_one(tmp_path):
    """A newer folder without a committed payload (a crashed save) is never chosen by load_state()."""
    run = make_run(tmp_path)
    train(run, 0, 3, save_at=(3,))
    run.ckpt.wait()
    crashed = tmp_path / "checkpoints" / "checkpoint_12"
    crashed.mkdir(parents=True)
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    run.accelerator.load_state()
    assert run.ckpt.step == 3
    run.ckpt.close()


def test_load_state_without_any_checkpoint_raises_not_found(tmp_path):
    """With automatic naming and no committed checkpoint, load_state() raises CheckpointNotFoundError."""
    run = make_run(tmp_path)
    assert run.ckpt.latest_checkpoint() is None
    with pytest.raises(CheckpointNotFoundError):
        run.accelerator.load_state()
    run.ckpt.close()


def test_saving_a_committed_number_again_is_refused(tmp_path):
    """save_state() onto a committed checkpoint_<n> (save iteration reset by hand) raises ValueError, as Accelerate."""
    run = make_run(tmp_path)
    run.accelerator.save_state(step=4)
    run.ckpt.wait()
    run.accelerator.project_configuration.iteration = 0
    with pytest.raises(ValueError, match="already committed"):
        run.accelerator.save_state(step=5)
    run.ckpt.close()


def test_without_a_step_names_follow_accelerates_save_iteration(tmp_path):
    """Plain save_state() calls are named checkpoint_0, checkpoint_1 ... as Accelerate names them."""
    run = make_run(tmp_path)
    run.accelerator.save_state()
    run.accelerator.save_state()
    run.ckpt.wait()
    assert committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    assert run.accelerator.save_iteration == 2
    run.ckpt.close()


def test_explicit_output_dir_without_automatic_naming(tmp_path):
    """Without automatic naming save_state(dir)/load_state(dir) use exactly that folder."""
    ref_run = make_run(None)
    reference = train(ref_run, 0, 8)
    ref_run.ckpt.close()
    run = make_run(None)
    train(run, 0, 4)
    run.accelerator.save_state(tmp_path / "mine", step=4)
    run.ckpt.close()
    run = make_run(None)
    run.accelerator.load_state(tmp_path / "mine")
    resumed = train(run, run.ckpt.step, 8)
    run.ckpt.close()
    assert bitwise(resumed) == bitwise(reference[4:])


def test_registered_objects_are_saved_and_restored(tmp_path):
    """Objects given to register_for_checkpointing come back with their state."""
    run = make_run(tmp_path)
    counter = Counter()
    run.accelerator.register_for_checkpointing(counter)
    counter.value, counter.history = 7, [1, 2, 3]
    run.accelerator.save_state(step=1)
    counter.value, counter.history = 0, []
    run.accelerator.load_state()
    assert (counter.value, counter.history) == (7, [1, 2, 3])
    run.ckpt.close()


def test_accelerator_step_and_save_iteration_are_restored(tmp_path):
    """load_state() restores accelerator.step and the save iteration (no name collision after resume)."""
    run = make_run(tmp_path)
    run.accelerator.step = 5
    run.accelerator.save_state()
    run.accelerator.step, run.accelerator.project_configuration.iteration = 0, 0
    run.accelerator.load_state()
    assert run.accelerator.step == 5 and run.accelerator.save_iteration == 1
    run.ckpt.close()


def test_user_hook_that_pops_weights_keeps_saving_its_model_itself(tmp_path):
    """A diffusers-style hook pops the weights it saves; the adapter saves everything else."""
    run = make_run(tmp_path)
    seen = {}

    def save_hook(models, weights, output_dir):
        torch.save(weights.pop(), os.path.join(output_dir, "user_model.pt"))
        seen["dir"] = output_dir

    def load_hook(models, input_dir):
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "user_model.pt")))

    run.accelerator.register_save_state_pre_hook(save_hook)
    run.accelerator.register_load_state_pre_hook(load_hook)
    train(run, 0, 2)
    weight = run.model.fc1.weight.detach().clone()
    folder = run.accelerator.save_state(step=2)
    run.ckpt.wait()
    assert Path(seen["dir"]).parent == folder.parent and (folder / "user_model.pt").exists()
    assert not Path(seen["dir"]).exists()  # the hook's staging folder joined the committed checkpoint
    with torch.no_grad():
        run.model.fc1.weight.zero_()
    run.accelerator.load_state()
    assert torch.equal(run.model.fc1.weight, weight)
    run.ckpt.close()


def test_close_gives_the_accelerator_its_own_methods_and_registers_no_hooks(tmp_path):
    """attach() registers no hooks of its own; after close() save_state/load_state are Accelerate's again."""
    run = make_run(tmp_path)
    acc = run.accelerator
    assert "save_state" in vars(acc) and "load_state" in vars(acc)
    run.ckpt.close()
    assert "save_state" not in vars(acc) and "load_state" not in vars(acc)
    assert not acc._save_model_state_pre_hook and not acc._load_model_state_pre_hook


def test_folder_written_by_accelerate_itself_is_loaded_only_when_allowed(tmp_path):
    """A folder of Accelerate's own (pickled) files is refused by default and loads with the explicit opt-in."""
    from torch_ckpt import UnsafeCheckpointError

    run = make_run(None, attach=False)
    train(run, 0, 3)
    run.accelerator.save_state(str(tmp_path / "native"))
    weight = run.model.fc1.weight.detach().clone()
    ckpt = accelerate_ckpt.attach(run.accelerator)
    with torch.no_grad():
        run.model.fc1.weight.zero_()
    with pytest.raises(UnsafeCheckpointError, match="allow_unsafe_accelerate_folder"):
        run.accelerator.load_state(str(tmp_path / "native"))
    run.accelerator.load_state(str(tmp_path / "native"), allow_unsafe_accelerate_folder=True)
    assert torch.equal(run.model.fc1.weight, weight)
    ckpt.close()


def test_background_error_is_raised_once_at_the_next_call(tmp_path, monkeypatch):
    """A failed background write surfaces at the next wait() as CheckpointWriteError, exactly once."""
    import torch_ckpt.save._checkpointer as engine

    def broken(req, ctx):
        raise CheckpointWriteError("disk on fire")

    run = make_run(tmp_path)
    monkeypatch.setattr(engine, "persist_checkpoint", broken)
    run.accelerator.save_state(step=1)
    with pytest.raises(CheckpointWriteError, match="disk on fire"):
        run.ckpt.wait()
    run.ckpt.wait()  # raised once only
    monkeypatch.undo()
    run.ckpt.close()


def test_should_save_follows_the_policy_and_names_checkpoints_by_save_iteration(tmp_path):
    """save_if_due(step) saves when the policy says so, named checkpoint_<save iteration> as Accelerate names it."""
    run = make_run(tmp_path, save_policy=EveryNSteps(3))
    saved = [step for step in range(1, 8) if run.ckpt.save_if_due(step) is not None]
    run.ckpt.wait()
    assert saved == [3, 6] and committed(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    run.ckpt.close()


def test_should_save_without_a_policy_raises_config_error(tmp_path):
    """should_save() needs a save policy; without one it raises ConfigError."""
    run = make_run(tmp_path)
    with pytest.raises(ConfigError, match="save_policy"):
        run.ckpt.should_save(1)
    run.ckpt.close()


def test_mtbf_setting_drives_should_save(tmp_path):
    """With an MTBF (Young/Daly) the adapter decides by the measured step time and save cost."""
    run = make_run(tmp_path, mtbf_seconds="1s", initial_cost_seconds=0.0)
    decisions = [run.ckpt.save_if_due(step) is not None for step in range(1, 6)]
    run.ckpt.wait()
    assert decisions[0] is False and any(decisions[1:])  # no step time after one step, then saves
    assert run.ckpt.manager.schedule_info()["policy"] == "YoungDaly"
    run.ckpt.close()


class _Recorder(GeneralTracker):
    """A minimal Accelerate tracker that keeps what it is given."""

    name = "recorder"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict, int]] = []

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values) -> None:
        pass

    def log(self, values, step=None, **kwargs) -> None:
        self.logged.append((values, step))


def test_trackers_receive_per_save_statistics(tmp_path):
    """With a tracker configured, each committed save logs its checkpoint/* statistics at its step."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    recorder = _Recorder()
    acc = Accelerator(cpu=True, log_with=[recorder], project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    acc.init_trackers("test")
    ckpt = accelerate_ckpt.attach(acc)
    model = acc.prepare(torch.nn.Linear(4, 4))
    acc.save_state(step=3)
    ckpt.wait()
    logged = [(values, step) for values, step in recorder.logged if "checkpoint/blocking_s" in values]
    assert len(logged) == 1 and logged[0][1] == 3
    assert logged[0][0]["checkpoint/bytes"] >= sum(p.numel() * 4 for p in model.parameters())
    ckpt.close()


def test_config_file_alone_turns_async_saving_off(tmp_path, monkeypatch):
    """The same code saves synchronously once ACCELERATE_CKPT_CONFIG names a file with async_save: false."""
    (tmp_path / "ckpt.yaml").write_text("async_save: false\n", encoding="utf-8")
    monkeypatch.setenv(accelerate_ckpt.ENV_VAR, str(tmp_path / "ckpt.yaml"))
    run = make_run(tmp_path / "proj")
    folder = run.accelerator.save_state(step=1)
    assert run.ckpt.last_handle.committed.done() and run.ckpt.last_handle.stats.mode == "sync"
    assert (folder / "manifest.json").exists()
    run.ckpt.close()


def test_config_file_alone_can_disable_the_adapter(tmp_path, monkeypatch):
    """With enabled: false in the file, save_state() is Accelerate's own (its files, no payload)."""
    (tmp_path / "ckpt.yaml").write_text("enabled: false\n", encoding="utf-8")
    monkeypatch.setenv(accelerate_ckpt.ENV_VAR, str(tmp_path / "ckpt.yaml"))
    run = make_run(tmp_path / "proj")
    folder = Path(run.accelerator.save_state())
    assert not run.ckpt.enabled and (folder / "model.safetensors").exists() and not (folder / "manifest.json").exists()
    run.ckpt.close()


def test_config_file_alone_sets_policy_and_retention(tmp_path, monkeypatch):
    """save_every_n_steps and total_limit from the file decide when to save and what to keep."""
    (tmp_path / "ckpt.yaml").write_text("save_every_n_steps: 2\nkeep_last: 1\n", encoding="utf-8")
    monkeypatch.setenv(accelerate_ckpt.ENV_VAR, str(tmp_path / "ckpt.yaml"))
    run = make_run(tmp_path / "proj")
    saved = [step for step in range(1, 7) if run.ckpt.save_if_due(step) is not None]
    run.ckpt.wait()
    assert saved == [2, 4, 6] and committed(tmp_path / "proj") == ["checkpoint_2"]
    run.ckpt.close()


def test_loading_an_interrupted_save_by_name_is_refused(tmp_path):
    """load_state(folder) of a save that never committed raises CheckpointNotFoundError."""
    run = make_run(tmp_path)
    crashed = tmp_path / "checkpoints" / "checkpoint_7"
    crashed.mkdir(parents=True)
    with pytest.raises(CheckpointNotFoundError, match="incomplete save"):
        run.accelerator.load_state(crashed)
    run.ckpt.close()


@pytest.mark.parametrize("settings", [{}, {"overlap_staging": True}], ids=["thread", "overlap_staging"])
def test_initial_checkpoint_before_training_changes_no_later_loss(tmp_path, settings):
    """save_state() before the first optimizer step leaves every later loss, lr and batch bitwise unchanged."""
    ref_run = make_run(tmp_path / "ref", **settings)
    reference = train(ref_run, 0, 8)
    ref_run.ckpt.close()
    run = make_run(tmp_path / "run", **settings)
    run.accelerator.save_state(step=0)
    got = train(run, 0, 8)
    run.ckpt.close()
    assert bitwise(got) == bitwise(reference)


class _Refusing(Counter):
    """A registered object whose load_state_dict fails."""

    def load_state_dict(self, sd):
        raise ValueError("refusing to load")


def test_failed_load_state_leaves_model_optimizer_and_objects_untouched(tmp_path):
    """A registered object failing to load undoes everything already loaded: model, optimizer, scheduler, RNG."""
    import copy

    run = make_run(tmp_path)
    run.accelerator.register_for_checkpointing(Counter())
    train(run, 0, 3, save_at=(3,))
    run.ckpt.close()
    run = make_run(tmp_path, seed=4)
    run.accelerator.register_for_checkpointing(_Refusing())
    model_before = copy.deepcopy(run.model.state_dict())
    sched_before = copy.deepcopy(run.scheduler.state_dict())
    rng_before = torch.get_rng_state()
    with pytest.raises(ValueError, match="refusing"):
        run.accelerator.load_state()
    assert not run.optimizer.optimizer.state
    assert all(torch.equal(v, model_before[k]) for k, v in run.model.state_dict().items())
    assert run.scheduler.state_dict() == sched_before and torch.equal(torch.get_rng_state(), rng_before)
    assert run.accelerator.step == 0
    run.ckpt.close()


def test_load_state_refuses_a_dtype_difference_unless_allow_cast(tmp_path):
    """A float64 model refuses the float32 checkpoint naming key and dtypes; allow_cast=True casts it."""
    from torch_ckpt import StateMismatchError

    run = make_run(tmp_path)
    train(run, 0, 2, save_at=(2,))
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.ckpt.close()
    run = make_run(tmp_path, seed=4)
    run.model.double()
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"model.0.fc1.weight: checkpoint torch.float32, live torch.float64"):
        run.accelerator.load_state()
    assert all(torch.equal(v, before[k]) for k, v in run.model.state_dict().items())
    run.accelerator.load_state(allow_cast=True)
    assert all(torch.equal(v, saved[k].double()) for k, v in run.model.state_dict().items())
    run.ckpt.close()
