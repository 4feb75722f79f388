"""``torch-ckpt ls / inspect / verify / convert / bench`` on real checkpoints (local and ``memory://``).

One run root with steps 10 and 20 is saved once per module by ``CheckpointManager`` with a
``memory://`` durable tier; tests that damage a checkpoint work on copies. Commands run in-process
through ``torch_ckpt.tools.cli.main`` with stdout captured.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from tests._format_fixtures import inline_shape_2_40, rank_json_nested_200k, rewrite, storage_data_not_a_dict
from torch_ckpt import CheckpointManager, TrainState
from torch_ckpt.tools.cli import main
from torch_ckpt.tools.listing import inspect_checkpoint, verify_checkpoint
from torch_ckpt.tools.sizing import interval_plan

STEP10, STEP20 = "step_000000010", "step_000000020"
SHARD = "__0_0.distcp"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 2, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))).double())


def _payload(node) -> tuple[int, int, int]:
    """(tensor bytes, tensor count, numpy bytes) of a nested state."""
    if isinstance(node, torch.Tensor):
        return node.numel() * node.element_size(), 1, 0
    if isinstance(node, np.ndarray):
        return 0, 0, node.nbytes
    values = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else []
    sums = [_payload(v) for v in values]
    return tuple(sum(s[i] for s in sums) for i in range(3)) if sums else (0, 0, 0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A local root with steps 10 and 20, replicated to a fresh memory:// root; expected sizes of step 20."""
    root = tmp_path_factory.mktemp("cli") / "run"
    url = f"memory://cli-{uuid.uuid4().hex[:8]}/run"
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    state = TrainState(model=model, optimizer=opt, scheduler=sched,
                       extras={"tokens": 123, "ema": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)})
    before = time.time()
    mgr = CheckpointManager(root, durable_url=url, async_save=False)
    for step in (10, 20):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
        mgr.save(step, state)
        assert mgr.wait_durable(30)
    expected = {k: _payload(v) for k, v in state.state_dict().items()}
    mgr.close()
    return {"root": root, "url": url, "expected": expected, "before": before, "after": time.time()}


def run(capsys, *argv) -> tuple[int, str, str]:
    """Run the command line in-process; returns (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys, *argv, code: int = 0):
    """Run a command with --json, check its exit code and parse its output."""
    got, out, err = run(capsys, *argv, "--json")
    assert got == code, err
    return json.loads(out)


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A private copy of the saved local root (to damage)."""
    dst = tmp_path / "run"
    shutil.copytree(saved["root"], dst)
    return dst


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of a file in place (same size)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# --- ls ----------------------------------------------------------------------------------------


def test_ls_json_lists_committed_steps_with_time_size_and_tiers(saved, capsys):
    """`ls ROOT --json` lists steps 10 and 20 committed, with commit time, listed and on-disk bytes and both tiers."""
    out = run_json(capsys, "ls", saved["root"])
    assert [(r["step"], r["status"]) for r in out["steps"]] == [(10, "committed"), (20, "committed")]
    for r in out["steps"]:
        step_dir = saved["root"] / r["name"]
        assert r["disk_bytes"] == sum(f.stat().st_size for f in step_dir.iterdir())
        assert r["bytes"] == r["disk_bytes"] - (step_dir / "manifest.json").stat().st_size
        assert saved["before"] <= r["wall_time"] <= saved["after"]
        assert set(r["tiers"]) == {"local", "durable"} and r["tiers"]["durable"]["url"] == saved["url"]
    assert out["counts"] == {"committed": 2, "partial": 0, "corrupt": 0, "plain-dcp": 0}


def test_ls_memory_url_lists_the_durable_copies(saved, capsys):
    """`ls memory://...` lists the replicated steps as committed in the durable tier."""
    out = run_json(capsys, "ls", saved["url"])
    assert [(r["step"], r["status"], list(r["tiers"])) for r in out["steps"]] == \
        [(10, "committed", ["durable"]), (20, "committed", ["durable"])]


def test_ls_reports_temporary_and_manifestless_directories_as_partial(copy, capsys):
    """A `.step_N.tmp` and a step directory without a manifest are partial; the exit code stays 0."""
    (copy / ".step_000000030.tmp").mkdir()
    (copy / ".step_000000030.tmp" / SHARD).write_bytes(b"x" * 10)
    shutil.copytree(copy / STEP20, copy / "step_000000040")
    (copy / "step_000000040" / "manifest.json").unlink()
    out = run_json(capsys, "ls", copy)
    partial = {r["step"]: r for r in out["steps"] if r["status"] == "partial"}
    assert set(partial) == {30, 40} and partial[30]["bytes"] == 10
    assert "temporary" in partial[30]["reason"] and "no manifest" in partial[40]["reason"]


