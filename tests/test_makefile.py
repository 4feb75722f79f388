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


# variables the Makefile reads: an outer `make test VENV=...` exports them to this process (command-line
# variables reach recipes' environments), and an inherited VENV would override every clone's own path
_MAKEFILE_VARS = {"VENV", "CACHE_DIR", "PYTHON", "TORCH_SPEC", "TORCH_INDEX_URL", "PYTEST_ARGS", "DEMO_DIR",
                  "TEST_WORKERS"}


def _make(clone: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k not in _MAKEFILE_VARS}
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


def test_variables_of_an_outer_make_do_not_leak_into_the_plan(tmp_path, monkeypatch):
    """Under `make test VENV=... CACHE_DIR=...` (exported to pytest) a clone still gets its own hashed environment."""
    monkeypatch.setenv("VENV", str(tmp_path / "outer-venv"))
    monkeypatch.setenv("CACHE_DIR", str(tmp_path / "outer-cache"))
    plan = _make(_clone(tmp_path), "venv-path", f"CACHE_DIR={tmp_path / 'cache'}")  # `make -n`: "echo PATH"
    assert re.search(re.escape(str(tmp_path / "cache")) + r"/venv-[0-9a-f]{16}$", plan.strip()), plan


def test_every_target_runs_its_own_clones_code_first(tmp_path):
    """Recipes see the clone first on PYTHONPATH: the shared environment's editable install may be another clone's."""
    clone = _clone(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MAKE") and k not in _MAKEFILE_VARS and k != "PYTHONPATH"}
    out = subprocess.run(["make", "-s", "-C", str(clone), "--eval", "show-path:\n\t@echo $$PYTHONPATH", "show-path"],
                         capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.strip() == str(clone)
