"""``ls`` / ``verify`` / ``inspect`` on roots whose checkpoints are not named ``step_N``.

An Accelerate root (``checkpoint_N``, PatternNaming), a Lightning ModelCheckpoint dirpath
(``epoch=0-step=N.ckpt`` directories and a ``last.ckpt`` symlink) and a mixed root: a root's
checkpoints are its subdirectories holding a torch-ckpt ``manifest.json``, the step is the
manifest's. Saves go through ``CheckpointManager`` with a :class:`PatternNaming`; commands run
in-process through ``torch_ckpt.tools.cli.main``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointManager, PatternNaming, TrainState
from torch_ckpt.tools.cli import main
from torch_ckpt.tools.listing import find_checkpoint, list_root


def _save(root: Path, pattern: str, steps: tuple[int, ...]) -> None:
    """Save a small model at ``steps`` under ``root`` with names from ``pattern``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with CheckpointManager(root, naming=PatternNaming(pattern), async_save=False, keep_last=None) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, TrainState(model=model, step=step))


def run_json(capsys, *argv, code: int = 0):
    """Run a command with --json in-process, check its exit code and parse its output."""
    got = main([str(a) for a in argv] + ["--json"])
    out = capsys.readouterr()
    assert got == code, out.err
    return json.loads(out.out)


@pytest.fixture
def accelerate_root(tmp_path) -> Path:
    """An Accelerate-style root: ``checkpoint_5`` and ``checkpoint_10`` (PatternNaming ``checkpoint_{step}``)."""
    root = tmp_path / "project" / "checkpoints"
    _save(root, "checkpoint_{step}", (5, 10))
    return root


@pytest.fixture
def lightning_root(tmp_path) -> Path:
    """A Lightning-style dirpath: ``epoch=0-step=10.ckpt``, ``epoch=1-step=20.ckpt`` and ``last.ckpt`` -> step 20."""
    root = tmp_path / "lightning"
    _save(root, "epoch=0-step={step}.ckpt", (10,))
    _save(root, "epoch=1-step={step}.ckpt", (20,))
    os.symlink("epoch=1-step=20.ckpt", root / "last.ckpt")
    (root / "lightning_logs").mkdir()
    return root


def test_ls_accelerate_root_lists_checkpoint_folders(accelerate_root, capsys):
    """`ls` of an Accelerate root lists checkpoint_5 and checkpoint_10 committed, steps from their manifests."""
    out = run_json(capsys, "ls", accelerate_root)
    assert [(r["step"], r["name"], r["status"]) for r in out["steps"]] == \
        [(5, "checkpoint_5", "committed"), (10, "checkpoint_10", "committed")]
    assert out["counts"] == {"committed": 2, "partial": 0, "corrupt": 0, "plain-dcp": 0}


def test_verify_accelerate_root_verifies_every_checkpoint(accelerate_root, capsys):
    """`verify` of an Accelerate root checks both checkpoints and passes."""
    out = run_json(capsys, "verify", accelerate_root)
    assert out["ok"] and [c["name"] for c in out["checkpoints"]] == ["checkpoint_5", "checkpoint_10"]


def test_inspect_accelerate_root_takes_the_newest_or_the_step_given(accelerate_root, capsys):
    """`inspect ROOT` inspects checkpoint_10; `--step 5` finds checkpoint_5 by its manifest."""
    assert run_json(capsys, "inspect", accelerate_root)["checkpoint"] == str(accelerate_root / "checkpoint_10")
    out = run_json(capsys, "inspect", accelerate_root, "--step", "5")
    assert out["checkpoint"] == str(accelerate_root / "checkpoint_5") and out["step"] == 5 and out["note"] is None


def test_ls_lightning_root_shows_last_ckpt_as_a_link_not_counted(lightning_root, capsys):
    """`last.ckpt` (a symlink) is listed as a link to epoch=1-step=20.ckpt and not counted; logs are not listed."""
    out = run_json(capsys, "ls", lightning_root)
    rows = [(r["step"], r["name"], r["link_to"], r["status"]) for r in out["steps"]]
    assert rows == [(10, "epoch=0-step=10.ckpt", None, "committed"), (20, "epoch=1-step=20.ckpt", None, "committed"),
                    (20, "last.ckpt", "epoch=1-step=20.ckpt", "committed")]
    assert out["counts"]["committed"] == 2 and out["steps"][2]["alias_of"] == "epoch=1-step=20.ckpt"