def test_ls_truncated_file_is_corrupt_and_exits_1(copy, capsys):
    """Without --verify a truncated shard already makes the step corrupt (size check); exit code 1."""
    shard = copy / STEP20 / SHARD
    shard.write_bytes(shard.read_bytes()[:-100])
    out = run_json(capsys, "ls", copy, code=1)
    row = out["steps"][1]
    assert row["status"] == "corrupt" and row["problems"][0]["file"] == SHARD


def test_ls_verify_catches_a_flipped_byte_that_sizes_miss(copy, capsys):
    """A same-size flipped byte passes the plain listing but `ls --verify` marks the step corrupt."""
    flip_byte(copy / STEP10 / SHARD)
    assert run_json(capsys, "ls", copy)["counts"]["corrupt"] == 0
    out = run_json(capsys, "ls", copy, "--verify", code=1)
    assert [r["status"] for r in out["steps"]] == ["corrupt", "committed"]
    assert "CRC-32" in out["steps"][0]["problems"][0]["problem"]


def test_ls_check_tiers_drops_durable_copies_that_are_gone(saved, copy, capsys):
    """With --check-tiers a durable copy recorded in the manifest but since removed is not listed as a tier."""
    fs = fsspec.filesystem("memory")
    durable = f"/cli-tier-{uuid.uuid4().hex[:8]}/run"
    fs.copy(f"{saved['url'].removeprefix('memory:/')}/{STEP20}", f"{durable}/{STEP20}", recursive=True)
    for name in (STEP10, STEP20):  # point the copy's records at a durable root holding step 20 only
        manifest = json.loads((copy / name / "manifest.json").read_text())
        manifest["tiers"]["durable"]["url"] = f"memory:/{durable}"
        (copy / name / "manifest.json").write_text(json.dumps(manifest))
    assert [list(r["tiers"]) for r in run_json(capsys, "ls", copy)["steps"]] == [["local", "durable"]] * 2
    rows = run_json(capsys, "ls", copy, "--check-tiers")["steps"]
    assert [(list(r["tiers"]), r.get("stale_tiers")) for r in rows] == \
        [(["local"], ["durable"]), (["local", "durable"], None)]


def test_ls_text_shows_a_row_per_step(saved, capsys):
    """The human listing has one row per step with its tiers and status."""
    code, out, _ = run(capsys, "ls", saved["root"])
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("10 ", "20 "))]
    assert len(rows) == 2 and all("local,durable" in r and r[-1] == "committed" for r in rows)


def test_ls_empty_root_lists_nothing(tmp_path, capsys):
    """An existing directory without checkpoints lists nothing and exits 0."""
    assert run_json(capsys, "ls", tmp_path)["steps"] == []


# --- inspect -----------------------------------------------------------------------------------


def test_inspect_component_sizes_equal_the_saved_tensor_bytes(saved, capsys):
    """Per component, bytes and tensor counts equal those of the state saved at step 20 (RNG inline included)."""
    out = run_json(capsys, "inspect", saved["root"] / STEP20)
    comps = {c["name"]: c for c in out["components"]}
    for name, (tensor_bytes, tensors, array_bytes) in saved["expected"].items():
        assert (comps[name]["tensor_bytes"], comps[name]["tensors"], comps[name]["array_bytes"]) == \
            (tensor_bytes, tensors, array_bytes), name
    assert comps["rng"]["rank_local_tensors"] == 1 and comps["model"]["dtypes"] == \
        {"float32": 6, "float64": 2, "int64": 1}
    assert out["totals"]["dcp_tensor_bytes"] == out["manifest_tensor_bytes"]


def test_inspect_counts_rank_local_tensors_on_every_rank_and_shared_ones_once(saved, copy, capsys):
    """In a 2-rank checkpoint the inline RNG tensor counts twice, DCP tensors named by both ranks once."""
    step_dir = copy / STEP20
    doc = json.loads((step_dir / "rank_00000.json").read_text())
    rewrite(step_dir, "rank_00001.json", json.dumps({**doc, "rank": 1, "world_size": 2}).encode())
    rewrite(step_dir, "rank_00000.json", json.dumps({**doc, "world_size": 2}).encode())
    manifest = json.loads((step_dir / "manifest.json").read_text())
    (step_dir / "manifest.json").write_text(json.dumps({**manifest, "world_size": 2}))
    assert run_json(capsys, "verify", step_dir)["ok"]
    comps = {c["name"]: c for c in run_json(capsys, "inspect", step_dir)["components"]}
    rng_bytes, _, _ = saved["expected"]["rng"]
    assert (comps["rng"]["tensor_bytes"], comps["rng"]["rank_local_tensors"]) == (2 * rng_bytes, 2)
    assert comps["model"]["tensor_bytes"] == saved["expected"]["model"][0]


