"""``AsyncDCPCheckpointIO``: a Lightning ``CheckpointIO`` whose saves are asynchronous, atomic DCP checkpoints.

Each ``save_checkpoint`` stages the checkpoint dict into host memory through
:class:`torch_ckpt.AsyncCheckpointer` and returns; a writer thread persists it as a torch-ckpt
directory (DCP shards, per-rank JSON, manifest with CRC-32 per file) written as a hidden
``.NAME.tmp.<id>`` sibling and renamed to ``NAME`` when complete. At most one save is in flight; the next
save, :meth:`~AsyncDCPCheckpointIO.wait` and ``teardown`` wait for it and raise its error, once.

Operations on names that Lightning issues while a save is in flight are ordered after its commit:

* ``remove_checkpoint`` (``ModelCheckpoint(save_top_k=...)``) of the in-flight checkpoint or of any
  other one is carried out right after the commit, by the writer thread. If the save fails, those
  removals are dropped (and logged), so the older checkpoints survive.
* saving to an existing path (``save_last=True``) writes a hidden sibling and swaps it in after the
  commit (see :mod:`lightning_ckpt._paths`).
* once attached to the trainer (:meth:`AsyncDCPCheckpointIO.attach`, done by
  :class:`~lightning_ckpt.MTBFCheckpoint`), ``save_last="link"`` links and loggers'
  ``after_save_checkpoint`` calls are deferred until the checkpoint they refer to is committed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ckpt._load import is_checkpoint_dir, load_checkpoint_dir, world
from lightning_ckpt._paths import TRASH_PREFIX, link_path, remove_path, replace_path
from lightning_ckpt._values import RANK_LOCAL_KEYS, UNSAFE_VALUE_MODES, encode_values
from torch_ckpt import AsyncCheckpointer, ConfigError, SaveHandle

__all__ = ["AsyncDCPCheckpointIO"]

log = logging.getLogger(__name__)

_NEXT_SUFFIX = ".next"


class _LightningState:
    """The checkpoint dict as the core's ``Stateful``: rank-local keys and overlap staging."""

    rank_local_keys = RANK_LOCAL_KEYS

    def __init__(self, state: dict[str, Any], param_ptrs: set[int] | None) -> None:
        self._state = state
        self._param_ptrs = param_ptrs

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def optimizer_owned_keys(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Parameters and optimizer state: copied in the background until the next optimizer step."""
        if self._param_ptrs is None:
            return set()
        return {k for k, t in tensors.items() if k.startswith("optimizer_states.") or (
            k.startswith("state_dict.") and getattr(t, "_local_tensor", t).data_ptr() in self._param_ptrs)}

    def optimizers(self) -> list:
        # No optimizer step pre-hooks: Lightning runs forward/backward inside optimizer.step(closure), so
        # MTBFCheckpoint waits in on_before_optimizer_step instead (after backward, before the update).
        return []


class AsyncDCPCheckpointIO(CheckpointIO):
    """Asynchronous, atomic, pickle-free DCP checkpoints for Lightning: ``Trainer(plugins=[AsyncDCPCheckpointIO()])``.

    Checkpoints are directories (at the path Lightning asks for, e.g. ``epoch=0-step=100.ckpt/``).
    ``load_checkpoint`` reads them, and still reads plain ``.ckpt`` files, so a project can switch
    mid-way. Single-device training works with the plugin alone. Multi-process strategies (DDP,
    FSDP, ModelParallel) need the plugin attached to the trainer so that every rank takes part in
    each save; :class:`~lightning_ckpt.MTBFCheckpoint` attaches it, or call :meth:`attach`.

    Args:
        async_save: Persist in a background thread (default) or inside ``save_checkpoint``.
        persist: Where background writes run: ``"thread"`` (default) or ``"process"`` (a writer process
            per rank; plain tensors only, not FSDP/ModelParallel states).
        overlap_staging: With :class:`~lightning_ckpt.MTBFCheckpoint`, copy parameters and optimizer
            state in the background while the next forward/backward runs; the callback waits for the
            copy before the next optimizer step. Without the callback everything is copied in
            ``save_checkpoint``.
        writer_niceness: Nice increment (0-19) of the writer thread on Linux; 0 leaves it unchanged.
        staging_budget_bytes: Host bytes for the reusable staging buffer; default half of the
            available RAM. A checkpoint that does not fit is written synchronously.
        thread_count: DCP writer threads per rank.
        timeout_seconds: Limit for checkpoint collectives between ranks, in seconds.
        verify_on_load: Check the CRC-32 of every file before loading (sizes are always checked).
        unsafe_values: What to do with checkpoint values that only pickling could store (for example
            a ``pathlib.Path`` hyper-parameter): ``"error"`` (default) raises naming the key;
            ``"pickle"`` stores them pickled, and loading them then needs ``weights_only=False``.
        allow_cast: Once attached to the trainer, loading one of our directories checks the model's
            and optimizers' tensors against the checkpoint before Lightning writes anything; a dtype
            difference is an error unless this is True (each cast key is then logged once).

    Raises:
        ConfigError: An argument is out of range.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        persist: Literal["thread", "process"] = "thread",
        overlap_staging: bool = True,
        writer_niceness: int = 0,
        staging_budget_bytes: int | None = None,
        thread_count: int = 1,
        timeout_seconds: float = 600.0,
        verify_on_load: bool = True,
        unsafe_values: Literal["error", "pickle"] = "error",
        allow_cast: bool = False,
    ) -> None:
        if unsafe_values not in UNSAFE_VALUE_MODES:
            raise ConfigError(f"unsafe_values must be one of {UNSAFE_VALUE_MODES}, got {unsafe_values!r}")
        if staging_budget_bytes is not None and staging_budget_bytes <= 0:
            raise ConfigError(f"staging_budget_bytes must be > 0 or None, got {staging_budget_bytes!r}")
        if persist not in ("thread", "process"):
            raise ConfigError(f"persist must be 'thread' or 'process', got {persist!r}")
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError(f"thread_count must be an int >= 1, got {thread_count!r}")
        if isinstance(writer_niceness, bool) or not isinstance(writer_niceness, int) or not 0 <= writer_niceness <= 19:
            raise ConfigError(f"writer_niceness must be an int in [0, 19], got {writer_niceness!r}")
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) \
                or not 0 < timeout_seconds < float("inf"):
            raise ConfigError(f"timeout_seconds must be a finite number of seconds > 0, got {timeout_seconds!r}")
        for name, value in (("async_save", async_save), ("overlap_staging", overlap_staging),
                            ("verify_on_load", verify_on_load), ("allow_cast", allow_cast)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        # the checkpointer itself is created on first use: creating it is collective once torch.distributed runs
        self._core_kwargs = dict(async_save=async_save, persist=persist, overlap_staging=overlap_staging,
                                 writer_niceness=writer_niceness, staging_budget_bytes=staging_budget_bytes,
                                 thread_count=thread_count, timeout_seconds=timeout_seconds)
        self.verify_on_load = bool(verify_on_load)
        self.unsafe_values = unsafe_values
        self.allow_cast = bool(allow_cast)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._checkpointer: AsyncCheckpointer | None = None
        self._lock = threading.Lock()
        self._inflight: Path | None = None
        self._after_commit: list[tuple[str, Callable[[], None]]] = []
        self._main_thread_calls: list[Callable[[], None]] = []
        self._param_ptrs: Callable[[], set[int]] | None = None
        self._collective = False
        self._was_attached = False
        self._cleaned_dirs: set[Path] = set()
        self._warned_fallback = False
        self.last_handle: SaveHandle | None = None

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the strategy and its plugins; runtime state stays behind.
        return {"_core_kwargs": self._core_kwargs, "verify_on_load": self.verify_on_load,
                "unsafe_values": self.unsafe_values, "allow_cast": self.allow_cast}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # -- wiring ----------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> None:
        """Route every checkpoint operation of ``trainer`` through this plugin on every rank.

        Call on every rank before ``fit`` (``MTBFCheckpoint`` does it in ``setup``). See
        :func:`lightning_ckpt._attach.attach` for what is installed per strategy.
        """
        from lightning_ckpt._attach import attach

        attach(self, trainer)

    def _set_collective(self) -> None:
        """Called by the attachment: every rank now calls save/remove/load (collective mode)."""
        self._collective = self._was_attached = True

    def enable_overlap(self, param_ptrs: Callable[[], set[int]]) -> None:
        """Let saves copy parameters/optimizer state in the background (the caller waits before steps)."""
        self._param_ptrs = param_ptrs

    def checkpointer(self) -> AsyncCheckpointer:
        """The core checkpointer (created on first use; collective over ranks when distributed)."""
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(**self._core_kwargs)
        return self._checkpointer

    def _is_coordinator(self) -> bool:
        if self._checkpointer is not None:
            return self._checkpointer.ctx.is_coordinator
        return world()[0] == 0

    # -- saving ----------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; it is committed at ``path`` (a directory) in the background.

        Raises:
            TypeError: ``storage_options`` is given (not supported).
            ConfigError: a value cannot be stored without pickling (see ``unsafe_values``).
            CheckpointError: an earlier background save failed (raised once).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not support storage_options")
        path = _local_path(path)
        if world()[1] > 1 and not self._collective:
            self._save_rank_zero_fallback(checkpoint, path)
            return
        ckpt = self.checkpointer()
        self.wait()
        state = _LightningState(encode_values(checkpoint, self.unsafe_values),
                                self._param_ptrs() if self._param_ptrs is not None else None)
        self._clean_dir_once(path.parent)
        overwrite = bool(ckpt.ctx.broadcast(os.path.lexists(path), what="checkpoint path check"))
        final = path.with_name(f".{path.name}{_NEXT_SUFFIX}") if overwrite else path
        if overwrite and ckpt.ctx.is_coordinator:
            remove_path(final)  # a leftover of a crash between commit and swap
        with self._lock:
            self._inflight = path  # before save(): the commit may complete before save() returns
        try:
            handle = ckpt.save(final, state, step=int(checkpoint.get("global_step", 0)),
                               on_committed=partial(self._on_committed, target=path, overwrite=overwrite))
        except BaseException:
            with self._lock:
                self._inflight, self._after_commit = None, []
            raise
        self.last_handle = handle
        handle.committed.add_done_callback(partial(self._on_done, target=path))

    def _save_rank_zero_fallback(self, checkpoint: dict[str, Any], path: Path) -> None:
        if world()[0] != 0:
            return
        if not self._warned_fallback and not self._was_attached:  # after a fit: e.g. ddp_spawn returning weights
            self._warned_fallback = True
            rank_zero_warn(
                "AsyncDCPCheckpointIO was called on rank 0 only (it is not attached to a running fit), so this "
                "checkpoint is written synchronously as a plain .ckpt file. For asynchronous DCP saves with several "
                "ranks add lightning_ckpt.MTBFCheckpoint to the callbacks, or call plugin.attach(trainer) on every "
                "rank.")
        TorchCheckpointIO().save_checkpoint(checkpoint, path)

    def _clean_dir_once(self, directory: Path) -> None:
        if directory in self._cleaned_dirs or not self._is_coordinator() or not directory.is_dir():
            return
        self._cleaned_dirs.add(directory)
        for entry in directory.iterdir():
            if entry.name.startswith(TRASH_PREFIX) or (entry.name.startswith(".") and (
                    entry.name.endswith(_NEXT_SUFFIX) or ".link-" in entry.name)):
                remove_path(entry)

    def _on_committed(self, committed: Path, *, target: Path, overwrite: bool) -> None:
        """Writer thread, every rank, after the commit: swap in an overwrite, then run deferred actions."""
        if self._is_coordinator() and overwrite:
            replace_path(Path(committed), target)
        with self._lock:
            actions, self._after_commit, self._inflight = self._after_commit, [], None
        for what, action in actions:
            try:
                action()
            except OSError as exc:
                log.warning("after committing %s: could not %s: %s", target, what, exc)

    def _on_done(self, future: Any, *, target: Path) -> None:
        if future.exception() is None:
            return
        with self._lock:
            dropped, self._after_commit, self._inflight = self._after_commit, [], None
            calls, self._main_thread_calls = self._main_thread_calls, []
        if dropped or calls:
            log.warning("saving %s failed: not carrying out %s and %d deferred logger call(s), so older checkpoints "
                        "stay in place", target, [what for what, _ in dropped], len(calls))

    def _when_committed(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on the coordinator now, or right after the in-flight save commits."""
        if not self._is_coordinator():
            return
        with self._lock:
            if self._inflight is not None:
                self._after_commit.append((what, action))
                return
        action()

    def _call_when_committed(self, call: Callable[[], None]) -> None:
        """Run ``call`` on this thread now, or at the next wait point after the in-flight save commits."""
        with self._lock:
            if self._inflight is not None:
                self._main_thread_calls.append(call)
                return
        call()

    def _link_when_committed(self, target: str, link: str) -> None:
        self._when_committed(f"link {link} -> {target}", partial(link_path, Path(target), Path(link)))

    @property
    def saving(self) -> bool:
        """True while a save is in flight (staged, not yet committed)."""
        return self._inflight is not None

    def poll(self) -> None:
        """Run deferred calls if the in-flight save has committed; never blocks."""
        if self._inflight is None:
            self._run_main_thread_calls()

    def _run_main_thread_calls(self) -> None:
        with self._lock:
            calls, self._main_thread_calls = self._main_thread_calls, []
        for call in calls:
            call()

    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads the live tensors."""
        if self._checkpointer is not None:
            self._checkpointer.wait_staged()

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise a background error once; run deferred calls."""
        if self._checkpointer is not None:
            self._checkpointer.wait()
        self._run_main_thread_calls()

    # -- removing --------------------------------------------------------------------------------
    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (directory, file or link), after the in-flight save commits."""
        target = _local_path(path)
        if world()[1] > 1 and not self._collective:
            if world()[0] == 0:
                remove_path(target)  # nothing in flight: fallback saves are synchronous
            return
        self._when_committed(f"remove {target}", partial(remove_path, target))

    # -- loading ---------------------------------------------------------------------------------
    @staticmethod
    def is_checkpoint_dir(path: Any) -> bool:
        """True if ``path`` is a committed torch-ckpt checkpoint directory."""
        return is_checkpoint_dir(path)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Return the checkpoint dict Lightning expects, from a torch-ckpt directory or a plain ``.ckpt`` file.

        Tensors are full (unsharded) CPU tensors, moved to ``map_location`` when it is a device or
        device string. Rank-local entries (loop progress, callback states) are this rank's own when
        the world size is the one that saved.

        Raises:
            CheckpointNotFoundError: ``path`` is a directory but not a committed checkpoint.
            CheckpointCorruptError: a file fails verification.
            UnsafeCheckpointError: pickled values and ``weights_only`` is not False.
        """
        if not Path(path).is_dir():
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return load_checkpoint_dir(Path(path), verify=self.verify_on_load, allow_pickle=weights_only is False,
                                   map_location=map_location)

    # -- lifecycle -------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Wait for the in-flight save and release the writer; raise a background error (once).

        While another exception is propagating the error is logged instead, so it does not mask it.
        """
        propagating = sys.exc_info()[1]  # Lightning tears down inside `except` when training failed
        self._collective = False  # until attached again: later rank-0-only calls (ddp_spawn) must not block
        ckpt, self._checkpointer = self._checkpointer, None
        if ckpt is None:
            self._run_main_thread_calls()
            return
        try:
            ckpt.close()
        except Exception:
            with self._lock:
                self._main_thread_calls = []
            if propagating is not None:
                log.exception("checkpoint error during teardown while %r propagates", propagating)
                return
            raise
        self._run_main_thread_calls()


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(f"AsyncDCPCheckpointIO writes to local paths only, got {text!r}")
    return Path(text.removeprefix("file://"))

