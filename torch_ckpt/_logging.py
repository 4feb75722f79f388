"""Rank-aware logging for torch-ckpt's loggers (no handler or global configuration is touched).

Every module logs through ``get_logger(__name__)``. In a distributed job only rank 0's records
pass by default; call :func:`log_all_ranks` (or set ``TORCH_CKPT_LOG_ALL_RANKS=1``) to see every
rank. Each record carries a ``rank`` attribute usable in formats (``%(rank)s``).
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "log_all_ranks"]

_ALL_RANKS = [os.environ.get("TORCH_CKPT_LOG_ALL_RANKS", "") not in ("", "0")]


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except (ImportError, RuntimeError, ValueError):
        return 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank = rank
        return rank == 0 or _ALL_RANKS[0] or record.levelno >= logging.ERROR


_FILTER = _RankFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the rank filter attached (errors from any rank always pass)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


def log_all_ranks(enabled: bool = True) -> None:
    """Let records from every rank through (default: rank 0 only, plus errors from any rank)."""
    _ALL_RANKS[0] = bool(enabled)
