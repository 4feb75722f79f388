"""Incremental saves: data files whose records are unchanged since the last save are hard-linked, not rewritten.

Every tensor record a rank writes is remembered per root and file prefix (:class:`Baseline`: file, offset,
length, the tensor's signature and the CRC-32 of its bytes, computed by the writer from the staged host
copy, never trusting a flag or version counter). At the next save a tensor whose signature and digest
equal its record's is not written: the record's data file is hard-linked into the new checkpoint's
partial directory and the tensor's DCP entry points at the record in it, provided the file is the very
file remembered (same device, inode, size; listed with that size and CRC-32 by the checkpoint's
committed manifest) and at least half of its bytes are still referenced (so a checkpoint never keeps
more than about twice its own bytes alive). A link that fails (``EXDEV``, ``EPERM``, no hard links)
means the tensors are written as usual.

Each checkpoint stays self-contained: every file it references is a link in its own directory, so
retention only deletes directories and the bytes live while any link does; a kill between link and
commit leaves only an uncommitted partial (removed as usual) and the previous checkpoint untouched.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointError
from torch_ckpt.format._files import read_manifest

__all__ = ["Record", "Baseline", "remember", "baseline_for", "link_file", "LINK_MIN_SHARE", "forget_all"]

log = get_logger(__name__)

#: least share of a previous data file's bytes the new checkpoint must reference for it to be linked
LINK_MIN_SHARE = 0.5
#: baselines kept per slot: the newest save's, and the one before (used when the newest was not committed)
_KEPT = 2


@dataclass(frozen=True)
class Record:
    """One tensor record of a data file: where it lies and what it holds.

    Attributes:
        file: data file name. offset, length: the record's byte range in it (bytes).
        signature: dtype, shape, strides, storage offset and size of the tensor (what its framing depends on).
        digest: ``(bytes, crc32)`` of the tensor's data.
    """

    file: str
    offset: int
    length: int
    signature: tuple
    digest: tuple[int, int]


@dataclass
class Baseline:
    """The data files and records one save of one rank (one file prefix) wrote or linked.

    Attributes:
        directory: the checkpoint directory they are committed in (when the save committed).
        step: its step (the manifest's).
        files: ``{name: (bytes, crc32, st_dev, st_ino)}``.
        records: ``{(key, chunk offset): Record}``.
    """

    directory: Path
    step: int
    files: dict[str, tuple[int, int, int, int]]
    records: dict[tuple, Record] = field(default_factory=dict)
    listed: dict[str, dict[str, int]] | None = None  # the committed manifest's files, once checked


_lock = threading.Lock()
_slots: dict[tuple[str, str], list[Baseline]] = {}


def _slot(final: Path, prefix: str) -> tuple[str, str]:
    return (os.path.abspath(final.parent), prefix)


def remember(final: Path, prefix: str, baseline: Baseline) -> None:
    """Record what the save into ``final`` wrote with file ``prefix`` (used once it is committed)."""
    with _lock:
        kept = [b for b in _slots.get(_slot(final, prefix), []) if b.directory != baseline.directory
                or b.step != baseline.step]
        _slots[_slot(final, prefix)] = [baseline, *kept][:_KEPT]


def forget_all() -> None:
    """Drop every baseline (tests; the next save of each root writes everything)."""
    with _lock:
        _slots.clear()


def baseline_for(final: Path, prefix: str) -> Baseline | None:
    """The newest remembered save of this root and prefix that is committed (its manifest reads), or None."""
    with _lock:
        candidates = list(_slots.get(_slot(final, prefix), []))
    for base in candidates:
        try:
            manifest = read_manifest(base.directory)
        except (CheckpointError, OSError):
            continue  # not committed (the save failed), or deleted by retention since
        if manifest.step == base.step:
            base.listed = manifest.files
            return base
    return None


def _same_file(st: os.stat_result, info: tuple[int, int, int, int]) -> bool:
    return (st.st_size, st.st_dev, st.st_ino) == (info[0], info[2], info[3])


def link_file(base: Baseline, name: str, into: Path) -> bool:
    """Hard-link ``base``'s data file ``name`` into directory ``into``; False (nothing left behind) when it is
    not the remembered file any more (listed size or CRC-32, device, inode, size differ) or cannot be linked."""
    info = base.files.get(name)
    listed = (base.listed or {}).get(name)
    if info is None or listed is None or (listed.get("bytes"), listed.get("crc32")) != info[:2]:
        return False
    src, dst = base.directory / name, into / name
    try:
        if not _same_file(os.stat(src, follow_symlinks=False), info):
            return False
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:  # EXDEV, EPERM, EMLINK, ENOTSUP...: the tensors are written instead
        log.debug("incremental save: cannot link %s into %s (%s); writing its tensors", src, into, exc)
        return False
    try:
        if _same_file(os.stat(dst, follow_symlinks=False), info):
            return True  # the link is the remembered file (not one that replaced it between stat and link)
        os.unlink(dst)
    except OSError:
        pass
    return False
