"""The distributed context: rank, world size, the private checkpoint process groups, rank-aware logging."""

from torch_ckpt._logging import log_all_ranks
from torch_ckpt.distributed._context import rank_and_world

__all__ = ["rank_and_world", "log_all_ranks"]
