"""lightning-ckpt: torch-ckpt's asynchronous, atomic DCP checkpoints for PyTorch Lightning.

``Trainer(plugins=[AsyncDCPCheckpointIO()], callbacks=[MTBFCheckpoint("ckpts")])``; see ``docs/lightning.md``.
A thin adapter: all checkpoint logic lives in :mod:`torch_ckpt`. Importing it changes nothing in Lightning; the
plugin installs its wrappers when constructed (:func:`load_from_checkpoint` too).
"""

from lightning_ckpt._callback import MTBFCheckpoint
from lightning_ckpt._checkpoint_io import AsyncDCPCheckpointIO
from lightning_ckpt._load import load_from_checkpoint

__all__ = ["AsyncDCPCheckpointIO", "MTBFCheckpoint", "load_from_checkpoint"]
