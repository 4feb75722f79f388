"""``AsyncDCPCheckpointIO``: a Lightning ``CheckpointIO`` saving asynchronous, atomic DCP checkpoints through one
:class:`torch_ckpt.CheckpointManager`; links, removals and logger calls made during a save run once it is committed."""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import uuid
import weakref
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from typing_extensions import override

from lightning_ckpt import _compat
from lightning_ckpt._load import (
    RANK_LOCAL_KEYS,
    RemoteCheckpoints,
    _ShardedTarget,
    decode_values,
    encode_values,
    is_url,
    load_checkpoint_dir,
    restore_candidates,
)
from torch_ckpt import (
    AfterCommit,
    CheckpointConfig,
    CheckpointManager,
    ConfigError,
    SaveHandle,
    StepNaming,
    TrainState,
    is_committed,
    rank_and_world,
)

log = logging.getLogger(__name__)
#: plugins, finished at interpreter exit by the process that made each (a forked child exits at once)
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PICKLED_FIELDS = ("_config", "verify_on_load", "unsafe_values", "allow_cast", "wait_outside_fit")
_HPC_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")
_MARK = "_lightning_ckpt_io"  # the plugin a strategy is attached to; a logger method already deferred
_UPLOADING = ("{} with log_model uploads checkpoint files only (it keeps paths for which Path.is_file()), and "
              "AsyncDCPCheckpointIO writes directories: no checkpoint is uploaded. Pass log_model=False and upload the "
              "checkpoint directories yourself, or use a durable tier (see docs/lightning.md, 'Loggers that upload "
              "checkpoints').")


