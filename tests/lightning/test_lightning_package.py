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


_WRAPPED = """
import sys
from lightning.fabric.utilities import cloud_io
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
import lightning_ckpt
targets = [cloud_io._load, Trainer.save_checkpoint, ModelCheckpoint._link_checkpoint, LightningCLI._parse_ckpt_path,
           _CheckpointConnector._parse_ckpt_path]
before = [getattr(t, "_lightning_ckpt_wrapped", False) for t in targets]
lightning_ckpt.AsyncDCPCheckpointIO()
targets = [cloud_io._load, Trainer.save_checkpoint, ModelCheckpoint._link_checkpoint, LightningCLI._parse_ckpt_path,
           _CheckpointConnector._parse_ckpt_path]
print(before, [getattr(t, "_lightning_ckpt_wrapped", False) for t in targets])
"""


def test_importing_changes_nothing_in_lightning_and_the_plugin_installs_its_wrappers():
    """A fresh process: after ``import lightning_ckpt`` Lightning is untouched; constructing the plugin wraps the
    loader, ``Trainer.save_checkpoint``, links, the fresh-fit path parsing and LightningCLI's ``--ckpt_path``."""
    pytest.importorskip("jsonargparse")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WRAPPED], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == f"{[False] * 5} {[True] * 5}"
