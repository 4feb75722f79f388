"""Every Lightning (or torchdata) private attribute or loop internal; checked on lightning 2.6.6, torchdata 0.11."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import signal
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins.io import torch_io
from lightning.fabric.utilities import cloud_io
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.core import saving
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_ckpt._load import is_remote_checkpoint, is_url, load_checkpoint_dir

_MARK = "_lightning_ckpt_wrapped"


def set_original_sigterm_handler(trainer: Any, handler: Any) -> bool:
    """Make Lightning restore ``handler`` for SIGTERM after ``fit``; False without a signal connector."""
    connector = getattr(trainer, "_signal_connector", None)
    originals = getattr(connector, "_original_handlers", None)
    if isinstance(originals, dict) and signal.SIGTERM in originals:
        originals[signal.SIGTERM] = handler
    return connector is not None


def mark_sigterm_received(trainer: Any) -> None:
    """Set ``trainer._signal_connector.received_sigterm``: Lightning raises ``SIGTERMException`` after the batch."""
    if (connector := getattr(trainer, "_signal_connector", None)) is not None:
        connector.received_sigterm = True


def sharded_flags(strategy: Any) -> tuple[bool, str]:
    """``ModelParallelStrategy._save_distributed_checkpoint`` and ``FSDPStrategy._state_dict_type``."""
    return getattr(strategy, "_save_distributed_checkpoint", True), getattr(strategy, "_state_dict_type", "sharded")


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (``_optimizer``)."""
    return getattr(optimizer, "_optimizer", optimizer)


def local_shard(tensor: Any) -> Any:
    """A ``DTensor``'s local shard (``_local_tensor``), else the tensor."""
    return getattr(tensor, "_local_tensor", tensor)


def uploading_loggers(trainer: Any) -> list[str]:
    """Loggers uploading checkpoint files (``log_model``: ``_scan_checkpoints`` keeps ``Path.is_file()`` paths)."""
    return [type(logger).__name__ for logger in trainer.loggers if getattr(logger, "_log_model", False)]


def is_last_batch(trainer: Any) -> bool:
    """``fit_loop.epoch_loop.batch_progress.is_last_batch``: the batch ended its epoch."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def is_final_batch(trainer: Any) -> bool:
    """Whether training stops after this batch: ``max_steps`` reached, or the last batch of the last epoch."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    return (trainer.max_epochs or 0) > 0 and trainer.current_epoch + 1 >= trainer.max_epochs and is_last_batch(trainer)


def isolate_validation_rng(trainer: Any) -> None:
    """Run validation during ``fit`` inside ``isolate_rng()`` (Lightning isolates the sanity check only)."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    if not getattr(loop.run, _MARK, False):
        loop.run = partial(_isolated_run, trainer, loop)  # a partial, not a closure: the trainer still pickles
        setattr(loop.run, _MARK, True)


def _isolated_run(trainer: Any, loop: Any, *args: Any, **kwargs: Any) -> Any:
    with contextlib.nullcontext() if trainer.sanity_checking else isolate_rng():  # the sanity check: by Lightning
        return type(loop).run(loop, *args, **kwargs)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` would write now (``_checkpoint_connector``); live tensors."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def finish_loader_states(checkpoint: dict[str, Any]) -> None:
    """Mark the train loaders' states of a checkpoint taken at an epoch's last batch finished (``_iterator_finished``,
    sampler ``yielded`` 0): torchdata's ``StatefulDataLoader`` says "not finished" there, and a resume ran an empty
    epoch."""

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
    """Draw what the next epoch's start draws (samplers' epoch, each train loader's iterator, its first batch)."""
    progress = trainer.fit_loop.epoch_progress.current
    loaders = trainer.fit_loop._combined_loader.flattened
    for loader in loaders:
        _set_sampler_epoch(loader, progress.processed + (progress.ready > progress.processed))
    for iterator in [iter(loader) for loader in loaders]:
        next(iterator, None)