def test_inspect_keys_lists_shapes_dtypes_and_storage(saved, capsys):
    """`--keys` lists DCP tensors and per-rank JSON tensors with shape, dtype and bytes."""
    keys = {k["key"]: k for k in run_json(capsys, "inspect", saved["root"] / STEP20, "--keys")["keys"]}
    assert keys["model.fc1.weight"] == {"key": "model.fc1.weight", "component": "model", "kind": "tensor",
                                        "storage": "dcp", "shape": [16, 8], "dtype": "float32", "bytes": 512,
                                        "chunks": 1}
    assert (keys["extras.ema"]["shape"], keys["extras.ema"]["dtype"]) == ([2, 3], "bfloat16")
    assert keys["rng.torch_cpu"]["storage"] == "json" and keys["rng.torch_cpu"]["rank"] == 0
    assert keys["rng.numpy.keys"]["kind"] == "ndarray"


def test_inspect_memory_url_matches_the_local_copy(saved, capsys):
    """Inspecting the durable copy over memory:// gives the same components as the local one."""
    local = run_json(capsys, "inspect", saved["root"] / STEP20)
    remote = run_json(capsys, "inspect", f"{saved['url']}/{STEP20}")
    assert remote["components"] == local["components"] and remote["step"] == 20


def test_inspect_root_uses_the_newest_step_or_the_one_given(saved, capsys):
    """A root resolves to its newest committed checkpoint, or to --step."""
    assert run_json(capsys, "inspect", saved["root"])["step"] == 20
    assert run_json(capsys, "inspect", saved["root"], "--step", "10")["step"] == 10


def test_inspect_text_shows_the_component_table(saved, capsys):
    """The human output has a row per component and a total."""
    code, out, _ = run(capsys, "inspect", saved["root"] / STEP20)
    assert code == 0
    names = [line.split()[0] for line in out.splitlines() if line[:1].isalpha()]
    assert {"model", "optimizer", "scheduler", "rng", "extras", "total"} <= set(names)


def test_inspect_tampered_metadata_exits_1_without_executing_it(copy, tmp_path, capsys):
    """A .metadata pickle calling os.system is refused by inspect (exit 1) and never runs."""
    marker = tmp_path / "pwned"
    rewrite(copy / STEP20, ".metadata", pickle.dumps(_Evil(marker)))
    code, _, err = run(capsys, "inspect", copy / STEP20)
    assert code == 1 and "refusing to unpickle" in err and not marker.exists()


# --- verify ------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_verify_intact_root_passes(saved, capsys):
    """`verify ROOT` checks both checkpoints (CRC-32 and structure) and exits 0."""
    out = run_json(capsys, "verify", saved["root"])
    assert out["ok"] and out["kind"] == "root" and out["problems"] == 0
    assert [(c["step"], c["ok"], c["checksums"], c["files"]) for c in out["checkpoints"]] == \
        [(10, True, True, 4), (20, True, True, 4)]  # .metadata, 2 shard files (2 writer threads), rank json
    dcp_tensors = sum(count for _, count, _ in saved["expected"].values()) - 1  # the RNG tensor is inline
    assert out["checkpoints"][1]["tensors"] == dcp_tensors


def test_verify_memory_url_passes(saved, capsys):
    """`verify memory://...` verifies the durable copies and exits 0."""
    out = run_json(capsys, "verify", saved["url"])
    assert out["ok"] and [c["step"] for c in out["checkpoints"]] == [10, 20]


def test_verify_flipped_byte_fails_naming_the_file(copy, capsys):
    """A flipped byte in a shard gives exit 1 and a CRC-32 problem on that file."""
    flip_byte(copy / STEP20 / SHARD)
    out = run_json(capsys, "verify", copy / STEP20, code=1)
    problems = out["checkpoints"][0]["problems"]
    assert [p["file"] for p in problems] == [SHARD] and "CRC-32" in problems[0]["problem"]


def test_verify_truncated_file_fails(copy, capsys):
    """A truncated per-rank file gives exit 1 and a size problem on that file."""
    rank = copy / STEP10 / "rank_00000.json"
    rank.write_bytes(rank.read_bytes()[:50])
    out = run_json(capsys, "verify", copy, code=1)
    bad = [c for c in out["checkpoints"] if not c["ok"]]
    assert [c["step"] for c in bad] == [10]
    assert any(p["file"] == "rank_00000.json" and "size" in p["problem"] for p in bad[0]["problems"])


def test_verify_missing_shard_fails(copy, capsys):
    """A deleted shard fails verify; the text output names its path as missing."""
    (copy / STEP20 / SHARD).unlink()
    code, out, _ = run(capsys, "verify", copy / STEP20)
    assert code == 1
    assert f"{copy / STEP20 / SHARD}: listed in the manifest but missing" in out and "FAIL" in out


def test_verify_tampered_metadata_is_refused_and_not_executed(copy, tmp_path, capsys):
    """A .metadata pickle calling os.system (manifest updated to match) fails verify and never runs."""
    marker = tmp_path / "pwned"
    rewrite(copy / STEP20, ".metadata", pickle.dumps(_Evil(marker)))
    out = run_json(capsys, "verify", copy / STEP20, code=1)
    problems = out["checkpoints"][0]["problems"]
    assert problems[0]["file"] == ".metadata" and "refusing to unpickle" in problems[0]["problem"]
    assert "system" in problems[0]["problem"] and not marker.exists()


