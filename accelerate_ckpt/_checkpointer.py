"""``attach()``: route an ``Accelerator``'s ``save_state``/``load_state`` through torch-ckpt.

Mechanism (see ``docs/accelerate.md``): Accelerate's pre-hooks only see the weights of plain
models; optimizers, schedulers, scaler, samplers and RNG are written synchronously after the hook
returns, and FSDP models before it runs. So :func:`attach` replaces ``save_state`` and
``load_state`` *on that one Accelerator instance* (instance attributes that shadow the class
methods; :meth:`AccelerateCheckpointer.close` removes them again). The replacements keep
Accelerate's contract: automatic naming, ``total_limit``, and every registered save/load pre-hook
runs with ``(models, weights, output_dir)`` / ``(models, input_dir)`` as before. The adapter's
own part is itself a registered pre-hook (a ``RemovableHandle`` each), run last: it ``pop()``s
the remaining ``weights``/``models``, which then go, with everything else, into one asynchronous,
sharded, atomic torch-ckpt save.
"""

from __future__ import annotations

import ast
import functools
import linecache
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate_ckpt._config import CkptSettings, load_settings
from accelerate_ckpt._durable import DurableCopy
from accelerate_ckpt._layout import (
    PAYLOAD,
    checkpoint_dir,
    checkpoint_root,
    committed_checkpoints,
    is_committed,
    prune,
)
from accelerate_ckpt._state import AcceleratorTrainState, check_supported
from torch_ckpt import (
    AsyncCheckpointer,
    CheckpointNotFoundError,
    ConfigError,
    SaveHandle,
    UnsafeCheckpointError,
)
from torch_ckpt.cadence import Cadence

__all__ = ["AccelerateCheckpointer", "attach"]

log = logging.getLogger(__name__)

#: ``if`` tests and decorators that run a ``save_state`` call on some processes only
_ONE_PROCESS_FLAGS = frozenset({"is_main_process", "is_local_main_process", "is_last_process"})
_ONE_PROCESS_INDEX = frozenset({"process_index", "local_process_index"})
_ONE_PROCESS_DECORATORS = frozenset({"on_main_process", "on_local_main_process", "on_last_process", "on_process",
                                     "on_local_process"})
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_STAT_KEYS = ("blocking_s", "wait_for_previous_s", "staging_s", "persist_s", "total_s", "bytes", "files_bytes",
              "gb_per_s")


def attach(accelerator: Any, config: str | os.PathLike | None = None, *, save_policy: Any = None,
           **settings: Any) -> AccelerateCheckpointer:
    """Make ``accelerator.save_state()`` asynchronous and ``load_state()`` exact, through torch-ckpt.

    Call it on every process, after creating the ``Accelerator`` (before or after ``prepare``),
    at the same point of the program (it creates the checkpoint process groups collectively).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        config: YAML settings file (keys: :class:`~accelerate_ckpt.CkptSettings`); the file named
            by the environment variable ``ACCELERATE_CKPT_CONFIG`` wins over it.
        save_policy: a :mod:`torch_ckpt.schedule` policy for :meth:`AccelerateCheckpointer.should_save`
            (wins over the ``save_every_n_steps``/``save_every``/``mtbf`` settings).
        settings: any setting of :class:`~accelerate_ckpt.CkptSettings`; wins over the file.

    Returns:
        The :class:`AccelerateCheckpointer` (call :meth:`~AccelerateCheckpointer.close` at the end).

    Raises:
        ConfigError: invalid settings, or an unsupported setup (DeepSpeed, Megatron-LM, XLA).
    """
    return AccelerateCheckpointer(accelerator, load_settings(config, **settings), save_policy=save_policy)


@functools.lru_cache(maxsize=64)
def _module_tree(filename: str) -> ast.Module | None:
    try:
        return ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None


