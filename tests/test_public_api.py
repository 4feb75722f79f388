"""The public surface: torch_ckpt.__all__, the subpackages' own surfaces, the state protocol, lazy imports."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_ckpt
from torch_ckpt.state import Checkpointable, HasStateDict, OptimizerState, TrainState

PKG = Path(torch_ckpt.__file__).parent

#: the names decided for torch_ckpt.__all__ (the adapters' helper adds at most two more)
DECIDED = {
    "CheckpointManager", "CheckpointConfig", "TrainState", "OptimizerState", "Checkpointable", "SaveHandle",
    "SaveReports", "StepNaming", "PatternNaming", "SavePolicy", "EveryNSteps", "EveryNSeconds", "YoungDaly",
    "RetentionPolicy", "KeepLatest", "KeepEveryNSteps", "DurableTier", "read_manifest", "is_committed",
    "load_full_state", "rank_and_world", "CheckpointError", "ConfigError", "CheckpointNotFoundError",
    "CheckpointCorruptError", "CheckpointWriteError", "StateMismatchError", "UnsafeCheckpointError",
}

#: names that left the top level, and the subpackage that keeps them public
MOVED = {
    "AsyncCheckpointer": "torch_ckpt.save", "SaveStats": "torch_ckpt.save", "Naming": "torch_ckpt.policy",
    "KeepAny": "torch_ckpt.policy", "AnyOf": "torch_ckpt.policy", "Cadence": "torch_ckpt.policy",
    "young_interval": "torch_ckpt.policy", "daly_interval": "torch_ckpt.policy",
    "expected_overhead": "torch_ckpt.policy", "expected_lost_work": "torch_ckpt.policy",
    "checkpoint_interval": "torch_ckpt.policy", "parse_duration": "torch_ckpt.durations",
    "format_duration": "torch_ckpt.durations", "export_torch": "torch_ckpt.tools",
    "export_safetensors": "torch_ckpt.tools", "DurableUnavailableError": "torch_ckpt.tiers",
    "Replicator": "torch_ckpt.tiers", "Manifest": "torch_ckpt.format", "log_all_ranks": "torch_ckpt.distributed",
    "CheckpointTimeoutError": "torch_ckpt.errors", "CheckpointReadError": "torch_ckpt.errors",
}

SUBPACKAGES = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())


def test_all_holds_the_decided_names_and_at_most_thirty():
    """__all__ has every decided name once, and at most two names beyond them."""
    assert DECIDED <= set(torch_ckpt.__all__)
    assert len(torch_ckpt.__all__) == len(set(torch_ckpt.__all__)) <= 30


@pytest.mark.parametrize("name", sorted(DECIDED))
def test_each_name_is_the_one_its_subpackage_exports(name):
    """torch_ckpt.X is the very object of the module it is taken from, and that module lists X in __all__."""
    module = importlib.import_module(torch_ckpt._MODULE_OF[name])
    assert getattr(torch_ckpt, name) is getattr(module, name)
    assert name in module.__all__


def test_type_checkers_see_the_names_the_runtime_gives():
    """The TYPE_CHECKING imports of torch_ckpt/__init__.py (what mypy reads) are __all__, from the same modules."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert seen == {name: torch_ckpt._MODULE_OF[name] for name in torch_ckpt.__all__}


@pytest.mark.parametrize(("name", "module"), sorted(MOVED.items()))
def test_names_that_left_the_top_stay_public_in_their_subpackage(name, module):
    """A name moved off torch_ckpt is no attribute of it any more, but is listed and resolves in its subpackage."""
    with pytest.raises(AttributeError):
        getattr(torch_ckpt, name)
    mod = importlib.import_module(module)
    assert name in mod.__all__ and getattr(mod, name) is not None


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_each_subpackage_init_is_a_thin_documented_surface(package):
    """Every subpackage __init__ has a docstring and an __all__ whose names resolve; it defines no class."""
    mod = importlib.import_module(f"torch_ckpt.{package}")
    assert (mod.__doc__ or "").strip()
    assert all(getattr(mod, name) is not None for name in mod.__all__)
    tree = ast.parse((PKG / package / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def test_unknown_names_raise_attribute_error_and_dir_lists_the_surface():
    """torch_ckpt.nonexistent raises AttributeError; dir(torch_ckpt) lists every public name."""
    with pytest.raises(AttributeError, match="nonexistent"):
        torch_ckpt.nonexistent  # noqa: B018
    assert set(torch_ckpt.__all__) <= set(dir(torch_ckpt))


def test_the_state_protocol_describes_what_save_and_restore_take():
    """TrainState, OptimizerState, a module and an optimizer are Checkpointable; a dict is not, an object with
    only state_dict() can be saved but not restored into."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for state in (TrainState(model=model, optimizer=optimizer), OptimizerState(optimizer), model, optimizer):
        assert isinstance(state, Checkpointable), state

    class SaveOnly:
        def state_dict(self) -> dict:
            return {}

    assert isinstance(SaveOnly(), HasStateDict) and not isinstance(SaveOnly(), Checkpointable)
    assert not isinstance({}, HasStateDict)


def test_the_package_is_typed():
    """py.typed ships beside torch_ckpt/__init__.py (PEP 561)."""
    assert (PKG / "py.typed").is_file()


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_import_is_lazy_and_fast_for_the_cli():
    """Importing torch_ckpt (and the CLI) imports neither torch nor any subpackage of torch_ckpt."""
    code = ("import sys, torch_ckpt; print(sorted(m for m in sys.modules if m.startswith('torch_ckpt.')));"
            "import torch_ckpt.tools.cli; print('torch' in sys.modules)")
    assert _fresh(code).splitlines() == ["[]", "False"]


def test_importing_the_config_does_not_load_the_engine():
    """torch_ckpt.config needs only the values, errors and policy modules: no torch, no restore engine."""
    code = ("import sys, torch_ckpt.config\n"
            "units = {m.split('.')[1] for m in sys.modules if m.startswith('torch_ckpt.')}\n"
            "print('torch' in sys.modules, sorted(units))")
    assert _fresh(code) == "False ['_logging', '_values', 'config', 'durations', 'errors', 'policy']"


@pytest.mark.slow
def test_core_imports_neither_lightning_nor_accelerate():
    """Importing every core module works with lightning and accelerate blocked."""
    code = ("import sys, pkgutil, importlib\n"
            "for blocked in ('lightning', 'pytorch_lightning', 'accelerate'):\n"
            "    sys.modules[blocked] = None\n"
            "import torch_ckpt\n"
            "for m in pkgutil.walk_packages(torch_ckpt.__path__, 'torch_ckpt.'):\n"
            "    if m.name != 'torch_ckpt.__main__':\n"
            "        importlib.import_module(m.name)\n"
            "print('ok')\n")
    assert _fresh(code) == "ok"
