"""lightning_ckpt._load: reading a checkpoint directory back as Lightning's dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_helpers import TinyModule, lightning_dict

from lightning_ckpt import AsyncDCPCheckpointIO, MTBFCheckpoint
from lightning_ckpt._load import load_checkpoint_dir
from tests._dist import run_distributed
from torch_ckpt import CheckpointNotFoundError, StateMismatchError


def test_a_directory_without_a_manifest_is_not_a_checkpoint(tmp_path):
    """A directory that was never committed (no manifest.json) raises CheckpointNotFoundError."""
    (tmp_path / "partial.ckpt").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="manifest"):
        load_checkpoint_dir([tmp_path / "partial.ckpt"], manager=None, verify=True, allow_pickle=False)


def test_map_location_moves_every_tensor(tmp_path):
    """map_location="meta" puts the model and optimizer tensors on the meta device."""
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(), tmp_path / "a.ckpt")
    io.teardown()
    loaded = load_checkpoint_dir([tmp_path / "a.ckpt"], manager=None, verify=True, allow_pickle=False,
                                 map_location="meta")
    assert loaded["state_dict"]["layer.weight"].is_meta
    assert loaded["optimizer_states"][0]["state"][0]["momentum_buffer"].is_meta


def _per_rank_body(rank: int, world: int, root: str) -> None:
    io = AsyncDCPCheckpointIO()
    io.start_fit()  # what attach() does: every rank calls the plugin
    ckpt = lightning_dict(7)
    ckpt["callbacks"] = {"MTBFCheckpoint": {"rng": {"torch_cpu": torch.full((3,), rank, dtype=torch.uint8)}}}
    ckpt["loops"]["fit_loop"]["state_dict"] = {"combined_loader": [{"yielded": 10 + rank}]}
    path = Path(root) / "step.ckpt"
    io.save_checkpoint(ckpt, path)
    io.wait()
    loaded = io.load_checkpoint(path)
    assert loaded["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["yielded"] == 10 + rank
    assert loaded["callbacks"]["MTBFCheckpoint"]["rng"]["torch_cpu"].tolist() == [rank] * 3
    io.teardown()


@pytest.mark.slow
def test_each_rank_loads_its_own_loop_and_callback_state(tmp_path):
    """With two ranks, loop progress and callback states (RNG) are stored and loaded per rank."""
    run_distributed(_per_rank_body, 2, str(tmp_path))


def _fit_three_steps(make_trainer, root) -> None:
    make_trainer(max_steps=3, plugins=[AsyncDCPCheckpointIO()],
                 callbacks=[MTBFCheckpoint(root, mtbf_seconds=None, save_every_n_steps=3)]).fit(TinyModule())


def test_a_dtype_difference_is_refused_before_lightning_loads_anything(make_trainer, tmp_path):
    """Resuming a float32 checkpoint into a float64 module raises StateMismatchError naming key and dtypes; no write."""
    _fit_three_steps(make_trainer, tmp_path / "ckpt")
    module = TinyModule().double()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(max_steps=6, plugins=[AsyncDCPCheckpointIO()],
                           callbacks=[MTBFCheckpoint(tmp_path / "ckpt2", mtbf_seconds=None)])
    expected = r"state_dict.layer.weight: checkpoint torch.float32, live torch.float64"
    with pytest.raises(StateMismatchError, match=expected):
        trainer.fit(module, ckpt_path=str(tmp_path / "ckpt" / "step_000000003"))
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


def test_allow_cast_lets_lightning_cast_the_checkpoint(make_trainer, tmp_path):
    """With AsyncDCPCheckpointIO(allow_cast=True) the float32 checkpoint loads into a float64 module."""
    _fit_three_steps(make_trainer, tmp_path / "ckpt")
    saved = load_checkpoint_dir([tmp_path / "ckpt" / "step_000000003"], manager=None, verify=True, allow_pickle=False)
    module = TinyModule().double()
    trainer = make_trainer(max_steps=3, plugins=[AsyncDCPCheckpointIO(allow_cast=True)],
                           callbacks=[MTBFCheckpoint(tmp_path / "ckpt2", mtbf_seconds=None)])
    trainer.fit(module, ckpt_path=str(tmp_path / "ckpt" / "step_000000003"))
    assert module.layer.weight.dtype == torch.float64
    assert torch.equal(module.layer.weight, saved["state_dict"]["layer.weight"].double())


def test_load_from_checkpoint_builds_the_module_from_a_directory(make_trainer, tmp_path):
    """lightning_ckpt.load_from_checkpoint(Model, dir) rebuilds the module with its hyper-parameters and weights."""
    from lightning_ckpt import load_from_checkpoint

    module = TinyModule(lr=0.25)
    make_trainer(max_steps=2, plugins=[AsyncDCPCheckpointIO()],
                 callbacks=[MTBFCheckpoint(tmp_path / "ckpt", mtbf_seconds=None)]).fit(module)
    loaded = load_from_checkpoint(TinyModule, tmp_path / "ckpt" / "step_000000002")
    assert loaded.hparams.lr == 0.25 and torch.equal(loaded.layer.weight, module.layer.weight)


def test_load_from_checkpoint_of_a_missing_path_names_it(tmp_path):
    """A path that does not exist raises CheckpointNotFoundError naming it."""
    from lightning_ckpt import load_from_checkpoint

    with pytest.raises(CheckpointNotFoundError, match="nope"):
        load_from_checkpoint(TinyModule, tmp_path / "nope")


class _Wider(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)


def test_a_model_with_other_keys_is_refused_before_lightning_loads_anything(make_trainer, tmp_path):
    """Resuming into a module with an extra layer raises StateMismatchError naming the missing keys; no write."""
    _fit_three_steps(make_trainer, tmp_path / "ckpt")
    module = _Wider()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(max_steps=6, plugins=[AsyncDCPCheckpointIO()],
                           callbacks=[MTBFCheckpoint(tmp_path / "ckpt2", mtbf_seconds=None)])
    with pytest.raises(StateMismatchError, match=r"Missing from checkpoint: \['state_dict.extra.bias'"):
        trainer.fit(module, ckpt_path=str(tmp_path / "ckpt" / "step_000000003"))
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


def test_a_dtype_difference_is_refused_when_attached_by_hand(make_trainer, tmp_path):
    """With plugin.attach(trainer) and no MTBFCheckpoint (no save yet), a dtype difference is refused too."""
    _fit_three_steps(make_trainer, tmp_path / "ckpt")
    io = AsyncDCPCheckpointIO()
    io.attach(trainer := make_trainer(max_steps=6, plugins=[io], enable_checkpointing=False))
    with pytest.raises(StateMismatchError, match="checkpoint torch.float32, live torch.float64"):
        trainer.fit(TinyModule().double(), ckpt_path=str(tmp_path / "ckpt" / "step_000000003"))


def test_lightnings_own_load_from_checkpoint_reads_a_directory(make_trainer, tmp_path):
    """Lightning's Model.load_from_checkpoint(dir) rebuilds the module with its hyper-parameters and weights."""
    module = TinyModule(lr=0.25)
    _fit_three_steps_of(make_trainer, tmp_path / "ckpt", module)
    loaded = TinyModule.load_from_checkpoint(tmp_path / "ckpt" / "step_000000003")
    assert loaded.hparams.lr == 0.25 and torch.equal(loaded.layer.weight, module.layer.weight)


