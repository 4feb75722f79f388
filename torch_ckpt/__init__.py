"""torch-ckpt: asynchronous, atomic, sharded (DCP) checkpoints for PyTorch training.

The public surface is :data:`__all__`; every other public name lives in its subpackage
(``torch_ckpt.policy``, ``torch_ckpt.save``, ``torch_ckpt.tiers``, ``torch_ckpt.errors``...). Names are
imported on first use, so ``import torch_ckpt`` (and the ``torch-ckpt`` command line) stays fast and
has no side effects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_ckpt.config import CheckpointConfig
    from torch_ckpt.distributed import rank_and_world
    from torch_ckpt.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointWriteError,
        ConfigError,
        StateMismatchError,
        UnsafeCheckpointError,
    )
    from torch_ckpt.format import TypedValues, read_manifest
    from torch_ckpt.handle import SaveHandle
    from torch_ckpt.manager import CheckpointManager
    from torch_ckpt.policy import (
        EveryNSeconds,
        EveryNSteps,
        KeepEveryNSteps,
        KeepLatest,
        PatternNaming,
        RetentionPolicy,
        SavePolicy,
        StepNaming,
        YoungDaly,
    )
    from torch_ckpt.root import is_committed
    from torch_ckpt.save import AfterCommit, SaveReports
    from torch_ckpt.state import Checkpointable, OptimizerState, TrainState
    from torch_ckpt.tiers import DurableTier
    from torch_ckpt.tools import load_full_state

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "CheckpointConfig", "TrainState", "OptimizerState", "Checkpointable", "SaveHandle",
    "SaveReports", "StepNaming", "PatternNaming", "SavePolicy", "EveryNSteps", "EveryNSeconds", "YoungDaly",
    "RetentionPolicy", "KeepLatest", "KeepEveryNSteps", "DurableTier", "read_manifest", "is_committed",
    "load_full_state", "rank_and_world", "CheckpointError", "ConfigError", "CheckpointNotFoundError",
    "CheckpointCorruptError", "CheckpointWriteError", "StateMismatchError", "UnsafeCheckpointError",
    "AfterCommit", "TypedValues",
]

#: The module each public name is imported from on first use.
_SOURCES = {
    "torch_ckpt.manager": ("CheckpointManager",),
    "torch_ckpt.config": ("CheckpointConfig",),
    "torch_ckpt.state": ("TrainState", "OptimizerState", "Checkpointable"),
    "torch_ckpt.handle": ("SaveHandle",),
    "torch_ckpt.save": ("SaveReports", "AfterCommit"),
    "torch_ckpt.policy": ("StepNaming", "PatternNaming", "SavePolicy", "EveryNSteps", "EveryNSeconds", "YoungDaly",
                          "RetentionPolicy", "KeepLatest", "KeepEveryNSteps"),
    "torch_ckpt.tiers": ("DurableTier",),
    "torch_ckpt.format": ("read_manifest", "TypedValues"),
    "torch_ckpt.root": ("is_committed",),
    "torch_ckpt.tools": ("load_full_state",),
    "torch_ckpt.distributed": ("rank_and_world",),
    "torch_ckpt.errors": ("CheckpointError", "ConfigError", "CheckpointNotFoundError", "CheckpointCorruptError",
                          "CheckpointWriteError", "StateMismatchError", "UnsafeCheckpointError"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
