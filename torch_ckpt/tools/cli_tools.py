"""``torch-ckpt`` subcommands that operate on checkpoints and on this machine: ``ls``, ``inspect``,
``verify``, ``convert`` and ``bench``.

Kept apart from the pure calculators in :mod:`torch_ckpt.tools.cli` so that ``plan``/``simulate`` start
without importing ``torch.distributed.checkpoint``: everything heavy is imported inside the
``run_*`` functions. The work itself lives in :mod:`torch_ckpt.tools.inspection`,
:mod:`torch_ckpt.tools.convert` and :mod:`torch_ckpt.tools.floors`; this module parses arguments and prints.

Exit codes (as in :mod:`torch_ckpt.tools.cli`): 0 success; 2 bad arguments, including a path or URL that
does not exist; 1 a checkpoint problem (``verify`` found one, ``ls`` lists a corrupt checkpoint, a
checkpoint cannot be read), with one line per problem.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch_ckpt.durations import format_duration
from torch_ckpt.errors import CheckpointError, ConfigError
from torch_ckpt.storage._locations import DurableUnavailableError, Location, PathNotFoundError, is_url
from torch_ckpt.tools.cli_common import UsageError, fmt_bytes, int_type, print_json, print_result

__all__ = [
    "add_common",
    "add_convert_arguments",
    "add_inspect_arguments",
    "add_ls_arguments",
    "add_verify_arguments",
    "run_convert",
    "run_inspect",
    "run_ls",
    "run_verify",
]


# ---------------------------------------------------------------------------------------------
# shared helpers


def _storage_options(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"anon\": true}'")
    return value


_storage_options.__name__ = "storage options"


_non_negative_int = int_type(0)


def add_common(p: argparse.ArgumentParser, *, remote: bool = True) -> None:
    if remote:
        p.add_argument("--storage-options", type=_storage_options, metavar="JSON",
                       help="fsspec options for URLs as a JSON object (credentials, endpoint...), e.g. "
                            "'{\"client_kwargs\": {\"endpoint_url\": \"http://127.0.0.1:9000\"}}'")
        p.add_argument("--follow-symlinks", action="store_true",
                       help="follow symbolic links inside checkpoints (local paths); by default a symlinked file, "
                            "manifest.json included, is refused as a restore refuses it")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars (they only show on a terminal)")


def _open(text: str, args: argparse.Namespace) -> Any:
    """A :class:`~torch_ckpt.tools.inspection.Location` for a path or URL; bad ones are usage errors (exit 2)."""
    options = getattr(args, "storage_options", None)
    if options and not is_url(text) and not getattr(args, "check_tiers", False):
        raise UsageError("--storage-options only applies to URLs (s3://, gs://, memory://...)")
    try:
        return Location(text, storage_options=options, allow_symlinks=getattr(args, "follow_symlinks", False))
    except ConfigError as exc:
        raise UsageError(f"cannot open {text!r}: {exc.__cause__ or exc}") from None


@contextmanager
def _argument_paths() -> Iterator[None]:
    """Turn 'this path does not exist' into a usage error (exit 2) and bad argument combinations too."""
    try:
        yield
    except (PathNotFoundError, ConfigError) as exc:
        raise UsageError(str(exc)) from None


def _fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{format_duration(max(0.0, seconds))} ago" if seconds >= 0 else "in the future"


def _fmt_local_time(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[list[str]], right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = (enumerate(zip(r, widths, strict=True)) for r in rows)
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in row).rstrip() for row in cells]


# ---------------------------------------------------------------------------------------------
# ls


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``torch-ckpt ls``."""
    p.add_argument("root", metavar="ROOT", help="a run root: local directory or fsspec URL (s3://bucket/run)")
    p.add_argument("--verify", action="store_true",
                   help="also check every file's CRC-32 and the structure (reads every byte); without it a "
                        "checkpoint is corrupt when its manifest is unreadable or files are missing or truncated")
    p.add_argument("--check-tiers", action="store_true",
                   help="confirm the durable copies recorded in the manifests by listing those tiers "
                        "(--storage-options applies to them)")
    add_common(p)


def run_ls(args: argparse.Namespace) -> int:
    """List a root; exit 1 when a checkpoint is corrupt."""
    from torch_ckpt.tools.checks import CORRUPT  # torch: imported when the command runs
    from torch_ckpt.tools.listing import list_root

    with _argument_paths():
        result = list_root(_open(args.root, args), verify=args.verify, check_tiers=args.check_tiers,
                           progress=not args.quiet)
    print_result(result, args.json, _ls_text)
    return 1 if result["counts"][CORRUPT] else 0