class _LightningState:
    """The checkpoint dict as the core's state, with its rank-local keys and overlap-staged tensors."""

    rank_local_keys = RANK_LOCAL_KEYS
    replicated_keys = ("state_dict", "optimizer_states")  # one tensor for the job (DCP); other tensors per rank

    def __init__(self, state: dict[str, Any], param_ptrs: set[int] | None) -> None:
        self._state, self._param_ptrs = state, param_ptrs

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def optimizer_owned_keys(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Parameters and optimizer state, copied in the background until the next optimizer step."""
        return set() if self._param_ptrs is None else {k for k, t in tensors.items() if k.startswith(
            "optimizer_states.") or (k.startswith("state_dict.") and _ptr(t) in self._param_ptrs)}

    def optimizers(self) -> list:
        return []  # Lightning steps inside optimizer.step(closure): MTBFCheckpoint waits in on_before_optimizer_step


class AsyncDCPCheckpointIO(CheckpointIO):
    """Asynchronous, atomic DCP checkpoints for Lightning: ``Trainer(plugins=[AsyncDCPCheckpointIO()])``.

    Checkpoints are directories at the paths Lightning asks for; plain ``.ckpt`` files still load. Multi-process
    strategies need it attached (:class:`~lightning_ckpt.MTBFCheckpoint` or :meth:`attach`). Constructing one
    installs its wrappers of Lightning (once per process). See ``docs/lightning.md``.

    Args:
        async_save: Persist in a background thread (default) or inside ``save_checkpoint``.
        persist: Where background writes run: ``"thread"`` (default) or ``"process"``.
        overlap_staging: With ``MTBFCheckpoint``, copy parameters and optimizer state in the background
            while the next forward/backward runs.
        writer_niceness: Nice increment (0-19) of the writer on Linux; 0 leaves it unchanged.
        staging_budget_bytes: Host bytes for the reusable staging buffer; default half of the RAM.
        thread_count: DCP writer threads per rank.
        timeout_seconds: Limit for checkpoint collectives between ranks, in seconds.
        verify_on_load: Check the CRC-32 of every file before loading (sizes are always checked).
        unsafe_values: Values without a typed, pickle-free encoding (``docs/lightning.md``): ``"pickle"``
            (default, as Lightning stores them) stores them pickled, and loading them then needs
            ``weights_only=False``; ``"error"`` refuses them with a ``ConfigError`` naming the key.
        allow_cast: Accept dtype differences between the checkpoint and the live model when loading into an
            attached trainer (each cast key is logged once).
        wait_outside_fit: A save outside a running ``fit`` returns only once the checkpoint is committed.
        incremental: Hard-link the files of tensors unchanged since the last save instead of writing them
            again (``docs/incremental.md``); False writes every byte of every save.

    Raises:
        ConfigError: An argument is out of range.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        persist: Literal["thread", "process"] = "thread",
        overlap_staging: bool = False,
        writer_niceness: int = 0,
        staging_budget_bytes: int | None = None,
        thread_count: int = 2,
        timeout_seconds: float = 600.0,
        verify_on_load: bool = True,
        unsafe_values: Literal["pickle", "error"] = "pickle",
        allow_cast: bool = False,
        wait_outside_fit: bool = True,
        incremental: bool = True,
    ) -> None:
        if unsafe_values not in ("pickle", "error") or not isinstance(allow_cast, bool) or \
                not isinstance(wait_outside_fit, bool):
            raise ConfigError(f"unsafe_values must be 'pickle' or 'error' and allow_cast/wait_outside_fit booleans, "
                              f"got {unsafe_values!r}, {allow_cast!r}, {wait_outside_fit!r}")
        self._config = CheckpointConfig(async_save=async_save, persist=persist, overlap_staging=overlap_staging,
                                        writer_niceness=writer_niceness, staging_budget_bytes=staging_budget_bytes,
                                        thread_count=thread_count, timeout_seconds=timeout_seconds,
                                        verify_on_load=verify_on_load, incremental=incremental)
        self.verify_on_load, self.unsafe_values = verify_on_load, unsafe_values
        self.allow_cast, self.wait_outside_fit = allow_cast, wait_outside_fit
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        _compat.install_hooks()
        _LIVE[self] = os.getpid()
        self._manager: CheckpointManager | None = None
        self._after = AfterCommit()  # links 0, removals 1, loggers 2; uploads -1 (their failure stops the rest)
        self._param_ptrs: Any = None
        self._collective = self._after_fit = False
        self._warned: set[str] = set()
        self.rng_restored_by_callback = False
        self.fallbacks: dict[str, list[Path]] = {}  # "last" -> newest-first candidates (MTBFCheckpoint)
        self._saving_path: str | None = None  # where last_handle writes (a URL: until uploaded)
        self._remote = RemoteCheckpoints()  # checkpoints at fsspec URLs: committed locally, then uploaded
        self._remote_options: dict[str, Any] = {}  # URL -> the storage_options it was saved with

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin: runtime state stays behind
        return {k: v for k, v in self.__dict__.items() if k in _PICKLED_FIELDS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    @property
    def last_handle(self) -> SaveHandle | None:
        """The :class:`~torch_ckpt.SaveHandle` of the latest save, or None."""
        return self._after.handle

    @property
    def saving(self) -> bool:
        """True while a save is in flight (staged, not yet committed)."""
        return self._after.saving

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def attach(self, trainer: Any) -> None:
        """Route every checkpoint operation of ``trainer`` through this plugin on every rank (before ``fit``).

        Raises:
            ConfigError: not the trainer's checkpoint IO, or a sharded strategy gathers full state dicts.
        """
        strategy = trainer.strategy
        if strategy.checkpoint_io is not self:
            raise ConfigError("this AsyncDCPCheckpointIO is not the trainer's checkpoint IO: pass it as "
                              "Trainer(plugins=[AsyncDCPCheckpointIO(...)])")
        is_sharded = _sharded(strategy)
        if trainer.state.status != TrainerStatus.RUNNING:  # before fit: install at setup, in every worker
            if not any(isinstance(cb, _AttachAtSetup) for cb in trainer.callbacks):
                trainer.callbacks.insert(0, _AttachAtSetup())
            return
        self.start_fit()
        if getattr(strategy, _MARK, None) is self:
            return
        if names := _compat.uploading_loggers(trainer):
            raise ConfigError(_UPLOADING.format(", ".join(names)))
        original_load = partial(type(strategy).load_checkpoint, strategy)
        original_teardown = partial(type(strategy).teardown, strategy)
        strategy.save_checkpoint = partial(_save_checkpoint, self, strategy)
        strategy.remove_checkpoint = self.remove_checkpoint
        strategy.teardown = partial(_teardown, self, original_teardown)
        strategy.load_checkpoint = partial(_load_checkpoint, self, trainer, original_load, is_sharded)
        if is_sharded:
            strategy.lightning_module_state_dict = partial(_sharded_module_state, strategy)
            strategy.optimizer_state = partial(_sharded_optimizer_state, strategy)
        for logger in trainer.loggers:  # notified once the save is committed
            if not getattr(logger.after_save_checkpoint, _MARK, False):
                logger.after_save_checkpoint = partial(_after_save_checkpoint, self, logger.after_save_checkpoint)
                setattr(logger.after_save_checkpoint, _MARK, True)
        setattr(strategy, _MARK, self)

    def start_fit(self) -> None:
        """Called once attached inside ``fit``: every rank now calls save/remove/load (collective)."""
        self._collective, self._after_fit = True, False

    def in_run(self, running: bool) -> None:
        """Told by ``Trainer.save_checkpoint`` whether its trainer is running (``fit``...): a save outside a run
        commits before it returns and releases the manager; inside one (also after an earlier run's
        teardown, this plugin reused) saves stay asynchronous and removals wait for them."""
        self._after_fit = not running

    def enable_overlap(self, module: Any) -> None:
        """Let saves copy ``module``'s parameters and optimizer state in the background (the caller waits)."""
        self._param_ptrs = lambda: {_ptr(p) for p in module.parameters()}

    def manager(self, directory: str | os.PathLike | None = None, **kwargs: Any) -> CheckpointManager:
        """The core manager, created on first use with root ``directory`` and ``kwargs`` (config fields).

        Raises:
            ConfigError: no manager yet and no ``directory``.
        """
        if self._manager is None:
            if directory is None:
                raise ConfigError("AsyncDCPCheckpointIO has no checkpoint directory yet")
            self._manager = CheckpointManager(directory, config=self._config.replace(
                naming=StepNaming(), **{"keep_last": None, **kwargs}))
        return self._manager

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; it is committed at ``path`` (a directory; a URL: then uploaded).

        Raises:
            TypeError: ``storage_options`` for a local path (as Lightning's ``TorchCheckpointIO``).
            ConfigError: a value needs pickling (``unsafe_values``), ``path`` is not a torch-ckpt checkpoint, or
                ``storage_options`` is not a dict.
            CheckpointError: an earlier background save or upload failed (raised once).
        """
        url = os.fspath(path) if isinstance(path, (str, os.PathLike)) and is_url(os.fspath(path)) else None
        if url is None and storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) applies to fsspec URLs "
                            f"only (s3://, memory://...), not to the local path {path}")
        if url is not None:
            if storage_options is not None and not isinstance(storage_options, dict):
                raise ConfigError(f"storage_options for a checkpoint URL must be a dict of fsspec options, got "
                                  f"{type(storage_options).__name__}")
            self._remote_options[url] = storage_options
            path = self._remote.local_path(url)
        path = _local_path(path).absolute()
        rank, world = rank_and_world()
        if world > 1 and not self._collective:  # Lightning calls us on rank 0 only
            if rank == 0:
                self._warn_once("rank0", "AsyncDCPCheckpointIO is called on rank 0 only (not attached to a running "
                                "fit), so this checkpoint is written synchronously as a plain .ckpt file. Add "
                                "lightning_ckpt.MTBFCheckpoint to the callbacks or call plugin.attach(trainer) "
                                "before fit.")
                if url is None:
                    TorchCheckpointIO().save_checkpoint(checkpoint, path)
                else:  # one object PUT: a reader sees the whole file or none
                    with fsspec.open(url, "wb", **(self._remote_options[url] or {})) as f:
                        torch.save(checkpoint, f)
            return
        state = self._state(checkpoint)
        manager = self.manager(path.parent)
        self.wait()  # the previous save and its deferred actions come first
        if rank == 0 and path.is_symlink():  # save_last="link" saves last.ckpt in full after a resume: Lightning's
            log.info("replacing the link %s by a checkpoint, as Lightning does", path)  # own IO replaces the link
            path.unlink()
        step = int(checkpoint.get("global_step", 0))
        named = path.parent == manager.root and manager.naming.step_of(path.name) == step
        self._after.handle = manager.save(step, state, path=None if named else path)
        self._saving_path = url or str(path)
        if url is not None and rank == 0:  # rank 0 uploads what every rank committed
            self._after.add(-1, f"upload {url}", lambda: self._remote.upload(path, url, storage_options))
        if self.wait_outside_fit and self._after_fit:
            self.teardown()  # committed; the manager this save opened after the run ends with it (lifecycle)

    def _state(self, checkpoint: dict[str, Any]) -> _LightningState:
        return _LightningState(encode_values(checkpoint, self.unsafe_values),
                               self._param_ptrs() if self._param_ptrs is not None else None)

    def save_to_memory(self, checkpoint: dict[str, Any]) -> None:
        """Stage ``checkpoint`` as its ``global_step`` into the manager's memory tier and return (every rank).

        Raises:
            ConfigError: no manager with a ``memory_root``, or a value needs pickling (``unsafe_values``).
            CheckpointError: an earlier background save failed (raised once).
        """
        state = self._state(checkpoint)
        self.wait()
        self._after.handle = self.manager().save(int(checkpoint.get("global_step", 0)), state, tier="memory")
        self._saving_path = None

    def warn_uploading_loggers(self, names: list[str]) -> None:
        """Warn once that loggers ``names`` upload no checkpoint of ours (``log_model`` picks files only)."""
        self._warn_once("loggers", _UPLOADING.format(", ".join(names)))

    def link_when_committed(self, target: str, link: str) -> None:
        """Point ``link`` at ``target`` atomically, once ``target``'s save is committed (rank 0 calls it)."""

        def relink() -> None:
            if os.path.isdir(link) and not os.path.islink(link):
                cast(CheckpointManager, self._manager).remove(link)  # a checkpoint saved there earlier (save_last=True)
            tmp = os.path.join(os.path.dirname(link), f".{os.path.basename(link)}.link-{uuid.uuid4().hex[:8]}")
            os.symlink(os.path.relpath(target, os.path.dirname(link)), tmp)
            os.replace(tmp, link)

        self._after.add(0, f"link {link} -> {target}", relink)

    def poll(self) -> None:
        """Carry out deferred links, removals and logger calls if the in-flight save has committed."""
        self._after.poll()

    def wait_for_path(self, path: Any) -> None:
        """Block until the in-flight save is committed if it writes ``path`` (``Tuner.lr_find`` reloads at once)."""
        text = os.fspath(path)
        if (self.saving or self._after.pending) and self._saving_path == (text if is_url(text) else
                                                                         os.path.abspath(text)):
            self.wait()

    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads the live tensors."""
        if self._manager is not None:
            self._manager.wait_staged()

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise a background error once; run deferred actions."""
        try:
            if self._manager is not None:
                self._manager.wait()
        finally:
            self._after.run()

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint, file or link at ``path`` once the in-flight save is committed."""
        text = os.fspath(path)
        if rank_and_world()[0] != 0:
            return
        if is_url(text):
            options = self._remote_options.get(text)
            self._after.add(1, f"remove {text}", lambda: self._remote.remove(text, options))
            return
        target = _local_path(path).absolute()
        if target.is_symlink() or target.is_file():
            self._after.add(1, f"remove {target}", lambda: target.unlink(missing_ok=True))
        elif target.is_dir():
            self._after.add(1, f"remove {target}", lambda: self._remove_dir(target))

    def _remove_dir(self, target: Path) -> None:
        """Remove the checkpoint directory ``target`` through the manager, or one opened for it (none is open
        outside a run): as Lightning's own plugin would, never silently keep it."""
        if self._manager is not None:
            self._manager.remove(target)
            return
        with CheckpointManager(target.parent, config=self._config.replace(naming=StepNaming(), keep_last=None,
                                                                          persist="thread")) as manager:
            manager.remove(target)

    @staticmethod
    def is_checkpoint_dir(path: Any) -> bool:
        """True if ``path`` is a committed torch-ckpt checkpoint directory."""
        return is_committed(path)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None, *,
                        live: dict[str, Any] | None = None, strict: bool = True) -> dict[str, Any]:
        """The checkpoint dict Lightning expects, from a torch-ckpt directory or URL or a plain ``.ckpt`` file;
        attached, first checked against ``live`` (``{"state_dict": ...}``; keys when ``strict``).

        Raises:
            CheckpointNotFoundError: ``path`` is a directory but not a committed checkpoint.
            CheckpointCorruptError: a file fails verification.
            StateMismatchError: the checkpoint does not match ``live``; nothing was loaded.
            UnsafeCheckpointError: pickled values and ``weights_only`` is not False.
        """
        self.wait_for_path(path)
        text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
        allow_pickle, options = weights_only is False, self._remote_options.get(text)
        if is_url(text) and self._remote.is_checkpoint(text, options):
            return load_checkpoint_dir([text], manager=None, verify=self.verify_on_load, allow_pickle=allow_pickle,
                                       map_location=map_location, storage_options=options)
        if is_url(text) or not Path(path).is_dir():
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        candidates = self._candidates(path)
        manager = self._manager if self._collective else None
        if manager is None and self._collective:  # attached, nothing saved yet: read through a read-only manager
            manager = CheckpointManager(Path(candidates[0]).parent, config=self._config.replace(
                read_only=True, persist="thread", naming=StepNaming(), keep_last=None))
        try:
            return load_checkpoint_dir(candidates, manager=manager, verify=self.verify_on_load,
                                       allow_pickle=allow_pickle, map_location=map_location, live=live,
                                       strict=strict, allow_cast=self.allow_cast)
        finally:
            if manager is not None and manager is not self._manager:
                manager.close()

    def _candidates(self, path: str | os.PathLike) -> list[Path]:
        """The checkpoint directories to try for a resume from ``path``, in order: ``path`` (absolute), or
        for an interrupted SLURM ``hpc_ckpt_N.ckpt`` the newest older one, then the older checkpoints a
        ``ckpt_path="last"`` resolution queued (:attr:`fallbacks`). Attached, warns once that the RNG is not
        restored without :class:`MTBFCheckpoint`. Every load of a directory (sharded or not) goes here."""
        # absolute: an attached manager reads a relative path relative to its root, not the working directory
        chosen = _instead_of_interrupted(Path(path).absolute())
        if self._collective and not self.rng_restored_by_callback:
            self._warn_once("rng", "AsyncDCPCheckpointIO alone does not restore the RNG: after this resume, dropout "
                            "and random augmentation differ from an uninterrupted run. Add "
                            "lightning_ckpt.MTBFCheckpoint for a bitwise exact resume.")
        return self.fallbacks.pop(str(chosen), [chosen])

    @override
    def teardown(self) -> None:
        """Wait for the in-flight save, release the manager; raise a background error (logged if one propagates)."""
        propagating = sys.exc_info()[1]  # Lightning tears down inside `except` when training failed
        self._collective = False  # until attached again: later rank-0-only calls must not block
        self._after_fit, manager = True, self._manager
        try:
            try:
                self.wait()
            finally:
                self._manager = None
                if manager is not None:
                    manager.close()
                self._remote.close()
        except Exception:  # the failed save's waiting actions are dropped (AfterCommit.run)
            if propagating is None:
                raise
            log.exception("checkpoint error during teardown while %r propagates", propagating)


@atexit.register
def _finish_at_exit() -> None:
    """Carry out deferred actions at exit without ``teardown`` (``ddp_spawn`` worker) once the save committed."""
    for io in [io for io, pid in list(_LIVE.items()) if pid == os.getpid()]:
        if io._manager is None or not io._after.pending:
            continue
        if io.saving:  # that bounded wait ran out (a save that needs ranks which are gone): it must not hold the exit
            log.error("the in-flight checkpoint save was not committed at interpreter exit; not carrying out %s",
                      io._after.pending)
            continue
        try:  # the save failed: wait() reports it and drops the removals
            io.wait()
        except Exception:  # noqa: BLE001 - at exit: report, never mask the exit status
            log.exception("checkpoint error while finishing the in-flight save at interpreter exit")


def _instead_of_interrupted(path: Path) -> Path:
    """``path``, or for an interrupted SLURM ``hpc_ckpt_N.ckpt`` (hidden partial files only) the newest older one."""
    match = _HPC_NAME.fullmatch(path.name)
    if match is None or is_committed(path) or any(not name.startswith(".") for name in os.listdir(path)):
        return path
    older = [(int(m.group(1)), other) for other in path.parent.iterdir() if (m := _HPC_NAME.fullmatch(other.name))
             and int(m.group(1)) < int(match.group(1)) and (other.is_file() or is_committed(other))]
    if not older:
        return path  # loading it raises CheckpointNotFoundError naming it
    chosen = max(older)[1]
    rank_zero_warn(f"{path} is a save that never committed (interrupted by a kill); resuming from {chosen} instead")
    return chosen


def _ptr(tensor: torch.Tensor) -> int:
    return _compat.local_shard(tensor).data_ptr()


def _local_path(path: Any) -> Path:
    return Path(os.fspath(path).removeprefix("file://"))


# -- attach(): every rank takes part in every save (Lightning calls a CheckpointIO on rank 0 only, FSDP and
# ModelParallel not at all); save, remove, load and teardown are replaced on the strategy *instance* by these
# module-level functions bound by functools.partial, never closures: an attached trainer still pickles (ddp_spawn)
def _sharded(strategy: Any) -> bool:
    """True for ModelParallel and FSDP; ConfigError when one is configured to gather full state dicts on rank 0."""
    distributed, dict_type = _compat.sharded_flags(strategy)
    fix = None
    if isinstance(strategy, ModelParallelStrategy) and not distributed:
        fix = "ModelParallelStrategy(save_distributed_checkpoint=True)"
    if isinstance(strategy, FSDPStrategy) and dict_type != "sharded":
        fix = "FSDPStrategy(state_dict_type='sharded')"
    if fix:
        raise ConfigError(f"AsyncDCPCheckpointIO writes sharded checkpoints (every rank its shards): use {fix}")
    return isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))


