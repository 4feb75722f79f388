"""Every use of a Lightning private attribute or loop internal, in one place.

Each is checked against ``lightning`` 2.6.6 (the version tested; ``pyproject.toml`` pins the range).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "dump_checkpoint", "finish_loader_states", "install_fresh_fit_hook", "install_link_hook", "install_load_hook",
    "is_final_batch", "is_last_batch", "isolate_validation_rng", "set_original_sigterm_handler", "sharded_flags",
    "signal_connector", "start_next_epoch",
]

log = logging.getLogger(__name__)
_MARK = "_lightning_ckpt_wrapped"


def install_link_hook() -> None:
    """Make ``ModelCheckpoint(save_last="link")`` links wait for the commit of what they name (idempotent; 2.6.6).

    ``ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)`` (a static method) removes the link and
    creates it at once, while our save is still being written. The wrapper hands the link to the trainer's
    checkpoint IO when it has ``link_when_committed`` (ours, attached or not; every other IO gets
    Lightning's behaviour): re-pointed atomically once ``filepath`` is committed, before any removal.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    original = ModelCheckpoint._link_checkpoint
    if getattr(original, _MARK, False):
        return

    def link(trainer: Any, filepath: str, linkpath: str) -> None:
        defer = getattr(trainer.strategy.checkpoint_io, "link_when_committed", None)
        if defer is None:
            return original(trainer, filepath, linkpath)
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            defer(os.path.abspath(filepath), os.path.abspath(linkpath))
        trainer.strategy.barrier()
        return None

    setattr(link, _MARK, True)
    ModelCheckpoint._link_checkpoint = staticmethod(link)


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


def install_load_hook(load_dir: Callable[[str, Any, bool | None], dict[str, Any]]) -> None:
    """Let Lightning's own checkpoint loader read torch-ckpt directories (idempotent; 2.6.6).

    ``LightningModule.load_from_checkpoint`` and ``TorchCheckpointIO.load_checkpoint`` (a Trainer
    without our plugin) both read through ``lightning.fabric.utilities.cloud_io._load``, bound at
    import as ``core.saving.pl_load`` and ``plugins.io.torch_io.pl_load``; the three names get one
    wrapper. Only a local directory holding ``manifest.json`` is handed to ``load_dir(path,
    map_location, weights_only)``; anything else goes to Lightning unchanged, and the
    ``IsADirectoryError`` it raises for another directory gets a message saying what to do.
    """
    import errno

    from lightning.fabric.plugins.io import torch_io
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    original = cloud_io._load
    if getattr(original, _MARK, False):
        return

    def _load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        local = isinstance(path_or_url, (str, os.PathLike)) and "://" not in os.fspath(path_or_url)
        if local and os.path.isfile(os.path.join(path_or_url, "manifest.json")):
            return load_dir(os.fspath(path_or_url), map_location, weights_only)
        try:
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        except IsADirectoryError as exc:
            raise IsADirectoryError(errno.EISDIR, (
                f"{path_or_url} is a directory, not a checkpoint file, and not a torch-ckpt checkpoint (no "
                "manifest.json). For a torch-ckpt checkpoint pass its step directory to "
                "lightning_ckpt.load_from_checkpoint(Model, path), or convert it to one file with "
                "`torch-ckpt convert CKPT --to torch OUT`"), os.fspath(path_or_url)) from exc

    setattr(_load, _MARK, True)
    for module in (cloud_io, saving, torch_io):
        if module is cloud_io or getattr(module, "pl_load", None) is original:
            setattr(module, "_load" if module is cloud_io else "pl_load", _load)


def install_fresh_fit_hook(is_ours: Callable[[Any], bool]) -> None:
    """A fresh ``fit(model)`` with only our ``OnExceptionCheckpoint`` callbacks loads nothing, silently (2.6.6).

    ``_CheckpointConnector._parse_ckpt_path`` turns ``ckpt_path=None`` into ``"last"`` when an
    ``OnExceptionCheckpoint`` is present, warning that "the last model of the previous fit" is used,
    then warns that no last checkpoint exists ("HINT: Set ModelCheckpoint(save_last=True)"). When
    every such callback is ours (``is_ours``) and none has a checkpoint yet, the wrapper returns None
    (what Lightning ends with) without either warning; otherwise Lightning's method runs unchanged.
    """
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.states import TrainerFn

    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, _MARK, False):
        return

    def parse(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        ours = [cb for cb in self.trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
        if ckpt_path is None and ours and self.trainer.state.fn == TrainerFn.FITTING and not any(
                getattr(cb, "save_last", None) for cb in self.trainer.checkpoint_callbacks) and all(
                is_ours(cb) and cb.ckpt_path is None for cb in ours):
            return None
        return original(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)

    setattr(parse, _MARK, True)
    _CheckpointConnector._parse_ckpt_path = parse