def _ls_text(result: dict[str, Any]) -> str:
    steps = result["steps"]
    if not steps:
        return f"{result['root']}: no checkpoints (a checkpoint is a directory holding a torch-ckpt manifest.json)"
    rows = [["STEP", "NAME", "TIME", "AGE", "SIZE", "TIERS", "STATUS"]]
    notes: list[str] = []
    held: dict[int, list[str]] = {}
    for r in steps:
        step = "-" if r["step"] is None else str(r["step"])
        name = r["name"] + (f" -> {r['link_to']}" if r["link_to"] else "")
        rows.append([step, name, _fmt_local_time(r["wall_time"]), _fmt_age(r["age_s"]), fmt_bytes(r["bytes"]),
                     ",".join(r["tiers"]) or "-", r["status"] + (", superseded" if r.get("superseded") else "")])
        if r["alias_of"] is not None:
            continue  # its target's row carries the notes
        if r["step"] is not None and r["status"] != "partial" and not r.get("superseded"):
            held.setdefault(r["step"], []).append(r["name"])
        if r["reason"]:
            notes.append(f"  step {step}: {r['name']}: {r['reason']}")
        for prob in r["problems"]:
            notes.append(f"  step {step}: {prob['path']}: {prob['problem']}")
        if r.get("stale_tiers"):
            notes.append(f"  step {step}: recorded in {', '.join(r['stale_tiers'])} but no longer there")
    notes += [f"  step {s}: held by {len(names)} checkpoints: {', '.join(names)}"
              for s, names in held.items() if len(names) > 1]
    c = result["counts"]
    head = f"{result['root']}: {c['committed']} committed, {c['partial']} partial, {c['corrupt']} corrupt" + \
        (f", {result['superseded']} superseded" if result.get("superseded") else "") + \
        (" (checksums verified)" if result["verified"] else "")
    foot = "SIZE: the files the manifest lists (as verify and inspect count them); for a partial entry, what is present"
    if result.get("superseded"):
        foot += ("\nsuperseded: a step of a timeline abandoned by a rollback (restore of an older step, then a save); "
                 "kept, never resumed")
    return "\n".join([head, *_table(rows, right=(0, 4)), *notes, foot])


# ---------------------------------------------------------------------------------------------
# inspect


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``torch-ckpt inspect``."""
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint directory (ROOT/step_000001000), or a run root for its newest committed "
                        "checkpoint; local path or fsspec URL")
    p.add_argument("--step", type=_non_negative_int, metavar="N", help="with a run root: inspect this step")
    p.add_argument("--keys", action="store_true", help="also list every tensor and array with shape and dtype")
    add_common(p)


def run_inspect(args: argparse.Namespace) -> int:
    """Print the per-component table (and keys) of a checkpoint."""
    from torch_ckpt.tools.inspection import inspect_checkpoint  # torch: imported when the command runs

    with _argument_paths():
        result = inspect_checkpoint(_open(args.checkpoint, args), step=args.step, keys=args.keys,
                                    progress=not args.quiet)
    print_result(result, args.json, _inspect_text)
    return 0


def _dtypes(d: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in d.items()) or "-"


def _inspect_text(r: dict[str, Any]) -> str:
    saved = f"saved {_fmt_local_time(r['wall_time'])} with torch {r['torch_version']}"
    lines = [f"note: {r['note']}"] if r.get("note") else []
    lines += [f"step {r['step']}  {r['checkpoint']}",
             f"world size {r['world_size']}, {saved}; {r['files']} files, {fmt_bytes(r['file_bytes'])} "
             "(the files the manifest lists)", ""]
    rows = [["COMPONENT", "BYTES", "TENSORS", "DTYPES", "OTHER"]]
    for c in [*r["components"], {"name": "total", **r["totals"], "dtypes": {}}]:
        other = []
        if c["arrays"]:
            other.append(f"{c['arrays']} numpy array{'s' * (c['arrays'] > 1)} ({fmt_bytes(c['array_bytes'])})")
        if c["values"]:
            other.append(f"{c['values']} value{'s' * (c['values'] > 1)}")
        tensors = str(c["tensors"]) + (f" ({c['rank_local_tensors']} per rank)" if c["rank_local_tensors"] else "")
        rows.append([c["name"], fmt_bytes(c["bytes"]), tensors, _dtypes(c["dtypes"]), ", ".join(other)])
    lines += _table(rows, right=(1,))
    lines.append("bytes: tensor and array payload (sharded tensors at full size, per-rank tensors on every rank); "
                 "values: other entries of rank 0's state")
    if "keys" in r:
        lines.append("")
        krows = [["KEY", "SHAPE", "DTYPE", "BYTES", "STORED"]]
        for k in r["keys"]:
            where = f"dcp ({k['chunks']} chunk{'s' * (k['chunks'] > 1)})" if k["storage"] == "dcp" else \
                f"rank {k['rank']} json" + (" (numpy)" if k["kind"] == "ndarray" else "")
            krows.append([k["key"], "x".join(map(str, k["shape"])) or "scalar", k["dtype"], fmt_bytes(k["bytes"]),
                          where])
        lines += _table(krows, right=(3,))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# verify


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``torch-ckpt verify``."""
    p.add_argument("target", metavar="CKPT|ROOT",
                   help="a checkpoint directory, or a run root to verify all its checkpoints; local path or URL")
    p.add_argument("--no-checksums", action="store_true",
                   help="check sizes and structure only, not every file's CRC-32 (does not read the tensor data)")
    add_common(p)


