"""Atomic changes to checkpoint names on a local POSIX file system.

Lightning addresses checkpoints by path and expects to overwrite (``last.ckpt`` with
``save_last=True``), link (``save_last="link"``) and delete them. A torch-ckpt checkpoint is a
directory, which ``rename`` cannot atomically put in place of an existing entry, so:

* :func:`replace_path` swaps the two entries with ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15;
  ext4, xfs, btrfs, tmpfs...) so the name always refers to the old or the new checkpoint. Where the
  kernel or file system lacks it, the old entry is renamed aside first (a window of microseconds in
  which the name does not exist; never a partial checkpoint).
* :func:`remove_path` renames a directory to a hidden trash name before deleting it.
* :func:`link_path` creates the symlink under a temporary name and renames it into place.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

from torch_ckpt.layout import fsync_dir

__all__ = ["TRASH_PREFIX", "is_real_dir", "link_path", "remove_path", "replace_path"]

TRASH_PREFIX = ".trash_"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def is_real_dir(path: Path) -> bool:
    """True for a directory that is not a symlink."""
    return path.is_dir() and not path.is_symlink()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing entries; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _trash_name(path: Path) -> Path:
    return path.with_name(f"{TRASH_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")


def remove_path(path: Path) -> None:
    """Delete a checkpoint directory, file or link; a missing path is not an error."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        trash = _trash_name(path)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def replace_path(new: Path, target: Path) -> None:
    """Give ``target`` the entry ``new`` holds (``new`` disappears); the old entry is deleted.

    ``target`` refers to either the old or the new entry at every instant (see the module docstring
    for the fallback without ``RENAME_EXCHANGE``).
    """
    if not os.path.lexists(target):
        os.rename(new, target)
    elif is_real_dir(new) or is_real_dir(target):
        if _exchange(new, target):
            remove_path(new)
        else:
            aside = _trash_name(target)
            os.rename(target, aside)
            os.rename(new, target)
            remove_path(aside)
    else:
        os.replace(new, target)
    fsync_dir(target.parent)


def link_path(target: Path, link: Path) -> None:
    """Make ``link`` a relative symlink to ``target``, replacing what ``link`` held atomically."""
    tmp = link.with_name(f".{link.name}.link-{uuid.uuid4().hex[:8]}")
    os.symlink(os.path.relpath(target, link.parent), tmp)
    replace_path(tmp, link)
