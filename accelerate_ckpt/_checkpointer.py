"""``attach()``: one ``Accelerator``'s ``save_state``/``load_state`` through a torch-ckpt ``CheckpointManager``."""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

from accelerate_ckpt import _compat as compat
from accelerate_ckpt._state import AcceleratorTrainState
from torch_ckpt import (
    AfterCommit,
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    DurableTier,
    PatternNaming,
    SaveHandle,
    SaveReports,
    UnsafeCheckpointError,
    is_committed,
    rank_and_world,
)

log = logging.getLogger(__name__)

#: Environment variable holding the path of a YAML settings file; it wins over ``config=``.
ENV_VAR = "ACCELERATE_CKPT_CONFIG"
_EXTRAS = {"enabled": True, "log_stats": True}  # the adapter's own keys and their defaults
_FIXED = ("naming", "read_only", "explicit_paths_only")  # set by the adapter itself


@dataclass(frozen=True)
class CkptSettings:
    """The merged settings (:func:`load_settings`).

    Attributes:
        config: every core setting (same names, units and defaults as ``CheckpointManager``), validated.
        keep_last_given: ``keep_last`` was set (not null); else automatic checkpoints follow ``total_limit``.
        enabled: False leaves the ``Accelerator`` untouched (Accelerate's own synchronous saves).
        log_stats: send per-save statistics to ``accelerator.log`` when trackers are configured.
    """

    config: CheckpointConfig
    keep_last_given: bool = False
    enabled: bool = True
    log_stats: bool = True


def load_settings(config: str | os.PathLike | None = None, **overrides: Any) -> CkptSettings:
    """Merge, later winning: the core's defaults, the YAML file (``ACCELERATE_CKPT_CONFIG`` if set, else ``config``),
    ``overrides`` (given in code).

    Raises:
        ConfigError: an unreadable file, an unknown or adapter-set key, or an invalid value (naming file and key).
    """
    path = os.environ.get(ENV_VAR) or config
    file_values = CheckpointConfig.read_yaml(path) if path else {}
    merged = {**file_values, **overrides}
    layers = [(os.fspath(path), file_values, True)] if path else []
    if overrides or not path:  # the file alone is checked first, so its errors name the file
        layers.append(("attach()" + (f" over {os.fspath(path)}" if path else ""), merged, False))
    for source, values, from_file in layers:
        if fixed := [k for k in _FIXED if k in values]:
            raise ConfigError(f"{source}: {fixed[0]} is set by accelerate_ckpt itself (Accelerate's checkpoint_N "
                              "folders, a writable root); leave it out")
        cfg, extra = CheckpointConfig.from_dict_with_extras(values, _EXTRAS, source=source, from_file=from_file,
                                                            reserved=_FIXED)
    return CkptSettings(cfg, merged.get("keep_last") is not None, **extra)


#: Accelerate's automatic checkpoint names, ``checkpoint_<save iteration>``.
NAMING = PatternNaming("checkpoint_{step}")
_HOOK_FILES = ".{}.hooks.tmp.{}"  # user save hooks write here; the files commit with the checkpoint (extra_dir)
_PRESENT = ".accelerate_ckpt.present.{}"  # a folder of one empty file per process calling save_state (iteration)
PRESENCE_WAIT_S = 15.0  # how long a save waits for every process's presence file, in seconds


def missing_processes(root: Path, key: str, rank: int, peers: range, timeout_s: float = PRESENCE_WAIT_S) -> list[int]:
    """Mark ``rank`` present at save ``key`` in ``root``; the ``peers`` (this node's ranks) whose marks did not appear
    within ``timeout_s``."""
    marks = root / _PRESENT.format(key)
    marks.mkdir(parents=True, exist_ok=True)
    (marks / str(rank)).touch()
    deadline = time.monotonic() + timeout_s
    while (missing := [r for r in peers if not (marks / str(r)).exists()]) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not missing and rank == peers[0]:  # every rank is past the earlier saves' checks (their saves committed)
        for old in root.glob(_PRESENT.format("*")):
            if old != marks:
                shutil.rmtree(old, ignore_errors=True)
    return missing


def _log_stats(accelerator: Any, settings: CkptSettings, handle: SaveHandle, step: int | None) -> None:
    """Send a committed save's statistics to the trackers at its training step (``accelerator``: a weak reference)."""
    if (acc := accelerator()) is not None and settings.log_stats and getattr(acc, "trackers", None):
        acc.log(SaveReports.metrics(handle), step=step)


