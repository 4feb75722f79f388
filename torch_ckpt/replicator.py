"""Background replication of committed local checkpoints to the durable tier.

One thread on the coordinating rank (on each node's leader with node-local roots), started when a
checkpoint is queued and ended when nothing is left to upload; at interpreter exit the queued
uploads get up to ``exit_flush_seconds`` (:mod:`torch_ckpt.lifecycle`). The queue holds
at most one pending step: a newer commit replaces an older one that has not started uploading
(coalescing), so an outage never builds an unbounded backlog and the newest checkpoint becomes
durable first. The one exception is a step the durable retention keeps as history (a multiple of
``durable_keep_every_n_steps``, see ``never_skip``): it is queued beside the newest and uploaded
after it, never coalesced away. Transient errors are retried with exponential backoff (capped);
during an outage training and local saves go on, a warning is logged once, and
:meth:`Replicator.stats` reports the lag. After each durable commit the durable retention policy
runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.layout import read_manifest
from torch_ckpt.lifecycle import finish_at_exit
from torch_ckpt.retention import RetentionPolicy, apply_retention
from torch_ckpt.tier_cleanup import remove_abandoned
from torch_ckpt.tiers import DurableTier

__all__ = ["Replicator"]

log = get_logger(__name__)


class Replicator:
    """Uploads committed local checkpoints, newest first, one at a time.

    Args:
        tier: the durable tier.
        retention: durable retention policy (None keeps everything).
        backoff_initial_seconds: first retry delay (seconds); doubles up to ``backoff_max_seconds``.
        backoff_max_seconds: longest retry delay (seconds).
        on_durable: called with ``(step, local_dir)`` after a durable commit.
        upload: ``upload(local_dir, manifest, abandon)`` replacing ``tier.upload`` (e.g. one node's
            part of a node-local checkpoint); ``abandon()`` is True once a newer step is queued
            (never for a step ``never_skip`` keeps).
        abandoned_after_seconds: after a durable commit (at most once per
            ``min(abandoned_after_seconds, 1 h)``), delete step prefixes that have no manifest and
            whose newest object is older than this (uploads abandoned by a crash); None never deletes
            them. Steps this replicator has queued or is uploading are never touched.
        never_skip: True for a step that must be uploaded even when newer steps commit before its
            upload starts (the steps the durable retention keeps as history); None: every queued
            step may be coalesced away. Every node of a node-local root must get the same function.
        exit_flush_seconds: how long the interpreter's exit waits for queued uploads (seconds; the
            manager passes ``durable_flush_timeout_seconds``).
    """

    def __init__(self, tier: DurableTier, *, retention: RetentionPolicy | None = None,
                 backoff_initial_seconds: float = 0.5, backoff_max_seconds: float = 30.0,
                 on_durable: Callable[[int, Path], None] | None = None,
                 abandoned_after_seconds: float | None = 24 * 3600.0,
                 upload: Callable[[Path, Any, Callable[[], bool]], None] | None = None,
                 never_skip: Callable[[int], bool] | None = None, exit_flush_seconds: float = 0.0) -> None:
        self.tier = tier
        self._upload = upload if upload is not None else (lambda local_dir, manifest, abandon:
                                                          tier.upload(local_dir, manifest))
        self.retention = retention
        self._backoff0 = backoff_initial_seconds
        self._backoff_max = backoff_max_seconds
        self._on_durable = on_durable
        self._abandoned_after = abandoned_after_seconds
        self._last_abandoned_check: float | None = None
        self._cond = threading.Condition()
        self._pending: tuple[int, Path] | None = None
        self._never_skip = never_skip
        self._history: dict[int, Path] = {}  # queued steps kept as history: uploaded after the newest
        self._active: int | None = None
        self._stop = False
        self._durable_step: int | None = None
        self._durable_time: float | None = None
        self._last_error: str | None = None
        self._outage_since: float | None = None
        self._skipped = 0
        self._uploaded_bytes = 0
        self._exit_flush_s = float(exit_flush_seconds)
        self._thread: threading.Thread | None = None  # started by submit(), ends when nothing is queued
        finish_at_exit(self, 1)

    def submit(self, step: int, local_dir: Path) -> None:
        """Queue a committed local checkpoint (replaces a queued older one unless :meth:`keeps` it)."""
        with self._cond:
            if self._pending is not None and self._pending[0] < step:
                self._set_aside(*self._pending, superseded_by=step)
            if self._pending is None or self._pending[0] < step:
                self._pending = (step, local_dir)
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._loop, name="torch_ckpt_replicator", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def keeps(self, step: int) -> bool:
        """True for a step never coalesced away (``never_skip``)."""
        return self._never_skip is not None and self._never_skip(step)

    def _set_aside(self, step: int, local_dir: Path, *, superseded_by: int) -> None:
        """A queued step a newer one replaces: kept for later when :meth:`keeps` it, else skipped."""
        if self.keeps(step):
            self._history[step] = local_dir
            log.info("step %d is uploaded after step %d (durable retention keeps it)", step, superseded_by)
        else:
            self._skipped += 1
            log.info("replication of step %d superseded by step %d", step, superseded_by)

    def _newer_queued(self) -> bool:
        with self._cond:
            if self._stop:
                return True
            return self._pending is not None and not (self._active is not None and self.keeps(self._active))

    def busy_steps(self) -> set[int]:
        """Steps queued or uploading (their local copies must not be deleted)."""
        with self._cond:
            busy = {s for s in (self._active, self._pending[0] if self._pending else None) if s is not None}
            return busy | set(self._history)

    def stats(self) -> dict[str, Any]:
        """Replication state: ``durable_step``, ``pending_step``, ``lag_s`` (age of the newest durable copy,
        seconds), ``outage_s``, ``last_error``, ``skipped`` (coalesced steps), ``uploaded_bytes``."""
        with self._cond:
            now = time.time()
            return {
                "durable_url": self.tier.url,
                "durable_step": self._durable_step,
                "pending_step": self._pending[0] if self._pending else self._active,
                "lag_s": None if self._durable_time is None else now - self._durable_time,
                "outage_s": None if self._outage_since is None else time.monotonic() - self._outage_since,
                "last_error": self._last_error,
                "skipped": self._skipped,
                "uploaded_bytes": self._uploaded_bytes,
            }

    def wait(self, timeout_seconds: float | None = None) -> bool:
        """Block until nothing is queued or uploading; False if ``timeout_seconds`` ran out."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        with self._cond:
            while self._pending is not None or self._active is not None or self._history:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
        return True

    def close(self, timeout_seconds: float | None = None) -> None:
        """Finish the queued replication (up to ``timeout_seconds``), then stop the thread."""
        finished = self.wait(timeout_seconds)
        if not finished:
            log.warning("durable replication to %s did not finish before close (%s)", self.tier.url, self.stats())
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _finish_at_exit(self) -> None:
        """Interpreter exit (:mod:`torch_ckpt.lifecycle`): finish the queued uploads within ``exit_flush_seconds``."""
        with self._cond:
            if self._stop or self._thread is None:
                return
            queued = sorted({s for s in (self._active, self._pending[0] if self._pending else None) if s is not None}
                            | set(self._history))
        log.warning("waiting up to %.0f s for the upload of step(s) %s to %s before the interpreter exits",
                    self._exit_flush_s, queued, self.tier.url)
        if not self.wait(self._exit_flush_s):
            log.error("the durable copy of step(s) %s on %s was not finished at the interpreter's exit (%s); the "
                      "local checkpoints are complete, the next run's saves are uploaded as usual", queued,
                      self.tier.url, self.stats())
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _loop(self) -> None:
        delay = self._backoff0
        while True:
            with self._cond:
                if self._stop or (self._pending is None and not self._history):
                    # idle (submit() starts a new thread), or close() gave up waiting: the rest is the next run's
                    self._thread = None
                    self._cond.notify_all()
                    return
                if self._pending is not None:  # the newest first
                    (step, local_dir), self._pending = self._pending, None
                else:
                    step = max(self._history)
                    local_dir = self._history.pop(step)
                self._active = step
            try:
                manifest = read_manifest(local_dir)
                self._upload(local_dir, manifest, self._newer_queued)
                with self._cond:
                    if self._durable_step is None or step > self._durable_step:  # history steps come later
                        self._durable_step, self._durable_time = step, time.time()
                    self._uploaded_bytes += sum(f["bytes"] for f in manifest.files.values())
                    if self._outage_since is not None:
                        log.warning("durable tier %s reachable again; step %d replicated", self.tier.url, step)
                    self._outage_since, self._last_error = None, None
                delay = self._backoff0
                log.info("replicated step %d to %s", step, self.tier.describe(step))
                if self._on_durable is not None:
                    self._on_durable(step, local_dir)
                self._apply_retention()
                self._remove_abandoned()
            except Exception as exc:  # noqa: BLE001 - retried; surfaced through stats and warnings
                with self._cond:
                    first = self._outage_since is None
                    if first:
                        self._outage_since = time.monotonic()
                    self._last_error = f"{type(exc).__name__}: {exc}"
                    if local_dir.exists() and self.keeps(step) and self._pending is not None:
                        self._history[step] = local_dir  # retried after the newer step
                    elif self._pending is None and local_dir.exists():  # retry unless superseded
                        self._pending = (step, local_dir)
                if first:
                    log.warning("replicating step %d to %s failed (%s); retrying with backoff, training goes on",
                                step, self.tier.url, exc)
                if isinstance(exc, CheckpointCorruptError):
                    log.warning("%s", exc)
                with self._cond:
                    self._active = None
                    self._cond.notify_all()
                    self._cond.wait(timeout=delay)
                delay = min(delay * 2, self._backoff_max)
                continue
            with self._cond:
                self._active = None
                self._cond.notify_all()

    def _apply_retention(self) -> None:
        if self.retention is None:
            return
        try:
            steps = list(self.tier.list_steps())
            for step in apply_retention(self.retention, steps, protected=list(self.busy_steps())):
                self.tier.delete(step)
                log.info("durable retention removed step %d from %s", step, self.tier.url)
        except Exception as exc:  # noqa: BLE001 - retention is retried after the next upload
            log.warning("durable retention on %s failed: %s", self.tier.url, exc)

    def _remove_abandoned(self) -> None:
        if self._abandoned_after is None:
            return
        now = time.monotonic()
        if self._last_abandoned_check is not None and \
                now - self._last_abandoned_check < min(self._abandoned_after, 3600.0):
            return
        self._last_abandoned_check = now
        try:
            remove_abandoned(self.tier, older_than_seconds=self._abandoned_after, exclude=self.busy_steps())
        except Exception as exc:  # noqa: BLE001 - retried after a later upload
            log.warning("removing abandoned uploads from %s failed: %s", self.tier.url, exc)