def _limits_to_some_processes(test: ast.expr) -> bool:
    """True for ``acc.is_main_process``, ``acc.process_index == 0`` and ``and`` chains holding one."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_limits_to_some_processes(v) for v in test.values)
    if isinstance(test, ast.Compare):
        test = test.left
    return isinstance(test, ast.Attribute) and test.attr in _ONE_PROCESS_FLAGS | _ONE_PROCESS_INDEX


def _one_process_guard() -> str | None:
    """The ``if``/decorator of the user code calling ``save_state`` that runs it on some processes only, or None.

    Read from the caller's source (the first frame outside this package), so a save that only some
    processes call is refused before any collective instead of stalling until the timeout.
    """
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back
    tree = None if frame is None else _module_tree(frame.f_code.co_filename)
    if tree is None:
        return None
    line, node, guard = frame.f_lineno, tree, None
    while node is not None:
        inner = None
        for child in ast.iter_child_nodes(node):
            if getattr(child, "lineno", line + 1) <= line <= (getattr(child, "end_lineno", None) or -1):
                inner = child
                break
        if isinstance(inner, ast.If) and _limits_to_some_processes(inner.test) and any(
                b.lineno <= line <= b.end_lineno for b in inner.body):
            guard = f"if {ast.unparse(inner.test)}:"
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            guard = None  # a guard outside the function does not guard its body...
            for deco in inner.decorator_list:  # ...but a decorator on it does
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Attribute) and target.attr in _ONE_PROCESS_DECORATORS:
                    guard = f"@{ast.unparse(deco)}"
        node = inner
    return guard


class AccelerateCheckpointer:
    """Asynchronous, atomic, sharded ``save_state``/``load_state`` for one ``Accelerator``.

    Use :func:`attach` to build it. Not thread-safe: call it from the training thread.

    Attributes:
        accelerator: the ``Accelerator``.
        settings: the merged :class:`~accelerate_ckpt.CkptSettings`.
        step: the training step. ``save_state()`` names automatic checkpoints ``checkpoint_<step>``
            when it is known (set by :meth:`should_save`, :meth:`save_if_due`, ``save_state(step=)``,
            ``load_state()`` or by you); while it is None, Accelerate's save iteration is used.
        hooks: the ``RemovableHandle``s of the adapter's save and load pre-hooks.
        last_handle: the :class:`~torch_ckpt.SaveHandle` of the latest save.
    """

    def __init__(self, accelerator: Any, settings: CkptSettings, *, save_policy: Any = None) -> None:
        self.accelerator = accelerator
        self.settings = settings
        self.step: int | None = None
        self.hooks: list[Any] = []
        self.last_handle: SaveHandle | None = None
        self._unlogged: list[SaveHandle] = []
        self._newest_committed_wall: float | None = None
        self._last_health = float("-inf")
        self._active = False  # True while our own save_state/load_state runs the hooks
        self._taken: list[Any] = []
        self._ckpt: AsyncCheckpointer | None = None
        self._durable: DurableCopy | None = None
        policy = save_policy if save_policy is not None else settings.save_policy()
        self._cadence = Cadence(policy) if policy is not None else None
        if not settings.enabled:
            log.info("accelerate_ckpt disabled by its settings: Accelerate's own save_state/load_state stay in use")
            return
        check_supported(accelerator)
        self._ckpt = AsyncCheckpointer(
            async_save=settings.async_save, persist=settings.persist, overlap_staging=settings.overlap_staging,
            writer_niceness=settings.writer_niceness, staging_budget_bytes=settings.staging_budget_bytes,
            thread_count=settings.thread_count, timeout_seconds=settings.timeout)
        world = self._ckpt.ctx.world_size
        if world != accelerator.num_processes:
            warnings.warn(
                f"torch.distributed has world size {world} but Accelerate runs {accelerator.num_processes} "
                "process(es) (on a CPU machine, torchrun needs ACCELERATE_USE_CPU=1 or Accelerator(cpu=True)); "
                f"checkpoints are written as world size {world}, while Accelerate trains each process alone",
                stacklevel=3)
        if settings.durable_url is not None:
            self._start_durable()
        self.hooks = [accelerator.register_save_state_pre_hook(self._save_hook),
                      accelerator.register_load_state_pre_hook(self._load_hook)]
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state

    def _start_durable(self) -> None:
        """The main process starts the replication; every process raises if that failed."""
        s, error = self.settings, None
        if self.accelerator.is_main_process:
            try:
                self._durable = DurableCopy(s.durable_url, storage_options=s.durable_storage_options,
                                            keep=s.durable_total_limit, verify=s.durable_verify)
            except Exception as exc:  # noqa: BLE001 - reported on every process below
                error = str(exc) if isinstance(exc, ConfigError) else f"cannot use durable_url {s.durable_url!r}: {exc}"
        error = self._ckpt.ctx.broadcast(error, what="durable tier")
        if error is not None:
            self._ckpt.close()
            self._ckpt = None
            raise ConfigError(error)

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
        """False when the settings disabled the adapter (Accelerate's own methods are in use)."""
        return self._ckpt is not None

    # -- hooks -----------------------------------------------------------------------------------
    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        """Take over every weight no earlier hook took: ``pop()`` them all (saved by torch-ckpt)."""
        if not self._active:  # Accelerate's own save_state is running (adapter bypassed): leave it alone
            return
        while weights:
            self._taken.append(weights.pop())

    def _load_hook(self, models: list, input_dir: str) -> None:
        """Take over every model no earlier hook loaded: ``pop()`` them all (loaded by torch-ckpt)."""
        if not self._active:
            return
        while models:
            self._taken.append(models.pop())

    def _run_hooks(self, table: dict, own: Callable, args: tuple) -> None:
        own_ids = {h.id for h in self.hooks}
        for key, hook in list(table.items()):
            if key not in own_ids:
                hook(*args)
        self._taken = []
        self._active = True
        try:
            own(*args)
        finally:
            self._active = False

    def _plain_model_indices(self) -> list[int]:
        """Indices of the models Accelerate hands to the hooks (all but FSDP models)."""
        fsdp = str(self.accelerator.distributed_type).endswith("FSDP")
        return [] if fsdp else list(range(len(self.accelerator._models)))

    def _skipped_models(self, candidates: list[int], originals: list[Any]) -> list[int]:
        """Candidates whose hook item (weights dict or model) an earlier, user-registered hook popped."""
        taken = {id(x) for x in self._taken}
        return [i for i, item in zip(candidates, originals) if id(item) not in taken]

    # -- saving ----------------------------------------------------------------------------------
    def _output_dir(self, output_dir: Any, number: int) -> tuple[Path, Path | None]:
        acc = self.accelerator
        if acc.project_configuration.automatic_checkpoint_naming:
            if acc.project_dir is None:
                raise ConfigError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
            root = checkpoint_root(acc.project_dir)
            return checkpoint_dir(root, number), root
        if output_dir is None:
            raise ValueError("save_state() needs output_dir unless automatic_checkpoint_naming is enabled")
        return Path(output_dir).expanduser(), None

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   step: int | None = None, **save_model_func_kwargs: Any) -> Path:
        """Replacement of ``Accelerator.save_state``: returns once the state is staged.

        Args:
            output_dir: the folder (ignored with automatic checkpoint naming, as in Accelerate).
            safe_serialization: ignored; torch-ckpt never pickles.
            step: the training step (sets :attr:`step`); names automatic checkpoints.
            save_model_func_kwargs: ignored (DeepSpeed-only in Accelerate).

        Returns:
            The checkpoint folder; its ``torch_ckpt`` payload appears when the save is committed.

        Raises:
            ValueError: the folder already holds a committed checkpoint.
            CheckpointError: an earlier background save failed (raised once).
        """
        acc = self.accelerator
        if self._ckpt is None:
            raise ConfigError("this AccelerateCheckpointer is closed or disabled")
        guard = _one_process_guard() if self._ckpt.ctx.world_size > 1 else None
        if guard is not None:
            raise ConfigError(
                f"accelerator.save_state() is called under `{guard}`, but with accelerate_ckpt every process must "
                "call it (each writes its own shard; the main process commits): remove the guard. Called on one "
                f"process it would wait {self._ckpt.ctx.timeout_seconds:.0f} s for the others and fail")
        t0 = time.monotonic()
        self.wait()  # at most one save in flight (the core would wait here too); raises a background error once
        waited = time.monotonic() - t0
        if step is not None:
            self.step = int(step)
        number = self.step if self.step is not None else acc.save_iteration
        folder, root = self._output_dir(output_dir, number)
        if is_committed(folder):
            raise ValueError(f"Checkpoint directory {folder} ({number}) already holds a committed checkpoint; "
                             "save under a new step")
        os.makedirs(folder, exist_ok=True)  # every process, so hooks may write into it at once
        log.info("Saving current state to %s", folder)
        candidates = self._plain_model_indices()
        own_ids = {h.id for h in self.hooks}
        if any(key not in own_ids for key in acc._save_model_state_pre_hook):  # user hooks see real state dicts
            weights = [acc.get_state_dict(acc._models[i], unwrap=False) for i in candidates]
        else:
            weights = [object() for _ in candidates]
        originals = list(weights)
        self._run_hooks(acc._save_model_state_pre_hook, self._save_hook, ([*acc._models], weights, str(folder)))
        state = AcceleratorTrainState(acc, step=number, save_iteration=acc.save_iteration + 1,
                                      skip_models=self._skipped_models(candidates, originals))
        limit = self.settings.total_limit or acc.project_configuration.total_limit
        on_committed = self._after_commit(root if limit else None, limit, number)
        handle = self._ckpt.save(folder / PAYLOAD, state, step=state.step, on_committed=on_committed)
        acc.project_configuration.iteration += 1
        handle.stats.wait_for_previous_s += waited
        handle.stats.blocking_s = time.monotonic() - t0  # the whole call: wait, hooks, staging
        self.last_handle = handle
        self._unlogged.append(handle)
        if self._cadence is not None:
            self._cadence.record_save_started(handle, time.monotonic())
        return folder

    def _after_commit(self, root: Path | None, limit: int | None, number: int) -> Callable[[Path], None] | None:
        """Replication and retention, run after the commit (writer thread, every rank; acts on the main one)."""
        durable = self._durable
        if not self.accelerator.is_main_process or (durable is None and root is None):
            return None

        def run(payload: Path) -> None:
            if durable is not None:
                durable.submit(number, Path(payload))
            if root is not None:
                prune(root, limit, newest=number, protect=durable.busy() if durable is not None else frozenset())

        return run

    # -- loading ---------------------------------------------------------------------------------
    def _newest_local_or_durable(self, root: Path) -> str | None:
        found = committed_checkpoints(root)
        local = max(found) if found else None
        remote = self._durable.newest() if self._durable is not None else None
        if remote is not None and (local is None or remote > local):
            try:
                return str(self._durable.fetch(remote, root))
            except Exception as exc:  # noqa: BLE001 - fall back to what is on local disk
                log.warning("could not download checkpoint %d from %s (%s); using local checkpoints", remote,
                            self._durable.tier.url, exc)
        return None if local is None else str(found[local])

    def latest_checkpoint(self) -> Path | None:
        """The newest committed automatic checkpoint folder, or None (collective: same answer on every rank).

        With ``durable_url``, a newer durable checkpoint (or the only one, after losing the local
        disk) is downloaded first, so the returned folder is always a local, committed checkpoint.
        """
        acc = self.accelerator
        if acc.project_dir is None or self._ckpt is None:  # disabled: there are no torch-ckpt checkpoints
            return None
        root = checkpoint_root(acc.project_dir)
        newest = self._newest_local_or_durable(root) if acc.is_main_process else None
        newest = self._ckpt.ctx.broadcast(newest, what="latest checkpoint")
        return None if newest is None else Path(newest)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, *,
                   allow_unsafe_accelerate_folder: bool = False, allow_cast: bool = False,
                   **load_model_func_kwargs: Any) -> None:
        """Replacement of ``Accelerator.load_state``: restores everything in place, exactly.

        Waits for an in-flight save first. A folder written by Accelerate itself (no ``torch_ckpt``
        payload) is refused unless ``allow_unsafe_accelerate_folder=True``: Accelerate's own
        ``load_state`` unpickles parts of it (``weights_only=False``), which can run code from the folder.

        Args:
            input_dir: the checkpoint folder; None picks the newest *committed* automatic checkpoint.
            allow_unsafe_accelerate_folder: hand a folder without a torch-ckpt payload to Accelerate's
                own ``load_state`` (only for folders you trust).
            allow_cast: cast tensors whose dtype differs from the live one (each cast key is logged
                once); by default a dtype difference is a ``StateMismatchError``. A failed load
                leaves the run as it was.
            load_kwargs: passed on only for folders Accelerate wrote itself.
            load_model_func_kwargs: passed on only for folders Accelerate wrote itself.

        Raises:
            ValueError: ``input_dir`` is not a folder, or None without automatic naming (as Accelerate).
            CheckpointNotFoundError: no committed checkpoint under the project's ``checkpoints``.
            StateMismatchError / CheckpointCorruptError: see :meth:`torch_ckpt.AsyncCheckpointer.load`.
        """
        acc = self.accelerator
        if self._ckpt is None:
            raise ConfigError("this AccelerateCheckpointer is closed or disabled")
        self.wait()
        if input_dir is not None:
            folder = Path(input_dir).expanduser()
            if not folder.is_dir():
                raise ValueError(f"Tried to find {folder} but folder does not exist")
            if not (folder / PAYLOAD).exists() and (any(folder.glob(f".{PAYLOAD}.tmp*")) or not any(folder.iterdir())):
                newest = self.latest_checkpoint() if acc.project_dir is not None else None
                raise CheckpointNotFoundError(
                    f"{folder} is an incomplete save (interrupted before it committed), not a checkpoint; "
                    + (f"the newest intact checkpoint is {newest}" if newest is not None else "load another one"))
            if not (folder / PAYLOAD).exists():
                if not allow_unsafe_accelerate_folder:
                    raise UnsafeCheckpointError(
                        f"{folder} has no {PAYLOAD}/ payload (it was not written through torch-ckpt). Accelerate's own "
                        "load_state would unpickle parts of it, which can run code from the folder; if you trust it, "
                        "call accelerator.load_state(folder, allow_unsafe_accelerate_folder=True)")
                log.info("%s has no %s payload: loading it with Accelerate's own load_state", folder, PAYLOAD)
                type(acc).load_state(acc, str(folder), load_kwargs, **load_model_func_kwargs)
                return
        elif acc.project_configuration.automatic_checkpoint_naming:
            folder = self.latest_checkpoint()
            if folder is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {checkpoint_root(acc.project_dir)} (use latest_checkpoint() to "
                    "check before resuming)")
        else:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        if load_model_func_kwargs.get("strict", True) is False:
            raise ConfigError(
                "load_state(strict=False) is not supported by accelerate_ckpt: it restores the complete state or "
                f"nothing. To load only the matching weights of model i: state, _ = torch_ckpt.load_full_state"
                f"('{folder / PAYLOAD}'); model.load_state_dict(state['model'][str(i)], strict=False)")
        log.info("Loading states from %s", folder)
        candidates = self._plain_model_indices()
        models = [acc._models[i] for i in candidates]
        originals = list(models)
        self._run_hooks(acc._load_model_state_pre_hook, self._load_hook, (models, str(folder)))
        state = AcceleratorTrainState(acc, skip_models=self._skipped_models(candidates, originals))
        self._ckpt.load(folder / PAYLOAD, state, verify=self.settings.verify_on_load, allow_cast=allow_cast)
        self.step = state.step

    # -- scheduling ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Record that training step ``step`` finished; True when the save policy says to save now.

        Call once per step on every process (rank 0 decides, every rank gets its answer). Sets
        :attr:`step`, so a following ``accelerator.save_state()`` is named ``checkpoint_<step>``.

        Raises:
            ConfigError: no save policy (``save_policy=`` or the ``save_every_n_steps``,
                ``save_every`` or ``mtbf`` settings).
        """
        if self._cadence is None:
            raise ConfigError("should_save() needs a save policy: attach(..., save_policy=...) or one of the settings "
                              "save_every_n_steps, save_every, mtbf")
        self._log_finished()
        self.step = int(step)
        now = time.monotonic()
        self._cadence.record_step(self.step, now)
        acc = self.accelerator
        decision = [self._cadence.decide(self.step, now) if acc.is_main_process else None]
        if self._ckpt is not None:
            return bool(self._ckpt.ctx.broadcast(decision[0], what="save decision"))
        if acc.num_processes > 1:  # disabled adapter: Accelerate's own collective
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(decision)
        return bool(decision[0])

    def save_if_due(self, step: int) -> SaveHandle | None:
        """``accelerator.save_state()`` when :meth:`should_save` says so.

        Returns:
            The save's :class:`~torch_ckpt.SaveHandle`; None when no save was due, or when the
            adapter is disabled (Accelerate's own ``save_state`` then saved synchronously).
        """
        if not self.should_save(step):
            return None
        self.accelerator.save_state()
        return self.last_handle if self.enabled else None

    # -- statistics ------------------------------------------------------------------------------
    def _log_finished(self) -> None:
        """Send the statistics of committed saves to the trackers (main process; training thread)."""
        done = [h for h in self._unlogged if h.done()]
        self._unlogged = [h for h in self._unlogged if not h.done()]
        acc = self.accelerator
        if not (self.settings.log_stats and getattr(acc, "trackers", None)):
            return
        for handle in done:
            if handle.committed.exception() is None:
                stats = handle.stats.as_dict()
                self._newest_committed_wall = max(self._newest_committed_wall or 0.0, stats["wall_time"])
                acc.log({f"checkpoint/{k}": stats[k] for k in _STAT_KEYS}, step=handle.step)
        now = time.monotonic()
        if self._newest_committed_wall is not None and (done or now - self._last_health >= 60.0):
            self._last_health = now  # health: the training time a failure right now would lose
            acc.log({"checkpoint/lost_work_s": time.time() - self._newest_committed_wall})

    # -- lifecycle -------------------------------------------------------------------------------
    def replication_stats(self) -> dict[str, Any]:
        """The durable replication state on the main process (``durable_step``, ``lag_s``...); {} otherwise."""
        return self._durable.stats() if self._durable is not None else {}

    def wait_replicated(self, timeout_seconds: float | None = None) -> bool:
        """Block until no upload to ``durable_url`` is queued or running; False if the timeout ran out."""
        return self._durable.replicator.wait(timeout_seconds) if self._durable is not None else True

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise a background error (once); log its stats."""
        if self._ckpt is not None:
            try:
                self._ckpt.wait()
            finally:
                self._log_finished()

    def close(self) -> None:
        """Wait for the in-flight save, then give the ``Accelerator`` its own methods back.

        Removes the instance attributes ``save_state``/``load_state`` and the two hooks, and
        releases the checkpointer; raises a pending background error once. Idempotent.
        """
        if self._ckpt is None:
            return
        ckpt, self._ckpt = self._ckpt, None
        try:
            ckpt.wait()
            self._log_finished()
        finally:
            for name in ("save_state", "load_state"):
                if vars(self.accelerator).get(name) == getattr(self, name):
                    delattr(self.accelerator, name)
            for handle in self.hooks:
                handle.remove()
            self.hooks = []
            if self._durable is not None:
                self._durable.close(self.settings.durable_flush_timeout)
                self._durable = None
            ckpt.close()
