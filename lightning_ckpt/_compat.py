"""Every use of a Lightning (or torchdata) private attribute or loop internal, in one place.

Each is checked against ``lightning`` 2.6.6 and ``torchdata`` 0.11 (the versions tested; ``pyproject.toml``
pins the ranges). The ``install_*`` hooks wrap a Lightning function once per process (idempotent).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
from collections.abc import Callable
from typing import Any

__all__ = [
    "dump_checkpoint", "finish_loader_states", "fit_loop_state", "install_cli_hook", "install_fresh_fit_hook",
    "install_link_hook", "install_load_hook", "install_save_hook", "is_final_batch", "is_last_batch",
    "isolate_validation_rng", "set_original_sigterm_handler", "sharded_flags", "signal_connector",
    "start_next_epoch", "uploading_loggers",
]

_MARK = "_lightning_ckpt_wrapped"


def signal_connector(trainer: Any) -> Any:
    """``trainer._signal_connector`` (``_original_handlers``, ``received_sigterm``), or None."""
    return getattr(trainer, "_signal_connector", None)


def set_original_sigterm_handler(connector: Any, handler: Any) -> None:
    """Make Lightning restore ``handler`` for SIGTERM after ``fit`` (``_original_handlers``)."""
    originals = getattr(connector, "_original_handlers", None)
    if isinstance(originals, dict) and signal.SIGTERM in originals:
        originals[signal.SIGTERM] = handler


def sharded_flags(strategy: Any) -> dict[str, Any]:
    """``ModelParallelStrategy._save_distributed_checkpoint`` and ``FSDPStrategy._state_dict_type``."""
    return {"save_distributed_checkpoint": getattr(strategy, "_save_distributed_checkpoint", True),
            "state_dict_type": getattr(strategy, "_state_dict_type", "sharded")}


def is_last_batch(trainer: Any) -> bool:
    """``fit_loop.epoch_loop.batch_progress.is_last_batch``: the batch ended its epoch."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def is_final_batch(trainer: Any) -> bool:
    """Whether training stops after this batch: ``max_steps`` reached, or the last batch of the last epoch."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    return (trainer.max_epochs or 0) > 0 and trainer.current_epoch + 1 >= trainer.max_epochs and is_last_batch(trainer)


def isolate_validation_rng(trainer: Any) -> None:
    """Run validation during ``fit`` inside ``isolate_rng()`` (Lightning does so for the sanity check only):
    a resumed run skips the validation after the saved step. Wraps ``fit_loop.epoch_loop.val_loop.run``."""

    val_loop = trainer.fit_loop.epoch_loop.val_loop
    run = val_loop.run
    if getattr(run, _MARK, False):
        return

    # the loop, not a closure or its bound or decorated `run` (neither pickles): the trainer still pickles
    isolated_run = functools.partial(_isolated_run, trainer, val_loop)
    setattr(isolated_run, _MARK, True)
    val_loop.run = isolated_run


def _isolated_run(trainer: Any, loop: Any, *args: Any, **kwargs: Any) -> Any:
    from lightning.pytorch.utilities.seed import isolate_rng

    run = type(loop).run  # the class's run: the instance attribute is this wrapper
    if trainer.sanity_checking:  # already isolated by Lightning
        return run(loop, *args, **kwargs)
    with isolate_rng():
        return run(loop, *args, **kwargs)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` would write now, hooks included (``_checkpoint_connector``);
    its tensors are the live ones (valid until the next optimizer step)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def fit_loop_state(trainer: Any) -> dict[str, Any]:
    """``trainer.fit_loop.state_dict()``: the loop progress and train loaders' states that a checkpoint taken
    now stores as ``loops.fit_loop`` (fresh dicts, later steps do not change them).

    At an epoch's last batch end, the epoch's progress is ``processed == started - 1`` and the batch's
    ``completed == processed - 1``; a resume from that state restarts (``FitLoop.restarting``), loads the
    loaders' states and counts the epoch finished (``FitLoop.reset``, ``RestartStage.RESTARTED_MID_EPOCH``).
    After ``on_advance_end`` counted the epoch completed, ``restarting`` is False in epoch-based training and
    ``_load_combined_loader_states`` skips the loaders' states.
    """
    return trainer.fit_loop.state_dict()


def finish_loader_states(checkpoint: dict[str, Any]) -> None:
    """Mark the train loaders' states of a checkpoint taken at an epoch's last batch as finished iterators.

    Lightning's fetcher knows a sized loader's length, so at the last batch torchdata's
    ``StatefulDataLoader`` state still says "not finished": a resume restored the exhausted iterator and
    Lightning ran an empty epoch (``current_epoch`` and epoch-seeded samplers one too high). With
    ``_iterator_finished`` set, the loader starts the next epoch with a fresh iterator; the sampler's own
    ``yielded`` (which ``StatefulDistributedSampler`` would carry into it) is reset. The states are
    Lightning's ``loops.fit_loop.state_dict.combined_loader``.
    """

    def finish(node: Any) -> None:
        if isinstance(node, dict) and "_iterator_finished" in node:
            node["_iterator_finished"] = True
            sampler = (node.get("_sampler_iter_state") or {}).get("sampler_state")
            if isinstance(sampler, dict) and "yielded" in sampler:
                sampler["yielded"] = 0
        for value in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            finish(value)

    finish(checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader"))


def start_next_epoch(trainer: Any) -> None:
    """Draw what the next epoch's start draws, as the fit loop would: set the train samplers' epoch
    (``_set_sampler_epoch``), create each train loader's iterator (``_combined_loader``), fetch a batch.
    Only for a run stopping at an epoch end (the iterators are left started)."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    progress = trainer.fit_loop.epoch_progress.current
    loaders = trainer.fit_loop._combined_loader.flattened
    for loader in loaders:
        _set_sampler_epoch(loader, progress.processed + (progress.ready > progress.processed))
    for iterator in [iter(loader) for loader in loaders]:
        next(iterator, None)


