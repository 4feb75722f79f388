"""Export of committed checkpoints: one torch.save file, or model weights as safetensors."""

import os
import stat
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from torch_ckpt import CheckpointManager, CheckpointNotFoundError, ConfigError, TrainState
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


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_an_export_gets_the_mode_of_any_new_file(tmp_path, to):
    """Both exports are created with 0666 minus the umask, like any file the user writes (not 0600)."""
    path, *_ = _saved(tmp_path)
    out = tmp_path / f"w.{to}"
    old = os.umask(0o027)
    try:
        (export_torch if to == "torch" else export_safetensors)(path, out)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_an_existing_output_is_refused_and_kept_unless_overwrite(tmp_path, to):
    """An existing OUT is refused with a ConfigError naming it and left untouched; overwrite=True replaces it."""
    path, *_ = _saved(tmp_path)
    export = export_torch if to == "torch" else export_safetensors
    out = tmp_path / "mine.bin"
    out.write_bytes(b"precious")
    with pytest.raises(ConfigError, match=r"mine\.bin already exists.*overwrite"):
        export(path, out)
    assert out.read_bytes() == b"precious"
    assert export(path, out, overwrite=True)["bytes"] == out.stat().st_size > len(b"precious")


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_overwrite_never_replaces_what_is_not_a_regular_file(tmp_path, kind):
    """overwrite=True onto a FIFO or a symbolic link is refused (ConfigError naming it); both stay as they were."""
    path, *_ = _saved(tmp_path)
    out, target = tmp_path / "out", tmp_path / "target.pt"
    target.write_bytes(b"keep")
    os.mkfifo(out) if kind == "fifo" else out.symlink_to(target)
    with pytest.raises(ConfigError, match="not a regular file"):
        export_torch(path, out, overwrite=True)
    assert (stat.S_ISFIFO(os.lstat(out).st_mode) if kind == "fifo" else out.is_symlink())
    assert target.read_bytes() == b"keep"


def test_an_export_that_fails_while_writing_leaves_no_output_and_no_partial(tmp_path, monkeypatch):
    """An error in the middle of writing leaves neither OUT nor a partial file beside it."""
    path, *_ = _saved(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def failing_save(obj, f):
        Path(f).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space"):
        export_torch(path, out_dir / "full.pt")
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("where", ["directory", "inside the checkpoint", "missing folder"])
def test_an_output_path_that_cannot_be_a_new_file_is_refused_naming_it(tmp_path, where):
    """OUT that is a directory, lies inside the exported checkpoint, or has no folder: ConfigError, nothing written."""
    path, *_ = _saved(tmp_path)
    out = {"directory": tmp_path, "inside the checkpoint": Path(path) / "full.pt",
           "missing folder": tmp_path / "nope" / "full.pt"}[where]
    before = sorted(os.listdir(path))
    with pytest.raises(ConfigError, match=str(out.parent if where == "missing folder" else out)):
        export_torch(path, out)
    assert sorted(os.listdir(path)) == before


def test_cli_convert_refuses_an_existing_output_and_overwrite_replaces_it(tmp_path, capsys):
    """`convert` onto an existing OUT exits 2 naming it and --overwrite; with --overwrite it replaces it."""
    path, *_ = _saved(tmp_path)
    out = tmp_path / "x.pt"
    out.write_bytes(b"keep")
    assert main(["convert", str(path), "--to", "torch", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_bytes() == b"keep"
    assert main(["convert", str(path), "--to", "torch", str(out), "--overwrite"]) == 0
    assert torch.load(out, weights_only=True)["step"] == 4


def test_cli_convert_json_names_the_chosen_checkpoint(tmp_path, capsys):
    """`convert ROOT --json` names the checkpoint it exported (the root's newest step), as inspect does."""
    import json

    path, *_ = _saved(tmp_path)
    capsys.readouterr()
    assert main(["convert", str(Path(path).parent), "--to", "torch", str(tmp_path / "x.pt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(path)


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


def _saved_models(tmp_path, names):
    """A TrainState checkpoint of a mapping of models (what the Accelerate adapter saves: {"0": model})."""
    torch.manual_seed(0)
    models = {n: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)) for n in names}
    with CheckpointManager(tmp_path / "run") as mgr:
        path = mgr.save(3, TrainState(model=models, step=3)).wait()
    return path, models


def test_safetensors_of_a_one_model_mapping_has_the_models_own_keys(tmp_path):
    """One model saved as {"0": model} (Accelerate's layout) exports '0.weight', not '0.0.weight'."""
    from safetensors.torch import load_file

    path, models = _saved_models(tmp_path, ["0"])
    result = export_safetensors(path, tmp_path / "w.safetensors")
    weights = load_file(tmp_path / "w.safetensors")
    assert set(weights) == set(models["0"].state_dict()) and result["models"] == []
    models["0"].load_state_dict(weights)


def test_safetensors_of_several_models_prefixes_keys_by_model_name(tmp_path):
    """Several models: keys are '<model name>.<key>' and the file's metadata lists the names."""
    from safetensors import safe_open

    path, models = _saved_models(tmp_path, ["0", "1"])
    assert export_safetensors(path, tmp_path / "w.safetensors")["models"] == ["0", "1"]
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        assert all(torch.equal(f.get_tensor(f"1.{k}"), v) for k, v in models["1"].state_dict().items())
    assert keys == {f"{n}.{k}" for n, m in models.items() for k in m.state_dict()} and meta["models"] == "0,1"


def test_safetensors_model_option_exports_one_model_without_prefix(tmp_path, capsys):
    """`convert --to safetensors --model 1` writes model 1 under its own keys; an unknown name exits 2."""
    from safetensors.torch import load_file

    path, models = _saved_models(tmp_path, ["0", "1"])
    assert main(["convert", str(path), "--to", "safetensors", str(tmp_path / "one.safetensors"), "--model", "1"]) == 0
    weights = load_file(tmp_path / "one.safetensors")
    assert set(weights) == set(models["1"].state_dict())
    assert all(torch.equal(weights[k], v) for k, v in models["1"].state_dict().items())
    with pytest.raises(ConfigError, match="no model named '2'"):
        export_safetensors(path, tmp_path / "two.safetensors", model="2")
    capsys.readouterr()
    assert main(["convert", str(path), "--to", "torch", str(tmp_path / "x.pt"), "--model", "1"]) == 2
    assert "--model applies to --to safetensors only" in capsys.readouterr().err


def test_safetensors_of_a_real_accelerate_checkpoint_has_the_models_own_keys(tmp_path):
    """A checkpoint written by accelerate_ckpt (checkpoint_0) exports the prepared model's own keys."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration
    from safetensors.torch import load_file

    import accelerate_ckpt

    try:
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path / "project"),
                                                                          automatic_checkpoint_naming=True))
        ckpt = accelerate_ckpt.attach(acc)
        torch.manual_seed(0)
        model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)))
        folder = acc.save_state(step=5)
        ckpt.close()
        export_safetensors(folder, tmp_path / "w.safetensors")
        weights = load_file(tmp_path / "w.safetensors")
        assert set(weights) == set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
