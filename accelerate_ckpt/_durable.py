"""The durable copy: committed checkpoints replicated to an fsspec URL, and fetched back on resume.

Uses the core's :class:`~torch_ckpt.tiers.DurableTier` (manifest-last commit, verified uploads) and
:class:`~torch_ckpt.replicator.Replicator` (one background thread on the main process, coalescing,
retries with backoff). The durable root mirrors the core's layout (``URL/step_<number>/``, number
= the Accelerate checkpoint number); a download lands in ``checkpoints/checkpoint_<number>/torch_ckpt``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from accelerate_ckpt._layout import PAYLOAD, checkpoint_dir
from torch_ckpt import CheckpointError, KeepLatest
from torch_ckpt.layout import fsync_dir
from torch_ckpt.replicator import Replicator
from torch_ckpt.tiers import DurableTier

__all__ = ["DurableCopy"]

log = logging.getLogger(__name__)


class DurableCopy:
    """Replication of one project's checkpoints to ``url`` (main process only).

    Args:
        url: fsspec URL of the durable root (``s3://bucket/run``, ``gs://``, ``file://``, ``memory://``).
        storage_options: fsspec options (credentials, endpoint...).
        keep: durable checkpoints to keep (None: all).
        verify: "checksum" (read every upload back) or "size".
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, keep: int | None = None,
                 verify: str = "checksum") -> None:
        self.tier = DurableTier(url, storage_options=storage_options, verify=verify)
        self.replicator = Replicator(self.tier, retention=KeepLatest(count=keep) if keep else None)

    def submit(self, number: int, payload: Path) -> None:
        """Queue a just-committed payload for upload (a newer one replaces a queued older one)."""
        self.replicator.submit(number, payload)

    def busy(self) -> set[int]:
        """Numbers queued or uploading: their local folders must not be pruned yet."""
        return self.replicator.busy_steps()

    def newest(self) -> int | None:
        """The newest committed durable checkpoint number; None if none or the store is unreachable."""
        try:
            steps = self.tier.list_steps()
        except CheckpointError as exc:
            log.warning("durable tier %s unavailable, resuming from local checkpoints only: %s", self.tier.url, exc)
            return None
        return max(steps) if steps else None

    def fetch(self, number: int, root: Path) -> Path:
        """Download checkpoint ``number`` (verified) into ``root/checkpoint_<number>``; returns that folder."""
        staging = root / ".durable_download"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        downloaded = self.tier.download(number, staging)
        folder = checkpoint_dir(root, number)
        folder.mkdir(parents=True, exist_ok=True)
        os.rename(downloaded, folder / PAYLOAD)
        fsync_dir(folder)
        shutil.rmtree(staging, ignore_errors=True)
        log.info("downloaded checkpoint %d from %s", number, self.tier.describe(number))
        return folder

    def stats(self) -> dict[str, Any]:
        """Replication state (``durable_step``, ``lag_s``, ``last_error``...), see the core's Replicator."""
        return self.replicator.stats()

    def close(self, timeout_seconds: float) -> None:
        """Finish queued uploads (up to ``timeout_seconds``), then stop the replication thread."""
        self.replicator.close(timeout_seconds)
