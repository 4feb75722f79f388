"""Helpers of the example tests: read an example's JSON-lines step log and compare two runs' logs."""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    """The records of a ``--log-jsonl`` file, one per line; ``[]`` when the run wrote none."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def assert_bitwise_equal(got: list[dict], want: list[dict]) -> None:
    """Same steps; loss and lr bitwise equal (same value and repr); same epoch and batch at every step."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in ("loss", "lr"):
            assert g[key] == w[key] and repr(g[key]) == repr(w[key]), \
                f"step {g['step']} {key}: {g[key]!r} != {w[key]!r}"
        assert g["epoch"] == w["epoch"], f"step {g['step']}: epoch {g['epoch']} != {w['epoch']}"
        assert g["batch"] == w["batch"], f"step {g['step']}: batch {g['batch']} != {w['batch']}"