def test_ls_lightning_root_text_names_the_link(lightning_root, capsys):
    """The text listing shows `last.ckpt -> epoch=1-step=20.ckpt` and counts 2 committed."""
    assert main(["ls", str(lightning_root)]) == 0
    out = capsys.readouterr().out
    assert "2 committed, 0 partial, 0 corrupt" in out and "last.ckpt -> epoch=1-step=20.ckpt" in out


def test_verify_lightning_root_skips_the_link(lightning_root, capsys):
    """`verify` checks the two checkpoints once each and lists last.ckpt as a skipped link."""
    out = run_json(capsys, "verify", lightning_root)
    assert out["ok"] and [c["name"] for c in out["checkpoints"]] == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt"]
    assert [(s["name"], s["link_to"]) for s in out["skipped"]] == [("last.ckpt", "epoch=1-step=20.ckpt")]


def test_inspect_lightning_root_and_its_link(lightning_root, capsys):
    """`inspect ROOT --step 10` finds epoch=0-step=10.ckpt; `inspect ROOT/last.ckpt` reads step 20 through the link."""
    out = run_json(capsys, "inspect", lightning_root, "--step", "10")
    assert out["checkpoint"] == str(lightning_root / "epoch=0-step=10.ckpt")
    assert run_json(capsys, "inspect", lightning_root / "last.ckpt")["step"] == 20


def test_inspect_step_held_twice_takes_the_newest_and_says_so(lightning_root, capsys):
    """Two real checkpoints of step 20 (a last.ckpt copy): --step 20 takes the one modified last and notes both."""
    (lightning_root / "last.ckpt").unlink()
    shutil.copytree(lightning_root / "epoch=1-step=20.ckpt", lightning_root / "last.ckpt")
    old = lightning_root / "epoch=1-step=20.ckpt"
    os.utime(old, (1_000_000, 1_000_000))
    out = run_json(capsys, "inspect", lightning_root, "--step", "20")
    assert out["checkpoint"] == str(lightning_root / "last.ckpt")
    assert "2 checkpoints" in out["note"] and "epoch=1-step=20.ckpt" in out["note"]
    listing = run_json(capsys, "ls", lightning_root)
    assert listing["counts"]["committed"] == 3


def test_mixed_root_lists_every_naming_and_partial_temporaries(tmp_path, capsys):
    """step_N, checkpoint_N, a `.NAME.tmp.<id>` temporary, a foreign manifest and a plain folder: only ours listed."""
    root = tmp_path / "mixed"
    _save(root, "step_{step:09d}", (1,))
    _save(root, "checkpoint_{step}", (2,))
    tmp = root / ".checkpoint_3.tmp.0123456789abcdef"
    shutil.copytree(root / "checkpoint_2", tmp)
    (root / "other_tool").mkdir()
    (root / "other_tool" / "manifest.json").write_text('{"format": "something-else", "step": 9}')
    (root / "logs").mkdir()
    out = run_json(capsys, "ls", root)
    rows = {r["name"]: (r["step"], r["status"]) for r in out["steps"]}
    assert rows == {"step_000000001": (1, "committed"), "checkpoint_2": (2, "committed"),
                    tmp.name: (None, "partial")}
    assert out["counts"] == {"committed": 2, "partial": 1, "corrupt": 0, "plain-dcp": 0}
    verified = run_json(capsys, "verify", root)
    assert verified["ok"] and [s["name"] for s in verified["skipped"]] == [tmp.name]


def test_corrupt_manifest_under_another_name_is_listed_corrupt(accelerate_root, capsys):
    """A checkpoint_N whose manifest.json is truncated is listed corrupt (exit 1), not hidden."""
    path = accelerate_root / "checkpoint_10" / "manifest.json"
    path.write_bytes(path.read_bytes()[:40])
    out = run_json(capsys, "ls", accelerate_root, code=1)
    assert [(r["name"], r["status"]) for r in out["steps"]] == \
        [("checkpoint_5", "committed"), ("checkpoint_10", "corrupt")]
    assert find_checkpoint(accelerate_root)[0].name == "checkpoint_5"


def test_ls_bytes_match_verify_and_inspect(accelerate_root, capsys):
    """`ls` bytes/files equal verify's and inspect's (files the manifest lists); disk_bytes adds the manifest."""
    row = list_root(accelerate_root)["steps"][-1]
    checked = run_json(capsys, "verify", accelerate_root / "checkpoint_10")["checkpoints"][0]
    inspected = run_json(capsys, "inspect", accelerate_root / "checkpoint_10")
    assert row["bytes"] == checked["bytes"] == inspected["file_bytes"]
    assert row["files"] == checked["files"] == inspected["files"]
    folder = accelerate_root / "checkpoint_10"
    on_disk = sum(f.stat().st_size for f in folder.iterdir())
    assert row["disk_bytes"] == on_disk == row["bytes"] + (folder / "manifest.json").stat().st_size


