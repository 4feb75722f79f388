"""The ``torch-ckpt`` command line (console script declared in ``pyproject.toml``).

Each subcommand is a row of ``_COMMANDS``: a function adding its arguments and a function
``_cmd_<name>(args) -> int`` whose docstring is the command's help line. ``plan`` and ``simulate``
start without importing torch; the commands on checkpoints import it when they run.

Exit codes: 0 success; 2 bad arguments (argparse's convention, also a path or URL that does not
exist, or a :class:`UsageError` or :class:`~torch_ckpt.errors.ConfigError` raised late), message
on stderr; 1 a checkpoint problem (``verify`` found one, ``ls`` lists a corrupt checkpoint, a
checkpoint cannot be read).

Examples::

    torch-ckpt plan --mtbf 8h --save-cost 2s
    torch-ckpt plan --params 70e9 --tp 8 --dp 32 --param-dtype bf16 --optimizer adam --mtbf 8h
    torch-ckpt simulate --mtbf 6h --save-cost 5m --restart-cost 10m --plot overhead.png
    torch-ckpt ls ckpts/ && torch-ckpt verify ckpts/
    torch-ckpt import torchtitan_out/step-100 ckpts/ --step 100
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch_ckpt._values import to_seconds
from torch_ckpt.durations import DURATION_FORMS, format_duration
from torch_ckpt.errors import CheckpointCorruptError, CheckpointError, ConfigError
from torch_ckpt.policy._naming import MAX_STEP
from torch_ckpt.storage._locations import Location, PathNotFoundError, is_url, outage
from torch_ckpt.tools.sizing import DTYPE_BYTES, OPTIMIZER_MOMENTS, checkpoint_size, interval_plan, parse_count

__all__ = ["main", "UsageError", "build_parser"]

_PROG = "torch-ckpt"
_MAX_FAILURES = 10_000_000  # bounds simulate's memory (8 bytes per failure, a few arrays)


class UsageError(ValueError):
    """A bad combination of arguments; ``main`` prints it and returns exit code 2."""


def _arg_type(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: ``parse`` raising ValueError (ConfigError included) becomes argparse's error."""
    def run(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    run.__name__ = name  # argparse names the type in its messages
    return run


def _number(cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise ValueError(f"expected {expected}, got {text!r}")
        return value
    return _arg_type("integer" if cast is int else "number", parse)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    return _number(int, lambda v: v >= minimum, f"an integer >= {minimum}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object, e.g. '{\"anon\": true}'")
    return value


positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number")
# keyword arguments of add_argument shared by many options
_DURATION: dict[str, Any] = {"metavar": "DURATION",
                             "type": _arg_type("duration", lambda t: to_seconds("duration", t, positive=True))}
_LAG: dict[str, Any] = {"metavar": "DURATION",
                        "type": _arg_type("duration", lambda t: to_seconds("duration", t, positive=False))}
_N: dict[str, Any] = {"metavar": "N", "type": _int_at_least(1)}
_STEP: dict[str, Any] = {"metavar": "N", "type": _number(int, lambda v: 0 <= v <= MAX_STEP,
                                                           "an integer from 0 to 2**63 - 1")}


def fmt_bytes(n: float | None) -> str:
    """``1.2 GB`` for 1.2e9 bytes (decimal units); "-" for None."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: float) -> str:
    suffix, scale = next(((u, s) for u, s in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= s), ("", 1))
    return f"{n / scale:.4g}{suffix}"


def _fmt_time(seconds: float) -> str:
    return f"{format_duration(seconds)} ({seconds:.1f} s)" if seconds >= 60 else format_duration(seconds)


def _fmt_local_time(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[list[str]], right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str | Callable[[dict[str, Any]], str],
          code: int = 0) -> int:
    print(json.dumps(payload, indent=2) if args.json else text if isinstance(text, str) else text(payload))
    return code


def interval_rows(plans: list[dict[str, Any]]) -> str:
    """The table of interval plans printed by ``plan`` and ``bench``."""
    steps = "step_time_s" in plans[0]
    rows = [["MTBF", "save cost", "lag", "Young", "Daly", "recommended", "lost work/failure", "overhead"]
            + (["steps"] if steps else [])]
    for pl in plans:
        rows.append([format_duration(pl["mtbf_s"]), format_duration(pl["save_cost_s"]),
                     format_duration(pl["durability_lag_s"]), _fmt_time(pl["young_interval_s"]),
                     _fmt_time(pl["daly_interval_s"]),
                     _fmt_time(pl["recommended_interval_s"]) + (" *" if pl["limited_by"] == "durability" else ""),
                     format_duration(pl["expected_lost_work_s"]), f"{100 * pl['expected_overhead']:.2f} %"]
                    + ([str(pl["interval_steps"])] if steps else []))
    lines = [*_table(rows), "recommended = Daly's interval" + (" in whole steps" if steps else "")
             + "; overhead = C/T + (T/2 + lag)/MTBF at it; lost work/failure = T/2 + lag."]
    if any(pl["limited_by"] == "durability" for pl in plans):
        lines.append("* raised to the time a save needs to become durable (save cost + lag), so saves do not pile up.")
    return "\n".join(lines)


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("interval mode", f"Optimal save interval (Young 1974, Daly 2006). Durations: "
                                              f"{DURATION_FORMS}.")
    g.add_argument("--mtbf", action="append", **_DURATION,
                   help="mean time between failures of the job; repeat for a table")
    g.add_argument("--gpus", **_N, help="GPUs of the job, with --gpu-mtbf (default with --params: tp x pp x dp)")
    g.add_argument("--gpu-mtbf", **_DURATION, help="MTBF of one GPU; the job's MTBF is this divided by --gpus")
    g.add_argument("--save-cost", **_DURATION,
                   help="training stall per save (default with --params: the blocking time)")
    g.add_argument("--durability-lag", **_LAG,
                   help="from the end of the stall until the save is durable (default 0; with --params: write time)")
    g.add_argument("--step-time", **_DURATION, help="seconds per training step, to express the interval in steps")
    s = p.add_argument_group("sizing mode", "Checkpoint bytes and save times for a model (GB = 1e9 bytes).")
    s.add_argument("--params", type=_arg_type("count", parse_count), metavar="COUNT",
                   help="number of parameters, e.g. 70e9 or 70B")
    s.add_argument("--tp", **_N, help="tensor-parallel degree (default 1)")
    s.add_argument("--pp", **_N, help="pipeline-parallel degree (default 1)")
    s.add_argument("--dp", **_N, help="data-parallel degree; the optimizer is sharded over it (default 1)")
    s.add_argument("--param-dtype", choices=sorted(DTYPE_BYTES), help="dtype of the weights (default bf16)")
    s.add_argument("--optimizer", choices=sorted(OPTIMIZER_MOMENTS),
                   help="fp32 moments: adam/adamw 2, sgd (momentum) 1 (default adam)")
    s.add_argument("--gpus-per-node", **_N, help="ranks per node (default 8)")
    s.add_argument("--d2h-gbps", type=positive_float, metavar="GB/s", help="device-to-host GB/s per GPU (default 25)")
    s.add_argument("--storage-gbps", type=positive_float, metavar="GB/s",
                   help="aggregate checkpoint-storage write GB/s (default 100)")


_SIZING_DEFAULTS: dict[str, Any] = {"tp": 1, "pp": 1, "dp": 1, "param_dtype": "bf16", "optimizer": "adam",
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
    args.gpus = args.gpus if args.gpus is not None else default_gpus
    if args.gpus is None:
        raise UsageError("--gpu-mtbf needs --gpus (or --params with --tp/--pp/--dp)")
    return [args.gpu_mtbf / args.gpus]


def _plan(args: argparse.Namespace, mtbf: float, cost: float, lag: float) -> dict[str, Any]:
    plan = interval_plan(mtbf, cost, durability_lag_s=lag, step_time_s=args.step_time)
    if args.gpu_mtbf is not None:
        plan.update(gpus=args.gpus, gpu_mtbf_s=args.gpu_mtbf)
    return plan


def _cmd_plan(args: argparse.Namespace) -> int:
    """save interval from MTBF and save cost; checkpoint sizes and times for a model"""
    sizing_given = [k for k in _SIZING_DEFAULTS if getattr(args, k) is not None]
    if args.params is None:
        if sizing_given:
            raise UsageError(f"--{sizing_given[0].replace('_', '-')} only applies to sizing mode (--params)")
        mtbfs = _job_mtbfs(args, None)
        if not mtbfs or args.save_cost is None:
            raise UsageError("plan needs --mtbf (or --gpus with --gpu-mtbf) and --save-cost, "
                             "or --params for sizing mode")
        plans = [_plan(args, m, args.save_cost, args.durability_lag or 0.0) for m in mtbfs]
        return _emit(args, plans[0] if len(plans) == 1 else {"plans": plans}, interval_rows(plans))
    size = checkpoint_size(args.params, **{k: v if getattr(args, k) is None else getattr(args, k)
                                           for k, v in _SIZING_DEFAULTS.items()})
    mtbfs = _job_mtbfs(args, size["world_size"])
    if len(mtbfs) > 1:
        raise UsageError("give a single --mtbf with --params")
    cost = args.save_cost if args.save_cost is not None else size["blocking_s"]
    lag = args.durability_lag if args.durability_lag is not None else size["write_s"]
    plan = _plan(args, mtbfs[0], cost, lag) if mtbfs else None
    return _emit(args, {**size, "interval": plan}, _sizing_text(size, plan))


def _sizing_text(z: dict[str, Any], plan: dict[str, Any] | None) -> str:
    mp, world = z["tp"] * z["pp"], z["world_size"]
    rows = [
        ("component", "total", "per rank", "split"),
        (f"model weights ({z['param_dtype']})", z["model_bytes"], z["model_bytes_per_rank"], f"tp x pp = {mp}"),
        ("optimizer fp32 master weights", z["optimizer_master_bytes"], z["optimizer_master_bytes"] / world,
         f"tp x pp x dp = {world}"),
        (f"optimizer moments ({OPTIMIZER_MOMENTS[z['optimizer']]} x fp32)", z["optimizer_moments_bytes"],
         z["optimizer_moments_bytes"] / world, f"tp x pp x dp = {world}"),
        ("optimizer total", z["optimizer_bytes"], z["optimizer_bytes_per_rank"], ""),
        ("checkpoint total (deduplicated)", z["total_bytes"], z["written_bytes_per_rank"], "written per rank"),
        ("staged per rank (its whole local state)", None, z["staged_bytes_per_rank"], ""),
    ]
    cells = [[r[0], r[1] if isinstance(r[1], str) else ("" if r[1] is None else fmt_bytes(r[1])),
              r[2] if isinstance(r[2], str) else fmt_bytes(r[2]), r[3]] for r in rows]
    lines = [
        f"{_fmt_count(z['params'])} parameters, {z['param_dtype']}, {z['optimizer']}; tp={z['tp']} pp={z['pp']} "
        f"dp={z['dp']} = {world} ranks on {z['nodes']} node(s) of {z['gpus_per_node']}", "",
        *_table(cells, right=(1, 2)), "",
        f"host RAM per node to stage {min(z['gpus_per_node'], world)} ranks: {fmt_bytes(z['host_ram_per_node_bytes'])}",
        f"blocking (device to host at {z['d2h_gbps']:g} GB/s per GPU): {format_duration(z['blocking_s'])}",
        f"write ({fmt_bytes(z['total_bytes'])} at {z['storage_gbps']:g} GB/s): {format_duration(z['write_s'])}",
    ]
    lines += ["(add --mtbf, or --gpu-mtbf with --gpus, for the save interval)"] if plan is None else \
        ["", interval_rows([plan])]
    return "\n".join(lines)


def _add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mtbf", required=True, **_DURATION,
                   help=f"mean time between failures of the job ({DURATION_FORMS})")
    p.add_argument("--save-cost", required=True, **_DURATION, help="training stall per save")
    p.add_argument("--durability-lag", default=0.0, **_LAG, help="from the end of the stall until durable (default 0)")
    p.add_argument("--restart-cost", default=0.0, **_LAG, help="time to restart after a failure (default 0)")
    p.add_argument("--min-interval", **_DURATION, help="smallest interval simulated (default Daly / 4)")
    p.add_argument("--max-interval", **_DURATION, help="largest interval simulated (default Daly x 4)")
    p.add_argument("--points", type=_int_at_least(2), default=81, help="intervals simulated, log-spaced (default 81)")
    p.add_argument("--failures", type=_int_at_least(1), default=200_000,
                   help="failures simulated, the same for every interval (default 200000; time grows linearly)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--plot", metavar="FILE.png", help="draw overhead versus interval (needs matplotlib)")


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Monte Carlo overhead versus save interval, with Young and Daly marked"""
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


def _add_common(p: argparse.ArgumentParser, *, remote: bool = True) -> None:
    """The options of the commands on checkpoints (``remote``: those that also read URLs)."""
    if remote:
        p.add_argument("--storage-options", type=_arg_type("storage options", _json_object), metavar="JSON",
                       help="fsspec options for URLs as a JSON object (credentials, endpoint...), e.g. "
                            "'{\"client_kwargs\": {\"endpoint_url\": \"http://127.0.0.1:9000\"}}'")
        p.add_argument("--follow-symlinks", action="store_true", help="follow symbolic links inside checkpoints "
                       "(local paths); by default a symlinked file is refused, as a restore refuses it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars (they only show on a terminal)")


def _open(text: str, args: argparse.Namespace) -> Location:
    """A :class:`Location` for a path or URL; a bad one is a usage error (exit 2)."""
    if args.storage_options and not is_url(text) and not getattr(args, "check_tiers", False):
        raise UsageError("--storage-options only applies to URLs (s3://, gs://, memory://...)")
    try:
        return Location(text, storage_options=args.storage_options, allow_symlinks=args.follow_symlinks)
    except ConfigError as exc:
        raise UsageError(f"cannot open {text!r}: {exc.__cause__ or exc}") from None


def _add_ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", metavar="ROOT", help="a run root: local directory or fsspec URL (s3://bucket/run)")
    p.add_argument("--verify", action="store_true",
                   help="also check every file's CRC-32 and the structure (reads every byte); without it a "
                        "checkpoint is corrupt when its manifest is unreadable or files are missing or truncated")
    p.add_argument("--check-tiers", action="store_true",
                   help="confirm the durable copies recorded in the manifests by listing those tiers "
                        "(--storage-options applies to them)")
    _add_common(p)


def _cmd_ls(args: argparse.Namespace) -> int:
    """list the checkpoints of a run root: step, time, size, tiers, status"""
    from torch_ckpt.tools.listing import CORRUPT, list_root  # torch: imported when the command runs

    result = list_root(_open(args.root, args), verify=args.verify, check_tiers=args.check_tiers,
                       progress=not args.quiet)
    return _emit(args, result, _ls_text, 1 if result["counts"][CORRUPT] else 0)


def _ls_text(result: dict[str, Any]) -> str:
    steps = result["steps"]
    if not steps:
        return f"{result['root']}: no checkpoints (a checkpoint is a directory holding a torch-ckpt manifest.json)"
    rows = [["STEP", "NAME", "TIME", "AGE", "SIZE", "WRITTEN", "TIERS", "STATUS"]]
    notes: list[str] = []
    held: dict[int, list[str]] = {}
    for r in steps:
        step = "-" if r["step"] is None else str(r["step"])
        age = "-" if r["age_s"] is None else \
            f"{format_duration(r['age_s'])} ago" if r["age_s"] >= 0 else "in the future"
        written = "-" if r.get("written_bytes") is None else fmt_bytes(r["written_bytes"])
        rows.append([step, r["name"] + (f" -> {r['link_to']}" if r["link_to"] else ""), _fmt_local_time(r["wall_time"]),
                     age, fmt_bytes(r["bytes"]), written, ",".join(r["tiers"]) or "-",
                     r["status"] + (", superseded" if r["superseded"] else "")])
        if r["alias_of"] is not None:
            continue  # its target's row carries the notes
        if r["step"] is not None and r["status"] in ("committed", "corrupt") and not r["superseded"]:
            held.setdefault(r["step"], []).append(r["name"])
        notes += [f"  step {step}: {r['name']}: {r['reason']}"] if r["reason"] else []
        notes += [f"  step {step}: {prob['path']}: {prob['problem']}" for prob in r["problems"]]
        if r.get("stale_tiers"):
            notes.append(f"  step {step}: recorded in {', '.join(r['stale_tiers'])} but no longer there")
    notes += [f"  step {s}: held by {len(names)} checkpoints: {', '.join(names)}"
              for s, names in held.items() if len(names) > 1]
    c = result["counts"]
    head = f"{result['root']}: {c['committed']} committed, {c['partial']} partial, {c['corrupt']} corrupt" + \
        (f", {c['plain-dcp']} plain DCP" if c["plain-dcp"] else "") + \
        (f", {result['superseded']} superseded" if result["superseded"] else "") + \
        (" (checksums verified)" if result["verified"] else "") + \
        f"; {fmt_bytes(result['disk_bytes'])} stored" + \
        (" (each object once)" if is_url(result["root"]) else " (hard-linked files counted once)")
    foot = "SIZE: the files the manifest lists (as verify and inspect count them); for a partial entry, what is present"
    foot += ("\nWRITTEN: of SIZE, what its upload stored under its own prefix; the rest it references in an earlier "
             "step's objects (incremental)" if is_url(result["root"]) else "\nWRITTEN: of SIZE, what its save wrote; "
             "the rest it hard-linked from an earlier checkpoint (incremental)")
    if result["superseded"]:
        foot += ("\nsuperseded: a step of a timeline abandoned by a rollback (restore of an older step, then a save); "
                 "kept, never resumed")
    return "\n".join([head, *_table(rows, right=(0, 4, 5)), *notes, foot])


def _add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint directory (ROOT/step_000001000), or a run root for its newest committed "
                        "checkpoint; local path or fsspec URL")
    p.add_argument("--step", **_STEP, help="with a run root: inspect this step")
    p.add_argument("--keys", action="store_true", help="also list every tensor and array with shape and dtype")
    _add_common(p)


def _cmd_inspect(args: argparse.Namespace) -> int:
    """what a checkpoint holds per component: bytes, tensors, dtypes (--keys: every key)"""
    from torch_ckpt.tools.listing import inspect_checkpoint

    result = inspect_checkpoint(_open(args.checkpoint, args), step=args.step, keys=args.keys, progress=not args.quiet)
    return _emit(args, result, _inspect_text)


def _inspect_text(r: dict[str, Any]) -> str:
    lines = [f"note: {r['note']}"] if r["note"] else []
    lines += [f"step {r['step']}  {r['checkpoint']}",
              f"world size {r['world_size']}, saved {_fmt_local_time(r['wall_time'])} with torch {r['torch_version']}; "
              f"{r['files']} files, {fmt_bytes(r['file_bytes'])} (the files the manifest lists)" +
              (f"; {fmt_bytes(r['written_bytes'])} written by its save, {fmt_bytes(r['linked_bytes'])} " +
               ("referenced in an earlier step's objects" if is_url(r["checkpoint"]) else
                "hard-linked from an earlier checkpoint") + " (incremental)" if r.get("linked_bytes") else ""), ""]
    rows = [["COMPONENT", "BYTES", "TENSORS", "DTYPES", "OTHER"]]
    for c in [*r["components"], {"name": "total", **r["totals"], "dtypes": {}}]:
        other = [f"{c['arrays']} numpy array{'s' * (c['arrays'] > 1)} ({fmt_bytes(c['array_bytes'])})"] * bool(
            c["arrays"]) + [f"{c['values']} value{'s' * (c['values'] > 1)}"] * bool(c["values"])
        tensors = str(c["tensors"]) + (f" ({c['rank_local_tensors']} per rank)" if c["rank_local_tensors"] else "")
        dtypes = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in c["dtypes"].items()) or "-"
        rows.append([c["name"], fmt_bytes(c["bytes"]), tensors, dtypes, ", ".join(other)])
    lines += _table(rows, right=(1,))
    lines.append("bytes: tensor and array payload (sharded tensors at full size, per-rank tensors on every rank); "
                 "values: other entries of rank 0's state")
    if "keys" in r:
        krows = [["KEY", "SHAPE", "DTYPE", "BYTES", "STORED"]]
        for k in r["keys"]:
            where = f"dcp ({k['chunks']} chunk{'s' * (k['chunks'] > 1)})" if k["storage"] == "dcp" else \
                f"rank {k['rank']} json" + (" (numpy)" if k["kind"] == "ndarray" else "")
            krows.append([k["key"], "x".join(map(str, k["shape"])) or "scalar", k["dtype"], fmt_bytes(k["bytes"]),
                          where])
        lines += ["", *_table(krows, right=(3,))]
    return "\n".join(lines)


def _add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="CKPT|ROOT",
                   help="a checkpoint directory, or a run root to verify all its checkpoints; local path or URL")
    p.add_argument("--no-checksums", action="store_true",
                   help="check sizes and structure only, not every file's CRC-32 (does not read the tensor data)")
    _add_common(p)