class _AttachAtSetup(Callback):
    """Installs the wrappers inside ``fit``/``validate``... on every rank (picklable for ``ddp_spawn``)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        trainer.strategy.checkpoint_io.attach(trainer)


def _save_checkpoint(io: Any, strategy: Any, checkpoint: dict[str, Any], filepath: Any,
                     storage_options: Any = None) -> None:
    io.save_checkpoint(checkpoint, strategy.broadcast(filepath), storage_options)


def _teardown(io: Any, original_teardown: Any) -> None:
    try:
        original_teardown()
    finally:
        io.teardown()  # idempotent; the sharded strategies' teardown does not call it


def _sharded_module_state(strategy: Any) -> dict[str, Any]:
    return get_model_state_dict(strategy.model)


def _sharded_optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    return TrainState(model=strategy.model, optimizer=[_compat.unwrap_optimizer(optimizer)],
                      rng=False).state_dict()["optimizer"]


def _load_checkpoint(io: Any, trainer: Any, original_load: Any, is_sharded: bool, checkpoint_path: Any,
                     weights_only: bool | None = None) -> dict[str, Any]:
    strategy = trainer.strategy
    checkpoint_path = strategy.broadcast(checkpoint_path)
    if is_url(os.fspath(checkpoint_path)):  # fsspec URL: downloaded and read by every rank (never a Path)
        return io.load_checkpoint(checkpoint_path, weights_only=weights_only)
    path = Path(checkpoint_path)
    io.wait_for_path(path)
    if not path.is_dir():  # a committed checkpoint is a directory
        return original_load(checkpoint_path, weights_only=weights_only)
    fitting = trainer.state.fn == TrainerFn.FITTING
    module = strategy.lightning_module
    optimizers = [_compat.unwrap_optimizer(o) for o in strategy.optimizers]
    if is_sharded and fitting and optimizers:
        candidates = io._candidates(path)
        target = _ShardedTarget(strategy.model, optimizers)
        restore_candidates(io.manager(path.parent), target, candidates, allow_cast=io.allow_cast)
        return decode_values(target.loaded, allow_pickle=weights_only is False)
    # DDP/single device restore before the optimizers exist: only the model is checked (by the core)
    live = None if is_sharded else {"state_dict": module.state_dict()}
    checkpoint = io.load_checkpoint(path, weights_only=weights_only, live=live, strict=module.strict_loading)
    if is_sharded:  # evaluation: full tensors on every rank, then sharded into the model
        set_model_state_dict(strategy.model, checkpoint["state_dict"],
                             options=StateDictOptions(full_state_dict=True, strict=module.strict_loading))
    return checkpoint


def _after_save_checkpoint(io: Any, original: Any, checkpoint_callback: Any) -> None:
    io._after.add(2, "notify loggers", partial(original, checkpoint_callback))
