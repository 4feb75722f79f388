"""Interop with plain DCP: stock ``dcp.load`` on our checkpoints (``prepare_dcp_load``), folders written by
plain ``dcp.save`` labelled by ``ls``/``verify``/``inspect``/``restore`` and adopted by ``torch-ckpt import``,
and ``convert`` of a run root. Real files, real ``dcp.save`` and ``dcp.load``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from torch_ckpt import CheckpointManager, CheckpointNotFoundError, ConfigError, TrainState
from torch_ckpt.tools import import_dcp, load_full_state, prepare_dcp_load
from torch_ckpt.tools.cli import main


def _trained(lr: float = 0.01, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a: torch.nn.Module, oa: torch.optim.Optimizer, b: torch.nn.Module, ob: torch.optim.Optimizer) -> None:
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key in sa["state"]:
        for name, v in sa["state"][key].items():
            assert torch.equal(v, sb["state"][key][name]), (key, name)


@pytest.fixture
def ours(tmp_path):
    model, opt = _trained()
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(5, TrainState(model=model, optimizer=opt))
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        mgr.save(9, TrainState(model=model, optimizer=opt))
    return tmp_path / "run", model, opt


def test_stock_dcp_load_restores_model_and_fresh_optimizer_after_prepare(ours):
    root, model, opt = ours
    ckpt = str(root / "step_000000009")
    fresh, fopt = _trained(lr=0.5, seed=1)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # no step taken: no moments yet
    model_sd, optim_sd = get_state_dict(fresh, fopt)
    with pytest.raises(BaseException, match="Missing key"):  # the standard recipe alone (DCP: BaseException)
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=ckpt)
    sd = {"model": model_sd, "optimizer": optim_sd}
    tensors = prepare_dcp_load(ckpt, sd)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values()) and "model.0.weight" in tensors
    dcp.load(tensors, checkpoint_id=ckpt)
    set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    _same(model, opt, fresh, fopt)
    assert fopt.param_groups[0]["lr"] == 0.01


def test_prepare_dcp_load_names_a_missing_top_level_key(ours):
    with pytest.raises(ConfigError, match="holds no 'scheduler'"):
        prepare_dcp_load(ours[0] / "step_000000009", {"scheduler": {}})


@pytest.fixture
def plain(tmp_path):
    """A folder written by plain dcp.save with the standard model+optimizer recipe and plain values."""
    model, opt = _trained()
    model_sd, optim_sd = get_state_dict(model, opt)
    src = tmp_path / "titan" / "step-7"
    dcp.save({"model": model_sd, "optimizer": optim_sd, "step": 7, "extra": {"tokens": [1, 2], "name": "x"}},
             checkpoint_id=str(src))
    return src, model, opt


def test_plain_dcp_folder_is_labelled_and_restore_refuses_to_start_from_scratch(plain, tmp_path, capsys):
    src, _, _ = plain
    root = tmp_path / "titan"
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "plain-dcp" in out and "plain DCP checkpoint (not written by torch-ckpt): torch-ckpt import" in out
    assert main(["ls", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["counts"]["plain-dcp"] == 1 and listed["steps"][0]["status"] == "plain-dcp"
    for argv in (["verify", str(src)], ["inspect", str(src)], ["inspect", str(root)], ["verify", str(root)]):
        code = main(argv)
        text = "".join(capsys.readouterr())
        assert code == 1 and "torch-ckpt import" in text and "step-7" in text, (argv, text)
    model, opt = _trained(seed=3)
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointNotFoundError, match="torch-ckpt import"):
        mgr.restore(TrainState(model=model, optimizer=opt))


@pytest.mark.parametrize("link", [False, True])
def test_import_makes_a_committed_step_that_restores_verifies_inspects_and_converts(plain, tmp_path, capsys, link):
    src, model, opt = plain
    root = tmp_path / "run"
    argv = ["import", str(src), str(root), "--step", "7"] + (["--link"] * link)
    assert main(argv) == 0, capsys.readouterr()
    step_dir = root / "step_000000007"
    data = next(step_dir.glob("*.distcp"))
    assert (os.stat(data).st_ino == os.stat(src / data.name).st_ino) is link
    capsys.readouterr()
    assert main(["verify", str(root)]) == 0 and "all OK" in capsys.readouterr().out
    assert main(["inspect", str(root)]) == 0 and "model" in capsys.readouterr().out
    state, manifest = load_full_state(step_dir)
    assert manifest.step == 7 and state["step"] == 7 and state["extra"] == {"tokens": [1, 2], "name": "x"}
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.01
    # restore() through the manager, into the same structure dcp.save was given
    fresh, fopt = _trained(lr=0.5, seed=2)
    model_sd, optim_sd = get_state_dict(fresh, fopt)
    live = {"model": model_sd, "optimizer": optim_sd, "step": 0, "extra": {"tokens": [], "name": ""}}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(live) == 7
    set_state_dict(fresh, fopt, model_state_dict=live["model"], optim_state_dict=live["optimizer"])
    _same(model, opt, fresh, fopt)
    assert live["step"] == 7 and live["extra"]["name"] == "x"
    # convert takes the root
    out = tmp_path / "out.pt"
    assert main(["convert", str(root), "--to", "torch", str(out)]) == 0
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == {"model", "optimizer", "step", "extra"} and torch.equal(loaded["model"]["0.weight"],
                                                                                 model.state_dict()["0.weight"])


def test_import_refuses_a_step_beyond_2_63_and_a_root_inside_a_checkpoint(plain, ours, tmp_path):
    """import of step 2**63 (API and CLI) and into a root inside a committed checkpoint is refused; nothing written."""
    (plain, *_), (root, *_) = plain, ours
    with pytest.raises(ConfigError, match="2\\*\\*63 - 1"):
        import_dcp(plain, tmp_path / "new", 2**63)
    assert main(["import", str(plain), str(tmp_path / "new"), "--step", str(10**23)]) == 2
    inside = root / "step_000000009" / "nested"
    with pytest.raises(ConfigError, match="inside it"):
        import_dcp(plain, inside, 3)
    assert not (tmp_path / "new").exists() and not inside.exists()


def test_import_refuses_an_existing_step_and_a_folder_that_is_not_plain_dcp(plain, ours, tmp_path):
    src, _, _ = plain
    root = ours[0]
    with pytest.raises(ConfigError, match="already exists"):
        import_dcp(src, root, 9)
    with pytest.raises(CheckpointNotFoundError, match="not a plain DCP checkpoint"):
        import_dcp(root / "step_000000009", tmp_path / "other", 1)
    assert main(["import", str(tmp_path / "missing"), str(root), "--step", "1"]) == 2
    assert not (root / "step_000000001").exists() and not [p for p in os.listdir(root) if p.startswith(".")]


def test_convert_takes_a_run_root_newest_step_or_step(ours, tmp_path, capsys):
    root, model, _ = ours
    out = tmp_path / "new.pt"
    assert main(["convert", str(root), "--to", "torch", str(out)]) == 0
    assert "step 9 ->" in capsys.readouterr().out
    sd = torch.load(out, weights_only=True)
    assert {"model", "optimizer", "step", "rng"} <= set(sd)
    model.load_state_dict(sd["model"])  # the documented load-back
    assert main(["convert", str(root), "--step", "5", "--to", "torch", str(out), "--overwrite"]) == 0
    assert "step 5 ->" in capsys.readouterr().out
    # a step the root lacks: a bad argument (exit 2)
    assert main(["convert", str(root), "--step", "6", "--to", "torch", str(out), "--overwrite"]) == 2
    assert main(["convert", str(root / "step_000000005"), "--step", "5", "--to", "torch", str(out),
                 "--overwrite"]) == 2
    shutil.rmtree(root / "step_000000009")


def test_ls_of_a_plain_dcp_folder_itself_names_the_import_command(plain, capsys):
    """`ls` of the plain DCP folder itself (not its parent) says what it is and how to import it."""
    src, _, _ = plain
    assert main(["ls", str(src)]) == 1
    err = capsys.readouterr().err
    assert "plain DCP checkpoint" in err and f"torch-ckpt import {src} ROOT --step N" in err


def test_import_into_the_plain_folder_itself_is_refused(plain):
    """A run root equal to (or inside) the plain DCP folder is refused: the advice names a separate ROOT."""
    src, _, _ = plain
    with pytest.raises(ConfigError, match="separate run root"):
        import_dcp(src, src, step=1)
    with pytest.raises(ConfigError, match="separate run root"):
        import_dcp(src, src / "run", step=1)


def test_restore_on_the_plain_folder_itself_advises_a_separate_root(plain):
    """A manager rooted at the plain DCP folder itself suggests importing into a separate ROOT."""
    src, model, opt = plain
    with pytest.raises(CheckpointNotFoundError, match=r"torch-ckpt import \S+ ROOT --step N"):
        CheckpointManager(src).restore(TrainState(model=model, optimizer=opt))
