"""Operator tools, off the save/restore path: the ``torch-ckpt`` command line, listing, inspection, verification
and export of checkpoints, and the interval sizing/simulation behind ``plan``, ``simulate`` and ``bench``. They
read checkpoints only through the storage/format layer, the same validation path a restore uses.

The exports are imported on first use, so the command line starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_ckpt.tools.convert import export_safetensors, export_torch, load_full_state

__all__ = ["load_full_state", "export_torch", "export_safetensors"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'torch_ckpt.tools' has no attribute {name!r}")
    return getattr(importlib.import_module("torch_ckpt.tools.convert"), name)
