"""The durable tier (an fsspec store), the background replicator and the cleanup of tiers."""

from torch_ckpt.tiers._durable import DurableTier, DurableUnavailableError
from torch_ckpt.tiers._replicator import Replicator

__all__ = ["DurableTier", "DurableUnavailableError", "Replicator"]
