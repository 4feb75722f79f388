"""On-disk layout, manifest and atomic commit of a checkpoint root (a local directory).

Layout of a run root::

    ROOT/
      step_000000100/            committed checkpoint (DCP files + per-rank JSON + manifest.json)
        .metadata                DCP global metadata (pickle, read with a restricted unpickler)
        __0_0.distcp ...         tensor shards, one file per rank and writer thread
        rank_00000.json ...      non-tensor state of each rank (types preserved, no pickle)
        manifest.json            written last: step, world size, files with sizes and CRC-32
      .step_000000110.tmp/       a save in progress; never listed, removed on the next start

Commit protocol (crash-safe at every instant): all files are written and fsynced inside the
temporary sibling, ``manifest.json`` is written and fsynced, the temporary directory is fsynced,
renamed to its final name (atomic on POSIX), and the root is fsynced. A directory with a final
name therefore always holds a complete checkpoint; ordering always uses the manifest's integer
step, never string order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)

__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "step_dir_name",
    "tmp_dir_name",
    "scan_committed",
    "read_manifest",
    "write_json_durable",
    "fsync_dir",
    "commit_dir",
    "clean_stale_temporaries",
    "check_root",
    "update_manifest_tiers",
    "RootLock",
    "rank_file_name",
    "MANIFEST_NAME",
]

log = get_logger(__name__)

FORMAT_NAME = "torch-ckpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_(\d+)(\.download)?\.tmp$")


def step_dir_name(step: int) -> str:
    """Final directory name of ``step`` (zero-padded; ordering still uses the manifest step)."""
    return f"step_{step:09d}"


def tmp_dir_name(step: int) -> str:
    """Temporary sibling directory name used while ``step`` is being written."""
    return f".step_{step:09d}.tmp"


def rank_file_name(rank: int) -> str:
    """Per-rank JSON file holding that rank's non-tensor state."""
    return f"rank_{rank:05d}.json"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` records about one committed checkpoint.

    Attributes:
        step: training step (int).
        world_size: number of ranks that wrote it.
        files: ``{file name: {"bytes": int, "crc32": int}}`` for every file except the manifest.
        wall_time: Unix time (seconds) of the commit.
        torch_version: ``torch.__version__`` of the writer.
        tensor_bytes: bytes of tensor payload saved (all ranks, after deduplication).
        timings: seconds spent per phase (``staging_s``, ``persist_s``, ...).
        format_version: on-disk format version.
        tiers: tiers holding a complete, verified copy besides this one, e.g.
            ``{"durable": {"url": "s3://b/run", "committed_at": 1.7e9}}``.
    """

    step: int
    world_size: int
    files: dict[str, dict[str, int]]
    wall_time: float = field(default_factory=time.time)
    torch_version: str = field(default_factory=lambda: torch.__version__)
    tensor_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    tiers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written to disk."""
        return {"format": FORMAT_NAME, "format_version": self.format_version, "step": self.step,
                "wall_time": self.wall_time, "world_size": self.world_size, "torch_version": self.torch_version,
                "tensor_bytes": self.tensor_bytes, "timings": self.timings, "tiers": self.tiers, "files": self.files}

    @classmethod
    def from_json(cls, data: Any, source: str) -> Manifest:
        """Validate a parsed manifest object (every field's type and range, plain file names).

        Raises:
            CheckpointCorruptError: naming ``source`` and the offending field.
        """
        from torch_ckpt.format import manifest_from_doc

        return manifest_from_doc(data, source)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: str | os.PathLike, obj: Any) -> tuple[int, int]:
    """Write ``obj`` as JSON and fsync it. Returns ``(bytes, crc32)`` of what was written."""
    import zlib

    data = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), zlib.crc32(data)


def update_manifest_tiers(step_dir: Path, tiers: dict[str, Any]) -> None:
    """Atomically rewrite ``step_dir/manifest.json`` with ``tiers`` merged in (write, fsync, rename)."""
    manifest = read_manifest(step_dir)
    data = manifest.to_json()
    data["tiers"] = {**manifest.tiers, **tiers}
    tmp = Path(step_dir) / (MANIFEST_NAME + ".tmp")
    write_json_durable(tmp, data)
    os.rename(tmp, Path(step_dir) / MANIFEST_NAME)
    fsync_dir(step_dir)


def read_manifest(step_dir: str | os.PathLike, *, allow_symlinks: bool = False) -> Manifest:
    """Read and validate ``step_dir/manifest.json`` (see :func:`torch_ckpt.format.read_manifest`).

    Raises:
        CheckpointNotFoundError: the manifest does not exist.
        CheckpointCorruptError: it is a symlink (unless ``allow_symlinks``) or not a regular file, too
            large, not bounded JSON, or not a valid torch-ckpt manifest; the message names the file.
    """
    from torch_ckpt.format import read_manifest as _read

    return _read(step_dir, allow_symlinks=allow_symlinks)


def check_root(root: Path, *, create: bool) -> None:
    """Validate a checkpoint root; optionally create it.

    Raises:
        CheckpointWriteError: the root exists but is not a directory, or cannot be created.
        CheckpointNotFoundError: ``create`` is False and the root does not exist.
    """
    if root.exists() and not root.is_dir():
        raise CheckpointWriteError(f"checkpoint root {root} exists but is not a directory; pass a directory path")
    if not root.exists():
        if not create:
            raise CheckpointNotFoundError(f"checkpoint root {root} does not exist")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(exc.errno, f"cannot create checkpoint root {root}: {exc.strerror}; "
                                       "choose a writable location") from exc


def scan_committed(root: str | os.PathLike) -> dict[int, Path]:
    """Return ``{step: directory}`` of committed checkpoints under ``root`` (manifest step wins).

    Directories with a final name but an unreadable manifest are skipped with a warning; temporary
    directories are never returned.
    """
    root = Path(root)
    found: dict[int, Path] = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        try:
            manifest = read_manifest(entry)
        except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
            log.warning("ignoring %s: %s", entry, exc)
            continue
        except OSError as exc:  # unreadable (permissions, I/O error): not a usable checkpoint either
            log.warning("ignoring %s: cannot read its manifest (%s)", entry, exc)
            continue
        if manifest.step != int(m.group(1)):
            log.warning("ignoring %s: manifest says step %d", entry, manifest.step)
            continue
        found[manifest.step] = entry
    return dict(sorted(found.items()))


def commit_dir(tmp: Path, final: Path) -> None:
    """Atomically publish ``tmp`` as ``final`` (fsync tmp, rename, fsync parent).

    Raises:
        CheckpointWriteError: ``final`` already exists or the rename fails.
    """
    fsync_dir(tmp)
    if final.exists():
        raise CheckpointWriteError(f"{final} already exists; a checkpoint for this step is already committed")
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise CheckpointWriteError(exc.errno, f"cannot commit {tmp} -> {final}: {exc.strerror}") from exc
    fsync_dir(final.parent)


def clean_stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Remove temporary step directories left by a crashed save. Returns what was removed."""
    removed = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if _TMP_RE.match(entry.name) or entry.name.startswith(".trash_step_"):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("removed %d stale temporary checkpoint dir(s) under %s", len(removed), root)
    return removed


def quarantine_step_dir(path: Path, *, reason: str = "corrupt") -> Path:
    """Move a checkpoint directory aside (never listed, never auto-deleted) and return its new path.

    ``reason`` names the hidden directory: ``.corrupt_step_N.<time>`` for a damaged checkpoint,
    ``.superseded_step_N.<time>`` for one from a run segment abandoned by restoring an older step.
    """
    target = path.with_name(f".{reason}_{path.name}.{int(time.time())}")
    os.rename(path, target)
    fsync_dir(path.parent)
    log.warning("moved %s checkpoint %s aside to %s", reason, path, target)
    return target


def remove_step_dir(path: Path) -> None:
    """Delete a committed checkpoint so that no partial one is ever visible under a final name.

    The directory is first renamed to a hidden trash name (atomic), then removed.
    """
    trash = path.with_name(f".trash_{path.name}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


_LOCKS_HELD: set[str] = set()  # lock files held by this process (to tell our own lock from a stale one)
_EMPTY_LOCK_GRACE_S = 10.0


def _process_start_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - no such process, or no permission
        return None


class RootLock:
    """An exclusive lock on a checkpoint root, so two runs never write (or prune) the same root.

    The lock file ``ROOT/.lock`` holds the owner's host, pid and process start time. On the same
    host, a lock is stale (and taken over, with a warning) when its pid is gone, when that pid now
    belongs to a process started later (pid reuse, e.g. a restarted container), when it names this
    very process without being held by it, or when the file is empty or unreadable and older than
    a few seconds (a crash between creating and writing it). A lock of a live process, or of another
    host, makes :meth:`acquire` fail with a message naming the owner.
    """

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / ".lock"
        self._held = False

    def _stale(self, owner: dict[str, Any], host: str) -> bool:
        if not owner:  # empty or unreadable
            try:
                return time.time() - self.path.stat().st_mtime > _EMPTY_LOCK_GRACE_S
            except OSError:
                return True
        pid = owner.get("pid")
        if owner.get("host") != host or not isinstance(pid, int):
            return False
        if pid == os.getpid():
            return str(self.path) not in _LOCKS_HELD
        started = _process_start_time(pid)
        if started is None:
            return True
        recorded = owner.get("started")
        return isinstance(recorded, (int, float)) and started > recorded + 1.0

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            CheckpointWriteError: another live run owns the root (the owner is named), or the lock
                file cannot be written (the path is named).
        """
        import socket

        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
              "started": _process_start_time(os.getpid())}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    owner = {}
                if self._stale(owner if isinstance(owner, dict) else {}, me["host"]):
                    log.warning("taking over stale lock %s (owner %s)", self.path, owner or "unreadable")
                    self.path.unlink(missing_ok=True)
                    continue
                raise CheckpointWriteError(
                    f"checkpoint root {self.path.parent} is in use by another run (host {owner.get('host')!r}, pid "
                    f"{owner.get('pid')}); use a different directory, or delete {self.path} if that run is gone")
            except OSError as exc:
                raise CheckpointWriteError(exc.errno, f"cannot create the lock {self.path}: {exc.strerror}; check "
                                           "that the checkpoint root is writable and has free space") from exc
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                self.path.unlink(missing_ok=True)
                raise CheckpointWriteError(exc.errno, f"cannot write the lock {self.path}: {exc.strerror}; check "
                                           "that the checkpoint root is writable and has free space") from exc
            self._held = True
            _LOCKS_HELD.add(str(self.path))
            return
        raise CheckpointWriteError(f"could not take the lock {self.path}")

    def release(self) -> None:
        """Drop the lock if this process holds it."""
        if self._held:
            self._held = False
            _LOCKS_HELD.discard(str(self.path))
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:  # the root itself was removed or replaced
                log.debug("could not remove lock %s: %s", self.path, exc)
