"""The adapters stand on the core's public surface: they import only names in ``torch_ckpt.__all__``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torch_ckpt

ROOT = Path(__file__).resolve().parents[1]


def private_imports(package: str) -> list[str]:
    """Every import of the core in ``package`` that is not ``from torch_ckpt import <name in __all__>``."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                bad += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("torch_ckpt.")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_ckpt":
                if node.module != "torch_ckpt":
                    bad.append(f"{where}: from {node.module} import ...")
                else:
                    bad += [f"{where}: {a.name} is not in torch_ckpt.__all__" for a in node.names
                            if a.name not in torch_ckpt.__all__]
    return bad


@pytest.mark.parametrize("package", ["accelerate_ckpt", "lightning_ckpt"])
def test_adapter_imports_only_public_core_names(package):
    """No ``from torch_ckpt.<module> import`` and no name outside ``torch_ckpt.__all__`` in the adapter."""
    assert private_imports(package) == []


def test_the_check_catches_a_private_import(tmp_path, monkeypatch):
    """A module importing ``torch_ckpt.root._layout`` and a private name is reported on both lines."""
    pkg = tmp_path / "fake_adapter"
    pkg.mkdir()
    (pkg / "mod.py").write_text("from torch_ckpt.root._layout import fsync_dir\nfrom torch_ckpt import _logging\n"
                                "from torch_ckpt import CheckpointManager\n", encoding="utf-8")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert private_imports("fake_adapter") == [
        "fake_adapter/mod.py:1: from torch_ckpt.root._layout import ...",
        "fake_adapter/mod.py:2: _logging is not in torch_ckpt.__all__"]