def install_link_hook() -> None:
    """``ModelCheckpoint(save_last="link")`` links wait for the commit of what they name.

    ``ModelCheckpoint._link_checkpoint`` (a static method) replaces the link at once, while our save is
    still written. The wrapper hands it to the trainer's checkpoint IO when that has ``link_when_committed``
    (ours, attached or alone); every other IO keeps Lightning's behaviour.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    original = ModelCheckpoint._link_checkpoint
    if getattr(original, _MARK, False):
        return

    def link(trainer: Any, filepath: str, linkpath: str) -> None:
        io = trainer.strategy.checkpoint_io
        # looked up on the class: a Mock trainer's IO answers every attribute, yet is not ours
        defer = getattr(type(io), "link_when_committed", None)
        if defer is None:
            return original(trainer, filepath, linkpath)
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            defer(io, os.path.abspath(filepath), os.path.abspath(linkpath))
        trainer.strategy.barrier()
        return None

    setattr(link, _MARK, True)
    ModelCheckpoint._link_checkpoint = staticmethod(link)


def install_load_hook(load_dir: Callable[[str, Any, bool | None], dict[str, Any]],
                      is_remote_checkpoint: Callable[[str], bool] = lambda url: False) -> None:
    """Lightning's own loader reads torch-ckpt directories.

    ``LightningModule.load_from_checkpoint`` and ``TorchCheckpointIO.load_checkpoint`` (a Trainer without
    our plugin) read through ``fabric.utilities.cloud_io._load``, bound at import as ``core.saving.pl_load``
    and ``plugins.io.torch_io.pl_load``; the three names get one wrapper. A local directory (a path
    or a ``file://`` URL) holding ``manifest.json``, or a URL for which ``is_remote_checkpoint`` (its
    ``manifest.json`` exists), goes to ``load_dir(path, map_location, weights_only)``; anything else goes to
    Lightning unchanged, and its ``IsADirectoryError`` for another directory says what to do.
    """
    from lightning.fabric.plugins.io import torch_io
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    original = cloud_io._load
    if getattr(original, _MARK, False):
        return

    def _load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        text = os.fspath(path_or_url) if isinstance(path_or_url, (str, os.PathLike)) else ""
        local = text[len("file://"):] if text.startswith("file://") else ("" if "://" in text else text)
        if local and os.path.isfile(os.path.join(local, "manifest.json")):
            return load_dir(local, map_location, weights_only)
        if text and not local and is_remote_checkpoint(text):  # an fsspec/http URL holding manifest.json
            return load_dir(text, map_location, weights_only)
        try:
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        except IsADirectoryError as exc:
            raise IsADirectoryError(errno.EISDIR, (
                f"{path_or_url} is a directory, not a checkpoint file, and not a local torch-ckpt checkpoint (no "
                "manifest.json; only local paths and file:// URLs are read as torch-ckpt checkpoints). "
                "For a torch-ckpt checkpoint pass its step directory to "
                "lightning_ckpt.load_from_checkpoint(Model, path), or convert it to one file with "
                "`torch-ckpt convert CKPT --to torch OUT`"), os.fspath(path_or_url)) from exc

    setattr(_load, _MARK, True)
    cloud_io._load = _load
    for module in (saving, torch_io):
        if module.pl_load is original:
            module.pl_load = _load


def install_fresh_fit_hook(is_ours: Callable[[Any], bool]) -> None:
    """A fresh ``fit(model)`` with our ``OnExceptionCheckpoint`` callbacks loads nothing, silently.

    With an ``OnExceptionCheckpoint``, ``_CheckpointConnector._parse_ckpt_path`` turns ``ckpt_path=None``
    into ``"last"`` warning that "the last model of the previous fit" is used, then warns that there is no
    last checkpoint ("HINT: Set ModelCheckpoint(save_last=True)"). When all of them are ours (``is_ours``)
    without a checkpoint and no ``ModelCheckpoint`` keeps a last one, the wrapper returns None (Lightning's
    result) without either warning; otherwise Lightning's method runs.
    """
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.states import TrainerFn

    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, _MARK, False):
        return

    def parse(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        trainer = self.trainer
        ft = [cb for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
        if ckpt_path is None and ft and trainer.state.fn == TrainerFn.FITTING and all(
                is_ours(cb) and cb.ckpt_path is None for cb in ft) and not any(
                getattr(cb, "save_last", None) for cb in trainer.checkpoint_callbacks):
            return None
        return original(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)

    setattr(parse, _MARK, True)
    _CheckpointConnector._parse_ckpt_path = parse


def uploading_loggers(trainer: Any) -> list[str]:
    """Names of the trainer's loggers that upload checkpoint files (``WandbLogger``/``MLflowLogger``/
    ``LitLogger`` ``log_model``: their ``_scan_checkpoints`` keeps only paths for which ``Path.is_file()``)."""
    return [type(logger).__name__ for logger in trainer.loggers if getattr(logger, "_log_model", False)]


def install_save_hook(is_ours: Callable[[Any], bool], warn: Callable[[Any, list[str]], None]) -> None:
    """``Trainer.save_checkpoint`` with our checkpoint IO (``is_ours``) outside a running ``fit``/``validate``...
    (``trainer.state.status`` not ``RUNNING``: before ``fit``, after it, in the main process of ``ddp_spawn``)
    returns once the checkpoint is committed, when the IO's ``wait_outside_fit`` is set; during a run it
    returns once staged. With loggers that upload checkpoint files (:func:`uploading_loggers`), ``warn(io,
    names)`` is called at each save (the IO warns once). Every other IO keeps Lightning's behaviour.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import TrainerStatus

    original = Trainer.save_checkpoint
    if getattr(original, _MARK, False):
        return

    def save_checkpoint(self: Any, filepath: Any, weights_only: bool | None = None,
                        storage_options: Any | None = None) -> None:
        io = self.strategy.checkpoint_io
        if not is_ours(io):
            return original(self, filepath, weights_only=weights_only, storage_options=storage_options)
        if names := uploading_loggers(self):
            warn(io, names)
        original(self, filepath, weights_only=weights_only, storage_options=storage_options)
        if self.state.status != TrainerStatus.RUNNING and io.wait_outside_fit:
            io.wait()
        return None

    setattr(save_checkpoint, _MARK, True)
    Trainer.save_checkpoint = save_checkpoint