def _cmd_verify(args: argparse.Namespace) -> int:
    """check a checkpoint (or every checkpoint of a root): checksums and structure"""
    from torch_ckpt.tools.listing import verify_path

    result = verify_path(_open(args.target, args), checksums=not args.no_checksums, progress=not args.quiet)
    return _emit(args, result, _verify_text, 0 if result["ok"] else 1)


def _verify_text(r: dict[str, Any]) -> str:
    lines = []
    for c in r["checkpoints"]:
        detail = f"{c['files']} files, {fmt_bytes(c['bytes'])}, {'?' if c['tensors'] is None else c['tensors']} " \
                 f"tensors; {'CRC-32' if c['checksums'] else 'sizes'}, structure"
        step = "-" if c["step"] is None else c["step"]
        lines.append(f"{'OK  ' if c['ok'] else 'FAIL'}  step {step}  {c['checkpoint']}  ({detail})")
        lines += [f"      partial: {c['partial']}"] if c.get("partial") else []
        lines += [f"      {p['path']}: {p['problem']}" for p in c["problems"]]
        lines += [f"      warning: {w['path']}: {w['problem']}" for w in c["warnings"]]
    lines += [f"skip  {s['name']}: " + (s["reason"] if s["link_to"] or s["plain_dcp"] else f"partial ({s['reason']})")
              for s in r["skipped"]]
    lines += [f"FAIL  {g}" for g in r["general_problems"]]
    bad = sum(not c["ok"] for c in r["checkpoints"])
    lines.append(f"verified {len(r['checkpoints'])} checkpoint(s): " +
                 ("all OK" if r["ok"] else f"{r['problems']} problem(s) in {bad} checkpoint(s)" if bad else
                  f"{r['problems']} problem(s)"))
    return "\n".join(lines)