def _wrap(owner: Any, name: str, make: Callable[[Any], Any], *, static: bool = False) -> None:
    original = getattr(owner, name)
    if not getattr(original, _MARK, False):
        wrapper = make(original)
        setattr(wrapper, _MARK, True)
        setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def install_hooks() -> None:
    """Wrap Lightning once per process (idempotent; other checkpoint IOs keep Lightning's behaviour): links wait for
    the commit (``_link_checkpoint``), the loader reads our directories (``cloud_io._load``), a fresh ``fit`` with no
    checkpoint of ours loads nothing (``_parse_ckpt_path``), ``Trainer.save_checkpoint`` outside ``fit`` returns
    committed, ``LightningCLI --ckpt_path DIR`` takes the directory's hyper-parameters (through a temporary file)."""
    _wrap(ModelCheckpoint, "_link_checkpoint", lambda original: partial(_link, original), static=True)
    original_load = cloud_io._load
    _wrap(cloud_io, "_load", lambda original: partial(_load, original))
    for module in (saving, torch_io):
        if module.pl_load is original_load:
            module.pl_load = cloud_io._load  # type: ignore[attr-defined]
    _wrap(_CheckpointConnector, "_parse_ckpt_path",
          lambda original: lambda self, *a, **k: _fresh_fit(original, self, *a, **k))
    _wrap(Trainer, "save_checkpoint", lambda original: lambda self, *a, **k: _save_checkpoint(original, self, *a, **k))
    if importlib.util.find_spec("jsonargparse") is not None:
        from lightning.pytorch.cli import LightningCLI

        _wrap(LightningCLI, "_parse_ckpt_path", lambda original: lambda self: _cli_ckpt_path(original, self))


def _link(original: Any, trainer: Any, filepath: str, linkpath: str) -> None:
    io = trainer.strategy.checkpoint_io
    defer = getattr(type(io), "link_when_committed", None)  # on the class: a Mock IO answers every attribute
    if defer is None:
        return original(trainer, filepath, linkpath)
    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        defer(io, os.path.abspath(filepath), os.path.abspath(linkpath))
    trainer.strategy.barrier()
    return None


def _load(original: Any, path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
    text = os.fspath(path_or_url) if isinstance(path_or_url, (str, os.PathLike)) else ""
    local = "" if is_url(text) else text.removeprefix("file://")
    if os.path.isfile(os.path.join(local, "manifest.json")) if local else is_remote_checkpoint(text):
        return load_checkpoint_dir([local or text], allow_pickle=weights_only is False, map_location=map_location)
    try:
        return original(path_or_url, map_location=map_location, weights_only=weights_only)
    except IsADirectoryError as exc:
        raise IsADirectoryError(errno.EISDIR, (
            f"{path_or_url} is a directory, not a checkpoint file, and not a local torch-ckpt checkpoint (no "
            "manifest.json; only local paths and file:// URLs are read as torch-ckpt checkpoints). For a torch-ckpt "
            "checkpoint pass its step directory to lightning_ckpt.load_from_checkpoint(Model, path), or convert it "
            "to one file with `torch-ckpt convert CKPT --to torch OUT`"), os.fspath(path_or_url)) from exc


def _fresh_fit(original: Any, self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool,
               model_connected: bool) -> Any:
    from lightning_ckpt._callback import MTBFCheckpoint  # not at the top: _callback imports this module

    trainer = self.trainer
    ft = [cb for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    if ckpt_path is None and ft and trainer.state.fn == TrainerFn.FITTING and all(
            isinstance(cb, MTBFCheckpoint) and cb.ckpt_path is None for cb in ft) and not any(
            getattr(cb, "save_last", None) for cb in trainer.checkpoint_callbacks):
        return None
    return original(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)


def _save_checkpoint(original: Any, self: Any, filepath: Any, weights_only: bool | None = None,
                     storage_options: Any | None = None) -> None:
    from lightning_ckpt._checkpoint_io import AsyncDCPCheckpointIO  # not at the top: it imports this module

    ours = isinstance(io := self.strategy.checkpoint_io, AsyncDCPCheckpointIO)
    if ours:
        io.in_run(self.state.status == TrainerStatus.RUNNING)  # a plugin reused after an earlier run's teardown
        if names := uploading_loggers(self):
            io.warn_uploading_loggers(names)
    original(self, filepath, weights_only=weights_only, storage_options=storage_options)
    if ours and self.state.status != TrainerStatus.RUNNING and io.wait_outside_fit:
        io.wait()


def _cli_ckpt_path(original: Any, self: Any) -> None:
    command = self.config.get("subcommand") if hasattr(self.config, "get") else None
    path = self.config[command].get("ckpt_path") if command else None
    if not (isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, "manifest.json"))):
        return original(self)
    hparams = load_checkpoint_dir([os.fspath(path)], allow_pickle=False, map_location="cpu").get("hyper_parameters", {})
    with tempfile.TemporaryDirectory(prefix="lightning_ckpt_cli_") as tmp:
        torch.save({"hyper_parameters": hparams}, shim := os.path.join(tmp, "hparams.ckpt"))
        self.config[command]["ckpt_path"] = shim
        try:
            return original(self)
        finally:
            self.config[command]["ckpt_path"] = path
