"""``MTBFCheckpoint``: save when the failure rate says so, resume exactly, and save on preemption."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.callbacks import OnExceptionCheckpoint
from typing_extensions import override

from lightning_ckpt import _compat
from lightning_ckpt._checkpoint_io import AsyncDCPCheckpointIO
from lightning_ckpt._load import encode_values
from torch_ckpt import CheckpointConfig, ConfigError, SaveReports, StepNaming, TrainState, YoungDaly, is_committed

__all__ = ["MTBFCheckpoint"]

log = logging.getLogger(__name__)

_STAT_KEYS = ("blocking_s", "staging_s", "persist_s", "total_s", "gb_per_s")
_PLAN_KEYS = ("interval_steps", "interval_s", "cost_s", "step_time_s", "expected_overhead", "mtbf_s")


class MTBFCheckpoint(OnExceptionCheckpoint):
    """Checkpoint at the interval that minimises expected lost work, through ``AsyncDCPCheckpointIO``.

    Needs ``Trainer(plugins=[AsyncDCPCheckpointIO()])``, which it attaches so every rank takes part in
    every save. Checkpoints are the directories ``DIRPATH/step_NNNNNNNNN``.

    Args:
        dirpath: Directory of this callback's checkpoints (created if missing).
        mtbf_seconds: Mean time between failures of the whole job, in seconds or a duration string
            (``"8h"``): saves follow the Young/Daly interval from it and the measured save cost. None: off.
        save_every_n_steps: Also save every this many optimizer steps (None: off).
        save_every_seconds: Also save when this many seconds (or a duration string) passed since the last save.
        initial_cost_seconds: Save cost assumed by the MTBF policy until a save is measured, in seconds.
        formula: ``"daly"`` (default) or ``"young"``.
        min_interval_steps: Never save more often than every this many steps (MTBF policy).
        keep_last: Keep this many newest committed checkpoints (None: all); older ones go after a commit.
        memory_root: Directory of the memory tier, typically under ``/dev/shm`` (tmpfs: it outlives the trainer
            process, not the node; each node keeps its own copy); None: no memory saves. Not inside ``dirpath``.
        memory_every_n_steps: Save into ``memory_root`` every this many optimizer steps at which no disk save
            is taken (None: off).
        memory_every_seconds: Save into ``memory_root`` when this many seconds (or a duration string) passed
            since the last save of either tier (None: off).
        memory_mtbf_seconds: Save into ``memory_root`` at the Young/Daly interval of this MTBF (process restarts on
            the same nodes; seconds or a duration string) and the memory saves' own measured cost (None: off).
        memory_keep_last: Keep this many newest steps in ``memory_root`` (>= 1).
        memory_replicas: Partner nodes holding a replica of each node's newest memory step, so a node loss
            resumes from a partner's RAM (>= 0; ignored on one node).
        memory_partner_stride: Node ``k`` sends its replicas to nodes ``k + stride * i`` (e.g. the nodes per rack).
        memory_replication_bytes_per_second: Cap on what each node sends to its partners (bytes or a size such as
            ``"1GB"``; None: no cap).
        save_on_sigterm: On SIGTERM, save at the next step boundary, wait for the commit, then stop.
        save_on_train_end: Save the final step when training ends normally.
        log_stats: Log each save's statistics (``ckpt/blocking_s``, ``ckpt/gb_per_s``...) and the schedule
            (``ckpt/interval_steps``, ``ckpt/expected_overhead``...) through the trainer's loggers.
        prog_bar: Show ``ckpt`` (last committed step) and ``ckpt_saving`` (1 while saving) in the progress bar.

    Raises:
        ConfigError: An argument is out of range.
    """

    def __init__(
        self,
        dirpath: str,
        *,
        mtbf_seconds: float | str | None = "24h",
        save_every_n_steps: int | None = None,
        save_every_seconds: float | str | None = None,
        initial_cost_seconds: float | str = 5.0,
        formula: Literal["daly", "young"] = "daly",
        min_interval_steps: int = 1,
        keep_last: int | None = 3,
        memory_root: str | None = None,
        memory_every_n_steps: int | None = None,
        memory_every_seconds: float | str | None = None,
        memory_mtbf_seconds: float | str | None = None,
        memory_keep_last: int = 2,
        memory_replicas: int = 1,
        memory_partner_stride: int = 1,
        memory_replication_bytes_per_second: int | str | None = None,
        save_on_sigterm: bool = True,
        save_on_train_end: bool = True,
        log_stats: bool = True,
        prog_bar: bool = True,
    ) -> None:
        super().__init__(dirpath=str(dirpath), filename="mtbf")
        config = CheckpointConfig(
            mtbf_seconds=mtbf_seconds, save_every_n_steps=save_every_n_steps, save_every_seconds=save_every_seconds,
            initial_cost_seconds=initial_cost_seconds, formula=formula, min_interval_steps=min_interval_steps,
            keep_last=keep_last, memory_root=memory_root, memory_every_n_steps=memory_every_n_steps,
            memory_every_seconds=memory_every_seconds, memory_mtbf_seconds=memory_mtbf_seconds,
            memory_keep_last=memory_keep_last, memory_replicas=memory_replicas,
            memory_partner_stride=memory_partner_stride,
            memory_replication_bytes_per_second=memory_replication_bytes_per_second)
        self._policy = config.build_save_policy()
        # every memory_* setting of the core, for the manager
        self._memory = {k: getattr(config, k) for k in config.field_names() if k.startswith("memory_")}
        policies = getattr(self._policy, "policies", None) or [self._policy]
        self._young_daly = next((p for p in policies if isinstance(p, YoungDaly)), None)
        self.keep_last, self.save_on_sigterm, self.save_on_train_end = keep_last, save_on_sigterm, save_on_train_end
        self.log_stats, self.prog_bar = log_stats, prog_bar
        self._io: AsyncDCPCheckpointIO | None = None
        self._manager: Any = None
        self._handlers: tuple[Any, Any] | None = None  # SIGTERM handler before the manager's, and the manager's
        self._candidates: list[Path] = []
        self._rng = TrainState()  # this rank's RNG (Python, NumPy, torch CPU/CUDA) only
        self._pending_rng: dict[str, Any] | None = None
        self._deferred: tuple[str | None, dict[str, Any]] | None = None  # an epoch end's path (None: memory), state
        self._epoch_end_loop: tuple[int, dict[str, Any]] | None = None  # last batch's step and fit-loop state
        self._reports = SaveReports()  # each commit once; lost work at most once a minute
        self._stepped = False
        self._last_saved_step: int | None = None

    @property
    def _setup_io(self) -> AsyncDCPCheckpointIO:
        """The trainer's plugin: :meth:`setup` sets it before any other hook runs."""
        assert self._io is not None, "MTBFCheckpoint.setup() has not run"
        return self._io

    def __getstate__(self) -> dict[str, Any]:
        # without its run's manager, plugin, signal handlers (setup sets them again): a trainer holding it pickles
        return {**self.__dict__, "_io": None, "_manager": None, "_handlers": None}

    @property
    @override
    def ckpt_path(self) -> str | None:  # type: ignore[override]
        """The newest committed checkpoint (``ckpt_path="last"``; this node's newest memory step if newer than every
        disk step), or None."""
        disk = _committed_steps(Path(self.dirpath))
        memory = _committed_steps(Path(root).expanduser()) if (root := self._memory["memory_root"]) else {}
        newest = [memory[max(memory)]] if memory and max(memory) > max(disk, default=-1) else []
        self._candidates = newest + [disk[s] for s in sorted(disk, reverse=True)]
        return str(self._candidates[0]) if self._candidates else None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, AsyncDCPCheckpointIO):
            raise ConfigError("MTBFCheckpoint needs Trainer(plugins=[lightning_ckpt.AsyncDCPCheckpointIO()]); the "
                              f"trainer's checkpoint IO is {type(io).__name__}")
        io.attach(trainer)
        self._io = io
        if stage != "fit":
            return
        # refuse hyper-parameters that cannot be stored now, not at the first save
        encode_values({"hyper_parameters": dict(pl_module.hparams), "datamodule_hyper_parameters": dict(
            trainer.datamodule.hparams) if trainer.datamodule is not None else {}}, io.unsafe_values)
        _compat.isolate_validation_rng(trainer)
        before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        self._manager = io.manager(self.dirpath, keep_last=self.keep_last, save_policy=self._policy,
                                   preemption_signals=("SIGTERM",) if self.save_on_sigterm else (), **self._memory)
        self._handlers = (before, signal.getsignal(signal.SIGTERM)) if before is not None else None
        if self._candidates:
            io.fallbacks[str(self._candidates[0])] = self._candidates
        io.rng_restored_by_callback = True
        io.enable_overlap(pl_module)
        self._reports, self._stepped, self._last_saved_step, self._deferred, self._epoch_end_loop = (
            SaveReports(), False, None, None, None)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Replace Lightning's SIGTERM handler by the manager's; handlers installed before ``fit`` still run."""
        if not self.save_on_sigterm or self._handlers is None or not _compat.set_original_sigterm_handler(
                trainer, self._handlers[0]):
            return
        before, record = self._handlers

        def handler(signum: int, frame: Any) -> None:
            record(signum, frame)
            if callable(before):
                before(signum, frame)

        signal.signal(signal.SIGTERM, handler)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._pending_rng is not None:  # resumed: after the epoch's iterator was created, before the forward
            self._rng.load_state_dict({"rng": self._pending_rng})
            self._pending_rng = None
        self._flush_deferred(trainer)

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._setup_io.wait_staged()
        self._stepped = True

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._stepped:  # no optimizer step in this batch (gradient accumulation): not a step boundary
            return
        self._stepped = False
        step = trainer.global_step
        self._setup_io.poll()
        asks = self._policy is not None or self.save_on_sigterm or self._memory["memory_root"] is not None
        tier = self._manager.save_due(step) if asks else None  # "disk", "memory" or None
        sigterm = self._manager.preemption_requested
        # the final step is saved at its step boundary: at on_train_end Lightning counts the epoch completed
        disk = tier == "disk" or sigterm or (self.save_on_train_end and _compat.is_final_batch(trainer))
        if disk or tier == "memory":
            self._save(trainer, step, stopping=sigterm, memory=not disk)
        if not disk and self.save_on_train_end and _compat.is_last_batch(trainer):
            # a stop decided later at this epoch end (EarlyStopping, a callback, the module) saves at on_train_end
            # with this loop state: a resume then loads the loaders' states (skipped once the epoch is counted)
            self._epoch_end_loop = (step, trainer.fit_loop.state_dict())
        if sigterm:
            self._setup_io.wait()
            log.warning("[rank %d] SIGTERM: checkpoint of step %d is committed; stopping", trainer.global_rank, step)
            _compat.mark_sigterm_received(trainer)  # Lightning raises SIGTERMException at the end of this batch
            trainer.should_stop = True
        self._report(trainer, pl_module)
        if self.log_stats and (lost := self._reports.lost_work(self._manager.health)) is not None:
            self._log_metrics(trainer, {"ckpt/lost_work_s": lost})  # what a failure now would lose
            log.info("checkpoint health: a failure now would lose %.1f s of training", lost)
        if self.prog_bar:
            pl_module.log("ckpt_saving", float(self._setup_io.saving), prog_bar=True, logger=False, on_step=True,
                          on_epoch=False)

    def _save(self, trainer: Any, step: int, *, stopping: bool = False, fit_loop: dict[str, Any] | None = None,
              memory: bool = False) -> None:
        """Save ``step`` (``memory``: into the memory tier); at an epoch end taken now (loaders finished) and written
        with the next epoch's first RNG (:meth:`_flush_deferred`). ``fit_loop`` replaces ``loops.fit_loop``."""
        if not memory:
            if step == self._last_saved_step:
                return
            self._last_saved_step = step
        path = None if memory else str(Path(self.dirpath) / StepNaming().name(step))
        checkpoint = _compat.dump_checkpoint(trainer)
        if not _compat.is_last_batch(trainer):
            self._write(trainer, path, checkpoint)
            return
        if fit_loop is not None:
            checkpoint["loops"]["fit_loop"] = fit_loop
        _compat.finish_loader_states(checkpoint)
        self._deferred = (path, checkpoint)
        if stopping:
            self._flush_deferred(trainer, stopping=True)

    def _flush_deferred(self, trainer: Any, *, stopping: bool = False) -> None:
        """Write the checkpoint deferred by :meth:`_save` with this RNG (stopping: the next epoch's start's)."""
        if self._deferred is None:
            return
        (path, checkpoint), self._deferred = self._deferred, None
        rng = self._rng.state_dict()["rng"]
        if stopping:
            _compat.start_next_epoch(trainer)
            rng, before = self._rng.state_dict()["rng"], rng
            self._rng.load_state_dict({"rng": before})
        checkpoint["callbacks"][self.state_key]["rng"] = rng
        self._write(trainer, path, checkpoint)

    def _write(self, trainer: Any, path: str | None, checkpoint: dict[str, Any]) -> None:
        """Save ``checkpoint`` at ``path`` (every rank; None: into the memory tier)."""
        if path is None:
            self._setup_io.save_to_memory(checkpoint)
            return
        trainer.strategy.save_checkpoint(checkpoint, path)
        trainer.strategy.barrier("MTBFCheckpoint.save")
        if self._setup_io.last_handle is not None:
            self._reports.add(self._setup_io.last_handle)

    @staticmethod
    def _log_metrics(trainer: Any, metrics: dict[str, float]) -> None:
        """Write ``metrics`` once, straight to the loggers (``pl_module.log`` repeats them per row)."""
        for logger in trainer.loggers if trainer.is_global_zero else ():
            logger.log_metrics(metrics, step=trainer.global_step)

    def _report(self, trainer: Any, pl_module: Any | None) -> None:
        """Log the statistics of every save committed since the last report (once each)."""
        for handle, _ in self._reports.committed():
            stats, info = handle.stats.as_dict(), self._manager.schedule_info()
            plan: dict[str, Any]
            plan = next((p for p in info.get("policies", [info]) if "interval_steps" in p), {})  # the MTBF policy's
            metrics = SaveReports.metrics(handle, "ckpt/", _STAT_KEYS)
            metrics.update({f"ckpt/{k}": float(plan[k]) for k in _PLAN_KEYS if isinstance(plan.get(k), (int, float))})
            if self.log_stats:
                self._log_metrics(trainer, metrics)
                log.info("checkpoint step %d committed: blocking %.3f s, persist %.3f s, %.3f GB/s; schedule %s",
                         handle.step, stats["blocking_s"], stats["persist_s"], stats["gb_per_s"],
                         {k: plan.get(k) for k in ("interval_steps", "expected_overhead", "limited_by")})
            if self.prog_bar and pl_module is not None:
                pl_module.log("ckpt", float(handle.step), prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Save the final step unless already saved (a stop inside an epoch is not: Lightning counts that epoch as
        completed), wait for it, log its statistics."""
        self._flush_deferred(trainer, stopping=True)
        step = trainer.global_step
        loop, self._epoch_end_loop = self._epoch_end_loop, None
        if self.save_on_train_end and step > 0 and step != self._last_saved_step:
            if _compat.is_last_batch(trainer) and loop is not None and loop[0] == step:
                self._save(trainer, step, stopping=True, fit_loop=loop[1])
            else:
                log.info("training stopped inside an epoch at step %d: not saving it at train end (it would resume "
                         "at the next epoch); the newest checkpoint is step %s", step, self._last_saved_step)
        self._setup_io.wait()
        self._report(trainer, None)

    @override
    def on_exception(self, trainer: Any, *_: Any, **__: Any) -> None:
        """Wait for the in-flight save (loggers are finalized next); never save a half-finished step."""
        try:
            if self._io is not None:
                self._io.wait()
        except Exception:
            log.exception("checkpoint error while handling another exception")

    @override
    def teardown(self, trainer: Any, *_: Any, **__: Any) -> None:
        """Nothing to remove (unlike ``OnExceptionCheckpoint``)."""

    @override
    def state_dict(self) -> dict[str, Any]:
        # the RNG is restored right before the first resumed batch (at an epoch end, see _save)
        return {"rng": self._rng.state_dict()["rng"],
                "young_daly": None if self._young_daly is None else self._young_daly.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng")
        if self._young_daly is not None and state_dict.get("young_daly"):
            self._young_daly.load_state_dict(state_dict["young_daly"])


def _committed_steps(root: Path) -> dict[int, Path]:
    """The committed ``step_N`` checkpoint directories under ``root`` (absolute), by step."""
    naming = StepNaming()
    steps = {naming.step_of(p.name): p for p in root.iterdir()} if root.is_dir() else {}
    return {s: p.absolute() for s, p in steps.items() if s is not None and is_committed(p)}