def attach(accelerator: Any, config: str | os.PathLike | None = None, *, save_policy: Any = None,
           **settings: Any) -> AccelerateCheckpointer:
    """Make ``accelerator.save_state()`` asynchronous and ``load_state()`` exact; call it on every process.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        config: YAML settings file; the one named by ``ACCELERATE_CKPT_CONFIG`` wins over it.
        save_policy: a ``torch_ckpt`` save policy for :meth:`AccelerateCheckpointer.should_save`.
        settings: settings of :class:`~accelerate_ckpt.CkptSettings` by key; they win over the file.

    Raises:
        ConfigError: invalid settings, or an unsupported setup (DeepSpeed, Megatron-LM, XLA).
    """
    return AccelerateCheckpointer(accelerator, load_settings(config, **settings), save_policy=save_policy)


class AccelerateCheckpointer:
    """Asynchronous, atomic, sharded ``save_state``/``load_state`` for one ``Accelerator`` (training thread only),
    which holds this checkpointer; it holds the ``Accelerator`` only weakly (``docs/accelerate.md``, "Lifecycle").

    Attributes:
        accelerator: the ``Accelerator`` (a ``ConfigError`` once it was freed).
        settings: the merged :class:`~accelerate_ckpt.CkptSettings`.
        step: the training step, recorded in each checkpoint and restored by ``load_state()`` (None: unknown).
            Automatic names follow Accelerate's save iteration, never this step.
        manager: the :class:`~torch_ckpt.CheckpointManager`, opened at first use (None until then).
        last_handle: the :class:`~torch_ckpt.SaveHandle` of the latest save.
    """

    _RUNTIME = ("_accelerator", "manager", "last_handle", "_reports", "_after")

    def __init__(self, accelerator: Any, settings: CkptSettings, *, save_policy: Any = None) -> None:
        self._accelerator: Callable[[], Any] = weakref.ref(accelerator)  # the Accelerator holds us: no reference cycle
        self.settings = settings
        self.step: int | None = None
        self._policy = {} if save_policy is None else {"save_policy": save_policy}
        self._reset()
        self._closed = not settings.enabled
        if not settings.enabled:
            log.info("accelerate_ckpt disabled by its settings: Accelerate's own save_state/load_state stay in use")
            return
        compat.check_supported(accelerator)
        if (world := rank_and_world()[1]) != accelerator.num_processes:
            warnings.warn(f"torch.distributed has world size {world} but Accelerate runs {accelerator.num_processes} "
                          "process(es) (on a CPU machine, torchrun needs ACCELERATE_USE_CPU=1 or Accelerator(cpu=True)"
                          f"); checkpoints are written as world size {world}, while Accelerate trains each process "
                          "alone", stacklevel=3)
        self._auto = bool(accelerator.project_configuration.automatic_checkpoint_naming)
        if settings.config.durable_url is not None:
            if not self._auto:
                raise ConfigError("durable_url needs ProjectConfiguration(automatic_checkpoint_naming=True): only "
                                  "automatic checkpoints are replicated")
            DurableTier(settings.config.durable_url, storage_options=settings.config.storage_options)  # fail now
        if settings.config.memory_root is not None and not self._auto:
            raise ConfigError("memory_root needs ProjectConfiguration(automatic_checkpoint_naming=True): memory saves "
                              "are numbered and resumed like automatic checkpoints (load_state() without a folder)")
        if self._auto and accelerator.project_dir is None:
            raise ConfigError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        accelerator.save_state, accelerator.load_state = self.save_state, self.load_state
        accelerator.end_training = self.end_training

    def _reset(self) -> None:
        self.manager: CheckpointManager | None = None
        self.last_handle: SaveHandle | None = None
        self._reports, self._after = SaveReports(), AfterCommit()  # statistics logged once committed

    def __getstate__(self) -> dict[str, Any]:
        # the Accelerator is strong only inside the pickle; the cycle is pickle's to resolve
        return {**{k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}, "acc": self._accelerator()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        acc = state.pop("acc")
        self.__dict__.update(state)
        self._accelerator = (lambda: None) if acc is None else weakref.ref(acc)
        self._reset()

    @property
    def accelerator(self) -> Any:
        """The attached ``Accelerator``.

        Raises:
            ConfigError: the ``Accelerator`` was freed (this checkpointer holds it only weakly).
        """
        if (acc := self._accelerator()) is None:
            raise ConfigError("the Accelerator of this AccelerateCheckpointer was freed; attach a new one")
        return acc

    def end_training(self) -> None:
        """Replacement of ``Accelerator.end_training``: commit the save in flight and close, then run Accelerate's.

        Raises:
            CheckpointError: the in-flight (or an earlier) background save failed.
        """
        acc = self.accelerator
        try:
            self.close()
        finally:
            type(acc).end_training(acc)  # Accelerate's own: finishes the trackers, destroys the process group

    def _open(self, root: Path | None = None) -> CheckpointManager:
        """The manager (collective at creation): ``project_dir/checkpoints`` with automatic naming, else ``root``."""
        if self.manager is None:
            s, acc = self.settings, self.accelerator
            keep = s.config.keep_last if s.keep_last_given else acc.project_configuration.total_limit
            # explicit folders: the run owns each folder it saves, not the directory they lie in
            self.manager = CheckpointManager(self._auto_root() if self._auto else cast(Path, root), config=s.config,
                                             naming=NAMING, explicit_paths_only=not self._auto,
                                             keep_last=keep if self._auto else None, **self._policy)
        return self.manager

    def _auto_root(self) -> Path:
        return Path(self.accelerator.project_dir).expanduser().absolute() / "checkpoints"

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this AccelerateCheckpointer is closed or disabled")

    def __enter__(self) -> AccelerateCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise
            log.exception("checkpoint error while closing after another exception")  # keep the original

    @property
    def enabled(self) -> bool:
        """False when the settings disabled the adapter or it was closed (Accelerate's own methods are in use)."""
        return not self._closed

    def _run_hooks(self, kind: str, items: list, folder: Path) -> list[int]:
        """Run the user's ``save``/``load`` pre-hooks on ``items`` (one per plain model); the indices they popped."""
        originals = list(items)
        for hook in list(compat.hooks(self.accelerator, kind).values()):
            hook(*((compat.prepared(self.accelerator, "models"),) if kind == "save" else ()), items, str(folder))
        left = {id(x) for x in items}
        return [i for i, item in enumerate(originals) if id(item) not in left]

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   step: int | None = None, **save_model_func_kwargs: Any) -> Path:
        """Replacement of ``Accelerator.save_state``: returns the folder (``checkpoint_<save iteration>`` with automatic
        naming, else ``output_dir``) once the state is staged. ``step`` sets :attr:`step`; other arguments are ignored.

        Raises:
            ConfigError: not every process calls it (within ``PRESENCE_WAIT_S``); the folder is not a torch-ckpt one.
            CheckpointError: an earlier background save failed (raised once).
        """
        self._check_open()
        acc = self.accelerator
        t0 = time.monotonic()
        self.wait()  # one save in flight; its hook files are in place before new hooks run
        waited = time.monotonic() - t0
        iteration = compat.save_iteration(acc)
        if self._auto:
            folder = self._auto_root() / NAMING.name(iteration)
        elif output_dir is None:
            raise ValueError("save_state() needs output_dir unless automatic_checkpoint_naming is enabled")
        else:
            folder = Path(output_dir).expanduser().absolute()
        rank, world = rank_and_world()
        local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun: the ranks of a node are consecutive
        peers = range(rank - local, rank - local + int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if len(peers) > 1 and (missing := missing_processes(folder.parent, str(iteration), rank, peers)):
            raise ConfigError(
                f"accelerator.save_state() was called on process {rank} but not on processes {missing} within "
                f"{PRESENCE_WAIT_S:.0f} s (e.g. under `if accelerator.is_main_process:`); with accelerate_ckpt every "
                "process must call it (each writes its own shard; the main process commits): remove the guard")
        if step is not None:
            self.step = int(step)
        manager, path = self._open(folder.parent), None if self._auto else folder
        number = iteration if self._auto or self.step is None else self.step
        log.info("Saving current state to %s (save iteration %d, training step %s)", folder, iteration,
                 "unknown" if self.step is None else self.step)
        user = bool(compat.hooks(acc, "save"))  # user hooks get the real weights
        weights = [acc.get_state_dict(m, unwrap=False) if user else object() for m in compat.hooked_models(acc)]
        hook_dir = folder.parent / _HOOK_FILES.format(folder.name, manager.checkpointer.incarnation)
        if user:
            shutil.rmtree(hook_dir, ignore_errors=True)
            os.makedirs(hook_dir)
        skipped = self._run_hooks("save", weights, hook_dir)
        state = AcceleratorTrainState(acc, step=self.step, save_iteration=iteration + 1, skip_models=skipped)
        handle = manager.save(number, state, path=path, extra_dir=hook_dir if user else None)
        compat.set_save_iteration(acc, iteration + 1)
        handle.stats.wait_for_previous_s += waited
        handle.stats.blocking_s = time.monotonic() - t0  # the whole call: wait, hooks, staging
        self.last_handle = self._after.handle = handle
        self._reports.add(handle)
        # the weak reference, not self: a pending action must not keep this object (and its manager) alive
        self._after.add(0, "log statistics", partial(_log_stats, self._accelerator, self.settings, handle, self.step))
        return folder

    def latest_checkpoint(self) -> Path | None:
        """The newest committed automatic checkpoint folder on local disk (or this node's ``memory_root`` one when
        newer), or None (collective)."""
        if self._closed or not self._auto:
            return None
        found = self._open().checkpoints()
        memory_root = self.settings.config.memory_root
        memory = self._open().health()["memory_step"] if memory_root is not None else None
        if memory is not None and memory > max(found, default=-1):
            return Path(cast(str, memory_root)).expanduser().absolute() / NAMING.name(memory)
        return found[max(found)] if found else None

    def _load_foreign(self, folder: Path, allow_unsafe: bool, load_kwargs: Any, kwargs: dict) -> None:
        """A folder without a torch-ckpt manifest: an incomplete save, or one plain Accelerate wrote."""
        if not any(not p.name.startswith(".") for p in folder.iterdir()):
            raise CheckpointNotFoundError(
                f"{folder} is an incomplete save (interrupted before it committed), not a checkpoint; "
                + (f"the newest intact checkpoint is {newest}" if (newest := self.latest_checkpoint()) is not None
                   else "load another one"))
        if not allow_unsafe:
            raise UnsafeCheckpointError(
                f"{folder} has no torch-ckpt manifest (it was not written through torch-ckpt). Accelerate's own "
                "load_state would unpickle parts of it, which can run code from the folder; if you trust it, "
                "call accelerator.load_state(folder, allow_unsafe_accelerate_folder=True)")
        log.info("%s has no torch-ckpt manifest: loading it with Accelerate's own load_state", folder)
        compat.plain_load_state(self.accelerator, str(folder), load_kwargs, kwargs)
        if (number := NAMING.step_of(folder.name)) is not None:  # Accelerate does not restore its save iteration
            compat.set_save_iteration(self.accelerator, number + 1)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, *,
                   allow_unsafe_accelerate_folder: bool = False, allow_cast: bool = False,
                   **load_model_func_kwargs: Any) -> None:
        """Replacement of ``Accelerator.load_state``: restores everything in place, exactly, or nothing.

        Args:
            input_dir: the folder; None: the newest intact automatic checkpoint in either tier (damaged: skipped).
            allow_unsafe_accelerate_folder: load a folder plain Accelerate wrote, with its own ``load_state`` (it
                unpickles: only folders you trust).
            allow_cast: cast tensors whose dtype differs from the live one (else ``StateMismatchError``).
            load_kwargs, load_model_func_kwargs: only for folders Accelerate wrote itself.

        Raises:
            ValueError: ``input_dir`` is not a folder, or None without automatic naming (as Accelerate).
            CheckpointNotFoundError: nothing to load, or ``input_dir`` is an incomplete save.
            UnsafeCheckpointError: ``input_dir`` was written by plain Accelerate (see above).
            ConfigError: ``strict=False`` (a checkpoint loads completely or not at all).
            StateMismatchError, CheckpointCorruptError: as ``CheckpointManager.restore``; the run is unchanged.
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
        folder = candidates[0] if candidates else manager.root
        if load_model_func_kwargs.get("strict", True) is False:
            raise ConfigError(
                "load_state(strict=False) is not supported by accelerate_ckpt: it restores the complete state or "
                f"nothing. To load only the matching weights of model i: state, _ = torch_ckpt.load_full_state"
                f"('{folder}'); model.load_state_dict(state['model'][str(i)], strict=False)")
        log.info("Loading states from %s", folder)
        state = AcceleratorTrainState(acc, skip_models=self._run_hooks("load", compat.hooked_models(acc), folder))
        if compat.hooks(acc, "load") or input_dir is not None:  # newest first: the user hooks read the first one
            restored = manager.restore(state, path=candidates, allow_cast=allow_cast) if candidates else None
        else:
            restored = manager.restore(state, allow_cast=allow_cast)  # newest intact in either tier
        if restored is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {manager.root} to load (check "
                                          "ckpt.latest_checkpoint() before resuming)")
        self.step = state.training_step

    def should_save(self, step: int) -> bool:
        """Record that training step ``step`` finished (every process, each step); True when the save policy says to
        save now. Else take a memory save here when the memory cadence (``memory_root``) says so.

        Raises:
            ConfigError: no save policy nor ``memory_root``, no checkpoint root yet, or a memory save with
                ``save_state``/``load_state`` pre-hooks registered.
        """
        self._check_open()
        if self.manager is None and not self._auto:
            raise ConfigError("should_save() needs ProjectConfiguration(project_dir=..., automatic_checkpoint_naming="
                              "True), or a first save_state(folder)/load_state(folder) to set the checkpoint root")
        self._after.poll()
        self._log_lost_work()
        self.step = int(step)
        tier = self._open().save_due(self.step)
        if tier == "memory":
            self._save_memory()
        return tier == "disk"

    def _save_memory(self) -> None:
        """A memory-tier save taking the next save iteration, so the newest of both tiers has the highest number."""
        acc = self.accelerator
        if hooks := [kind for kind in ("save", "load") if compat.hooks(acc, kind)]:
            raise ConfigError(f"memory_root: the registered {hooks[0]}_state pre-hooks write or read their own files, "
                              "which a memory checkpoint cannot hold: remove the hooks or the memory_* settings")
        self.wait()
        iteration = compat.save_iteration(acc)
        state = AcceleratorTrainState(acc, step=self.step, save_iteration=iteration + 1)
        self.last_handle = self._open().save(iteration, state, tier="memory")
        compat.set_save_iteration(acc, iteration + 1)

    def save_if_due(self, step: int) -> SaveHandle | None:
        """``accelerator.save_state()`` when :meth:`should_save` says so; its (or the memory save's) handle, or None."""
        before = self.last_handle
        if self.should_save(step):
            self.accelerator.save_state()
        return self.last_handle if self.last_handle is not before else None

    def _log_lost_work(self) -> None:  # the lost-work health figure, when due
        self._reports.committed()
        acc = self._accelerator()
        if acc is not None and self.manager is not None and self.settings.log_stats and getattr(acc, "trackers", None) \
                and (lost := self._reports.lost_work(self.manager.health)) is not None:
            acc.log({"checkpoint/lost_work_s": lost})

    def replication_stats(self) -> dict[str, Any]:
        """The durable replication state on the main process (``durable_step``, ``lag_s``...); {} otherwise."""
        return self.manager.replication_stats() if self.manager is not None else {}

    def wait_replicated(self, timeout_seconds: float | None = None) -> bool:
        """Block until no upload to ``durable_url`` is queued or running; False if the timeout ran out."""
        return self.manager.wait_durable(timeout_seconds) if self.manager is not None else True

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise a background error (once); log its statistics."""
        if self.manager is not None:
            try:
                self.manager.wait()
            finally:
                self._after.run()
                self._log_lost_work()

    def close(self) -> None:
        """Wait for the last save, give the ``Accelerator`` its own methods back, close the manager (idempotent);
        raises a failed background save's ``CheckpointError`` once."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            acc = self._accelerator()
            for name in ("save_state", "load_state", "end_training"):
                if acc is not None and vars(acc).get(name) == getattr(self, name):
                    delattr(acc, name)
            if self.manager is not None:
                for mark in self.manager.root.glob(f"{_PRESENT.format('*')}/{rank_and_world()[0]}"):
                    mark.unlink(missing_ok=True)  # the last save committed: every process is past its check
                self.manager.close()
