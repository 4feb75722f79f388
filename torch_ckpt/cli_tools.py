"""``torch-ckpt`` subcommands that operate on checkpoints (``convert``).

Kept apart from the pure calculators in :mod:`torch_ckpt.cli` so that ``plan``/``simulate`` start
without importing ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import argparse
import json


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``torch-ckpt convert``."""
    p.add_argument("checkpoint", metavar="CKPT", help="a committed checkpoint directory, e.g. ckpts/step_000001000")
    p.add_argument("--to", required=True, choices=("torch", "safetensors"),
                   help="torch: one torch.save file of the full state (loads with weights_only=True); "
                        "safetensors: the model weights only")
    p.add_argument("out", metavar="OUT", help="output file (.pt or .safetensors)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run_convert(args: argparse.Namespace) -> int:
    """Export a checkpoint; prints what was written."""
    from torch_ckpt.convert import export_safetensors, export_torch

    result = export_torch(args.checkpoint, args.out) if args.to == "torch" else \
        export_safetensors(args.checkpoint, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        extra = f", {result['tensors']} tensors" if "tensors" in result else ""
        print(f"step {result['step']} -> {result['out']} ({result['bytes']} bytes{extra})")
    return 0
