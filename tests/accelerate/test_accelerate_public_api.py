"""The public surface: every exported name imports, and the core never imports accelerate."""

from __future__ import annotations

import subprocess
import sys

import pytest

import accelerate_ckpt


def test_every_name_in_all_is_importable():
    """Each name in accelerate_ckpt.__all__ is an attribute of the package."""
    missing = [name for name in accelerate_ckpt.__all__ if not hasattr(accelerate_ckpt, name)]
    assert not missing


@pytest.mark.slow
def test_core_does_not_import_accelerate():
    """Importing every torch_ckpt module leaves accelerate unimported (the core never depends on it)."""
    code = ("import pkgutil, importlib, sys, torch_ckpt\n"
            "for m in pkgutil.iter_modules(torch_ckpt.__path__):\n"
            "    m.name != '__main__' and importlib.import_module('torch_ckpt.' + m.name)\n"
            "print('accelerate' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
