#!/usr/bin/env python
"""Memory saves every step: the writer's time per save with the retired step's files recycled vs deleted.

One process saves a dict of float32 tensors (``--mb`` MB, 16 MiB each) to the memory tier
(``memory_root`` on ``/dev/shm``, ``memory_keep_last=2``, ``persist="thread"``) ``--saves`` times, every
tensor changed before each save (so every file is written). Per save it times ``save()`` until the save
is committed and retention's deletions are done (``mgr.wait()``): the writer's work per save, which a
training step shares the machine with. ``recycled``: the default, the data files of the step retention
drops are written over by the next save (``memory_root/.spare``); ``deleted``: those files deleted at once
(as before), the next save allocating new tmpfs pages. Floors in the same run: writing the same bytes into
new tmpfs files (``tmpfs_new_s``), and over existing ones (``tmpfs_overwrite_s``). The first 4 saves of
each configuration are left out (retention starts at the third). Configurations alternate ``--rounds``
times.

    python benchmarks/memory_recycle.py --mb 160 --saves 24 --rounds 2 --json /tmp/memory_recycle.json

JSON: ``{"cases": {"recycled"|"deleted": {"median_s", "min_s", "per_round", "files_written_over"}}, "floors": {...},
"ratios": {"recycled_over_deleted", "recycled_over_tmpfs_new", "deleted_over_tmpfs_new"}, "machine": {...}}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, git_info, make_log  # noqa: E402

log = make_log("memory_recycle")
TENSOR_BYTES = 16 << 20


def _floors(nbytes: int, shm: Path) -> tuple[float, float]:
    """Seconds to write ``nbytes`` into new tmpfs files, and over the same files again."""
    buf = bytearray(os.urandom(TENSOR_BYTES))
    path = shm / "floor.bin"
    times = []
    for flags in (os.O_TRUNC, 0):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
        t0 = time.perf_counter()
        for at in range(0, nbytes, TENSOR_BYTES):
            os.pwrite(fd, buf, at)
        times.append(time.perf_counter() - t0)
        os.close(fd)
    path.unlink()
    return times[0], times[1]


def _run(case: str, mb: int, saves: int, shm: Path, base: Path) -> tuple[list[float], int]:
    """The seconds of each save after the fourth, and how many data files the saves wrote over."""
    import torch

    from torch_ckpt import CheckpointManager
    from torch_ckpt.format import _dcp_write
    from torch_ckpt.manager import _memory

    recycle, reuse, reused = _memory._recycle, _dcp_write._reuse_spare, [0]

    def counted(spare, path):  # observes only
        got = reuse(spare, path)
        reused[0] += got is not None
        return got
    _dcp_write._reuse_spare = counted
    if case == "deleted":
        _memory._recycle = lambda paths, spare, kept: _memory._delete(paths)
    state = {f"w{i:03d}": torch.randn(TENSOR_BYTES // 4) for i in range(max(1, (mb << 20) // TENSOR_BYTES))}
    mem, disk = Path(tempfile.mkdtemp(dir=shm)), Path(tempfile.mkdtemp(dir=base))
    times = []
    try:
        with CheckpointManager(disk, memory_root=str(mem), memory_keep_last=2, persist="thread") as mgr:
            for step in range(1, saves + 1):
                for t in state.values():
                    t.add_(1.0)
                t0 = time.perf_counter()
                mgr.save(step, state, tier="memory")
                mgr.wait()
                times.append(time.perf_counter() - t0)
    finally:
        _memory._recycle, _dcp_write._reuse_spare = recycle, reuse
        shutil.rmtree(mem, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return times[4:], reused[0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=160, help="state in MB (16 MiB tensors)")
    p.add_argument("--saves", type=int, default=24, help="memory saves per configuration and round (>= 6)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.saves < 6:
        p.error("--saves must be >= 6 (the first 4 are left out)")
    import logging

    logging.getLogger("torch_ckpt").setLevel(logging.ERROR)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    base = Path(tempfile.mkdtemp(prefix="torch_ckpt_memory_recycle_"))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    per_round: dict[str, list[float]] = {"recycled": [], "deleted": []}
    every: dict[str, list[float]] = {"recycled": [], "deleted": []}
    reused = {"recycled": 0, "deleted": 0}
    new, over = [], []
    try:
        for r in range(args.rounds):
            for case in ("deleted", "recycled"):
                times, files = _run(case, args.mb, args.saves, shm, base)
                every[case] += times
                reused[case] += files
                per_round[case].append(statistics.median(times))
                log(f"round {r + 1}: {case} median {per_round[case][-1]:.3f} s per save")
            a, b = _floors(args.mb << 20, shm)
            new.append(a)
            over.append(b)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cases = {c: {"median_s": statistics.median(v), "min_s": min(v), "per_round": per_round[c],
                 "files_written_over": reused[c]} for c, v in every.items()}
    floors = {"tmpfs_new_s": statistics.median(new), "tmpfs_overwrite_s": statistics.median(over)}
    result = {"benchmark": "memory_recycle", "cases": cases, "floors": floors,
              "ratios": {"recycled_over_deleted": cases["recycled"]["median_s"] / cases["deleted"]["median_s"],
                         "recycled_over_tmpfs_new": cases["recycled"]["median_s"] / floors["tmpfs_new_s"],
                         "deleted_over_tmpfs_new": cases["deleted"]["median_s"] / floors["tmpfs_new_s"]},
              "bytes": args.mb << 20,
              "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                          "memory_root": str(shm), "git": git_info()},
              "config": {**vars(args), "json": None if args.json is None else str(args.json)},
              "runtime_s": time.perf_counter() - t_start}
    emit_json(result, args.json)
    log("recycled/deleted {recycled_over_deleted:.2f}x, recycled/tmpfs-new {recycled_over_tmpfs_new:.2f}x".format(
        **result["ratios"]))
    return result


if __name__ == "__main__":
    main()
