"""Tests for ``torch-ckpt plan`` (torch_ckpt.tools.cli) and the sizing model behind it (torch_ckpt.tools.sizing)."""

from __future__ import annotations

import json

import pytest

from torch_ckpt.policy._schedule import (
    daly_interval,
    expected_lost_work,
    expected_overhead,
    young_interval,
)
from torch_ckpt.tools.cli import main
from torch_ckpt.tools.sizing import checkpoint_size, interval_plan, parse_count

SIZING_70B = ["--params", "70e9", "--tp", "8", "--dp", "32", "--param-dtype", "bf16", "--optimizer", "adam"]


def plan_json(capsys, *argv):
    """Run ``torch-ckpt plan ... --json`` and return the parsed output."""
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- interval mode -----------------------------------------------------------------------------


def test_plan_json_has_the_named_fields_with_formula_values(capsys):
    """`plan --mtbf 8h --save-cost 2s --json` gives Young, Daly, overhead and lost work from the formulas."""
    out = plan_json(capsys, "--mtbf", "8h", "--save-cost", "2s")
    daly = daly_interval(28800.0, 2.0)
    assert out["young_interval_s"] == pytest.approx(339.411, abs=1e-3)
    assert out["daly_interval_s"] == pytest.approx(daly)
    assert out["expected_overhead"] == pytest.approx(expected_overhead(daly, 2.0, 28800.0))
    assert out["expected_lost_work_s"] == pytest.approx(expected_lost_work(daly))


def test_plan_text_prints_both_intervals_lost_work_and_overhead(capsys):
    """The human output shows Young 5.66 min, Daly 5.63 min, lost work 2.82 min and 1.18 % overhead."""
    assert main(["plan", "--mtbf", "8h", "--save-cost", "2s"]) == 0
    text = capsys.readouterr().out
    for expected in ("Young", "Daly", "5.66 min", "5.63 min", "2.82 min", "1.18 %"):
        assert expected in text


def test_plan_repeated_mtbf_prints_the_corrected_seed_table(capsys):
    """The seed's rows (8 h, 2 h, 15 min at 2 s) come out as 338.1 s, 168.4 s and 58.7 s (Daly)."""
    out = plan_json(capsys, "--mtbf", "8h", "--mtbf", "2h", "--mtbf", "15m", "--save-cost", "2s")
    assert [round(p["daly_interval_s"], 1) for p in out["plans"]] == [338.1, 168.4, 58.7]
    assert [round(p["young_interval_s"], 1) for p in out["plans"]] == [339.4, 169.7, 60.0]


def test_plan_job_mtbf_from_gpu_mtbf_and_gpu_count(capsys):
    """--gpus 1024 --gpu-mtbf 2048h means a job MTBF of 2 h."""
    out = plan_json(capsys, "--gpus", "1024", "--gpu-mtbf", "2048h", "--save-cost", "2s")
    assert out["mtbf_s"] == 7200.0
    assert out["daly_interval_s"] == pytest.approx(daly_interval(7200.0, 2.0))


def test_plan_durability_lag_enters_loss_and_floors_interval(capsys):
    """A 20 min lag adds to the lost work and raises the interval to cost + lag so saves do not pile up."""
    out = plan_json(capsys, "--mtbf", "8h", "--save-cost", "2s", "--durability-lag", "20m")
    assert out["recommended_interval_s"] == 1202.0
    assert out["limited_by"] == "durability"
    assert out["expected_lost_work_s"] == pytest.approx(1202.0 / 2 + 1200.0)


def test_plan_step_time_converts_interval_to_steps(capsys):
    """With 1.5 s steps the 338.1 s interval is 225 steps."""
    out = plan_json(capsys, "--mtbf", "8h", "--save-cost", "2s", "--step-time", "1.5s")
    assert out["interval_steps"] == 225


def test_plan_cost_above_twice_mtbf_uses_daly_fallback(capsys):
    """C >= 2M gives Daly's documented fallback T = M."""
    out = plan_json(capsys, "--mtbf", "1m", "--save-cost", "3m")
    assert out["daly_interval_s"] == 60.0


# --- sizing mode -------------------------------------------------------------------------------


def test_sizing_70b_component_totals(capsys):
    """70B bf16 + Adam: model 140 GB, optimizer 840 GB (280 master + 560 moments), total 980 GB."""
    out = plan_json(capsys, *SIZING_70B)
    assert out["model_bytes"] == pytest.approx(140e9)
    assert out["optimizer_master_bytes"] == pytest.approx(280e9)
    assert out["optimizer_moments_bytes"] == pytest.approx(560e9)
    assert out["optimizer_bytes"] == pytest.approx(840e9)
    assert out["total_bytes"] == pytest.approx(980e9)


def test_sizing_70b_per_rank_sharding(capsys):
    """Weights split over tp=8 (17.5 GB/rank), optimizer over tp x dp = 256 (3.28 GB/rank)."""
    out = plan_json(capsys, *SIZING_70B)
    assert out["world_size"] == 256
    assert out["model_bytes_per_rank"] == pytest.approx(17.5e9)
    assert out["optimizer_bytes_per_rank"] == pytest.approx(840e9 / 256)
    assert out["written_bytes_per_rank"] == pytest.approx(980e9 / 256)


