"""Helpers for lifecycle tests: the torch-ckpt threads still alive."""

from __future__ import annotations

import threading
import time


def ckpt_threads(settle_s: float = 10.0) -> list[str]:
    """Names of the torch-ckpt threads of this process still alive after up to ``settle_s`` for them to end."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("torch_ckpt")]
        if not alive or time.monotonic() > deadline:
            return [t.name for t in alive]
        alive[0].join(0.05)
