"""CheckpointManager: saving, retention, resume and health of one run root, on top of the save, restore and tier
packages."""

from torch_ckpt.manager._manager import CheckpointManager

__all__ = ["CheckpointManager"]
