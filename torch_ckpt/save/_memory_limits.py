"""How much host memory this process may still allocate: available RAM capped by its memory cgroup.

Inside a container, ``psutil.virtual_memory().available`` reports the *host's* free memory (20 GiB
seen in a 900 MiB container), while the kernel kills the process (exit 137) once its cgroup's
charge reaches the cgroup limit. :func:`available_memory_bytes` therefore takes the smaller of the
host figure and the headroom of every memory cgroup on this process's path, read from
``/proc/self/cgroup`` and the cgroup file systems under ``/sys/fs/cgroup``:

* cgroup v2 (``0::/path``): ``memory.max`` and ``memory.high`` (``"max"`` means no limit) against
  ``memory.current``;
* cgroup v1 (``N:memory:/path``): ``memory.limit_in_bytes`` (about 2**63 means no limit) against
  ``memory.usage_in_bytes``.

The charge counts reclaimable page cache too (for example the files of the previous checkpoint);
as in ``docker stats`` and the kubelet's "working set", inactive file pages (``inactive_file``,
``total_inactive_file`` in ``memory.stat``) are not counted as used. Each ancestor up to the mount
root is checked, since a parent's limit applies to its children (nested cgroups, v1 with
``use_hierarchy``). Where the cgroup path is not found under the mount (a container that mounts its
own cgroup as the root without a cgroup namespace), the mount root is read.
"""

from __future__ import annotations

from pathlib import Path

import psutil

__all__ = ["cgroup_memory_headroom", "available_memory_bytes", "CGROUP_ROOT", "PROC_SELF_CGROUP"]

#: where the cgroup file systems are mounted
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: this process's cgroup membership
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: limits at or above this many bytes mean "no limit" (v1 writes 2**63 rounded down to a page)
_UNLIMITED = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _stat_value(directory: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = (directory / "memory.stat").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return 0
    stats = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stats[parts[0]] = int(parts[1])
    return next((stats[k] for k in keys if k in stats), 0)


def _levels(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``mount`` and its ancestors up to ``mount``, leaf first."""
    leaf = mount / path.strip("/") if path.strip("/") else mount
    if not leaf.is_dir():
        leaf = mount  # our cgroup is mounted as the root (container without a cgroup namespace)
    levels = [leaf]
    while levels[-1] != mount and mount in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def _headroom(levels: list[Path], limit_files: tuple[str, ...], usage_file: str, inactive_keys: tuple[str, ...]
              ) -> int | None:
    best: int | None = None
    for d in levels:
        limits = [v for v in (_read_int(d / name) for name in limit_files) if v is not None]
        if not limits:
            continue
        usage = _read_int(d / usage_file) or 0
        working_set = max(0, usage - _stat_value(d, inactive_keys))
        room = max(0, min(limits) - working_set)
        best = room if best is None else min(best, room)
    return best


def cgroup_memory_headroom(cgroup_root: Path | None = None, proc_self_cgroup: str | None = None) -> int | None:
    """Bytes this process's memory cgroups still allow it to allocate, or None when no limit applies.

    Args:
        cgroup_root: where the cgroup file systems are mounted (default :data:`CGROUP_ROOT`): v2 at
            the root itself or at ``unified/``, v1's memory controller at ``memory/``.
        proc_self_cgroup: the text of ``/proc/self/cgroup`` (default: read :data:`PROC_SELF_CGROUP`).

    Returns:
        The smallest ``limit - (usage - inactive file pages)`` (never below 0) over every cgroup
        level with a limit, v1 and v2; None without any limit (or without cgroups).
    """
    root = CGROUP_ROOT if cgroup_root is None else Path(cgroup_root)
    if proc_self_cgroup is None:
        try:
            proc_self_cgroup = PROC_SELF_CGROUP.read_text()
        except OSError:
            return None
    found: list[int] = []
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            for mount in (root, root / "unified"):
                if (mount / "cgroup.controllers").is_file():
                    room = _headroom(_levels(mount, path), ("memory.max", "memory.high"), "memory.current",
                                     ("inactive_file",))
                    if room is not None:
                        found.append(room)
                    break
        elif "memory" in controllers.split(","):
            mount = root / "memory"
            if mount.is_dir():
                room = _headroom(_levels(mount, path), ("memory.limit_in_bytes",), "memory.usage_in_bytes",
                                 ("total_inactive_file", "inactive_file"))
                if room is not None:
                    found.append(room)
    return min(found) if found else None


def available_memory_bytes() -> int:
    """Bytes of host memory a new allocation may take now: psutil's available RAM, capped by the cgroup headroom."""
    available = int(psutil.virtual_memory().available)
    room = cgroup_memory_headroom()
    return available if room is None else min(available, room)
