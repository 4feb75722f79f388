"""Background replication of committed local checkpoints to the durable tier.

One thread on the rank that acts on the root (each node's leader with node-local roots), started
when a step is queued and ended when nothing is left; at interpreter exit queued uploads get up to
``exit_flush_seconds``. At most one step is pending: a newer commit replaces an older one not yet
started (so an outage builds no backlog and the newest becomes durable first), except a step the
durable retention keeps as history (``never_skip``), uploaded after the newest. Errors are retried
with capped exponential backoff while training goes on; :meth:`Replicator.stats` reports the lag.
After each durable commit the durable retention runs. The thread also keeps the last known listing
(:meth:`Replicator.durable_listing`), so ``health()`` reports the tier without I/O on the caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_ckpt._lifecycle import finish_at_exit
from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.format._files import Manifest
from torch_ckpt.policy._lineage import head_of
from torch_ckpt.policy._retention import RetentionPolicy, apply_retention
from torch_ckpt.root._layout import read_manifest
from torch_ckpt.tiers._durable import DurableTier, remove_abandoned

__all__ = ["Replicator"]

log = get_logger(__name__)

#: A listing asked for by :meth:`Replicator.durable_listing` runs at most this often (seconds).
RELIST_SECONDS = 10.0


class Replicator:
    """Uploads committed local checkpoints, newest first, one at a time.

    Args:
        tier: the durable tier.
        retention: durable retention policy (None keeps everything).
        backoff_initial_seconds: first retry delay (seconds); doubles up to ``backoff_max_seconds``.
        backoff_max_seconds: longest retry delay (seconds).
        on_durable: called with ``(step, local_dir)`` after a durable commit.
        upload: ``upload(local_dir, manifest, abandon)`` replacing ``tier.upload`` (the root
            layout's uploader); ``abandon()`` is True once a newer step is queued (never for a step
            ``never_skip`` keeps).
        abandoned_after_seconds: after a durable commit (at most once per ``min(this, 1 h)``), delete
            manifest-less step prefixes idle for longer than this (seconds; None: never), except
            steps queued or uploading here.
        never_skip: True for a step uploaded even when newer steps commit first (history the durable
            retention keeps); None: any queued step may be coalesced away. The same on every node.
        arranges: move durable steps that an upload's lineage supersedes aside (:meth:`_make_way`);
            False on the nodes that do not commit, which wait (retrying) for the committing node.
        commits: a successful ``upload`` commits the step (False on the nodes that upload only
            their part); a committed step joins the known listing at once.
        exit_flush_seconds: how long the interpreter's exit waits for queued uploads (seconds).
    """

    def __init__(self, tier: DurableTier, *, retention: RetentionPolicy | None = None,
                 backoff_initial_seconds: float = 0.5, backoff_max_seconds: float = 30.0,
                 on_durable: Callable[[int, Path], None] | None = None,
                 abandoned_after_seconds: float | None = 24 * 3600.0,
                 upload: Callable[[Path, Any, Callable[[], bool]], None] | None = None,
                 never_skip: Callable[[int], bool] | None = None, arranges: bool = True,
                 commits: bool = True, exit_flush_seconds: float = 0.0) -> None:
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
        self._arranges = arranges
        self._cleared: Any = None  # lineage whose superseded durable steps are already moved aside
        self._uploaded_bytes = 0
        self._referenced_bytes = 0
        self._commits = commits
        self._known: dict[int, Manifest] | None = None  # the last listing of the tier (None: none succeeded)
        self._listed_at: float | None = None  # monotonic time of the last listing asked for
        self._list_requested = False  # health() asks for listings (durable_listing)
        self._exit_flush_s = float(exit_flush_seconds)
        self._thread: threading.Thread | None = None  # started on demand, ends when nothing is queued
        finish_at_exit(self, 1)

    def submit(self, step: int, local_dir: Path) -> None:
        """Queue a committed local checkpoint (replaces a queued older one unless :meth:`keeps` it)."""
        with self._cond:
            if self._pending is not None and self._pending[0] < step:
                self._set_aside(*self._pending, superseded_by=step)
            if self._pending is None or self._pending[0] < step:
                self._pending = (step, local_dir)
            self._ensure_thread()
            self._cond.notify_all()

    def _ensure_thread(self) -> None:
        """Start this replicator's thread if none runs (called with ``_cond`` held)."""
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._loop, name="torch_ckpt_replicator", daemon=True)
            self._thread.start()

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
        seconds), ``outage_s``, ``last_error``, ``skipped`` (coalesced steps), ``uploaded_bytes`` (sent to the
        store) and ``referenced_bytes`` (files of incremental saves not uploaded: they reference the object of
        an earlier step)."""
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
                "referenced_bytes": self._referenced_bytes,
            }

    def durable_listing(self, *, refresh: bool = True) -> dict[int, Manifest] | None:
        """The last known ``{step: manifest}`` of the durable tier (a copy, updated by this replicator's
        commits and deletions), without I/O on this thread; None when no listing succeeded yet or the
        last one failed (``last_error`` in :meth:`stats`). ``refresh`` asks this replicator's thread to
        list again (at most every ``RELIST_SECONDS``, after any upload in progress)."""
        with self._cond:
            if refresh and not self._list_requested and (
                    self._listed_at is None or time.monotonic() - self._listed_at >= RELIST_SECONDS):
                self._list_requested = True
                self._ensure_thread()
                self._cond.notify_all()
            return None if self._known is None else dict(self._known)

    def _list(self) -> None:
        """List the tier (on this replicator's thread) into the known listing."""
        with self._cond:
            self._listed_at = time.monotonic()
        try:
            listing = self.tier.list_steps()
        except Exception as exc:  # noqa: BLE001 - reported through durable_listing() and stats()
            with self._cond:
                self._known, self._last_error = None, f"listing: {type(exc).__name__}: {exc}"
            log.debug("listing durable tier %s failed: %s", self.tier.url, exc)
            return
        with self._cond:
            self._known = listing

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
        """Interpreter exit (:mod:`torch_ckpt._lifecycle`): finish the queued uploads within ``exit_flush_seconds``."""
        with self._cond:
            if self._stop or self._thread is None:
                return
            queued = sorted(self.busy_steps())
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
                if self._stop or (self._pending is None and not self._history and not self._list_requested):
                    # idle (submit() or a listing request starts a new thread), or close() gave up waiting
                    self._thread = None
                    self._cond.notify_all()
                    return
                step: int | None = None
                if self._pending is None and not self._history:  # only a listing was asked for
                    self._list_requested = False
                elif self._pending is not None:  # the newest first
                    (step, local_dir), self._pending = self._pending, None
                else:
                    step = max(self._history)
                    local_dir = self._history.pop(step)
                self._active = step
            if step is None:
                self._list()
                continue
            pause = 0.0
            try:
                manifest = read_manifest(local_dir)
                if self._make_way(manifest):
                    referenced0 = self.tier.bytes_referenced
                    self._upload(local_dir, manifest, self._newer_queued)
                    referenced = self.tier.bytes_referenced - referenced0  # hard-linked files not uploaded
                    with self._cond:
                        if self._durable_step is None or step > self._durable_step:  # history steps come later
                            self._durable_step, self._durable_time = step, time.time()
                        self._uploaded_bytes += sum(f["bytes"] for f in manifest.files.values()) - referenced
                        self._referenced_bytes += referenced
                        if self._commits and self._known is not None:
                            self._known[step] = manifest
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
                pause, delay = delay, min(delay * 2, self._backoff_max)
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
                if pause:
                    self._cond.wait(timeout=pause)

    def _make_way(self, manifest: Any) -> bool:
        """Before ``manifest``'s step is uploaded: apply the lineage rule (:mod:`torch_ckpt.policy._lineage`).

        False (not uploaded, with a warning) when the tier holds a newer timeline superseding it.
        Otherwise every durable step it supersedes, and another checkpoint under its own name, is
        moved aside first (once per lineage), so an upload never writes into a listed checkpoint;
        without ``arranges``, RuntimeError (retried) until the committing node has done so.
        """
        if manifest.lineage == self._cleared:
            return True
        durable = self.tier.list_steps()
        head = head_of([manifest.lineage, *(m.lineage for m in durable.values())])
        if not head.holds(manifest.step, manifest.lineage):
            log.warning("step %d is not replicated: the durable tier %s holds a newer timeline (%s) that supersedes "
                        "it (see torch_ckpt.policy._lineage)", manifest.step, self.tier.url, head.describe())
            return False
        stale = sorted(s for s, m in durable.items() if not head.holds(s, m.lineage) or
                       (s == manifest.step and (m.wall_time, m.lineage) != (manifest.wall_time, manifest.lineage)))
        if not self._arranges:
            if manifest.step in stale:
                raise RuntimeError(f"durable tier {self.tier.url}: step {manifest.step} still holds a checkpoint of "
                                   "another timeline; waiting for the committing node to move it aside")
        else:
            for s in stale:
                self.tier.set_aside(s, reason="superseded")
        if self._arranges or not stale:
            self._cleared = manifest.lineage
        return True

    def _apply_retention(self) -> None:
        if self.retention is None:
            return
        try:
            durable = self.tier.list_steps(reuse=True)  # this process alone writes the tier
            with self._cond:
                self._known = dict(durable)
            head = head_of(m.lineage for m in durable.values())  # superseded steps are neither kept nor counted
            steps = [s for s, m in durable.items() if head.holds(s, m.lineage)]
            for step in apply_retention(self.retention, steps, protected=list(self.busy_steps())):
                with self._cond:
                    if self._known is not None:
                        self._known.pop(step, None)
                self.tier.delete(step, listed=durable)
                durable.pop(step, None)
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