def install_cli_hook(load_dir: Callable[[str, Any, bool | None], dict[str, Any]]) -> None:
    """``LightningCLI --ckpt_path DIR`` takes the hyper-parameters of a torch-ckpt directory.

    ``LightningCLI._parse_ckpt_path`` reads them only from a file (``Path.is_file()``, then
    ``torch.load(weights_only=True)``); for a directory it silently built the model from defaults. For a
    local directory holding ``manifest.json`` the wrapper reads the checkpoint with ``load_dir`` (nothing
    unpickled), writes its ``hyper_parameters`` alone to a temporary ``torch.save`` file and runs Lightning's
    method on that file, so Lightning's own parsing applies; ``ckpt_path`` is put back afterwards. Nothing
    is installed without ``jsonargparse`` (no LightningCLI).
    """
    import importlib.util

    if importlib.util.find_spec("jsonargparse") is None:
        return
    from lightning.pytorch.cli import LightningCLI

    original = LightningCLI._parse_ckpt_path
    if getattr(original, _MARK, False):
        return

    def parse(self: Any) -> None:
        import tempfile

        import torch

        command = self.config.get("subcommand") if hasattr(self.config, "get") else None
        path = self.config[command].get("ckpt_path") if command else None
        if not (isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, "manifest.json"))):
            return original(self)
        hparams = load_dir(os.fspath(path), "cpu", True).get("hyper_parameters", {})
        with tempfile.TemporaryDirectory(prefix="lightning_ckpt_cli_") as tmp:
            shim = os.path.join(tmp, "hparams.ckpt")
            torch.save({"hyper_parameters": hparams}, shim)
            self.config[command]["ckpt_path"] = shim
            try:
                return original(self)
            finally:
                self.config[command]["ckpt_path"] = path

    setattr(parse, _MARK, True)
    LightningCLI._parse_ckpt_path = parse
