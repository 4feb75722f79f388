"""Export of committed checkpoints: one torch.save file, or model weights as safetensors."""

import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointManager, CheckpointNotFoundError, TrainState
from torch_ckpt.tools.cli import main
from torch_ckpt.tools.convert import export_safetensors, export_torch


def _saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path / "run") as mgr:
        path = mgr.save(4, TrainState(model=model, optimizer=opt, step=4, extras={"tokens": 7})).wait()
    return path, model, opt


def test_torch_export_loads_with_weights_only(tmp_path):
    """The .pt export holds the full state and loads with torch.load(weights_only=True)."""
    path, model, opt = _saved(tmp_path)
    out = tmp_path / "full.pt"
    assert export_torch(path, out)["step"] == 4
    full = torch.load(out, weights_only=True)
    assert full["step"] == 4 and full["extras"] == {"tokens": 7}
    for k, v in model.state_dict().items():
        assert torch.equal(full["model"][k], v)
    assert "rng" in full and isinstance(full["rng"]["torch_cpu"], torch.Tensor)


def test_safetensors_export_has_model_weights_only(tmp_path):
    """The safetensors export holds exactly the model's weights under their usual names."""
    from safetensors.torch import load_file

    path, model, _ = _saved(tmp_path)
    export_safetensors(path, tmp_path / "w.safetensors")
    weights = load_file(tmp_path / "w.safetensors")
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_cli_convert_and_missing_path(tmp_path, capsys):
    """torch-ckpt convert writes the file; a missing checkpoint exits non-zero with one clear line."""
    path, *_ = _saved(tmp_path)
    assert main(["convert", path, "--to", "torch", str(tmp_path / "x.pt")]) == 0
    assert (tmp_path / "x.pt").exists()
    assert main(["convert", str(tmp_path / "nope"), "--to", "torch", str(tmp_path / "y.pt")]) != 0
    assert "nope" in capsys.readouterr().err


def _fsdp_save(rank, world, root):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with CheckpointManager(root) as mgr:
        mgr.save(1, TrainState(model=model)).wait()
    if rank == 0:
        torch.save(full, f"{root}/ref.pt")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_export_of_a_sharded_checkpoint_has_full_tensors(tmp_path):
    """A checkpoint written by 2 FSDP2 ranks exports full, unsharded tensors and every rank's RNG."""
    run_distributed(_fsdp_save, 2, str(tmp_path))
    export_torch(tmp_path / "step_000000001", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert all(torch.equal(full["model"][k], v) for k, v in ref.items())
    assert len(full["per_rank"]) == 2


def test_export_of_a_missing_checkpoint_is_not_found(tmp_path):
    """Exporting a path that is not a checkpoint raises CheckpointNotFoundError."""
    with pytest.raises(CheckpointNotFoundError):
        export_torch(tmp_path, tmp_path / "x.pt")