def _add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT|ROOT",
                   help="a committed checkpoint directory (ckpts/step_000001000) or a run root (its newest committed "
                        "step, or --step); local path or fsspec URL (downloaded and verified first)")
    p.add_argument("--to", required=True, choices=("torch", "safetensors"),
                   help="torch: one torch.save file of the full state (torch.load(OUT, weights_only=True) gives the "
                        "saved state's top-level keys, e.g. model, optimizer, scheduler, step, rng, with full CPU "
                        "tensors; per_rank too when several ranks wrote it); safetensors: the model weights only, "
                        "keyed as model.state_dict()")
    p.add_argument("out", metavar="OUT", help="output file (.pt or .safetensors)")
    p.add_argument("--step", **_STEP, help="with a run root: convert this step")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (else it is refused)")
    p.add_argument("--model", metavar="NAME",
                   help="safetensors of a checkpoint of several models: export only this one, under its own keys "
                        "(without it, each key is prefixed by its model's name and a dot)")
    _add_common(p)


@contextmanager
def _local_copy(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """``(local directory, what was chosen)`` of the checkpoint: itself (a root: its chosen step), or a
    verified download of a URL (the chosen step's URL)."""
    from torch_ckpt.tiers._durable import DurableTier
    from torch_ckpt.tools.listing import find_checkpoint, step_of

    if not is_url(args.checkpoint):
        path = find_checkpoint(_open(args.checkpoint, args), step=args.step)[0].path
        yield path, str(path)
        return
    url = args.checkpoint.rstrip("/")
    parent, _, name = url.rpartition("/")
    step, temporary = step_of(name)
    if temporary or (step is not None and "://" not in parent):
        raise UsageError(f"{url} is not a checkpoint URL (expected ROOT_URL or ROOT_URL/step_NNNNNNNNN)")
    if step is not None and args.step is not None:
        raise UsageError(f"{url} is a checkpoint; --step applies to a run root only")
    tmp = tempfile.mkdtemp(prefix="torch-ckpt-convert-")
    try:
        try:
            tier = DurableTier(parent if step is not None else url, storage_options=args.storage_options)
            if step is None:
                steps = tier.list_steps()
                step = args.step if args.step is not None else max(steps, default=None)
                if step is None or step not in steps:
                    raise UsageError(f"{url} holds no committed checkpoint" +
                                     (f" of step {args.step}" if args.step is not None else "") +
                                     (f"; its committed steps: {', '.join(map(str, steps))}" if steps else ""))
            elif not Location.on(tier.fs, f"{tier.root}/{name}", url).exists():
                raise UsageError(f"{url} does not exist")
            local = str(tier.download(step, Path(tmp))), tier.describe(step)
        except ConfigError as exc:
            raise UsageError(f"cannot open {url!r}: {exc.__cause__ or exc}") from None
        except (CheckpointError, OSError, ValueError):  # ValueError includes UsageError
            raise
        except Exception as exc:  # noqa: BLE001 - backend errors (botocore, aiohttp...) mean unreachable
            raise outage(f"cannot read {url}", exc) from exc
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cmd_convert(args: argparse.Namespace) -> int:
    """export a checkpoint (or a root's newest) to one torch.save file or the model weights to safetensors"""
    from torch_ckpt.tools.convert import export_safetensors, export_torch

    if args.model is not None and args.to != "safetensors":
        raise UsageError("--model applies to --to safetensors only (--to torch exports the full state)")
    try:
        with _local_copy(args) as (path, chosen):
            result = export_torch(path, args.out, allow_symlinks=args.follow_symlinks, overwrite=args.overwrite) \
                if args.to == "torch" else export_safetensors(path, args.out, model=args.model,
                                                              overwrite=args.overwrite,
                                                              allow_symlinks=args.follow_symlinks)
    except CheckpointCorruptError as exc:  # a root's newest step: say how to take an older one (restore would)
        root = Path(os.path.expanduser(args.checkpoint))
        if args.step is not None or is_url(args.checkpoint) or (root / "manifest.json").exists():
            raise
        from torch_ckpt.root._layout import scan_committed

        steps = sorted(scan_committed(root))
        raise CheckpointCorruptError(f"{exc}; that is the newest step of {root}: export an older committed one "
                                     f"with --step N (committed: {', '.join(map(str, steps[:-1][-10:]))})"
                                     if len(steps) > 1 else str(exc)) from exc
    result["checkpoint"] = chosen  # the checkpoint exported (a root's chosen step), as inspect names it
    extra = f", {result['tensors']} tensors" if "tensors" in result else ""
    if result.get("models"):
        extra += f"; keys prefixed by model name: {', '.join(result['models'])}"
    return _emit(args, result, f"step {result['step']} -> {result['out']} ({result['bytes']} bytes{extra})")


def _add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="a folder written by plain dcp.save (or torchtitan): .metadata and "
                                              "*.distcp files, no manifest.json")
    p.add_argument("root", metavar="ROOT", help="the run root to add it to, as ROOT/step_NNNNNNNNN")
    p.add_argument("--step", required=True, **_STEP, help="the step it becomes")
    p.add_argument("--link", action="store_true", help="hard-link the data files instead of copying (one file system)")