def test_verify_placeholder_absent_from_metadata_fails(copy, capsys):
    """A tensor placeholder in a rank's tree that DCP metadata lacks is a structure problem of that file."""
    step_dir = copy / STEP20
    doc = json.loads((step_dir / "rank_00000.json").read_text())
    doc["tree"]["model"]["ghost"] = {"__tensor__": "model.ghost"}
    rewrite(step_dir, "rank_00000.json", json.dumps(doc).encode())
    out = run_json(capsys, "verify", step_dir, code=1)
    problems = out["checkpoints"][0]["problems"]
    assert [p["file"] for p in problems] == ["rank_00000.json"] and "'model.ghost'" in problems[0]["problem"]


def test_verify_corrupt_durable_copy_fails(saved, capsys):
    """A flipped byte in a memory:// copy fails `verify URL` with the file's URL named."""
    fs = fsspec.filesystem("memory")
    src = saved["url"].removeprefix("memory:/")
    dst = f"/cli-bad-{uuid.uuid4().hex[:8]}/run"
    fs.copy(src, dst, recursive=True)
    data = bytearray(fs.cat_file(f"{dst}/{STEP10}/{SHARD}"))
    data[100] ^= 0xFF
    fs.pipe_file(f"{dst}/{STEP10}/{SHARD}", bytes(data))
    out = run_json(capsys, "verify", f"memory:/{dst}", code=1)
    bad = [p for c in out["checkpoints"] for p in c["problems"]]
    assert [p["path"] for p in bad] == [f"memory:/{dst}/{STEP10}/{SHARD}"]


def test_verify_no_checksums_misses_a_flipped_byte(copy, capsys):
    """`--no-checksums` checks sizes, structure and record headers only, so a flipped tensor data byte passes."""
    from torch_ckpt.tools.convert import load_full_state

    weight = load_full_state(copy / STEP20)[0]["model"]["fc1.weight"]
    data = (copy / STEP20 / SHARD).read_bytes()
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    flip_byte(copy / STEP20 / SHARD, at + 5)
    out = run_json(capsys, "verify", copy / STEP20, "--no-checksums")
    assert out["ok"] and out["checkpoints"][0]["checksums"] is False


def test_verify_root_without_checkpoints_fails(tmp_path, capsys):
    """Verifying a root that holds no checkpoint is a problem (exit 1), not a silent pass."""
    out = run_json(capsys, "verify", tmp_path, code=1)
    assert out["checkpoints"] == [] and out["general_problems"]


def test_python_api_matches_the_command(saved):
    """The functions behind the commands are usable from Python with the same results."""
    assert verify_checkpoint(saved["root"] / STEP10)["ok"]
    assert inspect_checkpoint(saved["url"])["step"] == 20


# --- progress, errors --------------------------------------------------------------------------


def test_progress_bar_only_on_a_terminal_and_not_with_quiet(saved, capsys, monkeypatch):
    """Verification draws a bar on stderr when it is a terminal, and nothing with --quiet."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert run(capsys, "verify", saved["root"] / STEP20)[2] != ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert run(capsys, "verify", saved["root"] / STEP20, "--quiet")[2] == ""


@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
def test_missing_path_exits_2_with_one_line(command, tmp_path, capsys):
    """A path that does not exist is a usage error: exit 2, one line on stderr naming it."""
    code, out, err = run(capsys, command, tmp_path / "nope")
    assert code == 2 and out == "" and err.strip() == f"torch-ckpt {command}: error: {tmp_path / 'nope'} does not exist"


def test_bad_storage_options_and_unknown_protocol_exit_2(capsys):
    """Invalid --storage-options JSON and an unknown URL protocol are usage errors (exit 2)."""
    code, _, err = run(capsys, "ls", "memory://x", "--storage-options", "{nope")
    assert code == 2 and "not valid JSON" in err
    code, _, err = run(capsys, "ls", "nosuchproto://bucket/run")
    assert code == 2 and "Protocol not known" in err and "Traceback" not in err


class _Unreachable(fsspec.AbstractFileSystem):
    """An fsspec store whose every call fails like a dropped connection."""

    protocol = "unreachable"

    def _fail(self, *args, **kwargs):
        raise RuntimeError("connection reset by peer")

    exists = ls = info = cat_file = _open = _fail


def test_unreachable_store_exits_1_with_one_line(capsys):
    """A backend error from the store (not a missing path) is a checkpoint problem: exit 1, no traceback."""
    fsspec.register_implementation("unreachable", _Unreachable, clobber=True)
    code, out, err = run(capsys, "verify", "unreachable://bucket/run")
    assert code == 1 and out == ""
    assert err.strip() == ("torch-ckpt verify: error: cannot read unreachable://bucket/run: RuntimeError: connection "
                           "reset by peer")


class _ConnectsAtOnce(fsspec.AbstractFileSystem):
    """An fsspec store that connects when created (as FTP and SFTP do), to a port where nothing listens."""

    protocol = "connectsatonce"

    def __init__(self, *args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")


def test_a_store_that_refuses_the_connection_when_created_exits_1_naming_the_url(capsys):
    """A backend refusing the connection in its constructor: exit 1, one line naming the URL, no traceback."""
    fsspec.register_implementation("connectsatonce", _ConnectsAtOnce, clobber=True)
    code, out, err = run(capsys, "ls", "connectsatonce://host/run")
    assert code == 1 and out == "" and "Traceback" not in err
    assert "cannot reach URL connectsatonce://host/run: ConnectionRefusedError" in err


def test_a_store_without_credentials_says_where_they_go(capsys, monkeypatch):
    """An S3 URL with no credentials anywhere fails in one line that names the environment and --storage-options."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, _, err = run(capsys, "ls", "s3://no-such-bucket/run", "--storage-options",
                       '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}')
    assert code == 1
    assert "credentials" in err and "AWS_ACCESS_KEY_ID" in err and "--storage-options" in err