def run_verify(args: argparse.Namespace) -> int:
    """Verify; exit 1 on any problem, each listed with its file."""
    from torch_ckpt.tools.verification import verify_path  # torch: imported when the command runs

    with _argument_paths():
        result = verify_path(_open(args.target, args), checksums=not args.no_checksums, progress=not args.quiet)
    print_result(result, args.json, _verify_text)
    return 0 if result["ok"] else 1


def _verify_text(r: dict[str, Any]) -> str:
    lines = []
    for c in r["checkpoints"]:
        what = "sizes, structure" if not c["checksums"] else "CRC-32, structure"
        detail = f"{c['files']} files, {fmt_bytes(c['bytes'])}, {c['tensors'] if c['tensors'] is not None else '?'} " \
                 f"tensors; {what}"
        lines.append(f"{'OK  ' if c['ok'] else 'FAIL'}  step {c['step']}  {c['checkpoint']}  ({detail})")
        if c.get("partial"):
            lines.append(f"      partial: {c['partial']}")
        lines += [f"      {p['path']}: {p['problem']}" for p in c["problems"]]
        lines += [f"      warning: {w['path']}: {w['problem']}" for w in c["warnings"]]
    lines += [f"skip  {s['name']}: " + (s["reason"] if s.get("link_to") else f"partial ({s['reason']})")
              for s in r["skipped"]]
    lines += [f"FAIL  {g}" for g in r["general_problems"]]
    bad = sum(not c["ok"] for c in r["checkpoints"])
    lines.append(f"verified {len(r['checkpoints'])} checkpoint(s): " +
                 ("all OK" if r["ok"] else f"{r['problems']} problem(s) in {bad} checkpoint(s)" if bad else
                  f"{r['problems']} problem(s)"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# convert


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``torch-ckpt convert``."""
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a committed checkpoint directory, e.g. ckpts/step_000001000, or an fsspec URL of one "
                        "(downloaded and verified first)")
    p.add_argument("--to", required=True, choices=("torch", "safetensors"),
                   help="torch: one torch.save file of the full state (loads with weights_only=True); "
                        "safetensors: the model weights only")
    p.add_argument("out", metavar="OUT", help="output file (.pt or .safetensors)")
    p.add_argument("--model", metavar="NAME",
                   help="safetensors of a checkpoint of several models: export only this one, under its own keys "
                        "(without it, each key is prefixed by its model's name and a dot)")
    add_common(p)


@contextmanager
def _local_copy(args: argparse.Namespace) -> Iterator[str]:
    """The checkpoint as a local directory: itself, or a verified download of a URL (removed after)."""
    from torch_ckpt.tools.checks import step_of  # torch: imported when the command runs

    if not is_url(args.checkpoint):
        if getattr(args, "storage_options", None):
            raise UsageError("--storage-options only applies to URLs (s3://, gs://, memory://...)")
        path = os.path.expanduser(args.checkpoint.removeprefix("file://"))
        if not os.path.exists(path):
            raise UsageError(f"{path} does not exist")
        yield path
        return
    from torch_ckpt.tiers._durable import DurableTier

    url = args.checkpoint.rstrip("/")
    parent, _, name = url.rpartition("/")
    step, temporary = step_of(name)
    if step is None or temporary or "://" not in parent:
        raise UsageError(f"{url} is not a checkpoint URL (expected ROOT_URL/step_NNNNNNNNN)")
    try:
        tier = DurableTier(parent, storage_options=args.storage_options)
    except ConfigError as exc:
        raise UsageError(f"cannot open {url!r}: {exc.__cause__ or exc}") from None

    tmp = tempfile.mkdtemp(prefix="torch-ckpt-convert-")
    try:
        try:
            if not tier.fs.exists(f"{tier.root}/{name}"):
                raise UsageError(f"{url} does not exist")
            local = str(tier.download(step, Path(tmp)))
        except (CheckpointError, OSError, ValueError):  # ValueError includes UsageError
            raise
        except Exception as exc:  # noqa: BLE001 - backend errors (botocore, aiohttp...) mean unreachable
            raise DurableUnavailableError(f"cannot read {url}: {exc}") from exc
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_convert(args: argparse.Namespace) -> int:
    """Export a checkpoint; prints what was written."""
    from torch_ckpt.tools.convert import export_safetensors, export_torch

    if args.model is not None and args.to != "safetensors":
        raise UsageError("--model applies to --to safetensors only (--to torch exports the full state)")
    with _local_copy(args) as path:
        if args.to == "torch":
            result = export_torch(path, args.out, allow_symlinks=args.follow_symlinks)
        else:
            result = export_safetensors(path, args.out, model=args.model, allow_symlinks=args.follow_symlinks)
    result["checkpoint"] = args.checkpoint
    if args.json:
        print_json(result)
    else:
        extra = f", {result['tensors']} tensors" if "tensors" in result else ""
        if result.get("models"):
            extra += f"; keys prefixed by model name: {', '.join(result['models'])}"
        print(f"step {result['step']} -> {result['out']} ({result['bytes']} bytes{extra})")
    return 0