def _cmd_import(args: argparse.Namespace) -> int:
    """adopt a folder written by plain dcp.save (or torchtitan) as a committed step of a run root"""
    from torch_ckpt.tools.convert import import_dcp

    src, root = (os.path.expanduser(a) for a in (args.src, args.root))
    if not os.path.isdir(src):
        raise UsageError(f"{src} is not a directory")
    r = import_dcp(src, root, args.step, link=args.link)
    return _emit(args, r, f"{src} -> {r['checkpoint']} (step {r['step']}: {r['tensors']} tensors, {r['values']} "
                          f"values, {fmt_bytes(r['bytes'])} {'linked' if r['linked'] else 'copied'})")


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", nargs="?", default=".",
                   help="where checkpoints would be written; a temporary file is written, read and removed "
                        "(default: the current directory)")
    p.add_argument("--size-mib", type=positive_float, default=256.0, metavar="MIB",
                   help="bytes per measurement in MiB (default 256; each disk phase also stops after ~4 s)")
    p.add_argument("--state-gib", type=positive_float, metavar="GIB",
                   help="checkpoint size in GiB, for the save cost and write time it implies")
    p.add_argument("--mtbf", **_DURATION,
                   help="mean time between failures of the job (e.g. 8h), for the recommended interval")
    p.add_argument("--step-time", **_DURATION, help="seconds per training step, to express the interval in steps")
    _add_common(p, remote=False)


