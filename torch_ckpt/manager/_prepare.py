"""Rank 0's checks and moves before a save of :class:`~torch_ckpt.CheckpointManager` is agreed.

A mixin of the manager (it uses the manager's root, naming and engine): it validates the step, an
explicit ``path`` and ``extra_dir``, moves damaged or superseded directories aside, and refuses
newer steps of another run. :mod:`torch_ckpt.manager._manager` submits the save; this module decides
whether its target may be written.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt._values import check_int
from torch_ckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, ConfigError
from torch_ckpt.policy._lineage import BASE, Lineage, head_of
from torch_ckpt.root._layout import quarantine_step_dir, read_manifest, scan_manifests
from torch_ckpt.root._temporaries import PARTIAL_PREFIX, is_reservation, is_temporary_name
from torch_ckpt.save._persist import check_extra_name

log = get_logger("torch_ckpt.manager._manager")

__all__ = ["ManagerPrepareMixin"]


def _reserved_name(name: str) -> bool:
    """True for a name of the form of the manager's own files: temporaries (:func:`is_temporary_name`,
    ``.torch-ckpt.tmp.<id>``), partials (``.torch-ckpt.partial.<id>``), the aside directories of a
    delete, supersede, quarantine or replace, and the root lock. Other hidden names
    (Lightning's ``.lr_find_<uuid>.ckpt``) are ordinary checkpoint paths."""
    return is_temporary_name(name) or name.startswith(
        (PARTIAL_PREFIX, ".torch-ckpt.", ".trash_", ".superseded_", ".corrupt_", ".lock")) or \
        bool(re.match(r"^\..+\.replaced\.[0-9a-f]{1,64}$", name))


def _list_steps(steps: list[int]) -> str:
    """``[500, 600, 700]``, or the first and last few of a long list."""
    if len(steps) <= 8:
        return str(steps)
    return f"[{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}]"


class ManagerPrepareMixin:
    """The checks :meth:`~torch_ckpt.CheckpointManager.save` runs before the ranks agree on a save."""

    def _stage_extra(self, extra_dir: str | os.PathLike, final: Path) -> Path:
        """Rank 0, inside :meth:`save`: move ``extra_dir`` aside to a hidden sibling of ``final``.

        The hook files are taken now, so the caller may refill ``extra_dir`` for the next save at
        once; the background commit moves them into the checkpoint before its manifest.

        Raises:
            ConfigError: ``extra_dir`` is missing, not a directory, a symlink, the root, ``final``, a
                directory containing either, or inside ``final``.
            CheckpointWriteError: an entry uses a checkpoint file's name, or the move fails.
        """
        src = Path(extra_dir).expanduser()
        src = (src if src.is_absolute() else self.root / src).absolute()
        if src.is_symlink() or not src.is_dir():
            raise ConfigError(f"extra_dir {src} must be an existing directory (not a symlink) holding the files "
                              "to commit with the checkpoint")
        for guarded in (self.root, final):
            if src == guarded or src in guarded.parents:
                raise ConfigError(f"extra_dir {src} is or contains {guarded}: name a directory of its own that holds "
                                  "only the framework's files")
        if final in src.parents:
            raise ConfigError(f"extra_dir {src} lies inside the checkpoint {final}; use a separate directory")
        for entry in src.iterdir():
            check_extra_name(entry)
        staged = final.with_name(f".{final.name}.extra.tmp.{self._ckpt.incarnation}")
        try:
            if staged.exists():
                shutil.rmtree(staged)
            shutil.move(str(src), str(staged))  # a rename on one file system
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot move extra_dir {src} to {staged}: {exc.strerror or exc}") \
                from exc
        return staged

    def _explicit_path(self, path: str | os.PathLike) -> Path:
        if not isinstance(path, (str, os.PathLike)) or str(path) == "":
            raise ConfigError(f"path must be a non-empty directory path, got {path!r}")
        final = Path(path).expanduser()
        final = (final if final.is_absolute() else self.root / final).absolute()
        if final == self.root or final in self.root.parents:
            raise ConfigError(f"path {final} is the checkpoint root or contains it; name a directory inside or "
                              "beside the root")
        if _reserved_name(final.name):
            raise ConfigError(f"path {final}: this name has the form of torch-ckpt's own temporary or set-aside "
                              "directories (.torch-ckpt.*, .NAME.tmp.<id>, .trash_*, .superseded_*, .corrupt_*, "
                              ".NAME.replaced.<id>, "
                              ".lock); choose another name")
        return final

    def _prepare_step(self, step: Any, final: Path, *, explicit: bool = False) -> bool:
        """Every rank, before the save agreement: validate ``step``; on rank 0 also check its directory.

        After :meth:`restore` loaded a step older than the newest live one, the newer checkpoints
        belong to an abandoned timeline (:mod:`torch_ckpt.policy._lineage`): the first save moves every
        local step the new one supersedes aside (``.superseded_<name>.<time>``, kept, never
        listed) so that "latest" follows the run again.
        A damaged directory of ``step`` is moved aside too (``.corrupt_<name>.<time>``).

        Returns:
            True (on rank 0) when ``final`` holds a committed checkpoint that the commit replaces.

        Raises:
            ConfigError: read-only manager, invalid or already committed step, newer steps of
                another run (``on_existing_newer="error"``), or ``final`` is not a torch-ckpt
                checkpoint.
            CheckpointWriteError: a directory could not be moved aside.
        """
        if self.read_only:
            raise ConfigError(f"this CheckpointManager was opened with read_only=True on {self.root}: it restores "
                              "and lists checkpoints but does not save; open a writable root without read_only "
                              "to save")
        check_int("step", step, 0)
        if self.config.explicit_paths_only and not explicit:
            raise ConfigError(f"this CheckpointManager was opened with explicit_paths_only=True on {self.root}: "
                              "every save names its directory (save(step, state, path=...))")
        self._captured_at[step] = time.time()  # the state is captured right after this call
        while len(self._captured_at) > 256:
            self._captured_at.pop(next(iter(self._captured_at)))
        restored, self._restored_step = self._restored_step, None
        if not self._acts_on_root:
            return False
        try:
            head = self._head_lineage()
            if restored is not None and not self.config.explicit_paths_only:
                # a rollback: the steps of the abandoned timeline go aside
                for s, (s_path, s_manifest) in scan_manifests(self.root, self.naming).items():
                    if not head.holds(s, s_manifest.lineage):
                        quarantine_step_dir(s_path, reason="superseded")
            if explicit:
                return self._check_explicit(final)
            if os.path.lexists(final) and not is_reservation(final):  # an empty directory is free to use
                try:
                    read_manifest(final)
                except CheckpointNotFoundError:
                    raise ConfigError(f"{final} exists but is not a torch-ckpt checkpoint (no manifest.json): it is "
                                      "never written into or deleted; move it away or use another directory") from None
                except CheckpointError:
                    quarantine_step_dir(final, reason="corrupt")
                else:
                    raise ConfigError(f"step {step} is already committed at {final}; save under a new step")
            self._check_no_newer_steps(step, restored)
            return False
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointWriteError(exc.errno, f"cannot prepare step {step} under {self.root}: {exc.strerror} "
                                       f"({exc.filename})") from exc

    def _head_lineage(self) -> Lineage:
        """The segment this manager's saves belong to (:mod:`torch_ckpt.policy._lineage`), decided once on the
        rank acting on the root: the one a restore chose, else the head of the local root's history."""
        if self._lineage is None:
            self._lineage = head_of(m.lineage for _, m in scan_manifests(self.root, self.naming).values()) \
                if self._acts_on_root else BASE
        return self._lineage

    def _check_explicit(self, final: Path) -> bool:
        """Rank 0: may ``final`` be written? True when it holds a committed checkpoint to replace."""
        if not os.path.lexists(final):
            return False
        if final.is_symlink() or not final.is_dir():
            raise ConfigError(f"{final} exists and is not a directory written by torch-ckpt (a file or symlink): "
                              "it is never overwritten; remove it or save elsewhere")
        if is_reservation(final):  # an empty folder (or a save that died before committing): written into
            return False
        try:
            read_manifest(final)
        except CheckpointNotFoundError:
            raise ConfigError(f"{final} exists but is not a torch-ckpt checkpoint (no manifest.json): it is never "
                              "written into or deleted; move it away or save elsewhere") from None
        except CheckpointError:
            quarantine_step_dir(final, reason="corrupt")  # ours but damaged: kept aside, never listed
            return False
        return True

    def _check_no_newer_steps(self, step: int, restored: int | None = None) -> None:
        """Rank 0: refuse (or move aside) committed steps newer than ``step`` that this run did not write.

        ``restored``: the step this manager's last restore loaded (the save names a step below it).
        """
        if self._newest_known is not None and step > self._newest_known:
            self._newest_known = step
            return
        head = self._head_lineage()
        committed = {s: p for s, (p, m) in scan_manifests(self.root, self.naming).items() if head.holds(s, m.lineage)}
        newer = [s for s in committed if s > step]
        if newer and self.on_existing_newer == "supersede":
            log.warning("step %d: moving the newer committed steps %s of an earlier run aside "
                        "(on_existing_newer='supersede')", step, _list_steps(newer))
            for s in newer:
                quarantine_step_dir(committed[s], reason="superseded")
        elif newer and restored is not None:
            raise ConfigError(
                f"this manager restored step {restored} and is now asked to save step {step}, below it; {self.root} "
                f"holds committed step(s) {_list_steps(newer)} newer than step {step}, so 'latest' would stay at step "
                f"{newer[-1]} and retention would delete this save first. Save a step above {restored} (the restored "
                f"state's step counts on from {restored}), or pass CheckpointManager(..., "
                "on_existing_newer='supersede') to move the newer steps aside (kept hidden, never listed)")
        elif newer:
            raise ConfigError(
                f"{self.root} already holds committed step(s) {_list_steps(newer)} newer than step {step}, which this "
                f"manager did not restore (an earlier run's?). Saving step {step} there would leave 'latest' at step "
                f"{newer[-1]} (a restart would resume it) and retention would delete this run's checkpoints first. "
                f"Call restore() to continue from step {newer[-1]}, save steps above {newer[-1]}, use a new directory, "
                "or pass CheckpointManager(..., on_existing_newer='supersede') to move the newer steps aside (kept as "
                "hidden .superseded_step_N.* directories, never listed)")
        self._newest_known = step  # every other committed step is older now