def _fit_three_steps_of(make_trainer, root, module) -> None:
    make_trainer(max_steps=3, plugins=[AsyncDCPCheckpointIO()],
                 callbacks=[MTBFCheckpoint(root, mtbf_seconds=None, save_every_n_steps=3)]).fit(module)


def test_a_trainer_without_the_plugin_resumes_from_a_directory(make_trainer, tmp_path):
    """trainer.fit(ckpt_path=dir) with Lightning's own CheckpointIO resumes at the saved step and state."""
    _fit_three_steps(make_trainer, tmp_path / "ckpt")
    module = TinyModule()
    trainer = make_trainer(max_steps=5, enable_checkpointing=False)
    trainer.fit(module, ckpt_path=str(tmp_path / "ckpt" / "step_000000003"))
    assert trainer.global_step == 5 and len(module.draws) == 2  # resumed at step 3


def test_lightnings_loader_keeps_weights_only_semantics_on_a_directory(tmp_path):
    """pl_load(dir) refuses values stored pickled unless weights_only=False, like the plugin's load_checkpoint."""
    from fractions import Fraction

    from lightning.fabric.utilities.cloud_io import _load as pl_load

    from torch_ckpt import UnsafeCheckpointError

    point = Fraction(1, 3)  # needs pickling
    io = AsyncDCPCheckpointIO(unsafe_values="pickle")
    io.save_checkpoint(lightning_dict(hyper_parameters={"p": point}), tmp_path / "a.ckpt")
    io.teardown()
    with pytest.raises(UnsafeCheckpointError, match="hyper_parameters.p"):
        pl_load(tmp_path / "a.ckpt")
    assert pl_load(tmp_path / "a.ckpt", weights_only=False)["hyper_parameters"]["p"] == point
    assert pl_load(tmp_path / "a.ckpt", weights_only=False).keys() == io.load_checkpoint(
        tmp_path / "a.ckpt", weights_only=False).keys()


def test_another_directory_still_raises_saying_what_to_do(tmp_path):
    """Model.load_from_checkpoint on a directory without a manifest raises IsADirectoryError naming it and the fixes."""
    (tmp_path / "not_ours").mkdir()
    with pytest.raises(IsADirectoryError, match=r"not_ours.*lightning_ckpt.load_from_checkpoint.*torch-ckpt convert"):
        TinyModule.load_from_checkpoint(tmp_path / "not_ours")


def test_lightnings_load_from_checkpoint_reads_a_file_url_of_a_directory(make_trainer, tmp_path):
    """Model.load_from_checkpoint('file://' + dir) loads a torch-ckpt directory as the plain path does."""
    module = TinyModule(lr=0.25)
    _fit_three_steps_of(make_trainer, tmp_path / "ckpt", module)
    loaded = TinyModule.load_from_checkpoint(f"file://{tmp_path / 'ckpt' / 'step_000000003'}")
    assert torch.equal(loaded.layer.weight, module.layer.weight)