def _memory_copy(tmp_path: Path) -> Path:
    """A committed memory step: one node's copy of a node-local checkpoint (node 0 of 1)."""
    model = torch.nn.Linear(4, 2)
    state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with CheckpointManager(tmp_path / "disk", memory_root=str(tmp_path / "mem"), async_save=False) as mgr:
        mgr.save(1, state, tier="memory")
    return tmp_path / "mem" / "step_000000001"


def test_ls_counts_a_hard_linked_file_once_in_the_stored_total(tmp_path):
    """Incremental steps share a linked data file: ls's stored total counts it once, below the sum of the sizes."""
    frozen, trained = torch.randn(256, 256), torch.randn(4, 4)
    with CheckpointManager(tmp_path, thread_count=2) as mgr:
        for step in (1, 2, 3):
            trained.add_(1.0)
            mgr.save(step, TrainState(extras={"frozen": frozen, "trained": trained}, rng=False)).wait()
    listing = list_root(tmp_path)
    linked = sum(r["linked_bytes"] for r in listing["steps"])
    assert linked > 0
    files = [p for d in tmp_path.glob("step_*") for p in d.iterdir()]
    assert listing["disk_bytes"] == sum({(p.stat().st_ino): p.stat().st_size for p in files}.values())
    assert listing["disk_bytes"] <= sum(r["disk_bytes"] for r in listing["steps"]) - linked


def test_the_copy_of_a_one_node_run_is_listed_without_a_partial_note(tmp_path):
    """A memory step of a run of one node holds the whole checkpoint: ls, verify and inspect call it no part."""
    from torch_ckpt.tools.listing import inspect_checkpoint, verify_checkpoint

    copy = _memory_copy(tmp_path)
    row = list_root(copy.parent, verify=True)["steps"][0]
    assert row["status"] == "committed" and row.get("reason") is None
    assert "partial" not in verify_checkpoint(copy) and inspect_checkpoint(copy)["note"] is None


def test_verify_checks_the_structure_of_a_node_copy(tmp_path):
    """verify reads a node copy's metadata view and rank trees: it counts the tensors and finds a forged tree."""
    from _format_fixtures import rewrite

    from torch_ckpt.tools.listing import verify_checkpoint

    copy = _memory_copy(tmp_path)
    assert verify_checkpoint(copy)["ok"] and verify_checkpoint(copy)["tensors"] == 2
    doc = json.loads((copy / "rank_00000.json").read_text())
    doc["tree"]["model"]["__odict__"]["weight"] = {"__tensor__": "model.nowhere"}
    rewrite(copy, "rank_00000.json", json.dumps(doc).encode())  # the manifest agrees: only the structure is wrong
    result = verify_checkpoint(copy)
    assert not result["ok"] and any("model.nowhere" in p["problem"] for p in result["problems"])


def test_a_root_whose_only_checkpoint_is_corrupt_names_it_and_its_problem(tmp_path):
    """find_checkpoint on a root holding only a corrupt checkpoint names that checkpoint and why, not just 'none'."""
    from torch_ckpt import CheckpointNotFoundError

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    (tmp_path / "step_000000001" / "manifest.json").write_text('{"format": "torch-ckpt", "broken')
    with pytest.raises(CheckpointNotFoundError, match=r"step_000000001.*not valid JSON.*torch-ckpt verify"):
        find_checkpoint(tmp_path)


def test_a_crashed_save_of_another_naming_is_listed_partial_and_verify_says_so(tmp_path):
    """A folder named by another naming (Accelerate's checkpoint_N) holding only a partial is listed as partial,
    and verify on it says it is an incomplete save."""
    from torch_ckpt.tools.listing import verify_root

    with CheckpointManager(tmp_path, naming=PatternNaming("checkpoint_{step}")) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    (tmp_path / "checkpoint_2" / ".torch-ckpt.partial.0123456789abcdef").mkdir(parents=True)
    rows = {r["name"]: r for r in list_root(tmp_path)["steps"]}
    assert rows["checkpoint_2"]["status"] == "partial" and rows["checkpoint_1"]["status"] == "committed"
    result = verify_root(tmp_path / "checkpoint_2")
    assert not result["ok"] and "incomplete save" in result["general_problems"][0]
