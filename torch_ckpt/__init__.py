"""torch-ckpt: asynchronous, atomic, sharded (DCP) checkpoints for PyTorch training.

Names are imported lazily on first use, so ``import torch_ckpt`` (and the ``torch-ckpt`` command
line) stays fast and has no side effects.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointManager": "torch_ckpt.manager._manager",
    "CheckpointConfig": "torch_ckpt.config",
    "AsyncCheckpointer": "torch_ckpt.save._checkpointer",
    "TrainState": "torch_ckpt.state._train_state",
    "OptimizerState": "torch_ckpt.state._optimizer_state",
    "Naming": "torch_ckpt.policy._naming",
    "StepNaming": "torch_ckpt.policy._naming",
    "PatternNaming": "torch_ckpt.policy._naming",
    "is_committed": "torch_ckpt.root._layout",
    "SaveHandle": "torch_ckpt.handle",
    "SaveStats": "torch_ckpt.handle",
    "SaveReports": "torch_ckpt.save._reports",
    "rank_and_world": "torch_ckpt.distributed._context",
    "RetentionPolicy": "torch_ckpt.policy._retention",
    "KeepLatest": "torch_ckpt.policy._retention",
    "KeepEveryNSteps": "torch_ckpt.policy._retention",
    "KeepAny": "torch_ckpt.policy._retention",
    "SavePolicy": "torch_ckpt.policy._schedule",
    "EveryNSteps": "torch_ckpt.policy._schedule",
    "EveryNSeconds": "torch_ckpt.policy._schedule",
    "YoungDaly": "torch_ckpt.policy._schedule",
    "AnyOf": "torch_ckpt.policy._schedule",
    "young_interval": "torch_ckpt.policy._interval",
    "daly_interval": "torch_ckpt.policy._interval",
    "expected_overhead": "torch_ckpt.policy._interval",
    "expected_lost_work": "torch_ckpt.policy._interval",
    "checkpoint_interval": "torch_ckpt.policy._interval",
    "parse_duration": "torch_ckpt.durations",
    "format_duration": "torch_ckpt.durations",
    "export_torch": "torch_ckpt.tools.convert",
    "load_full_state": "torch_ckpt.tools.convert",
    "Cadence": "torch_ckpt.policy._cadence",
    "DurableTier": "torch_ckpt.tiers._durable",
    "DurableUnavailableError": "torch_ckpt.tiers._durable",
    "Replicator": "torch_ckpt.tiers._replicator",
    "Manifest": "torch_ckpt.root._layout",
    "read_manifest": "torch_ckpt.root._layout",
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
    "AfterCommit": "torch_ckpt.save._after_commit",
    "TypedValues": "torch_ckpt.format._typed_values",
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
