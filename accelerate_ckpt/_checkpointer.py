"""``attach()``: route an ``Accelerator``'s ``save_state``/``load_state`` through a torch-ckpt ``CheckpointManager``.

Accelerate's pre-hooks only see the weights of plain models; optimizers, schedulers, scaler,
samplers and RNG are written synchronously after the hooks return, and FSDP models before they run.
So :func:`attach` replaces ``save_state`` and ``load_state`` *on that one Accelerator instance*
(instance attributes; :meth:`AccelerateCheckpointer.close` removes them). Registered pre-hooks still
run in order with ``(models, weights, output_dir)`` / ``(models, input_dir)``; what they do not
``pop()`` the manager saves with everything else in one asynchronous, sharded, atomic checkpoint. Naming, retention, resume with fallback, rollback,
atomic replacement of a reused folder, scheduling and the durable copy are the manager's.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from accelerate_ckpt import _compat as compat
from accelerate_ckpt._config import CkptSettings, load_settings
from accelerate_ckpt._guard import one_process_guard
from accelerate_ckpt._state import AcceleratorTrainState
from torch_ckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    DurableTier,
    PatternNaming,
    SaveHandle,
    UnsafeCheckpointError,
    is_committed,
)

__all__ = ["NAMING", "AccelerateCheckpointer", "attach"]

log = logging.getLogger(__name__)

#: Accelerate's automatic checkpoint names, ``checkpoint_<save iteration>``.
NAMING = PatternNaming("checkpoint_{step}")
_HOOK_FILES = ".{}.hooks.tmp.{}"  # user save hooks write here; the files commit with the checkpoint (extra_dir)

_STAT_KEYS = ("blocking_s", "wait_for_previous_s", "staging_s", "persist_s", "total_s", "bytes", "files_bytes",
              "gb_per_s")


def attach(accelerator: Any, config: str | os.PathLike | None = None, *, save_policy: Any = None,
           **settings: Any) -> AccelerateCheckpointer:
    """Make ``accelerator.save_state()`` asynchronous and ``load_state()`` exact, through torch-ckpt.

    Call it on every process, after creating the ``Accelerator`` (before or after ``prepare``),
    at the same point of the program.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        config: YAML settings file (keys: :class:`~accelerate_ckpt.CkptSettings`); the file named by
            the environment variable ``ACCELERATE_CKPT_CONFIG`` wins over it.
        save_policy: a :mod:`torch_ckpt.schedule` policy for :meth:`AccelerateCheckpointer.should_save`
            (instead of the ``save_every_n_steps``/``save_every_seconds``/``mtbf_seconds`` settings).
        settings: any setting of :class:`~accelerate_ckpt.CkptSettings`; wins over the file.

    Returns:
        The :class:`AccelerateCheckpointer` (call :meth:`~AccelerateCheckpointer.close` at the end).

    Raises:
        ConfigError: invalid settings, or an unsupported setup (DeepSpeed, Megatron-LM, XLA).
    """
    return AccelerateCheckpointer(accelerator, load_settings(config, **settings), save_policy=save_policy)


class AccelerateCheckpointer:
    """Asynchronous, atomic, sharded ``save_state``/``load_state`` for one ``Accelerator``.

    Use :func:`attach` to build it. Not thread-safe: call it from the training thread.

    Attributes:
        accelerator: the ``Accelerator``.
        settings: the merged :class:`~accelerate_ckpt.CkptSettings`.
        step: the training step, recorded in each checkpoint and restored by ``load_state()``; set
            by :meth:`should_save`, :meth:`save_if_due`, ``save_state(step=)`` or by you (None:
            unknown). Automatic names follow Accelerate's save iteration, never this step.
        manager: the :class:`~torch_ckpt.CheckpointManager` (root ``project_dir/checkpoints`` with
            automatic naming, else the parent of the first folder saved or loaded; None until then).
        last_handle: the :class:`~torch_ckpt.SaveHandle` of the latest save.
    """

    def __init__(self, accelerator: Any, settings: CkptSettings, *, save_policy: Any = None) -> None:
        self.accelerator = accelerator
        self.settings = settings
        self.step: int | None = None
        self.manager: CheckpointManager | None = None
        self.last_handle: SaveHandle | None = None
        self._policy = {} if save_policy is None else {"save_policy": save_policy}
        self._unlogged: list[tuple[SaveHandle, int | None]] = []  # (handle, training step)
        self._last_health = float("-inf")
        self._closed = not settings.enabled
        if not settings.enabled:
            log.info("accelerate_ckpt disabled by its settings: Accelerate's own save_state/load_state stay in use")
            return
        compat.check_supported(accelerator)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != accelerator.num_processes:
            warnings.warn(
                f"torch.distributed has world size {world} but Accelerate runs {accelerator.num_processes} "
                "process(es) (on a CPU machine, torchrun needs ACCELERATE_USE_CPU=1 or Accelerator(cpu=True)); "
                f"checkpoints are written as world size {world}, while Accelerate trains each process alone",
                stacklevel=3)
        self._auto = bool(accelerator.project_configuration.automatic_checkpoint_naming)
        cfg = settings.config
        if cfg.durable_url is not None:
            if not self._auto:
                raise ConfigError("durable_url needs ProjectConfiguration(automatic_checkpoint_naming=True): only "
                                  "automatic checkpoints are replicated")
            DurableTier(cfg.durable_url, storage_options=cfg.storage_options)  # fail now on a bad URL
        if self._auto and accelerator.project_dir is None:
            raise ConfigError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state

    def _open(self, root: Path | None = None) -> CheckpointManager:
        """The manager; created on first use (collective: every process reaches it at the same call).

        Its root is ``project_dir/checkpoints`` with automatic naming, else ``root``. Not created at
        ``attach()``, so that a fresh run's ``checkpoints`` folder appears only with its first save.
        """
        if self.manager is None:
            if self._auto:
                root = Path(self.accelerator.project_dir).expanduser() / "checkpoints"
            s = self.settings
            keep = s.config.keep_last if s.keep_last_given else self.accelerator.project_configuration.total_limit
            self.manager = CheckpointManager(root, config=s.config, naming=NAMING, keep_last=keep if self._auto else None,
                                             **self._policy)
        return self.manager

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this AccelerateCheckpointer is closed or disabled")

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> AccelerateCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # keep the original exception; log this one
                log.exception("checkpoint error while closing after another exception")

    @property
    def enabled(self) -> bool:
        """False when the settings disabled the adapter or it was closed (Accelerate's own methods are in use)."""
        return not self._closed

    # -- hooks -----------------------------------------------------------------------------------
    def _run_hooks(self, table: dict, items: list, folder: Path, *, save: bool) -> list[int]:
        """Run the registered pre-hooks on ``items`` (one per plain model; none for FSDP, whose models
        Accelerate never hands to hooks); what they leave is torch-ckpt's. Returns the model indices a
        hook ``pop()``ed (it saves or loads that model itself)."""
        originals = list(items)
        args = (compat.prepared(self.accelerator, "models"), items, str(folder)) if save else (items, str(folder))
        for hook in list(table.values()):
            hook(*args)
        left = {id(x) for x in items}
        return [i for i, item in enumerate(originals) if id(item) not in left]

    # -- saving ----------------------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   step: int | None = None, **save_model_func_kwargs: Any) -> Path:
        """Replacement of ``Accelerator.save_state``: returns once the state is staged.

        With automatic naming the folder is ``checkpoint_<save iteration>`` (as in Accelerate);
        otherwise ``output_dir``, which may be saved again: the new checkpoint replaces the old
        one atomically when it commits (the old one stays loadable until then).

        Args:
            output_dir: the folder (ignored with automatic checkpoint naming, as in Accelerate).
            safe_serialization: ignored; torch-ckpt never pickles.
            step: the training step (sets :attr:`step`), recorded in the checkpoint.
            save_model_func_kwargs: ignored (DeepSpeed-only in Accelerate).

        Returns:
            The checkpoint folder; it appears, complete, when the save commits.

        Raises:
            ConfigError: called under an ``if accelerator.is_main_process:``-style guard with several
                processes (every process must call it); ``output_dir`` exists and is not a torch-ckpt
                checkpoint (it is never written into); ``checkpoint_<n>`` exists (as in Accelerate).
            CheckpointError: an earlier background save failed (raised once).
        """
        self._check_open()
        acc = self.accelerator
        guard = one_process_guard() if acc.num_processes > 1 else None
        if guard is not None:
            raise ConfigError(
                f"accelerator.save_state() is called under `{guard}`, but with accelerate_ckpt every process must "
                "call it (each writes its own shard; the main process commits): remove the guard. Called on one "
                f"process it would wait {self.settings.config.timeout_seconds:.0f} s for the others and fail")
        t0 = time.monotonic()
        self.wait()  # one save in flight; its hook files are in place before new hooks run
        waited = time.monotonic() - t0
        if step is not None:
            self.step = int(step)
        iteration = compat.save_iteration(acc)
        if self._auto:
            manager, path, number = self._open(), None, iteration
            folder = manager.root / NAMING.name(iteration)
        elif output_dir is None:
            raise ValueError("save_state() needs output_dir unless automatic_checkpoint_naming is enabled")
        else:
            folder = Path(output_dir).expanduser().absolute()
            manager, path = self._open(folder.parent), folder
            number = self.step if self.step is not None else iteration
        log.info("Saving current state to %s (save iteration %d, training step %s)", folder, iteration,
                 "unknown" if self.step is None else self.step)
        user = bool(compat.save_hooks(acc))
        models = [] if compat.is_fsdp(acc) else compat.prepared(acc, "models")
        weights = [acc.get_state_dict(m, unwrap=False) if user else object() for m in models]  # user hooks: real ones
        hook_dir = folder.parent / _HOOK_FILES.format(folder.name, manager.checkpointer.incarnation)
        if user:
            shutil.rmtree(hook_dir, ignore_errors=True)
            os.makedirs(hook_dir)
        skipped = self._run_hooks(compat.save_hooks(acc), weights, hook_dir, save=True)
        state = AcceleratorTrainState(acc, step=self.step, save_iteration=iteration + 1, skip_models=skipped)
        handle = manager.save(number, state, path=path, extra_dir=hook_dir if user else None)
        compat.set_save_iteration(acc, iteration + 1)
        handle.stats.wait_for_previous_s += waited
        handle.stats.blocking_s = time.monotonic() - t0  # the whole call: wait, hooks, staging
        self.last_handle = handle
        self._unlogged.append((handle, self.step))
        return folder

    # -- loading ---------------------------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        """The newest committed automatic checkpoint folder on local disk, or None (collective).

        ``load_state()`` also looks at ``durable_url`` and falls back past a damaged newest checkpoint.
        """
        if self._closed or not self._auto:
            return None
        found = self._open().checkpoints()
        return found[max(found)] if found else None

    def _load_foreign(self, folder: Path, allow_unsafe: bool, load_kwargs: Any, kwargs: dict) -> None:
        """A folder without a torch-ckpt manifest: an incomplete save, or one plain Accelerate wrote."""
        acc = self.accelerator
        accelerate_files = [p for p in folder.iterdir() if not p.name.startswith(".")]
        if not accelerate_files:
            newest = self.latest_checkpoint()
            raise CheckpointNotFoundError(
                f"{folder} is an incomplete save (interrupted before it committed), not a checkpoint; "
                + (f"the newest intact checkpoint is {newest}" if newest is not None else "load another one"))
        if not allow_unsafe:
            raise UnsafeCheckpointError(
                f"{folder} has no torch-ckpt manifest (it was not written through torch-ckpt). Accelerate's own "
                "load_state would unpickle parts of it, which can run code from the folder; if you trust it, "
                "call accelerator.load_state(folder, allow_unsafe_accelerate_folder=True)")
        log.info("%s has no torch-ckpt manifest: loading it with Accelerate's own load_state", folder)
        compat.plain_load_state(acc, str(folder), load_kwargs, kwargs)
        number = NAMING.step_of(folder.name)
        if number is not None:  # Accelerate does not restore its save iteration; the folder name holds it
            compat.set_save_iteration(acc, number + 1)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, *,
                   allow_unsafe_accelerate_folder: bool = False, allow_cast: bool = False,
                   **load_model_func_kwargs: Any) -> None:
        """Replacement of ``Accelerator.load_state``: restores everything in place, exactly, or nothing.

        Without ``input_dir`` (automatic naming) the newest checkpoint intact in either tier is
        loaded; a damaged one is skipped with a warning naming it. Loading an older checkpoint than
        the newest rolls back: the newer ones are moved aside (kept, hidden) at the next save.

        Args:
            input_dir: the checkpoint folder; None picks the newest intact automatic checkpoint.
            allow_unsafe_accelerate_folder: hand a folder without a torch-ckpt manifest to
                Accelerate's own ``load_state`` (only for folders you trust: it unpickles).
            allow_cast: cast tensors whose dtype differs from the live one (each cast key is logged
                once); by default a dtype difference is a ``StateMismatchError``.
            load_kwargs: passed on only for folders Accelerate wrote itself.
            load_model_func_kwargs: passed on only for folders Accelerate wrote itself;
                ``strict=False`` is refused for torch-ckpt checkpoints.

        Raises:
            ValueError: ``input_dir`` is not a folder, or None without automatic naming (as Accelerate).
            CheckpointNotFoundError: no checkpoint to load, or ``input_dir`` is an incomplete save.
            UnsafeCheckpointError: ``input_dir`` was written by Accelerate itself (see above).
            ConfigError: ``strict=False``.
            StateMismatchError / CheckpointCorruptError: see :meth:`torch_ckpt.CheckpointManager.restore`;
                a failed load leaves the run as it was.
        """
        self._check_open()
        acc = self.accelerator
        self.wait()
        if input_dir is not None:
            folder = Path(input_dir).expanduser().absolute()
            if not folder.is_dir():
                raise ValueError(f"Tried to find {folder} but folder does not exist")
            if not is_committed(folder):
                self._load_foreign(folder, allow_unsafe_accelerate_folder, load_kwargs, load_model_func_kwargs)
                return
            manager, candidates = self._open(folder.parent), [folder]
        elif self._auto:
            manager = self._open()
            candidates = [p for _, p in sorted(manager.checkpoints().items(), reverse=True)]
        else:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        if load_model_func_kwargs.get("strict", True) is False:
            raise ConfigError(
                "load_state(strict=False) is not supported by accelerate_ckpt: it restores the complete state or "
                "nothing. To load only the matching weights of model i: state, _ = torch_ckpt.load_full_state"
                f"('{candidates[0] if candidates else manager.root}'); "
                "model.load_state_dict(state['model'][str(i)], strict=False)")
        hooked = bool(compat.load_hooks(acc))
        folder = candidates[0] if candidates else manager.root
        log.info("Loading states from %s", folder)
        models = [] if compat.is_fsdp(acc) else compat.prepared(acc, "models")
        skipped = self._run_hooks(compat.load_hooks(acc), models, folder, save=False)
        state = AcceleratorTrainState(acc, skip_models=skipped)
        if hooked or input_dir is not None:  # explicit folders, newest first: the user hooks read the first one
            restored = manager.restore(state, path=candidates, allow_cast=allow_cast) if candidates else None
        else:
            restored = manager.restore(state, allow_cast=allow_cast)  # newest intact in either tier
        if restored is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {manager.root} to load (check "
                                          "ckpt.latest_checkpoint() before resuming)")
        self.step = state.training_step

    # -- scheduling ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Record that training step ``step`` finished; True when the save policy says to save now.

        Call once per step on every process (the main process decides, every process gets its
        answer). Sets :attr:`step`, recorded by the next ``accelerator.save_state()``.

        Raises:
            ConfigError: no save policy (``save_policy=`` or the ``save_every_n_steps``,
                ``save_every_seconds`` or ``mtbf_seconds`` settings), or no manager yet (automatic
                naming off and nothing saved or loaded).
        """
        self._check_open()
        if self.manager is None and not self._auto:
            raise ConfigError("should_save() needs ProjectConfiguration(project_dir=..., automatic_checkpoint_naming="
                              "True), or a first save_state(folder)/load_state(folder) to set the checkpoint root")
        self._log_finished()
        self.step = int(step)
        return self._open().should_save(self.step)

    def save_if_due(self, step: int) -> SaveHandle | None:
        """``accelerator.save_state()`` when :meth:`should_save` says so; returns its handle or None."""
        if not self.should_save(step):
            return None
        self.accelerator.save_state()
        return self.last_handle

    # -- statistics ------------------------------------------------------------------------------
    def _log_finished(self) -> None:
        """Send the statistics of committed saves to the trackers (training thread)."""
        done = [(h, step) for h, step in self._unlogged if h.done()]
        self._unlogged = [(h, step) for h, step in self._unlogged if not h.done()]
        acc = self.accelerator
        if not (self.settings.log_stats and getattr(acc, "trackers", None)) or self.manager is None:
            return
        for handle, step in done:  # at the training step (the handle's step is the checkpoint number)
            if handle.committed.exception() is None:
                stats = handle.stats.as_dict()
                acc.log({f"checkpoint/{k}": stats[k] for k in _STAT_KEYS}, step=step)
        now = time.monotonic()
        lost = self.manager.health()["lost_work_if_failure_now_s"]
        if lost is not None and (done or now - self._last_health >= 60.0):
            self._last_health = now  # health: the training time a failure right now would lose
            acc.log({"checkpoint/lost_work_s": lost})

    # -- lifecycle -------------------------------------------------------------------------------
    def replication_stats(self) -> dict[str, Any]:
        """The durable replication state on the main process (``durable_step``, ``lag_s``...); {} otherwise."""
        return self.manager.replication_stats() if self.manager is not None else {}

    def wait_replicated(self, timeout_seconds: float | None = None) -> bool:
        """Block until no upload to ``durable_url`` is queued or running; False if the timeout ran out."""
        return self.manager.wait_durable(timeout_seconds) if self.manager is not None else True

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise a background error (once); log its stats."""
        if self.manager is not None:
            try:
                self.manager.wait()
            finally:
                self._log_finished()

    def close(self) -> None:
        """Wait for the in-flight save, give the ``Accelerator`` its own methods back, close the manager.

        Removes the instance attributes ``save_state``/``load_state``; raises a pending background
        error once. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            for name in ("save_state", "load_state"):
                if vars(self.accelerator).get(name) == getattr(self, name):
                    delattr(self.accelerator, name)
            if self.manager is not None:
                self.manager.close()
