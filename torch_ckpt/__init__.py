"""torch-ckpt: asynchronous, atomic, sharded (DCP) checkpoints for PyTorch training.

Names are imported lazily on first use, so ``import torch_ckpt`` (and the ``torch-ckpt`` command
line) stays fast and has no side effects.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointManager": "torch_ckpt.manager",
    "CheckpointConfig": "torch_ckpt.config",
    "AsyncCheckpointer": "torch_ckpt.checkpointer",
    "TrainState": "torch_ckpt.state",
    "OptimizerState": "torch_ckpt.optim_plain",
    "Naming": "torch_ckpt.naming",
    "StepNaming": "torch_ckpt.naming",
    "PatternNaming": "torch_ckpt.naming",
    "is_committed": "torch_ckpt.layout",
    "SaveHandle": "torch_ckpt.handle",
    "SaveStats": "torch_ckpt.handle",
    "SaveReports": "torch_ckpt.save_reports",
    "rank_and_world": "torch_ckpt.dist",
    "RetentionPolicy": "torch_ckpt.retention",
    "KeepLatest": "torch_ckpt.retention",
    "KeepEveryNSteps": "torch_ckpt.retention",
    "KeepAny": "torch_ckpt.retention",
    "SavePolicy": "torch_ckpt.schedule",
    "EveryNSteps": "torch_ckpt.schedule",
    "EveryNSeconds": "torch_ckpt.schedule",
    "YoungDaly": "torch_ckpt.schedule",
    "AnyOf": "torch_ckpt.schedule",
    "young_interval": "torch_ckpt.interval",
    "daly_interval": "torch_ckpt.interval",
    "expected_overhead": "torch_ckpt.interval",
    "expected_lost_work": "torch_ckpt.interval",
    "checkpoint_interval": "torch_ckpt.interval",
    "parse_duration": "torch_ckpt.durations",
    "format_duration": "torch_ckpt.durations",
    "export_torch": "torch_ckpt.tools.convert",
    "load_full_state": "torch_ckpt.tools.convert",
    "Cadence": "torch_ckpt.cadence",
    "DurableTier": "torch_ckpt.tiers",
    "DurableUnavailableError": "torch_ckpt.tiers",
    "Replicator": "torch_ckpt.replicator",
    "Manifest": "torch_ckpt.layout",
    "read_manifest": "torch_ckpt.layout",
    "log_all_ranks": "torch_ckpt._logging",
    "export_safetensors": "torch_ckpt.tools.convert",
    "CheckpointError": "torch_ckpt.errors",
    "CheckpointNotFoundError": "torch_ckpt.errors",
    "CheckpointCorruptError": "torch_ckpt.errors",
    "UnsafeCheckpointError": "torch_ckpt.errors",
    "StateMismatchError": "torch_ckpt.errors",
    "CheckpointWriteError": "torch_ckpt.errors",
    "CheckpointTimeoutError": "torch_ckpt.errors",
    "ConfigError": "torch_ckpt.errors",
    "CheckpointReadError": "torch_ckpt.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
