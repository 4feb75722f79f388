"""OmegaConf (Hydra) hyper-parameters come back as the same DictConfig/ListConfig, without pickling."""

from __future__ import annotations

import dataclasses

import pytest

omegaconf = pytest.importorskip("omegaconf")

from lightning_helpers import TinyModule  # noqa: E402
from omegaconf import DictConfig, ListConfig, OmegaConf  # noqa: E402

from lightning_ckpt import AsyncDCPCheckpointIO  # noqa: E402
from lightning_ckpt._load import decode_values, encode_values  # noqa: E402
from torch_ckpt import ConfigError  # noqa: E402

OMEGACONF = "__lightning_ckpt_omegaconf__"  # the stored marker (checkpoints of earlier versions)
PICKLED = "__lightning_ckpt_pickled__"  # the stored marker (checkpoints of earlier versions)


class ConfModule(TinyModule):
    """TinyModule whose hyper-parameters are one OmegaConf DictConfig (as Hydra passes them)."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)


def test_dictconfig_hparams_come_back_as_a_dictconfig(make_trainer, tmp_path):
    """load_from_checkpoint gives hparams of type DictConfig with attribute access and the interpolation kept."""
    cfg = OmegaConf.create({"lr": 0.1, "sigterm_at_step": None, "opt": {"name": "sgd", "lr": "${lr}"},
                            "layers": [4, 2]})
    trainer = make_trainer(max_steps=2, plugins=[AsyncDCPCheckpointIO(unsafe_values="error")])
    trainer.fit(ConfModule(cfg))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    model = ConfModule.load_from_checkpoint(tmp_path / "m.ckpt")
    assert isinstance(model.hparams, DictConfig) and model.hparams.opt.lr == 0.1
    assert OmegaConf.to_container(model.hparams.opt)["lr"] == "${lr}" and isinstance(model.hparams.layers, ListConfig)


def test_a_listconfig_round_trips_with_its_type_and_flags():
    """A read-only ListConfig is stored under the OmegaConf marker and comes back read-only, equal."""
    cfg = OmegaConf.create([1, {"a": "x"}])
    OmegaConf.set_readonly(cfg, True)
    encoded = encode_values({"hyper_parameters": {"v": cfg}}, "error")
    assert OMEGACONF in encoded["hyper_parameters"]["v"]
    out = decode_values(encoded, allow_pickle=False)["hyper_parameters"]["v"]
    assert type(out) is ListConfig and out == cfg and OmegaConf.is_readonly(out)


@dataclasses.dataclass
class Schema:
    lr: float = 0.1


def test_a_structured_config_is_pickled_by_default_and_refused_in_strict_mode():
    """A structured config (dataclass schema) has no typed encoding: pickled by default, ConfigError with 'error'."""
    cfg = OmegaConf.structured(Schema)
    assert PICKLED in encode_values({"hp": cfg}, "pickle")["hp"]
    with pytest.raises(ConfigError, match="'hp'"):
        encode_values({"hp": cfg}, "error")
