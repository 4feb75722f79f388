"""Every use of a Lightning private attribute or loop internal, in one place.

Each function names the Lightning versions it was checked against (``lightning`` 2.6.6, the version
the tests run; the range in ``pyproject.toml`` is the one tested). When Lightning changes one of
these, only this module changes; each caller degrades as documented when an attribute is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = [
    "defer_link_checkpoint", "dump_checkpoint", "is_final_batch", "is_last_batch", "isolate_validation_rng",
    "load_module_state",
    "set_original_sigterm_handler", "sharded_flags", "signal_connector",
]

log = logging.getLogger(__name__)
_MARK = "_lightning_ckpt_wrapped"


def defer_link_checkpoint(callback: Any, link: Callable[[Any, str, str], None]) -> bool:
    """Replace ``ModelCheckpoint._link_checkpoint`` (a staticmethod) on this instance only.

    Checked against lightning 2.6.6 (``ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)``).

    Returns:
        False when the attribute does not exist (links are then not deferred).
    """
    if not hasattr(callback, "_link_checkpoint"):
        return False
    callback._link_checkpoint = link
    return True


def signal_connector(trainer: Any) -> Any:
    """``trainer._signal_connector`` (``_original_handlers``, ``received_sigterm``), or None.

    Checked against lightning 2.6.6.
    """
    return getattr(trainer, "_signal_connector", None)


def sharded_flags(strategy: Any) -> dict[str, Any]:
    """``ModelParallelStrategy._save_distributed_checkpoint`` and ``FSDPStrategy._state_dict_type``.

    Checked against lightning 2.6.6.
    """
    return {"save_distributed_checkpoint": getattr(strategy, "_save_distributed_checkpoint", True),
            "state_dict_type": getattr(strategy, "_state_dict_type", "sharded")}


def is_last_batch(trainer: Any) -> bool:
    """Whether the batch that just finished was the last of its training epoch.

    ``trainer.fit_loop.epoch_loop.batch_progress.is_last_batch``; checked against lightning 2.6.6.
    """
    try:
        return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
    except AttributeError:
        return False


def isolate_validation_rng(trainer: Any) -> bool:
    """Run validation during ``fit`` inside Lightning's ``isolate_rng()``, as Lightning runs the sanity check.

    Validation draws from the global RNG (its loader's iterator takes a seed from it when the
    loader has no ``generator=``; validation steps may draw too). A resumed run skips the
    validation that followed the saved step, so without this its training draws would shift.
    Wraps ``trainer.fit_loop.epoch_loop.val_loop.run`` on the instance (idempotent); checked against
    lightning 2.6.6.

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
    """Build ``cls`` from a checkpoint dict as ``cls.load_from_checkpoint`` does after reading the file.

    ``lightning.pytorch.core.saving._load_state`` (hyper-parameters, ``on_load_checkpoint``, strict
    ``load_state_dict``); checked against lightning 2.6.6.
    """
    from lightning.pytorch.core.saving import _load_state

    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write now (hooks included), without writing it.

    ``trainer._checkpoint_connector.dump_checkpoint(weights_only=False)``; checked against lightning
    2.6.6. Tensors are the live ones (valid until the next optimizer step); everything else is a
    snapshot.
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def is_final_batch(trainer: Any) -> bool:
    """Whether training stops after the batch that just finished: ``max_steps`` reached, or the last batch
    of the last epoch (``max_epochs``).

    Uses :func:`is_last_batch`; checked against lightning 2.6.6.
    """
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs > 0 and trainer.current_epoch + 1 >= max_epochs \
        and is_last_batch(trainer)


def set_original_sigterm_handler(connector: Any, handler: Any) -> None:
    """Make Lightning restore ``handler`` for SIGTERM after ``fit`` (``_SignalConnector._original_handlers``).

    Checked against lightning 2.6.6.
    """
    import signal

    originals = getattr(connector, "_original_handlers", None)
    if isinstance(originals, dict) and signal.SIGTERM in originals:
        originals[signal.SIGTERM] = handler