def _cmd_bench(args: argparse.Namespace) -> int:
    """measure this machine's copy, write and read floors; the save cost and interval they imply"""
    from torch_ckpt.tools.sizing import measure_floors, recommend

    if (args.mtbf is not None or args.step_time is not None) and args.state_gib is None:
        raise UsageError("--mtbf and --step-time need --state-gib (the checkpoint size)")
    if args.step_time is not None and args.mtbf is None:
        raise UsageError("--step-time needs --mtbf")
    directory = os.path.expanduser(args.directory)
    if not os.path.isdir(directory):
        raise UsageError(f"{directory} " + ("is not a directory" if os.path.exists(directory) else "does not exist"))
    if not args.quiet and not args.json and sys.stderr.isatty():
        print(f"measuring in {os.path.abspath(directory)} ({args.size_mib:g} MiB per phase)...", file=sys.stderr)
    floors = measure_floors(directory, size_bytes=max(1, int(args.size_mib * (1 << 20))))
    rec = None if args.state_gib is None else \
        recommend(floors, args.state_gib * (1 << 30), mtbf_s=args.mtbf, step_time_s=args.step_time)
    return _emit(args, {**floors, "recommendation": rec}, _bench_text(floors, rec, args.state_gib))
def _bench_text(f: dict[str, Any], rec: dict[str, Any] | None, state_gib: float | None) -> str:
    def row(label: str, gbps: float, note: str = "") -> str:
        return f"  {label:<32}{gbps:8.2f} GB/s" + (f"  ({note})" if note else "")

    lines = [f"floors measured in {f['directory']} ({f['size_bytes'] / 2**20:g} MiB per phase, "
             f"{f['elapsed_s']:.1f} s):", row("copy into preallocated memory", f["copy_gbps"])]
    if f["d2h_gbps"]:
        lines.append(row("device to pinned host memory", f["d2h_gbps"], f["d2h_device"]))
    lines += [row("write + fsync", f["write_gbps"], f"{fmt_bytes(f['write_bytes'])} in {f['write_s']:.2f} s"),
              row("read (page cache dropped)" if f["read_cold"] else "read (page cache not dropped)", f["read_gbps"])]
    if rec is None:
        return "\n".join([*lines, "(add --state-gib, and --mtbf, for the save cost and interval these imply)"])
    lines += ["", f"for a {state_gib:g} GiB state ({fmt_bytes(rec['state_bytes'])}):"] + [
        f"  {label:<40}{format_duration(seconds)}" for label, seconds in (
            ("save cost: device-to-host copy" if rec["staging_floor"] == "d2h" else
             "save cost: copy into staging memory", rec["save_cost_s"]),
            ("write until durable (lag)", rec["write_s"]), ("synchronous save would stall", rec["sync_save_cost_s"]),
            ("restore read, at least", rec["restore_read_s"]))]
    lines += ["(add --mtbf for the recommended save interval)"] if rec["interval"] is None else \
        ["", interval_rows([rec["interval"]])]
    return "\n".join(lines)


