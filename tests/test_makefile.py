"""The Makefile's environment: keyed on the dependency files' contents, reused by every fresh clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _clone(tmp_path: Path, name: str = "clone") -> Path:
    """A directory holding copies of the Makefile and pyproject.toml, freshly written (as a clone's are)."""
    clone = tmp_path / name
    clone.mkdir()
    for f in ("Makefile", "pyproject.toml"):
        shutil.copyfile(ROOT / f, clone / f)
    return clone


def _make(clone: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(["make", "-n", "-s", "-C", str(clone), *args], capture_output=True, text=True, env=env,
                         timeout=60, check=True)
    return out.stdout


def test_a_fresh_clone_reuses_an_installed_environment(tmp_path):
    """Files newer than the environment's stamp (any fresh clone) do not re-run the install."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".deps-installed").touch()
    old = time.time() - 3600
    os.utime(venv / ".deps-installed", (old, old))
    plan = _make(_clone(tmp_path), "setup", f"VENV={venv}")
    assert "-m venv" not in plan and "creating" not in plan
    assert "install --no-deps --no-build-isolation -e ." in plan  # the clone's own code is still installed


def test_a_missing_stamp_builds_the_environment(tmp_path):
    """An environment without its stamp is created and installed."""
    plan = _make(_clone(tmp_path), "setup", f"VENV={tmp_path / 'venv'}")
    assert "-m venv" in plan and '-e ".[dev]"' in plan


def test_other_dependency_files_get_another_environment(tmp_path):
    """The environment's name depends on the contents of pyproject.toml, not on where the clone is."""
    a, b, c = _clone(tmp_path, "a"), _clone(tmp_path, "b"), _clone(tmp_path, "c")
    (c / "pyproject.toml").write_text((c / "pyproject.toml").read_text() + "\n# changed\n")
    names = [re.findall(r"venv-[0-9a-f]{16}", _make(d, "venv-path", f"CACHE_DIR={tmp_path / 'cache'}"))
             for d in (a, b, c)]
    assert len(names[0]) == 1 and names[0] == names[1] != names[2]
