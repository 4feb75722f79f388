"""The ``torch-ckpt`` command line (console script declared in ``pyproject.toml``).

Each subcommand is a ``_Command`` in the ``_COMMANDS`` table: a help line, a function adding its
arguments to its sub-parser, and a function ``_cmd_<name>(args) -> int`` running it. To add one
(``ls``, ``inspect``, ``verify``, ``convert``...), write those two functions and add a table row.

Exit codes: 0 success; 2 bad arguments (argparse's convention), with a message on stderr.
A subcommand reports a bad argument it can only detect late by raising :class:`UsageError`.

Examples::

    torch-ckpt plan --mtbf 8h --save-cost 2s
    torch-ckpt plan --params 70e9 --tp 8 --dp 32 --param-dtype bf16 --optimizer adam --mtbf 8h
    torch-ckpt simulate --mtbf 6h --save-cost 5m --restart-cost 10m --plot overhead.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch_ckpt.durations import DURATION_FORMS, format_duration
from torch_ckpt.errors import CheckpointError
from torch_ckpt.tools import cli_bench, cli_tools
from torch_ckpt.tools.cli_common import (
    UsageError,
    int_type,
    interval_rows,
    non_negative_duration,
    positive_duration,
    positive_float,
)
from torch_ckpt.tools.sizing import (
    DTYPE_BYTES,
    OPTIMIZER_MOMENTS,
    checkpoint_size,
    interval_plan,
    parse_count,
)

__all__ = ["main", "UsageError"]

_PROG = "torch-ckpt"
_MAX_FAILURES = 10_000_000  # bounds simulate's memory (8 bytes per failure, a few arrays)


@dataclass(frozen=True)
class _Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------
# argument types


def _count(text: str) -> float:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_positive_int = int_type(1)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> int:
    print(json.dumps(payload, indent=2) if args.json else text)
    return 0


# ---------------------------------------------------------------------------------------------
# plan


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    d = f"Durations accept {DURATION_FORMS}."
    g = p.add_argument_group("interval mode", f"Optimal save interval (Young 1974, Daly 2006). {d}")
    g.add_argument("--mtbf", type=positive_duration, action="append", metavar="DURATION",
                   help="mean time between failures of the whole job; repeat for a table of several")
    g.add_argument("--gpus", type=_positive_int, metavar="N",
                   help="GPUs of the job, with --gpu-mtbf (default with --params: tp x pp x dp)")
    g.add_argument("--gpu-mtbf", type=positive_duration, metavar="DURATION",
                   help="MTBF of one GPU; the job's MTBF is this divided by --gpus")
    g.add_argument("--save-cost", type=positive_duration, metavar="DURATION",
                   help="training stall per save (with --params: default is the computed blocking time)")
    g.add_argument("--durability-lag", type=non_negative_duration, metavar="DURATION",
                   help="time from the end of the stall until the save is durable (default 0; "
                        "with --params: the computed write time)")
    g.add_argument("--step-time", type=positive_duration, metavar="DURATION",
                   help="seconds per training step, to express the interval in steps")
    s = p.add_argument_group("sizing mode", "Checkpoint bytes and save times for a model (GB = 1e9 bytes).")
    s.add_argument("--params", type=_count, metavar="COUNT", help="number of parameters, e.g. 70e9 or 70B")
    s.add_argument("--tp", type=_positive_int, metavar="N", help="tensor-parallel degree (default 1)")
    s.add_argument("--pp", type=_positive_int, metavar="N", help="pipeline-parallel degree (default 1)")
    s.add_argument("--dp", type=_positive_int, metavar="N",
                   help="data-parallel degree; the optimizer is sharded over it (default 1)")
    s.add_argument("--param-dtype", choices=sorted(DTYPE_BYTES), help="dtype of the weights (default bf16)")
    s.add_argument("--optimizer", choices=sorted(OPTIMIZER_MOMENTS),
                   help="fp32 moments: adam/adamw 2, sgd (momentum) 1 (default adam)")
    s.add_argument("--gpus-per-node", type=_positive_int, metavar="N", help="ranks per node (default 8)")
    s.add_argument("--d2h-gbps", type=positive_float, metavar="GB/s",
                   help="device-to-host copy bandwidth per GPU in GB/s (default 25)")
    s.add_argument("--storage-gbps", type=positive_float, metavar="GB/s",
                   help="aggregate checkpoint-storage write bandwidth in GB/s (default 100)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


_SIZING_DEFAULTS = {"tp": 1, "pp": 1, "dp": 1, "param_dtype": "bf16", "optimizer": "adam",
                    "gpus_per_node": 8, "d2h_gbps": 25.0, "storage_gbps": 100.0}


def _job_mtbfs(args: argparse.Namespace, default_gpus: int | None) -> list[float]:
    if args.mtbf and (args.gpu_mtbf is not None or args.gpus is not None):
        raise UsageError("give either --mtbf or --gpus with --gpu-mtbf, not both")
    if args.mtbf:
        return list(args.mtbf)
    if args.gpu_mtbf is None:
        if args.gpus is not None:
            raise UsageError("--gpus needs --gpu-mtbf (the MTBF of one GPU)")
        return []
    gpus = args.gpus if args.gpus is not None else default_gpus
    if gpus is None:
        raise UsageError("--gpu-mtbf needs --gpus (or --params with --tp/--pp/--dp)")
    args.gpus = gpus
    return [args.gpu_mtbf / gpus]


def _cmd_plan(args: argparse.Namespace) -> int:
    """``torch-ckpt plan``: interval mode (``--mtbf``, ``--save-cost``) and sizing mode (``--params``)."""
    sizing_given = [k for k in _SIZING_DEFAULTS if getattr(args, k) is not None]
    if args.params is None:
        if sizing_given:
            raise UsageError(f"--{sizing_given[0].replace('_', '-')} only applies to sizing mode (--params)")
        mtbfs = _job_mtbfs(args, None)
        if not mtbfs or args.save_cost is None:
            raise UsageError("plan needs --mtbf (or --gpus with --gpu-mtbf) and --save-cost, "
                             "or --params for sizing mode")
        plans = [interval_plan(m, args.save_cost, durability_lag_s=args.durability_lag or 0.0,
                               step_time_s=args.step_time) for m in mtbfs]
        for pl in plans:
            if args.gpu_mtbf is not None:
                pl.update(gpus=args.gpus, gpu_mtbf_s=args.gpu_mtbf)
        payload = plans[0] if len(plans) == 1 else {"plans": plans}
        return _emit(args, payload, interval_rows(plans))
    opts = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in _SIZING_DEFAULTS.items()}
    size = checkpoint_size(args.params, **opts)
    mtbfs = _job_mtbfs(args, size["world_size"])
    if len(mtbfs) > 1:
        raise UsageError("give a single --mtbf with --params")
    cost = args.save_cost if args.save_cost is not None else size["blocking_s"]
    lag = args.durability_lag if args.durability_lag is not None else size["write_s"]
    plan = None
    if mtbfs:
        plan = interval_plan(mtbfs[0], cost, durability_lag_s=lag, step_time_s=args.step_time)
        if args.gpu_mtbf is not None:
            plan.update(gpus=args.gpus, gpu_mtbf_s=args.gpu_mtbf)
    return _emit(args, {**size, "interval": plan}, _sizing_text(size, plan))


def _sizing_text(z: dict[str, Any], plan: dict[str, Any] | None) -> str:
    mp, world = z["tp"] * z["pp"], z["world_size"]
    moments = OPTIMIZER_MOMENTS[z["optimizer"]]
    rows = [
        ("component", "total", "per rank", "split"),
        (f"model weights ({z['param_dtype']})", z["model_bytes"], z["model_bytes_per_rank"], f"tp x pp = {mp}"),
        ("optimizer fp32 master weights", z["optimizer_master_bytes"], z["optimizer_master_bytes"] / world,
         f"tp x pp x dp = {world}"),
        (f"optimizer moments ({moments} x fp32)", z["optimizer_moments_bytes"],
         z["optimizer_moments_bytes"] / world, f"tp x pp x dp = {world}"),
        ("optimizer total", z["optimizer_bytes"], z["optimizer_bytes_per_rank"], ""),
        ("checkpoint total (deduplicated)", z["total_bytes"], z["written_bytes_per_rank"], "written per rank"),
        ("staged per rank (its whole local state)", None, z["staged_bytes_per_rank"], ""),
    ]
    cells = [[r[0], r[1] if isinstance(r[1], str) else ("" if r[1] is None else _fmt_bytes(r[1])),
              r[2] if isinstance(r[2], str) else _fmt_bytes(r[2]), r[3]] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [
        f"{_fmt_count(z['params'])} parameters, {z['param_dtype']}, {z['optimizer']}; tp={z['tp']} pp={z['pp']} "
        f"dp={z['dp']} = {world} ranks on {z['nodes']} node(s) of {z['gpus_per_node']}",
        "",
        *("  ".join([c[0].ljust(widths[0]), c[1].rjust(widths[1]), c[2].rjust(widths[2]), c[3]]).rstrip()
          for c in cells),
        "",
        f"host RAM per node to stage {min(z['gpus_per_node'], world)} ranks: "
        f"{_fmt_bytes(z['host_ram_per_node_bytes'])}",
        f"blocking (device to host at {z['d2h_gbps']:g} GB/s per GPU): {format_duration(z['blocking_s'])}",
        f"write ({_fmt_bytes(z['total_bytes'])} at {z['storage_gbps']:g} GB/s): {format_duration(z['write_s'])}",
    ]
    if plan is None:
        lines.append("(add --mtbf, or --gpu-mtbf with --gpus, for the save interval)")
    else:
        lines += ["", interval_rows([plan])]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# simulate


def _add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mtbf", type=positive_duration, required=True, metavar="DURATION",
                   help=f"mean time between failures of the job (durations: {DURATION_FORMS})")
    p.add_argument("--save-cost", type=positive_duration, required=True, metavar="DURATION",
                   help="training stall per save")
    p.add_argument("--durability-lag", type=non_negative_duration, default=0.0, metavar="DURATION",
                   help="time from the end of the stall until the save is durable (default 0)")
    p.add_argument("--restart-cost", type=non_negative_duration, default=0.0, metavar="DURATION",
                   help="time to restart after a failure (default 0)")
    p.add_argument("--min-interval", type=positive_duration, metavar="DURATION",
                   help="smallest interval simulated (default Daly / 4)")
    p.add_argument("--max-interval", type=positive_duration, metavar="DURATION",
                   help="largest interval simulated (default Daly x 4)")
    p.add_argument("--points", type=int_type(2), default=81, help="intervals simulated, log-spaced (default 81)")
    p.add_argument("--failures", type=_positive_int, default=200_000,
                   help="failures simulated, the same failure times for every interval "
                        "(default 200000; runtime grows linearly)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--plot", metavar="FILE.png", help="draw overhead versus interval (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _cmd_simulate(args: argparse.Namespace) -> int:
    """``torch-ckpt simulate``: Monte Carlo overhead versus interval, next to Young and Daly."""
    from torch_ckpt.tools.simulate import plot_sweep, sweep  # numpy only when simulating

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed: pip install matplotlib")
    if args.failures > _MAX_FAILURES:
        raise UsageError(f"--failures must be at most {_MAX_FAILURES}, got {args.failures}")
    try:
        result = sweep(mtbf_s=args.mtbf, cost_s=args.save_cost, durability_lag_s=args.durability_lag,
                       restart_s=args.restart_cost, min_interval_s=args.min_interval,
                       max_interval_s=args.max_interval, points=args.points, failures=args.failures,
                       seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.plot:
        plot_sweep(result, args.plot)
    header = (f"MTBF {format_duration(args.mtbf)}, save cost {format_duration(args.save_cost)}, durability lag "
              f"{format_duration(args.durability_lag)}, restart {format_duration(args.restart_cost)}; "
              f"{args.failures} failures, seed {args.seed}\n")
    footer = f"\nplot written to {args.plot}" if args.plot else ""
    return _emit(args, {**result.to_dict(), "plot": args.plot}, header + result.table() + footer)


# ---------------------------------------------------------------------------------------------
# entry point

_COMMANDS: dict[str, _Command] = {
    "plan": _Command("save interval from MTBF and save cost; checkpoint sizes and times for a model",
                     _add_plan_arguments, _cmd_plan),
    "simulate": _Command("Monte Carlo overhead versus save interval, with Young and Daly marked",
                         _add_simulate_arguments, _cmd_simulate),
    "ls": _Command("list the checkpoints of a run root: step, time, size, tiers, status",
                   cli_tools.add_ls_arguments, cli_tools.run_ls),
    "inspect": _Command("what a checkpoint holds per component: bytes, tensors, dtypes (--keys: every key)",
                        cli_tools.add_inspect_arguments, cli_tools.run_inspect),
    "verify": _Command("check a checkpoint (or every checkpoint of a root): checksums and structure",
                       cli_tools.add_verify_arguments, cli_tools.run_verify),
    "convert": _Command("export a checkpoint to one torch.save file or the model weights to safetensors",
                        cli_tools.add_convert_arguments, cli_tools.run_convert),
    "bench": _Command("measure this machine's copy, write and read floors; the save cost and interval they imply",
                      cli_bench.add_bench_arguments, cli_bench.run_bench),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of ``_COMMANDS``."""
    parser = argparse.ArgumentParser(prog=_PROG, description="torch-ckpt: checkpoint planning and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in _COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 on bad arguments (message on stderr).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # e.g. `torch-ckpt ls ROOT | head`: the reader left, nothing is wrong
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0
    except UsageError as exc:
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a checkpoint problem: one clear line, exit 1
        if not isinstance(exc, (CheckpointError, OSError)):
            raise
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # run through the package so exception classes are the importable ones
    from torch_ckpt.tools.cli import main as _main

    sys.exit(_main())
