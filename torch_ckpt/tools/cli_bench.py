"""``torch-ckpt bench``: measure the storage floors of a directory and the save interval they imply."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from torch_ckpt.durations import format_duration
from torch_ckpt.tools.cli_common import (
    UsageError,
    fmt_bytes,
    interval_rows,
    positive_duration,
    positive_float,
    print_json,
)
from torch_ckpt.tools.cli_tools import add_common

__all__ = ["add_bench_arguments", "run_bench"]


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``torch-ckpt bench``."""
    p.add_argument("directory", metavar="DIR", nargs="?", default=".",
                   help="where checkpoints would be written; a temporary file is written, read and removed "
                        "(default: the current directory)")
    p.add_argument("--size-mib", type=positive_float, default=256.0, metavar="MIB",
                   help="bytes per measurement in MiB (default 256; each disk phase also stops after ~4 s)")
    p.add_argument("--state-gib", type=positive_float, metavar="GIB",
                   help="checkpoint size in GiB, for the save cost and write time it implies")
    p.add_argument("--mtbf", type=positive_duration, metavar="DURATION",
                   help="mean time between failures of the job (e.g. 8h), for the recommended interval")
    p.add_argument("--step-time", type=positive_duration, metavar="DURATION",
                   help="seconds per training step, to express the interval in steps")
    add_common(p, remote=False)


def run_bench(args: argparse.Namespace) -> int:
    """Measure the floors; with --state-gib (and --mtbf) print what they imply."""
    from torch_ckpt.tools.floors import measure_floors, recommend

    if (args.mtbf is not None or args.step_time is not None) and args.state_gib is None:
        raise UsageError("--mtbf and --step-time need --state-gib (the checkpoint size)")
    if args.step_time is not None and args.mtbf is None:
        raise UsageError("--step-time needs --mtbf")
    directory = os.path.expanduser(args.directory)
    if not os.path.exists(directory):
        raise UsageError(f"{directory} does not exist")
    if not os.path.isdir(directory):
        raise UsageError(f"{directory} is not a directory")
    size = max(1, int(args.size_mib * (1 << 20)))
    if not args.quiet and not args.json and sys.stderr.isatty():
        print(f"measuring in {os.path.abspath(directory)} ({args.size_mib:g} MiB per phase)...", file=sys.stderr)
    floors = measure_floors(directory, size_bytes=size)
    rec = recommend(floors, args.state_gib * (1 << 30), mtbf_s=args.mtbf, step_time_s=args.step_time) \
        if args.state_gib is not None else None
    if args.json:
        print_json({**floors, "recommendation": rec})
    else:
        print(_bench_text(floors, rec, args.state_gib))
    return 0


def _bench_text(f: dict[str, Any], rec: dict[str, Any] | None, state_gib: float | None) -> str:

    def row(label: str, gbps: float, note: str = "") -> str:
        return f"  {label:<32}{gbps:8.2f} GB/s" + (f"  ({note})" if note else "")

    size = f"{f['size_bytes'] / 2**20:g} MiB per phase"
    lines = [f"floors measured in {f['directory']} ({size}, {f['elapsed_s']:.1f} s):",
             row("copy into preallocated memory", f["copy_gbps"])]
    if f["d2h_gbps"]:
        lines.append(row("device to pinned host memory", f["d2h_gbps"], f["d2h_device"]))
    lines += [row("write + fsync", f["write_gbps"], f"{fmt_bytes(f['write_bytes'])} in {f['write_s']:.2f} s"),
              row("read (page cache dropped)" if f["read_cold"] else "read (page cache not dropped)", f["read_gbps"])]
    if rec is None:
        lines.append("(add --state-gib, and --mtbf, for the save cost and interval these imply)")
        return "\n".join(lines)

    def line(label: str, seconds: float) -> str:
        return f"  {label:<40}{format_duration(seconds)}"

    lines += ["", f"for a {state_gib:g} GiB state ({fmt_bytes(rec['state_bytes'])}):",
              line("save cost: device-to-host copy" if rec["staging_floor"] == "d2h" else
                   "save cost: copy into staging memory", rec["save_cost_s"]),
              line("write until durable (lag)", rec["write_s"]),
              line("synchronous save would stall", rec["sync_save_cost_s"]),
              line("restore read, at least", rec["restore_read_s"])]
    if rec["interval"] is None:
        lines.append("(add --mtbf for the recommended save interval)")
    else:
        lines += ["", interval_rows([rec["interval"]])]
    return "\n".join(lines)
