"""``AsyncDCPCheckpointIO``: a Lightning ``CheckpointIO`` saving asynchronous, atomic DCP checkpoints through one
:class:`torch_ckpt.CheckpointManager`; links, removals and logger calls made during a save run once it is committed."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ckpt._load import load_checkpoint_dir
from lightning_ckpt._values import RANK_LOCAL_KEYS, UNSAFE_VALUE_MODES, encode_values
from torch_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    ConfigError,
    SaveHandle,
    StepNaming,
    is_committed,
    rank_and_world,
)

__all__ = ["AsyncDCPCheckpointIO"]

log = logging.getLogger(__name__)
_PICKLED_FIELDS = ("_config", "verify_on_load", "unsafe_values", "allow_cast", "wait_outside_fit")


class _LightningState:
    """The checkpoint dict as the core's ``Stateful``, with its rank-local keys and overlap-staged tensors."""

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
    """Asynchronous, atomic, pickle-free DCP checkpoints for Lightning: ``Trainer(plugins=[AsyncDCPCheckpointIO()])``.

    Checkpoints are directories at the paths Lightning asks for; plain ``.ckpt`` files still load.
    Multi-process strategies need it attached (:class:`~lightning_ckpt.MTBFCheckpoint` or :meth:`attach`);
    alone it does not restore the RNG (see ``docs/lightning.md``).

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
        unsafe_values: Values only pickling could store: ``"error"`` (default) raises naming the key;
            ``"pickle"`` stores them pickled (loading them then needs ``weights_only=False``).
        allow_cast: Accept dtype differences between the checkpoint and the live model when loading into an
            attached trainer (each cast key is logged once).
        wait_outside_fit: A save outside a running ``fit`` returns only once the checkpoint is committed.

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
        unsafe_values: Literal["error", "pickle"] = "error",
        allow_cast: bool = False,
        wait_outside_fit: bool = True,
    ) -> None:
        if unsafe_values not in UNSAFE_VALUE_MODES or not isinstance(allow_cast, bool) or \
                not isinstance(wait_outside_fit, bool):
            raise ConfigError(f"unsafe_values must be one of {UNSAFE_VALUE_MODES} and allow_cast/wait_outside_fit "
                              f"booleans, got {unsafe_values!r}, {allow_cast!r}, {wait_outside_fit!r}")
        # the core's one typed configuration validates the manager's settings (same names and defaults)
        self._config = CheckpointConfig(async_save=async_save, persist=persist, overlap_staging=overlap_staging,
                                        writer_niceness=writer_niceness, staging_budget_bytes=staging_budget_bytes,
                                        thread_count=thread_count, timeout_seconds=timeout_seconds,
                                        verify_on_load=verify_on_load)
        self.verify_on_load, self.unsafe_values = verify_on_load, unsafe_values
        self.allow_cast, self.wait_outside_fit = allow_cast, wait_outside_fit
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._manager: CheckpointManager | None = None
        self._pending: list[tuple[int, str, Callable[[], None]]] = []  # (order, what, action) after the commit
        self._param_ptrs: Callable[[], set[int]] | None = None
        self._collective = self._in_fit = self._after_fit = self._warned_fallback = self._warned_rng = False
        self.rng_restored_by_callback = False
        self.fallbacks: dict[str, list[Path]] = {}  # "last" -> newest-first candidates (MTBFCheckpoint)
        self.last_handle: SaveHandle | None = None

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin: runtime state stays behind
        return {k: v for k, v in self.__dict__.items() if k in _PICKLED_FIELDS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    def attach(self, trainer: Any) -> None:
        """Route every checkpoint operation of ``trainer`` through this plugin on every rank (before ``fit``).

        Raises:
            ConfigError: not the trainer's checkpoint IO, or a sharded strategy gathers full state dicts.
        """
        from lightning_ckpt._attach import attach

        attach(self, trainer)

    def start_fit(self) -> None:
        """Called once attached inside ``fit``: every rank now calls save/remove/load (collective)."""
        self._collective, self._in_fit, self._after_fit = True, True, False

    def enable_overlap(self, module: Any) -> None:
        """Let saves copy ``module``'s parameters and optimizer state in the background (the caller waits)."""
        self._param_ptrs = lambda: {_ptr(p) for p in module.parameters()}

    def manager(self, directory: str | os.PathLike | None = None, **kwargs: Any) -> CheckpointManager:
        """The core manager, created on first use (collectively once attached) with root ``directory``
        (default: the first checkpoint's directory) and ``kwargs`` (:class:`~torch_ckpt.CheckpointConfig` fields).

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
        """Stage ``checkpoint`` and return; it is committed at ``path`` (a directory) in the background.

        Raises:
            TypeError: ``storage_options`` is given.
            ConfigError: a value needs pickling (see ``unsafe_values``), or ``path`` is not a torch-ckpt checkpoint.
            CheckpointError: an earlier background save failed (raised once).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not support storage_options")
        path = _local_path(path).absolute()
        if rank_and_world()[1] > 1 and not self._collective:  # Lightning calls us on rank 0 only
            if rank_and_world()[0] == 0:
                if not self._warned_fallback:
                    self._warned_fallback = True
                    rank_zero_warn("AsyncDCPCheckpointIO is called on rank 0 only (not attached to a running fit), so "
                                   "this checkpoint is written synchronously as a plain .ckpt file. Add lightning_ckpt."
                                   "MTBFCheckpoint to the callbacks or call plugin.attach(trainer) before fit.")
                TorchCheckpointIO().save_checkpoint(checkpoint, path)
            return
        state = _LightningState(encode_values(checkpoint, self.unsafe_values),
                                self._param_ptrs() if self._param_ptrs is not None else None)
        manager = self.manager(path.parent)
        self.wait()  # the previous save and its deferred actions come first
        step = int(checkpoint.get("global_step", 0))
        named = path.parent == manager.root and manager.naming.step_of(path.name) == step
        self.last_handle = manager.save(step, state, path=None if named else path)
        if self.wait_outside_fit and self._after_fit:
            self.wait()

    @property
    def saving(self) -> bool:
        """True while a save is in flight (staged, not yet committed)."""
        return self.last_handle is not None and not self.last_handle.committed.done()

    def _after_commit(self, order: int, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` now, or once the in-flight save is committed (links 0, removals 1, loggers 2)."""
        if self.saving:
            self._pending.append((order, what, action))
        else:
            action()

    def _run_pending(self) -> None:
        handle, (pending, self._pending) = self.last_handle, (sorted(self._pending, key=lambda p: p[0]), [])
        if pending and handle is not None and handle.committed.done() and handle.committed.exception() is not None:
            log.warning("the last save failed: not carrying out %s, so older checkpoints stay in place",
                        [what for _, what, _ in pending])
            return
        for _, what, action in pending:
            try:
                action()
            except OSError as exc:
                log.warning("after a commit: could not %s: %s", what, exc)

    def link_when_committed(self, target: str, link: str) -> None:
        """Point ``link`` at ``target`` atomically, once ``target``'s save is committed (rank 0 calls it)."""

        def relink() -> None:
            if os.path.isdir(link) and not os.path.islink(link):
                self._manager.remove(link)  # a checkpoint saved there earlier (save_last=True)
            tmp = os.path.join(os.path.dirname(link), f".{os.path.basename(link)}.link-{uuid.uuid4().hex[:8]}")
            os.symlink(os.path.relpath(target, os.path.dirname(link)), tmp)
            os.replace(tmp, link)

        self._after_commit(0, f"link {link} -> {target}", relink)

    def call_when_committed(self, call: Callable[[], None]) -> None:
        """Run ``call`` (a logger notification) on this thread once the in-flight save is committed."""
        self._after_commit(2, "notify loggers", call)

    def poll(self) -> None:
        """Carry out deferred links, removals and logger calls if the in-flight save has committed."""
        if self._pending and not self.saving:
            self._run_pending()

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
            self._run_pending()

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (directory, file or link) once the in-flight save is committed."""
        target = _local_path(path).absolute()
        if rank_and_world()[0] == 0 and (target.is_symlink() or target.is_file()):
            self._after_commit(1, f"remove {target}", lambda: target.unlink(missing_ok=True))
        elif rank_and_world()[0] == 0 and self._manager is not None:
            self._after_commit(1, f"remove {target}", lambda: self._manager.remove(target))

    @staticmethod
    def is_checkpoint_dir(path: Any) -> bool:
        """True if ``path`` is a committed torch-ckpt checkpoint directory."""
        return is_committed(path)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None, *,
                        live: dict[str, Any] | None = None, strict: bool = True) -> dict[str, Any]:
        """The checkpoint dict Lightning expects, from a torch-ckpt directory or a plain ``.ckpt`` file.

        For ``ckpt_path="last"`` of :class:`~lightning_ckpt.MTBFCheckpoint`, a checkpoint failing verification
        falls back to the next older one with a warning; an explicit path raises. Once attached, a directory
        is first checked against ``live`` (``{"state_dict": <the live model's state>}``; keys when ``strict``).

        Raises:
            CheckpointNotFoundError: ``path`` is a directory but not a committed checkpoint.
            CheckpointCorruptError: a file fails verification.
            StateMismatchError: the checkpoint does not match ``live``; nothing was loaded.
            UnsafeCheckpointError: pickled values and ``weights_only`` is not False.
        """
        if not Path(path).is_dir():
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        # absolute: an attached manager reads a relative path relative to its root, not the working directory
        candidates = self.fallbacks.pop(str(Path(path).absolute()), [Path(path).absolute()])
        if self._in_fit and not self.rng_restored_by_callback and not self._warned_rng:
            self._warned_rng = True
            rank_zero_warn("AsyncDCPCheckpointIO alone does not restore the RNG: after this resume, dropout and random "
                           "augmentation differ from an uninterrupted run. Add lightning_ckpt.MTBFCheckpoint for a "
                           "bitwise exact resume.")
        manager = self._manager if self._collective else None
        if manager is None and self._collective:  # attached, nothing saved yet: read through a read-only manager
            manager = CheckpointManager(Path(candidates[0]).absolute().parent, config=self._config.replace(
                read_only=True, persist="thread", naming=StepNaming(), keep_last=None))
        try:
            return load_checkpoint_dir(candidates, manager=manager, verify=self.verify_on_load,
                                       allow_pickle=weights_only is False, map_location=map_location, live=live,
                                       strict=strict, allow_cast=self.allow_cast)
        finally:
            if manager is not None and manager is not self._manager:
                manager.close()

    @override
    def teardown(self) -> None:
        """Wait for the in-flight save, release the manager; raise a background error once (log it while
        another exception propagates)."""
        propagating = sys.exc_info()[1]  # Lightning tears down inside `except` when training failed
        self._collective = self._in_fit = False  # until attached again: later rank-0-only calls must not block
        self._after_fit, manager = True, self._manager
        try:
            try:
                self.wait()
            finally:
                self._manager = None
                if manager is not None:
                    manager.close()
        except Exception:
            self._pending = []
            if propagating is None:
                raise
            log.exception("checkpoint error during teardown while %r propagates", propagating)


def _ptr(tensor: torch.Tensor) -> int:
    return getattr(tensor, "_local_tensor", tensor).data_ptr()  # a DTensor's local shard


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(f"AsyncDCPCheckpointIO writes to local paths only, got {text!r}")
    return Path(text.removeprefix("file://"))