# --- convert, bench ----------------------------------------------------------------------------


def test_convert_of_a_root_whose_newest_step_is_corrupt_names_the_older_steps(copy, tmp_path, capsys):
    """`convert ROOT` stops at a corrupt newest step (exit 1) and says which older steps --step can export."""
    shard = copy / STEP20 / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run(capsys, "convert", copy, "--to", "torch", tmp_path / "full.pt")
    assert code == 1 and "CRC-32" in err and "--step N (committed: 10)" in err
    assert not (tmp_path / "full.pt").exists()


def test_convert_from_a_memory_url(saved, tmp_path, capsys):
    """`convert URL --to torch` downloads, verifies and exports a file loadable with weights_only=True."""
    out = run_json(capsys, "convert", f"{saved['url']}/{STEP20}", "--to", "torch", tmp_path / "full.pt", "--quiet")
    state = torch.load(out["out"], weights_only=True)
    assert out["step"] == 20 and state["model"]["fc1.weight"].shape == (16, 8)


def test_bench_reports_floors_and_the_plan_they_imply(tmp_path, capsys):
    """`bench` measures positive floors and derives save cost, lag and the Daly plan from them."""
    out = run_json(capsys, "bench", tmp_path, "--size-mib", "4", "--state-gib", "2", "--mtbf", "8h",
                   "--step-time", "1s")
    assert all(out[k] > 0 for k in ("copy_gbps", "write_gbps", "read_gbps")) and out["write_bytes"] == 4 << 20
    rec, state = out["recommendation"], 2 * 2**30
    floor = "d2h_gbps" if out["d2h_gbps"] else "copy_gbps"  # staging is device-to-host when CUDA is present
    assert rec["save_cost_s"] == pytest.approx(state / (out[floor] * 1e9))
    assert rec["write_s"] == pytest.approx(state / (out["write_gbps"] * 1e9))
    plan = interval_plan(28800, rec["save_cost_s"], durability_lag_s=rec["write_s"], step_time_s=1.0)
    assert rec["interval"]["daly_interval_s"] == pytest.approx(plan["daly_interval_s"])
    assert rec["interval"]["recommended_interval_s"] == pytest.approx(plan["recommended_interval_s"])
    assert rec["interval"]["interval_steps"] == plan["interval_steps"]
    assert list(tmp_path.iterdir()) == []


# --- s3 ----------------------------------------------------------------------------------------


def test_ls_and_verify_an_s3_root_with_storage_options(saved, capsys):
    """With --storage-options JSON (endpoint, keys), `ls` and `verify` work on an s3:// root (moto server)."""
    pytest.importorskip("s3fs", reason="the s3 extra is not installed")
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import socket

    import boto3

    from torch_ckpt.root._layout import read_manifest
    from torch_ckpt.tiers._durable import DurableTier

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="ckpts")
        options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        step_dir = saved["root"] / STEP20
        DurableTier("s3://ckpts/run", storage_options=options).upload(step_dir, read_manifest(step_dir))
        opts = ["--storage-options", json.dumps(options)]
        listed = run_json(capsys, "ls", "s3://ckpts/run", *opts)
        assert [(r["step"], r["status"]) for r in listed["steps"]] == [(20, "committed")]
        assert run_json(capsys, "verify", "s3://ckpts/run", *opts)["ok"]
    finally:
        server.stop()


