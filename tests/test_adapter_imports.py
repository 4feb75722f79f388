"""The adapters stand on the core's public surface (only names in ``torch_ckpt.__all__``) and keep every private
attribute of Lightning/Accelerate they use in their ``_compat.py``."""

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


#: Names for the adapters' own objects: their private attributes are theirs to use anywhere in the package.
OWN_OBJECTS = {"self", "cls", "io", "_compat", "compat"}


def framework_privates(package: str) -> list[str]:
    """Private attributes and private imported names of other packages used outside the adapter's ``_compat.py``."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in OWN_OBJECTS):
                bad.append(f"{where}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "setattr", "hasattr") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and str(node.args[1].value).startswith("_"):
                bad.append(f"{where}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] not in (package, "__future__"):
                bad += [f"{where}: import {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return bad


@pytest.mark.parametrize("package", ["accelerate_ckpt", "lightning_ckpt"])
def test_framework_privates_only_in_compat(package):
    """Every private attribute or name of Lightning/Accelerate the adapter touches is in its ``_compat.py``."""
    assert framework_privates(package) == []


def test_the_compat_check_catches_private_access(tmp_path, monkeypatch):
    """Private attributes, ``getattr`` names and imports are reported outside ``_compat.py``, not inside it."""
    pkg = tmp_path / "fake_adapter"
    pkg.mkdir()
    body = "from lightning.fabric.utilities.data import _set_sampler_epoch\nx = trainer._checkpoint_connector\n" \
           "y = getattr(acc, '_models')\nz = self._own\n"
    (pkg / "mod.py").write_text(body, encoding="utf-8")
    (pkg / "_compat.py").write_text(body, encoding="utf-8")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert framework_privates("fake_adapter") == [
        "fake_adapter/mod.py:1: import lightning.fabric.utilities.data._set_sampler_epoch",
        "fake_adapter/mod.py:2: trainer._checkpoint_connector",
        "fake_adapter/mod.py:3: getattr(acc, '_models')"]
