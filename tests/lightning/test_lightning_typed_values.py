"""Values Lightning checkpoints hold (classes, dataclasses, namedtuples, OmegaConf configs) round-trip with their
exact type and without pickling; what only pickling stores is pickled by default and never crashes a fit."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections import namedtuple

import pytest
import torch
from lightning.pytorch.utilities.parsing import AttributeDict
from lightning_helpers import TinyModule

from lightning_ckpt import AsyncDCPCheckpointIO
from lightning_ckpt._load import decode_values, encode_values
from torch_ckpt import UnsafeCheckpointError

Pair = namedtuple("Pair", "a b")

CLASS = "__lightning_ckpt_class__"  # the stored marker (checkpoints of earlier versions)
PICKLED = "__lightning_ckpt_pickled__"  # the stored marker (checkpoints of earlier versions)


@dataclasses.dataclass(frozen=True)
class Frozen:
    root: pathlib.Path
    n: int = 0

    def __post_init__(self) -> None:
        Frozen.inits += 1


Frozen.inits = 0


def _round_trip(value, mode="error"):
    """(the stored marker of ``value``, the value decoded from it)."""
    encoded = encode_values({"hyper_parameters": {"v": value}}, mode)
    stored = encoded["hyper_parameters"]["v"]
    return stored, decode_values(encoded, allow_pickle=False)["hyper_parameters"]["v"]


def test_a_class_is_stored_by_its_import_path():
    """A class value (Lightning's hparams_type) is stored by reference and found again, without pickling."""
    stored, out = _round_trip(AttributeDict)
    assert out is AttributeDict and stored == {CLASS: [AttributeDict.__module__, "AttributeDict"]}


def test_a_frozen_dataclass_comes_back_exactly_without_running_its_init():
    """A frozen dataclass is rebuilt from its fields with its exact type; __post_init__ does not run on load."""
    value = Frozen(pathlib.Path("/d"), 3)
    inits = Frozen.inits
    _, out = _round_trip(value)
    assert type(out) is Frozen and out == value and Frozen.inits == inits


def test_a_namedtuple_comes_back_with_its_type():
    """A module-level namedtuple comes back as that namedtuple (not a tuple, not pickled)."""
    _, out = _round_trip(Pair(1, (2, 3)))
    assert type(out) is Pair and out == Pair(1, (2, 3))


def test_a_class_of_a_module_not_imported_is_refused_on_load():
    """Loading never imports a module a checkpoint names: a class there is an UnsafeCheckpointError naming it."""
    encoded = {"hyper_parameters": {"v": {CLASS: ["some_module_not_imported", "Thing"]}}}
    with pytest.raises(UnsafeCheckpointError, match="some_module_not_imported"):
        decode_values(encoded, allow_pickle=False)
    assert "some_module_not_imported" not in sys.modules


def test_a_hparams_type_that_is_not_a_mapping_is_refused():
    """Lightning calls hparams_type with the hyper-parameters: a checkpoint naming another class is refused."""
    with pytest.raises(UnsafeCheckpointError, match="hparams_type"):
        decode_values({"hparams_type": {CLASS: ["pathlib", "Path"]}}, allow_pickle=False)


def test_values_without_a_typed_encoding_are_pickled_by_default():
    """The default stores an nn.Module hyper-parameter pickled (no crash); loading it needs weights_only=False."""
    io = AsyncDCPCheckpointIO()
    encoded = encode_values({"hyper_parameters": {"loss": torch.nn.CosineEmbeddingLoss()}}, io.unsafe_values)
    assert PICKLED in encoded["hyper_parameters"]["loss"]
    with pytest.raises(UnsafeCheckpointError, match=r"hyper_parameters\.loss"):
        decode_values(dict(encoded), allow_pickle=False)


class LossHyperParameter(TinyModule):
    """TinyModule with an nn.Module among its hyper-parameters (only pickling stores it)."""

    def __init__(self, loss: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_a_fit_with_an_unpicklable_free_hyper_parameter_saves_and_loads(make_trainer, tmp_path):
    """A module whose hparams hold an nn.Module trains, saves and loads with weights_only=False (default IO)."""
    trainer = make_trainer(max_steps=2, plugins=[AsyncDCPCheckpointIO()])
    trainer.fit(LossHyperParameter(torch.nn.CosineEmbeddingLoss(margin=0.5)))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    model = LossHyperParameter.load_from_checkpoint(tmp_path / "m.ckpt", weights_only=False)
    assert isinstance(model.hparams.loss, torch.nn.CosineEmbeddingLoss) and model.hparams.loss.margin == 0.5


@pytest.mark.parametrize("value", [torch.bfloat16, torch.device("cpu")], ids=["dtype", "device"])
def test_torch_dtypes_and_devices_round_trip_without_pickling(value):
    """A torch dtype or device hyper-parameter comes back equal, without pickling (strict mode stores it)."""
    stored, out = _round_trip(value)
    assert PICKLED not in stored and out == value and type(out) is type(value)