_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "plan": (_add_plan_arguments, _cmd_plan), "simulate": (_add_simulate_arguments, _cmd_simulate),
    "ls": (_add_ls_arguments, _cmd_ls), "inspect": (_add_inspect_arguments, _cmd_inspect),
    "verify": (_add_verify_arguments, _cmd_verify), "convert": (_add_convert_arguments, _cmd_convert),
    "import": (_add_import_arguments, _cmd_import), "bench": (_add_bench_arguments, _cmd_bench),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of ``_COMMANDS`` (each also takes ``--json``)."""
    parser = argparse.ArgumentParser(prog=_PROG, description="torch-ckpt: checkpoint planning and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add_arguments, run) in _COMMANDS.items():
        p = sub.add_parser(name, help=run.__doc__, description=run.__doc__)
        add_arguments(p)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (without the program name; default ``sys.argv[1:]``) and return the
    exit code: 0 on success, 2 on bad arguments, 1 on a checkpoint problem (message on stderr)."""
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
    except (UsageError, CheckpointError, OSError) as exc:  # one clear line
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
        # bad arguments or a path that does not exist: 2; a checkpoint problem: 1
        return 2 if isinstance(exc, (UsageError, ConfigError, PathNotFoundError)) else 1


if __name__ == "__main__":  # run through the package so exception classes are the importable ones
    from torch_ckpt.tools.cli import main as _main

    sys.exit(_main())
