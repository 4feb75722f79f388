"""What follows a commit of :class:`~torch_ckpt.CheckpointManager` on the root: callbacks, replication, retention.

A mixin of the manager (it uses the manager's root, naming, tiers and engine). In the writer
thread, once every rank is done with a committed directory, the rank acting on the root runs the
commit callbacks, hands the checkpoint to the durable tier's :class:`~torch_ckpt.tiers._replicator.Replicator`
and applies local retention; the replicator records each durable copy in the local manifest.
Failures here are logged and never change the save's outcome.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._lineage import BASE
from torch_ckpt.policy._retention import RetentionPolicy, apply_retention
from torch_ckpt.root._layout import (
    read_manifest,
    retire_step_dir,
    scan_committed,
    scan_manifests,
    update_manifest_tiers,
)
from torch_ckpt.tiers._replicator import Replicator

log = get_logger("torch_ckpt.manager._manager")

__all__ = ["ManagerCommitMixin"]


class ManagerCommitMixin:
    """Commit callbacks, durable replication and retention of :class:`~torch_ckpt.CheckpointManager`."""

    def _make_replicator(self, retention: RetentionPolicy | None) -> Replicator:
        # nothing here references the manager: its replicator thread must not keep an unclosed manager alive
        every = self.config.durable_keep_every_n_steps
        history = None if every is None else (lambda step: step % every == 0)  # never coalesced away
        tier, wait_seconds = self._tier, self._durable_flush_timeout
        record = _durable_recorder(tier.url)
        # the layout's upload (node-local roots: every node uploads its own shards); the committing rank runs
        # durable retention and cleanup
        commit, upload = self._roots.commits, self._roots.uploader(tier, wait_seconds)
        return Replicator(tier, retention=retention if commit else None, upload=upload,
                          on_durable=record if commit else None,
                          abandoned_after_seconds=24 * 3600.0 if commit else None, never_skip=history,
                          arranges=commit, commits=commit, exit_flush_seconds=wait_seconds)

    def add_commit_callback(self, callback: Callable[[int, Path], None]) -> None:
        """Call ``callback(step, directory)`` after each commit, on rank 0 only.

        It runs in the writer thread once every rank has finished with the committed directory
        (no rank reads it again), before replication and retention of that save. An exception it
        raises is logged and never changes the save's outcome. Use it for links and notifications.
        """
        if not callable(callback):
            raise ConfigError(f"commit callback must be callable, got {callback!r}")
        self._commit_callbacks.append(callback)

    def _after_commit(self, step: int, final: Path, replicate: bool) -> Callable[[], None] | None:
        if not self._acts_on_root:
            return None
        # committed: a failing callback is reported and never fails the save
        for callback in self._commit_callbacks if self._ctx.is_coordinator else ():
            try:
                callback(step, final)
            except Exception as exc:  # noqa: BLE001
                log.error("commit callback %r for step %d (%s) failed: %s: %s", callback, step, final,
                          type(exc).__name__, exc)
        if replicate and self._replicator is not None:
            self._replicator.submit(step, final)
        try:
            retired = self._apply_retention()
        except Exception as exc:  # noqa: BLE001
            log.error("retention after committing step %d failed (the checkpoint at %s is committed; older "
                      "checkpoints may remain): %s: %s", step, final, type(exc).__name__, exc)
            return None
        # retired checkpoints are hidden already; their bytes are deleted once `committed` resolved
        return (lambda: [shutil.rmtree(p, ignore_errors=True) for p in retired]) if retired else None

    def _catch_up_at_start(self) -> None:
        """At start, the work a commit's writer may not have lived to do (a rank killed after rank 0's rename).

        The newest committed step whose manifest records no durable copy in this manager's tier
        is handed to the replicator (shared roots), and local retention is applied, as right
        after its commit. Failures are logged: the start goes on.
        """
        try:
            committed = scan_committed(self.root, self.naming)
            if self._replicator is not None and not self._roots.node_local and committed:
                step = max(committed)
                durable = read_manifest(committed[step]).tiers.get("durable", {})
                if durable.get("url") != self._tier.url:
                    log.info("step %d has no durable copy in %s yet: replicating it now", step, self._tier.url)
                    self._replicator.submit(step, committed[step])
            for retired in self._apply_retention():
                shutil.rmtree(retired, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - the checkpoints stay as they are; the next commit tries again
            log.warning("replication and retention of the checkpoints found at start failed: %s: %s",
                        type(exc).__name__, exc)

    def _apply_retention(self) -> list[Path]:
        """Hide the checkpoints the retention policy retires (renamed to their trash names).

        Returns:
            The hidden trash directories, still to delete (``shutil.rmtree``).
        """
        if not self._acts_on_root or self.retention is None or self.config.explicit_paths_only:
            return []
        head = self._lineage if self._lineage is not None else BASE
        committed = {s: p for s, (p, m) in scan_manifests(self.root, self.naming).items()
                     if head.holds(s, m.lineage)}  # a superseded step is neither kept nor counted
        busy = self._replicator.busy_steps() if self._replicator is not None else set()
        retired: list[Path] = []
        for step in apply_retention(self.retention, list(committed), protected=sorted(busy)):
            try:
                retired.append(retire_step_dir(committed[step]))
                log.info("retention removed step %d (%s)", step, committed[step])
            except OSError as exc:
                log.warning("retention could not remove %s: %s", committed[step], exc)
        return retired


def _durable_recorder(url: str) -> Callable[[int, Path], None]:
    """The replicator's ``on_durable``: record the durable copy of a step in its local manifest."""

    def record(step: int, local_dir: Path) -> None:
        try:
            update_manifest_tiers(local_dir, {"durable": {"url": url, "committed_at": time.time()}})
        except OSError as exc:  # the local copy may have been pruned meanwhile
            log.debug("could not record the durable copy of step %d in %s: %s", step, local_dir, exc)

    return record
