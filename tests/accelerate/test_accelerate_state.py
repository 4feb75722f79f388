"""``AcceleratorTrainState``: what goes into the checkpoint for the Accelerator's prepared objects."""

from __future__ import annotations

import enum
import pathlib
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")
from acc_helpers import Counter, TinyNet, make_run

from accelerate_ckpt import AcceleratorTrainState
from accelerate_ckpt._compat import check_supported
from torch_ckpt import ConfigError, StateMismatchError
from torch_ckpt.format._files import split_state

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


def test_state_holds_every_component(tmp_path):
    """Model, optimizer, scheduler, dataloader, RNG, registered objects and Accelerate counters are all there."""
    run = make_run(tmp_path, attach=False)
    run.accelerator.register_for_checkpointing(Counter())
    sd = AcceleratorTrainState(run.accelerator, step=4).state_dict()
    assert {"model", "optimizer", "scheduler", "dataloader", "rng", "custom", "accelerate", "step"} <= set(sd)
    assert set(sd["model"]) == {"0"} and sd["step"] == 4 and sd["dataloader"]["0"]["epoch"] == 0


def test_two_models_with_their_own_optimizers_use_parameter_names(tmp_path):
    """Each optimizer whose parameters belong to one model is saved by parameter name under that model."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    a, b = TinyNet(), TinyNet()
    acc.prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1))
    tensors, _ = split_state(AcceleratorTrainState(acc).state_dict())
    assert "model.1.fc1.weight" in tensors
    assert not AcceleratorTrainState(acc).state_dict()["optimizers_plain"]


def test_optimizer_spanning_two_models_round_trips(tmp_path):
    """An optimizer over two models is kept with its own state_dict() and restored exactly."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    import accelerate_ckpt

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                    automatic_checkpoint_naming=True))
    ckpt = accelerate_ckpt.attach(acc)
    a, b = TinyNet(), TinyNet()
    a, b, opt = acc.prepare(a, b, torch.optim.Adam([*a.parameters(), *b.parameters()], lr=0.1))
    for _ in range(2):
        acc.backward((a(torch.randn(2, 4)) + b(torch.randn(2, 4))).pow(2).mean())
        opt.step()
        opt.zero_grad()
    saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    acc.save_state(step=2)
    opt.state_dict()["state"][0]["exp_avg"].zero_()
    acc.load_state()
    assert all(torch.equal(opt.state_dict()["state"][0][k], v) for k, v in saved.items())
    ckpt.close()


def test_different_number_of_registered_objects_is_a_mismatch(tmp_path):
    """Loading into a run that registered other objects raises StateMismatchError."""
    run = make_run(tmp_path)
    run.accelerator.register_for_checkpointing(Counter())
    run.accelerator.save_state(step=1)
    run.ckpt.wait()
    run.accelerator._custom_objects.append(Counter())
    with pytest.raises(StateMismatchError, match="register_for_checkpointing"):
        run.accelerator.load_state()
    run.ckpt.close()


def test_disabled_grad_scaler_is_left_out(tmp_path):
    """A disabled GradScaler has no state to save, so the state has no scaler entry."""
    run = make_run(tmp_path, attach=False)
    run.accelerator.scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert "scaler" not in AcceleratorTrainState(run.accelerator).state_dict()


@pytest.mark.parametrize("kind", ["DistributedType.DEEPSPEED", "DistributedType.MEGATRON_LM", "DistributedType.XLA"])
def test_engines_that_save_themselves_are_refused(kind):
    """DeepSpeed, Megatron-LM and XLA setups raise ConfigError (their engines own the model state)."""
    with pytest.raises(ConfigError, match=kind.split(".")[1]):
        check_supported(SimpleNamespace(distributed_type=kind))


class _Mode(enum.Enum):
    TRAIN = "train"


class _Paths:
    """A registered object whose state holds a path, an enum member and an OrderedDict (no plain JSON values)."""

    def __init__(self) -> None:
        self.state = {"root": pathlib.Path("/data/a"), "mode": _Mode.TRAIN, "order": OrderedDict(b=1, a=2)}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict) -> None:
        self.state = dict(sd)


def test_registered_objects_with_paths_and_enums_round_trip_without_pickling(tmp_path):
    """torch_ckpt.TypedValues stores a custom object's path and enum: they come back with their exact types."""
    run = make_run(tmp_path)
    obj = _Paths()
    run.accelerator.register_for_checkpointing(obj)
    run.accelerator.save_state(step=1)
    saved, obj.state = obj.state_dict(), {}
    run.accelerator.load_state()
    assert obj.state == saved and type(obj.state["root"]) is type(saved["root"]) and obj.state["mode"] is _Mode.TRAIN
    assert type(obj.state["order"]) is OrderedDict and list(obj.state["order"]) == ["b", "a"]
    run.ckpt.close()
