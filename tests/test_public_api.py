"""The public surface of torch_ckpt: every exported name imports; the core never imports adapters."""

import subprocess
import sys

import pytest

import torch_ckpt


def test_every_name_in_all_imports():
    """Each name in torch_ckpt.__all__ resolves from the package root."""
    for name in torch_ckpt.__all__:
        assert getattr(torch_ckpt, name) is not None, name


@pytest.mark.slow
def test_core_imports_neither_lightning_nor_accelerate():
    """Importing every core module works with lightning and accelerate blocked."""
    code = ("import sys, pkgutil, importlib\n"
            "for blocked in ('lightning', 'pytorch_lightning', 'accelerate'):\n"
            "    sys.modules[blocked] = None\n"
            "import torch_ckpt\n"
            "for m in pkgutil.iter_modules(torch_ckpt.__path__):\n"
            "    if m.name != '__main__':\n"
            "        importlib.import_module('torch_ckpt.' + m.name)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_import_is_lazy_and_fast_for_the_cli():
    """Importing torch_ckpt does not import torch (the plan/simulate CLI starts instantly)."""
    code = "import sys, torch_ckpt, torch_ckpt.tools.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
