"""A run root: step directories, temporaries and reservations, the root lock, committed-step scanning and
node-local roots."""

from torch_ckpt.root._layout import is_committed

__all__ = ["is_committed"]
