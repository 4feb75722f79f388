"""Helpers shared by the benchmark scripts (run them as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def git_info() -> dict[str, Any]:
    """Commit of the checkout and whether the library has uncommitted changes (results depend on it)."""

    def git(*a):
        try:
            return subprocess.run(
                ["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "torch_ckpt")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "library_dirty": bool(status) if status is not None else None,
    }
