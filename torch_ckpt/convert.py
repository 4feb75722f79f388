"""Export a committed checkpoint to a single ``torch.save`` file or to safetensors.

Both exports read the checkpoint with the same pickle-free path as :meth:`CheckpointManager.restore`
(restricted metadata unpickler, tensors with ``weights_only=True``, non-tensor values from JSON) and
assemble full, unsharded tensors whatever world size wrote them. DCP's own
``format_utils.dcp_to_torch_save`` is not used because it unpickles every non-tensor item.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torch_ckpt.codec import join_state
from torch_ckpt.dcp_io import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from torch_ckpt.dist import single_process_quiet
from torch_ckpt.errors import CheckpointNotFoundError, ConfigError
from torch_ckpt.layout import Manifest, rank_file_name, read_manifest
from torch_ckpt.restore import verify_files

__all__ = ["load_full_state", "export_torch", "export_safetensors"]


def _resolve(checkpoint: str | Path) -> tuple[Path, Manifest]:
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a checkpoint directory (expected ROOT/step_NNNNNNNNN)")
    return path, read_manifest(path)


def load_full_state(checkpoint: str | Path, *, verify: bool = True) -> tuple[dict[str, Any], Manifest]:
    """Load a committed checkpoint as one nested dict of full tensors and Python values (one process).

    Args:
        checkpoint: a committed step directory.
        verify: check every file's size and CRC-32 first.

    Returns:
        ``(state, manifest)``. ``state`` is rank 0's nested state with full tensors; when the
        checkpoint was written by several ranks, ``state["per_rank"]`` lists each rank's rank-local
        values (RNG, dataloader position).

    Raises:
        CheckpointNotFoundError: not a committed checkpoint directory.
        CheckpointCorruptError: a file fails verification.
    """
    path, manifest = _resolve(checkpoint)
    verify_files(path, manifest, checksums=verify)
    md = read_dcp_metadata(path / ".metadata")
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if tensors:
        with single_process_quiet(True):
            dcp.load(tensors, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    trees = [json.loads((path / rank_file_name(r)).read_bytes())["tree"] for r in range(manifest.world_size)]
    state = join_state(trees[0], tensors)
    if manifest.world_size > 1:
        state["per_rank"] = [join_state({k: v for k, v in t.items() if k in ("rng", "dataloader")}, tensors)
                             for t in trees]
    return state, manifest


def _weights_only_safe(node: Any) -> Any:
    """Replace numpy values by tensors / Python scalars so ``torch.load(weights_only=True)`` can read them."""
    import numpy as np

    if isinstance(node, dict):
        return {k: _weights_only_safe(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_weights_only_safe(v) for v in node)
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node.copy())
    if isinstance(node, np.generic):
        return node.item()
    return node


def export_torch(checkpoint: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the full state of ``checkpoint`` as one ``torch.save`` file; returns a summary dict.

    The file loads with ``torch.load(out, weights_only=True)`` (numpy arrays become tensors).
    """
    state, manifest = load_full_state(checkpoint)
    torch.save(_weights_only_safe(state), out)
    return {"step": manifest.step, "out": str(out), "bytes": Path(out).stat().st_size}


def export_safetensors(checkpoint: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the model weights of ``checkpoint`` as safetensors.

    The weights are the ``model`` entry of a :class:`~torch_ckpt.TrainState` checkpoint, or the
    ``state_dict`` entry of a Lightning one, under their usual names (no prefix).

    Raises:
        ConfigError: the checkpoint has no model tensors, or ``safetensors`` is not installed.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError("exporting to safetensors needs the 'safetensors' package: pip install safetensors") from exc
    state, manifest = load_full_state(checkpoint)
    model = state.get("model") or state.get("state_dict")  # TrainState / Lightning checkpoints
    if not isinstance(model, dict) or not model:
        raise ConfigError(f"{checkpoint}: no 'model' (TrainState) or 'state_dict' (Lightning) entry to export")
    weights: dict[str, torch.Tensor] = {}

    def collect(prefix: str, node: Any) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, torch.Tensor):
                weights[key] = v.contiguous()
            elif isinstance(v, dict):
                collect(f"{key}.", v)

    collect("", model)
    save_file(weights, str(out), metadata={"step": str(manifest.step), "format": "torch-ckpt export"})
    return {"step": manifest.step, "out": str(out), "tensors": len(weights), "bytes": Path(out).stat().st_size}
