"""Uploads abandoned on the durable tier: step prefixes that never got their manifest.

A durable checkpoint is committed by writing its ``manifest.json`` last (:mod:`torch_ckpt.tiers._durable`),
so an uploader that dies midway leaves objects under a step prefix that no reader ever lists. These
functions find such prefixes once they have been idle long enough that no upload can still be
writing them, and delete them. The replicator runs :func:`remove_abandoned` after a durable commit
(at most once an hour); see :class:`torch_ckpt.tiers._replicator.Replicator`. A prefix holding any object
whose store reports no modification time is never deleted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torch_ckpt._logging import get_logger
from torch_ckpt.format._read import MANIFEST_NAME
from torch_ckpt.storage._locations import DurableUnavailableError, object_mtime

if TYPE_CHECKING:
    from torch_ckpt.tiers._durable import DurableTier

__all__ = ["abandoned_uploads", "idle_seconds", "remove_abandoned"]

log = get_logger(__name__)


def abandoned_uploads(tier: DurableTier, *, older_than_seconds: float,
                      exclude: set[int] | frozenset[int] = frozenset(), now: float | None = None) -> dict[int, float]:
    """``{step: age in seconds}`` of the tier's step prefixes without a manifest whose newest object
    is older than ``older_than_seconds``.

    A prefix whose objects carry no modification time, or any object younger than the limit, may
    still be uploading and is never returned; nor is any step in ``exclude``.

    Args:
        tier: the durable tier.
        older_than_seconds: idle time (seconds) after which a manifest-less prefix counts as abandoned.
        exclude: steps never returned (queued or uploading here).
        now: the current Unix time (seconds); defaults to ``time.time()``.

    Raises:
        DurableUnavailableError: the store cannot be listed.
    """
    now = time.time() if now is None else now
    found: dict[int, float] = {}
    for name in tier.list_names():
        named_step = tier.naming.step_of(name)
        if named_step is None or named_step in exclude:
            continue
        age = idle_seconds(tier, named_step, now)
        if age is not None and age > older_than_seconds:
            found[named_step] = age
    return found


def idle_seconds(tier: DurableTier, step: int, now: float) -> float | None:
    """Seconds since the newest object of an uncommitted step prefix was written; None when the
    step is committed, empty, or an object's time is unknown (it may still be uploading).

    Raises:
        DurableUnavailableError: the prefix cannot be listed.
    """
    prefix = tier.location(step).path
    try:
        objects = tier.fs.find(prefix, detail=True)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any backend error here means "unreachable"
        raise DurableUnavailableError(f"cannot list {tier.describe(step)}: {exc}") from exc
    if any(str(path).rstrip("/").endswith("/" + MANIFEST_NAME) for path in objects):
        return None  # committed (or being deleted manifest-first by retention)
    times = [object_mtime(info) for info in objects.values()]
    if not times or any(t is None for t in times):
        return None
    return now - max(times)


def remove_abandoned(tier: DurableTier, *, older_than_seconds: float,
                     exclude: set[int] | frozenset[int] = frozenset(), now: float | None = None) -> list[int]:
    """Delete the step prefixes :func:`abandoned_uploads` returns; returns their steps (ascending).

    Each prefix is listed again right before its deletion and kept if a manifest or a new object
    appeared meanwhile. Arguments as :func:`abandoned_uploads`.

    Raises:
        DurableUnavailableError: the store cannot be listed.
    """
    removed = []
    for step in sorted(abandoned_uploads(tier, older_than_seconds=older_than_seconds, exclude=exclude, now=now)):
        tier.refresh()
        age = idle_seconds(tier, step, time.time() if now is None else now)
        if age is None or age <= older_than_seconds:
            continue
        tier.fs.rm(tier.location(step).path, recursive=True)
        removed.append(step)
        log.warning("durable tier %s: removed abandoned upload of step %d (no manifest, untouched for %.0f s)",
                    tier.url, step, age)
    tier.refresh()
    return removed
