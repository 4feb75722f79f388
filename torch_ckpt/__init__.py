"""torch-ckpt: asynchronous, atomic, sharded (DCP) checkpoints for PyTorch training."""

from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from torch_ckpt.handle import SaveHandle, SaveStats
from torch_ckpt.manager import CheckpointManager
from torch_ckpt.retention import KeepAny, KeepEveryNSteps, KeepLatest, RetentionPolicy
from torch_ckpt.state import TrainState

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "TrainState",
    "SaveHandle",
    "SaveStats",
    "RetentionPolicy",
    "KeepLatest",
    "KeepEveryNSteps",
    "KeepAny",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
    "StateMismatchError",
    "CheckpointWriteError",
    "CheckpointTimeoutError",
    "ConfigError",
]
