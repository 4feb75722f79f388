"""lightning_ckpt/__init__.py: the public names, and constructors LightningCLI can turn into YAML."""

from __future__ import annotations

import inspect

import pytest

import lightning_ckpt


def test_every_public_name_imports():
    """Every name in lightning_ckpt.__all__ is importable from the package."""
    assert all(getattr(lightning_ckpt, name) is not None for name in lightning_ckpt.__all__)


@pytest.mark.parametrize("name", [n for n in lightning_ckpt.__all__ if isinstance(getattr(lightning_ckpt, n), type)])
def test_every_constructor_argument_is_typed_and_documented(name):
    """LightningCLI reads types and Args: help from the signature and docstring: none may be missing."""
    docstring_parser = pytest.importorskip("docstring_parser")
    cls = getattr(lightning_ckpt, name)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    documented = {p.arg_name for p in docstring_parser.parse(cls.__doc__).params if p.description}
    assert all(p.annotation is not inspect.Parameter.empty for p in params)
    assert {p.name for p in params} <= documented