def test_sizing_70b_staging_ram_and_times(capsys):
    """8 ranks per node stage 166 GB; 0.83 s blocking at 25 GB/s; about 10 s to write at 100 GB/s."""
    out = plan_json(capsys, *SIZING_70B, "--d2h-gbps", "25", "--storage-gbps", "100")
    staged = 17.5e9 + 840e9 / 256
    assert out["host_ram_per_node_bytes"] == pytest.approx(8 * staged)
    assert out["blocking_s"] == pytest.approx(staged / 25e9)
    assert out["write_s"] == pytest.approx(9.8)


def test_sizing_text_lists_components(capsys):
    """The human sizing output names 140 GB, 840 GB, 980 GB and the 9.8 s write."""
    assert main(["plan", *SIZING_70B]) == 0
    text = capsys.readouterr().out
    for expected in ("70B parameters", "140 GB", "840 GB", "980 GB", "17.5 GB", "166 GB", "9.8 s"):
        assert expected in text


def test_sizing_with_mtbf_uses_blocking_as_cost_and_write_as_lag(capsys):
    """Given --mtbf, the interval uses the computed blocking time as C and the write time as lag."""
    out = plan_json(capsys, *SIZING_70B, "--mtbf", "8h")
    assert out["interval"]["save_cost_s"] == pytest.approx(out["blocking_s"])
    assert out["interval"]["durability_lag_s"] == pytest.approx(9.8)
    assert out["interval"]["daly_interval_s"] == pytest.approx(daly_interval(28800.0, out["blocking_s"]))


def test_sizing_gpu_mtbf_defaults_gpu_count_to_world_size(capsys):
    """--gpu-mtbf without --gpus divides by tp x pp x dp."""
    out = plan_json(capsys, *SIZING_70B, "--gpu-mtbf", "2048h")
    assert out["interval"]["mtbf_s"] == pytest.approx(2048 * 3600 / 256)


def test_sizing_explicit_save_cost_overrides_blocking(capsys):
    """--save-cost replaces the computed blocking time in the interval."""
    out = plan_json(capsys, *SIZING_70B, "--mtbf", "8h", "--save-cost", "2s")
    assert out["interval"]["young_interval_s"] == pytest.approx(young_interval(28800.0, 2.0))


def test_sizing_fp32_weights_need_no_master_copy():
    """fp32 weights are their own master copy: Adam adds only 8 bytes/param."""
    size = checkpoint_size(1e9, param_dtype="fp32", optimizer="adam")
    assert size["optimizer_master_bytes"] == 0
    assert size["optimizer_bytes"] == pytest.approx(8e9)


def test_sizing_pipeline_parallel_splits_weights():
    """With pp=4 the weights are split over tp x pp ranks."""
    assert checkpoint_size(70e9, tp=8, pp=4, dp=8)["model_bytes_per_rank"] == pytest.approx(140e9 / 32)


@pytest.mark.parametrize(
    ("text", "count"),
    [("70e9", 70e9), ("70B", 70e9), ("7.5b", 7.5e9), ("350M", 350e6), ("1.2T", 1.2e12), ("1000", 1e3)],
)
def test_parse_count_forms(text, count):
    """Parameter counts accept plain numbers, exponents and K/M/B/T suffixes."""
    assert parse_count(text) == pytest.approx(count)


@pytest.mark.parametrize("kwargs", [{"param_dtype": "int4"}, {"optimizer": "lion"}, {"tp": 0}, {"d2h_gbps": 0.0}])
def test_checkpoint_size_rejects_bad_arguments(kwargs):
    """Unknown dtypes or optimizers and non-positive degrees or bandwidths raise ValueError."""
    with pytest.raises(ValueError):
        checkpoint_size(1e9, **kwargs)


def test_interval_plan_rejects_zero_cost():
    """A zero save cost has no meaningful interval and is refused."""
    with pytest.raises(ValueError, match="save cost"):
        interval_plan(3600.0, 0.0)


# --- errors and the command table ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--mtbf", "0s", "--save-cost", "2s"], "must be positive"),
        (["plan", "--mtbf=-1h", "--save-cost", "2s"], "must be positive"),
        (["plan", "--mtbf", "eight", "--save-cost", "2s"], "invalid duration 'eight'"),
        (["plan", "--mtbf", "8h"], "needs --mtbf"),
        (["plan", "--mtbf", "8h", "--gpu-mtbf", "100h", "--save-cost", "1s"], "not both"),
        (["plan", "--gpu-mtbf", "100h", "--save-cost", "1s"], "needs --gpus"),
        (["plan", "--tp", "8", "--mtbf", "8h", "--save-cost", "1s"], "--tp only applies"),
        (["plan", "--params", "lots"], "invalid parameter count"),
        (["plan", "--params", "70B", "--tp", "0"], "argument --tp: expected an integer >= 1, got '0'"),
        (["plan", "--params", "70B", "--dp", "2.5"], "argument --dp: expected an integer >= 1, got '2.5'"),
        (["plan", "--params", "70B", "--mtbf", "1h", "--mtbf", "2h"], "single --mtbf"),
        (["plan", "--params", "70B", "--param-dtype", "int3"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(capsys, argv, message):
    """Bad arguments return exit code 2 and explain themselves on stderr."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_no_subcommand_prints_help_and_exits_2(capsys):
    """Running with no subcommand lists the commands and returns 2."""
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err


def test_help_exits_0(capsys):
    """`plan --help` documents the duration forms and returns 0."""
    assert main(["plan", "--help"]) == 0
    assert "1.5d" in capsys.readouterr().out
