"""Every use of a Lightning private attribute or loop internal, in one place.

Each is checked against ``lightning`` 2.6.6 (the version tested; ``pyproject.toml`` pins the range).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = [
    "defer_link_checkpoint", "dump_checkpoint", "is_final_batch", "is_last_batch", "isolate_validation_rng",
    "load_module_state", "finish_loader_states",
    "set_original_sigterm_handler", "sharded_flags", "signal_connector", "start_next_epoch",
]

log = logging.getLogger(__name__)
_MARK = "_lightning_ckpt_wrapped"


def defer_link_checkpoint(callback: Any, link: Callable[[Any, str, str], None]) -> bool:
    """Replace ``ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)`` on this instance (2.6.6).

    Returns:
        False when the attribute does not exist (links are then not deferred).
    """
    if not hasattr(callback, "_link_checkpoint"):
        return False
    callback._link_checkpoint = link
    return True


def signal_connector(trainer: Any) -> Any:
    """``trainer._signal_connector`` (``_original_handlers``, ``received_sigterm``), or None (2.6.6)."""
    return getattr(trainer, "_signal_connector", None)


def sharded_flags(strategy: Any) -> dict[str, Any]:
    """``ModelParallelStrategy._save_distributed_checkpoint`` and ``FSDPStrategy._state_dict_type`` (2.6.6)."""
    return {"save_distributed_checkpoint": getattr(strategy, "_save_distributed_checkpoint", True),
            "state_dict_type": getattr(strategy, "_state_dict_type", "sharded")}


def is_last_batch(trainer: Any) -> bool:
    """``trainer.fit_loop.epoch_loop.batch_progress.is_last_batch``: the batch ended its epoch (2.6.6)."""
    try:
        return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
    except AttributeError:
        return False


def isolate_validation_rng(trainer: Any) -> bool:
    """Run validation during ``fit`` inside ``isolate_rng()``, as Lightning runs the sanity check.

    A resumed run skips the validation after the saved step, so its RNG draws would otherwise shift.
    Wraps ``trainer.fit_loop.epoch_loop.val_loop.run`` on the instance (idempotent; 2.6.6).

    Returns:
        False when the loop attribute does not exist (validation then shares the training stream).
    """
    from lightning.pytorch.utilities.seed import isolate_rng

    try:
        val_loop = trainer.fit_loop.epoch_loop.val_loop
    except AttributeError:
        return False
    run = val_loop.run
    if getattr(run, _MARK, False):
        return True

    def isolated_run(*args: Any, **kwargs: Any) -> Any:
        if trainer.sanity_checking:  # Lightning isolates the sanity check itself
            return run(*args, **kwargs)
        with isolate_rng():
            return run(*args, **kwargs)

    setattr(isolated_run, _MARK, True)
    val_loop.run = isolated_run
    return True


def load_module_state(cls: type, checkpoint: dict[str, Any], *, strict: bool | None, **kwargs: Any) -> Any:
    """Build ``cls`` from a checkpoint dict as ``cls.load_from_checkpoint`` does (``saving._load_state``, 2.6.6)."""
    from lightning.pytorch.core.saving import _load_state

    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` would write now, hooks included (``_checkpoint_connector``, 2.6.6).

    Tensors are the live ones (valid until the next optimizer step); everything else is a snapshot.
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def finish_loader_states(checkpoint: dict[str, Any]) -> None:
    """Mark the train loaders' states in a checkpoint of an epoch's last batch as finished iterators.

    Lightning's fetcher knows a sized loader's length, so at the last batch the iterator has not raised
    ``StopIteration`` and torchdata's ``StatefulDataLoader`` state says "not finished": a resume restores
    the exhausted iterator and Lightning runs an empty epoch (``current_epoch`` and epoch-seeded samplers
    one too high). Marked finished (``_iterator_finished``, torchdata 0.11), the loader starts the next
    epoch with a fresh iterator; the sampler's own position (``sampler_state.yielded``, which
    ``StatefulDistributedSampler`` would carry into that iterator) is reset. The loop state is Lightning's
    ``loops.fit_loop.state_dict.combined_loader`` (2.6.6).
    """

    def finish(node: Any) -> None:
        if isinstance(node, dict):
            if "_iterator_finished" in node:
                node["_iterator_finished"] = True
                sampler = (node.get("_sampler_iter_state") or {}).get("sampler_state")
                if isinstance(sampler, dict) and "yielded" in sampler:
                    sampler["yielded"] = 0
            for value in node.values():
                finish(value)
        elif isinstance(node, list):
            for value in node:
                finish(value)

    finish(checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader"))


def start_next_epoch(trainer: Any) -> None:
    """Draw what the start of the next epoch draws, as the fit loop would (2.6.6): set the train samplers' epoch
    (``_set_sampler_epoch``), create every train loader's iterator, fetch its first batch (``_combined_loader``).

    Only for a run that stops at an epoch end: the iterators are left behind, started.
    """
    from lightning.fabric.utilities.data import _set_sampler_epoch

    progress = trainer.fit_loop.epoch_progress.current
    epoch = progress.processed + (1 if progress.ready > progress.processed else 0)
    loaders = trainer.fit_loop._combined_loader.flattened
    for loader in loaders:
        _set_sampler_epoch(loader, epoch)
    for iterator in [iter(loader) for loader in loaders]:
        next(iterator, None)


def is_final_batch(trainer: Any) -> bool:
    """Whether training stops after this batch: ``max_steps`` reached, or the last batch of the last epoch."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs > 0 and trainer.current_epoch + 1 >= max_epochs \
        and is_last_batch(trainer)


def set_original_sigterm_handler(connector: Any, handler: Any) -> None:
    """Make Lightning restore ``handler`` for SIGTERM after ``fit`` (``_original_handlers``, 2.6.6)."""
    import signal

    originals = getattr(connector, "_original_handlers", None)
    if isinstance(originals, dict) and signal.SIGTERM in originals:
        originals[signal.SIGTERM] = handler
