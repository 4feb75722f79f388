"""Tests for the Monte Carlo interval check (torch_ckpt.tools.simulate) and ``torch-ckpt simulate``."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import numpy as np
import pytest

from torch_ckpt.policy._schedule import daly_interval
from torch_ckpt.tools.cli import main
from torch_ckpt.tools.simulate import plot_sweep, simulate_overhead, sweep

HOUR = 3600.0
MIN = 60.0


@pytest.mark.parametrize(
    ("mtbf", "cost", "lag", "restart"),
    [
        (24 * HOUR, 5 * MIN, 0.0, 10 * MIN),  # Daly's published examples
        (6 * HOUR, 5 * MIN, 0.0, 10 * MIN),
        (15 * MIN, 5 * MIN, 0.0, 10 * MIN),
        (8 * HOUR, 2.0, 0.0, 0.0),  # the seed's 256-GPU row
        (2 * HOUR, 2.0, 30.0, 60.0),  # asynchronous saves with a durability lag
    ],
)
def test_simulated_optimum_within_10_percent_of_daly(mtbf, cost, lag, restart):
    """The interval with the lowest simulated overhead lies within 10 % of Daly's."""
    result = sweep(mtbf_s=mtbf, cost_s=cost, durability_lag_s=lag, restart_s=restart, seed=1)
    assert result.optimum_interval_s == pytest.approx(daly_interval(mtbf, cost), rel=0.10)


def test_simulated_overhead_matches_first_order_model_when_small():
    """At M = 8 h, C = 2 s the measured overhead at Daly's interval is within 5 % of C/T + T/2M."""
    t = daly_interval(8 * HOUR, 2.0)
    measured = simulate_overhead(t, mtbf_s=8 * HOUR, cost_s=2.0)[0]
    assert measured == pytest.approx(2.0 / t + t / 2 / (8 * HOUR), rel=0.05)


def test_durability_lag_costs_about_lag_over_mtbf():
    """A 60 s durability lag adds about L/M to the overhead, as the expected-loss model says."""
    common = dict(mtbf_s=8 * HOUR, cost_s=2.0, failures=100_000)
    t = daly_interval(8 * HOUR, 2.0)
    extra = simulate_overhead(t, durability_lag_s=60.0, **common)[0] - simulate_overhead(t, **common)[0]
    assert extra == pytest.approx(60.0 / (8 * HOUR), rel=0.15)


def test_restart_cost_adds_overhead():
    """A longer restart after each failure raises the measured overhead."""
    base = simulate_overhead(600.0, mtbf_s=HOUR, cost_s=10.0, failures=20_000)[0]
    slow = simulate_overhead(600.0, mtbf_s=HOUR, cost_s=10.0, restart_s=300.0, failures=20_000)[0]
    assert slow > base + 0.05


def test_same_seed_same_result_and_seed_matters():
    """A seed reproduces the run exactly; another seed gives different numbers."""
    a = simulate_overhead([100.0, 300.0], mtbf_s=HOUR, cost_s=5.0, failures=5_000, seed=3)
    b = simulate_overhead([100.0, 300.0], mtbf_s=HOUR, cost_s=5.0, failures=5_000, seed=3)
    c = simulate_overhead([100.0, 300.0], mtbf_s=HOUR, cost_s=5.0, failures=5_000, seed=4)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_sweep_default_range_brackets_daly_and_marks_it():
    """The default sweep spans Daly / 4 to Daly x 4 and reports Young and Daly overheads."""
    result = sweep(mtbf_s=HOUR, cost_s=5.0, points=9, failures=5_000)
    daly = daly_interval(HOUR, 5.0)
    assert result.intervals_s[0] == pytest.approx(daly / 4)
    assert result.intervals_s[-1] == pytest.approx(daly * 4)
    assert result.daly_interval_s == daly
    assert 0 < result.daly_overhead < 1 and 0 < result.young_overhead < 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mtbf_s": 0.0, "cost_s": 1.0}, "mtbf_s"),
        ({"mtbf_s": -HOUR, "cost_s": 1.0}, "mtbf_s"),
        ({"mtbf_s": HOUR, "cost_s": 0.0}, "cost_s"),
        ({"mtbf_s": HOUR, "cost_s": 1.0, "restart_s": -1.0}, "restart_s"),
        ({"mtbf_s": HOUR, "cost_s": 1.0, "failures": 0}, "failures"),
        ({"mtbf_s": HOUR, "cost_s": 1.0, "points": 1}, "points"),
        ({"mtbf_s": HOUR, "cost_s": 1.0, "intervals_s": [10.0, 0.0]}, "intervals_s"),
        ({"mtbf_s": HOUR, "cost_s": 1.0, "min_interval_s": 100.0, "max_interval_s": 50.0}, "below"),
    ],
)
def test_sweep_rejects_bad_input(kwargs, match):
    """Out-of-range arguments raise ValueError naming the problem."""
    with pytest.raises(ValueError, match=match):
        sweep(**kwargs)


def test_cli_simulate_defaults_are_fast_and_report_optimum(capsys):
    """`simulate --json` with default sizes finishes in under 2 s and names optimum, Young and Daly."""
    start = time.perf_counter()
    assert main(["simulate", "--mtbf", "8h", "--save-cost", "2s", "--json"]) == 0
    assert time.perf_counter() - start < 2.0
    out = json.loads(capsys.readouterr().out)
    assert out["daly_interval_s"] == pytest.approx(daly_interval(8 * HOUR, 2.0))
    assert out["optimum_interval_s"] == pytest.approx(out["daly_interval_s"], rel=0.10)
    assert len(out["intervals_s"]) == len(out["overhead"]) == 81


def test_cli_simulate_text_marks_the_measured_optimum(capsys):
    """The text table marks the measured optimum and lists Young and Daly."""
    assert main(["simulate", "--mtbf", "6h", "--save-cost", "5m", "--points", "11", "--failures", "20000"]) == 0
    text = capsys.readouterr().out
    assert "<- measured optimum" in text and "Young (1974)" in text and "Daly (2006)" in text


def test_cli_simulate_plot_without_matplotlib_exits_2(capsys, monkeypatch, tmp_path):
    """--plot without matplotlib fails with exit 2 and says to pip install matplotlib."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["simulate", "--mtbf", "8h", "--save-cost", "2s", "--plot", str(tmp_path / "o.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists()


def test_plot_sweep_without_matplotlib_raises_with_install_hint(monkeypatch, tmp_path):
    """plot_sweep raises ImportError naming the install command when matplotlib is missing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = sweep(mtbf_s=HOUR, cost_s=5.0, points=3, failures=1_000)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_sweep(result, str(tmp_path / "o.png"))


def test_cli_simulate_plot_writes_png(tmp_path, capsys):
    """With matplotlib installed, --plot writes a PNG file."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "overhead.png"
    assert main(["simulate", "--mtbf", "8h", "--save-cost", "2s", "--failures", "5000", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--save-cost", "2s"], "--mtbf"),
        (["simulate", "--mtbf", "0", "--save-cost", "2s"], "must be positive"),
        (["simulate", "--mtbf", "8h", "--save-cost", "2s", "--points", "1"], "--points"),
        (["simulate", "--mtbf", "8h", "--save-cost", "2s", "--failures", "100000000"], "--failures"),
        (["simulate", "--mtbf", "8h", "--save-cost", "2s", "--min-interval", "10m", "--max-interval", "5m"], "below"),
    ],
)
def test_cli_simulate_bad_arguments_exit_2(capsys, argv, message):
    """Bad simulate arguments return 2 with a message."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err