def test_verify_s3_object_with_a_flipped_byte_reports_the_local_files_problem(copy, capsys):
    """`verify s3://...` (moto server) reports a flipped object with the problem `verify` gives the local file."""
    pytest.importorskip("s3fs", reason="the s3 extra is not installed")
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    from tests._s3 import S3
    from torch_ckpt.root._layout import read_manifest
    from torch_ckpt.tiers._durable import DurableTier

    server = S3()
    server.start()
    try:
        step_dir = copy / STEP20
        tier = DurableTier(f"s3://{server.new_bucket()}/run", storage_options=server.options)
        tier.upload(step_dir, read_manifest(step_dir))
        key = f"{tier.location(20).path}/{SHARD}"
        data = bytearray(tier.fs.cat_file(key))
        data[len(data) // 2] ^= 0xFF  # the byte flip_byte() flips in the local file
        tier.fs.pipe_file(key, bytes(data))
        flip_byte(step_dir / SHARD)
        remote = run_json(capsys, "verify", tier.describe(20), "--storage-options", json.dumps(server.options), code=1)
        local = run_json(capsys, "verify", step_dir, code=1)
    finally:
        server.stop()
    problems = [[(p["file"], p["problem"]) for p in out["checkpoints"][0]["problems"]] for out in (remote, local)]
    assert problems[0] == problems[1] and "CRC-32" in problems[0][0][1]
    assert remote["checkpoints"][0]["problems"][0]["path"] == f"{tier.describe(20)}/{SHARD}"


# --- read-only tools are as strict as restore (issue 14, items 3 and 4) --------------------------


def _live_state() -> TrainState:
    """A state of the same structure as the saved one (to restore into)."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2),
                      extras={"tokens": 0, "ema": torch.zeros(2, 3, dtype=torch.bfloat16)})


def _metadata(step_dir: Path):
    from torch_ckpt.format._files import read_dcp_metadata

    return read_dcp_metadata(step_dir / ".metadata")


def _storage_elsewhere(step_dir: Path) -> str:
    """.metadata storage paths rewritten to a copy of another step's shard outside this checkpoint."""
    other = step_dir.parent / STEP10 / SHARD
    md = _metadata(step_dir)
    for info in md.storage_data.values():
        info.relative_path = str(other)
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return ".metadata"


def _shape_beyond_chunks(step_dir: Path) -> str:
    """model.fc1.weight declared (20, 8) while its chunks cover (16, 8)."""
    md = _metadata(step_dir)
    md.state_dict_metadata["model.fc1.weight"].size = torch.Size([20, 8])
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return ".metadata"


def _declared_2_40(step_dir: Path) -> str:
    """model.fc1.weight and its one chunk declared with 2^40 elements (storage unchanged)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = _metadata(step_dir)
    item = md.state_dict_metadata["model.fc1.weight"]
    old = next(i for i in md.storage_data if i.fqn == "model.fc1.weight")
    info = md.storage_data.pop(old)
    item.size = torch.Size([2**40])
    item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2**40]))]
    md.storage_data[MetadataIndex("model.fc1.weight", torch.Size([0]))] = info
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return ".metadata"


def _symlinked_copy(step_dir: Path) -> str:
    """The shard replaced by a symlink to an identical copy outside the checkpoint."""
    outside = step_dir.parent / "outside.distcp"
    shutil.copyfile(step_dir / SHARD, outside)
    (step_dir / SHARD).unlink()
    (step_dir / SHARD).symlink_to(outside)
    return SHARD


def _storage_8_short(step_dir: Path) -> str:
    """model.fc1.weight's storage entry declared 8 bytes shorter than its record (issue 14, gap 1)."""
    md = _metadata(step_dir)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.fc1.weight")
    info.length -= 8
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return str(info.relative_path)


def _declared_dtype(dtype: torch.dtype):
    def damage(step_dir: Path) -> str:
        """model.fc1.weight (stored float32) declared as another dtype in .metadata (issue 14, gap 2)."""
        md = _metadata(step_dir)
        md.state_dict_metadata["model.fc1.weight"].properties.dtype = dtype
        rewrite(step_dir, ".metadata", pickle.dumps(md))
        return str(next(v for k, v in md.storage_data.items() if k.fqn == "model.fc1.weight").relative_path)

    return damage


def _chunk_reshaped(step_dir: Path) -> str:
    """model.fc1.weight (16, 8) and its chunk declared (8, 16): same element count, other shape."""
    md = _metadata(step_dir)
    item = md.state_dict_metadata["model.fc1.weight"]
    item.size = torch.Size([8, 16])
    item.chunks[0].sizes = torch.Size([8, 16])
    rewrite(step_dir, ".metadata", pickle.dumps(md))
    return str(next(v for k, v in md.storage_data.items() if k.fqn == "model.fc1.weight").relative_path)


def _rank_key_not_in_metadata(step_dir: Path) -> str:
    """rank_00000.json refers to a tensor key that .metadata does not hold (issue 14, gap 3)."""
    doc = json.loads((step_dir / "rank_00000.json").read_text())
    doc["tree"]["model"]["fc1.weight"] = {"__tensor__": "model.ghost"}
    rewrite(step_dir, "rank_00000.json", json.dumps(doc).encode())
    return "rank_00000.json"


_DAMAGES = {"storage-8-bytes-short": _storage_8_short, "declared-float64": _declared_dtype(torch.float64),
            "declared-int32": _declared_dtype(torch.int32), "chunk-reshaped": _chunk_reshaped,
            "rank-key-not-in-metadata": _rank_key_not_in_metadata, "storage-elsewhere": _storage_elsewhere,
            "shape-beyond-chunks": _shape_beyond_chunks,
            "declared-2^40": _declared_2_40, "storage_data=5": storage_data_not_a_dict,
            "inline-2^40": inline_shape_2_40,
            "rank-json-200k-deep": rank_json_nested_200k, "symlinked-copy": _symlinked_copy}


@pytest.mark.parametrize("damage", list(_DAMAGES), ids=list(_DAMAGES))
def test_verify_fails_exactly_where_restore_refuses(copy, capsys, damage):
    """For each tampering, restore raises CheckpointCorruptError and verify exits 1 naming the same file."""
    from torch_ckpt import CheckpointCorruptError

    bad = _DAMAGES[damage](copy / STEP20)
    with CheckpointManager(copy) as mgr:
        with pytest.raises(CheckpointCorruptError) as info:
            mgr.restore(_live_state(), step=20)
    assert str(copy / STEP20 / bad) in str(info.value)
    out = run_json(capsys, "verify", copy / STEP20, code=1)
    assert bad in [p["file"] for p in out["checkpoints"][0]["problems"]], out["checkpoints"][0]["problems"]


@pytest.mark.parametrize("damage", list(_DAMAGES), ids=list(_DAMAGES))
def test_convert_refuses_what_restore_refuses_and_writes_nothing(copy, tmp_path, capsys, damage):
    """convert exits 1 with one line naming the file for each tampering; no output file is written."""
    bad = _DAMAGES[damage](copy / STEP20)
    code, out, err = run(capsys, "convert", copy / STEP20, "--to", "torch", tmp_path / "full.pt")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(copy / STEP20 / bad) in err and "Traceback" not in err
    assert not (tmp_path / "full.pt").exists()


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_symlinked_shard_pointing_outside_is_never_opened(copy, tmp_path, capsys, command):
    """A shard symlinked to a file outside the checkpoint is reported as a symlink; verify fails, inspect refuses."""
    outside = tmp_path / "fifo_outside"
    os.mkfifo(outside)  # opening it for reading would block: the test hangs if the link is followed
    (copy / STEP20 / SHARD).unlink()
    (copy / STEP20 / SHARD).symlink_to(outside)
    if command == "verify":
        out = run_json(capsys, "verify", copy / STEP20, code=1)
        problems = out["checkpoints"][0]["problems"]
        assert [(p["file"], "symbolic link" in p["problem"]) for p in problems] == [(SHARD, True)], problems
    else:
        code, out, err = run(capsys, "inspect", copy / STEP20)
        assert code == 1 and out == "" and f"{SHARD}: file listed in the manifest is a symbolic link" in err, err


def test_symlinked_manifest_is_corrupt_for_every_tool_unless_followed(copy, tmp_path, capsys):
    """manifest.json as a symlink: ls lists the step corrupt, verify/inspect exit 1; --follow-symlinks accepts it."""
    real = tmp_path / "manifest.json"
    (copy / STEP20 / "manifest.json").rename(real)
    (copy / STEP20 / "manifest.json").symlink_to(real)
    listing = run_json(capsys, "ls", copy, code=1)
    assert [(r["step"], r["status"]) for r in listing["steps"]] == [(10, "committed"), (20, "corrupt")]
    assert "symbolic link" in listing["steps"][1]["problems"][0]["problem"]
    assert run_json(capsys, "verify", copy / STEP20, code=1)["ok"] is False
    code, _, err = run(capsys, "inspect", copy / STEP20)
    assert code == 1 and "symbolic link" in err
    assert run_json(capsys, "verify", copy / STEP20, "--follow-symlinks")["ok"] is True


@pytest.mark.parametrize("damage", ["digits", "depth"])
def test_ls_and_verify_report_a_malformed_manifest_without_a_traceback(copy, capsys, damage):
    """A manifest with a 5000-digit integer or 200k-deep nesting: ls/verify exit 1 naming it, the other step is fine."""
    path = copy / STEP20 / "manifest.json"
    text = path.read_text()
    path.write_text(text.replace('"tensor_bytes":', '"tensor_bytes":' + "7" * 5000 + ',"x":', 1) if damage == "digits"
                    else text.replace('"timings":{', '"timings":{"deep":' + "[" * 200_000 + "]" * 200_000 + ",", 1))
    assert path.read_text() != text
    code, out, err = run(capsys, "ls", copy)
    assert code == 1 and "Traceback" not in out + err
    assert "20" in out and "corrupt" in out and "manifest.json" in out
    result = run_json(capsys, "verify", copy, code=1)
    assert [(c["step"], c["ok"]) for c in result["checkpoints"]] == [(10, True), (20, False)]
    assert result["checkpoints"][1]["problems"][0]["file"] == "manifest.json"


@pytest.mark.parametrize("world_size", [2**40, 2**31 - 1])
def test_verify_of_a_huge_declared_world_size_stays_small(copy, capsys, world_size):
    """A manifest declaring world_size 2^40 (or 2^31-1) is one problem; verify allocates under 20 MB."""
    import tracemalloc

    path = copy / STEP20 / "manifest.json"
    path.write_text(path.read_text().replace('"world_size":1,', f'"world_size":{world_size},', 1))
    tracemalloc.start()
    try:
        out = run_json(capsys, "verify", copy / STEP20, "--no-checksums", code=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    problems = out["checkpoints"][0]["problems"]
    assert len(problems) == 1 and str(world_size) in problems[0]["problem"], problems
    assert peak < 20 * 2**20, f"verify allocated {peak / 2**20:.1f} MB"


def test_ls_lists_a_symlinked_step_directory_as_restore_does(copy, tmp_path, capsys):
    """A step directory that is a symlink (to a complete checkpoint) is listed committed by ls, as restore lists it."""
    root = tmp_path / "linked"
    root.mkdir()
    (root / STEP20).symlink_to(copy / STEP20)
    listing = run_json(capsys, "ls", root)
    assert [(r["step"], r["status"]) for r in listing["steps"]] == [(20, "committed")]
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [20]


@pytest.mark.parametrize("command", ["ls", "verify", "inspect"])
def test_a_symlink_loop_in_the_root_does_not_break_the_tools(copy, capsys, command):
    """A self-referencing symlink beside the steps (ELOOP on stat) is passed over: ls/verify/inspect still work."""
    (copy / "loop").symlink_to("loop")
    out = run_json(capsys, command, copy)
    if command == "ls":
        assert [r["step"] for r in out["steps"]] == [10, 20]
    elif command == "verify":
        assert out["ok"] and len(out["checkpoints"]) == 2
    else:
        assert out["step"] == 20


# --- ls marks what restore would skip, by cheap checks only (issue 14, gap 4) --------------------


def _world_size_2(step_dir: Path) -> None:
    doc = json.loads((step_dir / "manifest.json").read_text())
    doc["world_size"] = 2
    (step_dir / "manifest.json").write_text(json.dumps(doc))


def _metadata_unlisted(step_dir: Path) -> None:
    doc = json.loads((step_dir / "manifest.json").read_text())
    del doc["files"][".metadata"]
    (step_dir / "manifest.json").write_text(json.dumps(doc))


_LS_DAMAGES = {"world-size-2-one-rank-file": (_world_size_2, "manifest.json"),
               "metadata-unlisted": (_metadata_unlisted, ".metadata"),
               "shard-missing": (lambda d: (d / SHARD).unlink(), SHARD),
               "rank-file-missing": (lambda d: (d / "rank_00000.json").unlink(), "rank_00000.json")}


@pytest.mark.parametrize("damage", list(_LS_DAMAGES), ids=list(_LS_DAMAGES))
def test_ls_without_verify_marks_what_restore_skips(copy, capsys, damage):
    """ls (no --verify) lists a step with manifest-only inconsistencies or missing files corrupt; restore skips it."""
    edit, bad = _LS_DAMAGES[damage]
    edit(copy / STEP20)
    listing = run_json(capsys, "ls", copy, code=1)
    assert [(r["step"], r["status"]) for r in listing["steps"]] == [(10, "committed"), (20, "corrupt")]
    assert [p["file"] for p in listing["steps"][1]["problems"]] == [bad], listing["steps"][1]["problems"]
    with CheckpointManager(copy) as mgr:
        assert mgr.restore(_live_state()) == 10


# --- a forged manifest step is named as a disagreement of two files (issue 14, gap 5) ------------


def _forged_step(root: Path) -> Path:
    """step 20 moved to step_000000030 with its manifest saying step 30 (the rank file still says 20)."""
    forged = root / "step_000000030"
    (root / STEP20).rename(forged)
    doc = json.loads((forged / "manifest.json").read_text())
    doc["step"] = 30
    (forged / "manifest.json").write_text(json.dumps(doc))
    return forged


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_forged_manifest_step_names_both_files_and_both_values(copy, tmp_path, capsys, command):
    """inspect/convert of a step whose manifest says 30 but whose rank file says 20 name both files and both steps."""
    forged = _forged_step(copy)
    extra = ["--to", "torch", str(tmp_path / "out.pt")] if command == "convert" else []
    code, out, err = run(capsys, command, forged, *extra)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{forged / 'rank_00000.json'}: step 20 in this per-rank state file disagrees with step 30 in " \
           f"{forged / 'manifest.json'}" in err, err


@pytest.mark.parametrize("where", ["root", "url"])
def test_a_missing_step_names_the_committed_ones(saved, capsys, where):
    """`inspect --step N` of a step the root (local or durable) lacks says which steps it holds; exit 2."""
    code, _, err = run(capsys, "inspect", saved[where], "--step", 15)
    assert code == 2, err
    assert "no committed checkpoint of step 15" in err and "its committed steps: 10, 20" in err
