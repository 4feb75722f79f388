"""Choosing what to resume from: the newest checkpoint complete in any reachable tier."""

from __future__ import annotations

from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from torch_ckpt.layout import read_manifest, scan_committed
from torch_ckpt.naming import Naming, StepNaming
from torch_ckpt.tiers import DurableTier, DurableUnavailableError

__all__ = ["restore_candidates"]

log = get_logger(__name__)


def restore_candidates(root: Path, tier: DurableTier | None, step: int | None,
                       naming: Naming | None = None) -> list[tuple[int, str]] | BaseException:
    """Candidate ``(step, "local"|"durable")`` pairs to restore, newest first; run on the coordinator.

    A step held by both tiers is listed twice, local copy first: when the local copy fails
    verification, the same step is taken from the durable tier before any older step. The durable
    tier is listed with its timeout (:meth:`DurableTier.listed`).

    Returns an exception instead of raising it, so the coordinator can broadcast it to every rank.
    """
    naming = naming or StepNaming()
    try:
        local = list(scan_committed(root, naming))
        durable: list[int] = []
        outage: DurableUnavailableError | None = None
        if tier is not None:
            try:
                durable = list(tier.listed())
            except DurableUnavailableError as exc:
                if not local:
                    return DurableUnavailableError(
                        f"{exc}. No local checkpoint under {root} either: refusing to start from scratch "
                        "while the durable tier cannot be read. Retry when the store is reachable, or remove "
                        "durable_url (or catch DurableUnavailableError) to start from scratch deliberately.")
                outage = exc
                if step is None:
                    log.warning("%s; resuming from the local tier only", exc)
        if step is not None:
            if step in local:
                return [(step, "local")] + ([(step, "durable")] if step in durable else [])
            if step in durable:
                return [(step, "durable")]
            if outage is not None:  # it may be there: say why it cannot be known
                return DurableUnavailableError(f"step {step} is not under {root}, and {outage}")
            candidate = root / naming.name(step)
            if candidate.is_dir():  # present but not listed: say what is wrong with it
                manifest = read_manifest(candidate)
                return CheckpointCorruptError(f"{candidate}: manifest says step {manifest.step}, not {step}")
            where = f"{root}" + (f" or {tier.url}" if tier is not None else "")
            return CheckpointNotFoundError(f"step {step} is not a committed checkpoint under {where}; committed "
                                           f"steps: {sorted(set(local) | set(durable))[-10:]}")
        return [(s, where) for s in sorted(set(local) | set(durable), reverse=True)
                for where in ("local", "durable") if s in (local if where == "local" else durable)]
    except CheckpointError as exc:
        return exc
