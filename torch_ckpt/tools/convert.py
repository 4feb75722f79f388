"""Export a committed checkpoint to a single ``torch.save`` file or to safetensors.

Both exports read the checkpoint with the same pickle-free path as :meth:`CheckpointManager.restore`
(restricted metadata unpickler, tensors with ``weights_only=True``, non-tensor values from JSON) and
assemble full, unsharded tensors whatever world size wrote them. DCP's own
``format_utils.dcp_to_torch_save`` is not used because it unpickles every non-tensor item.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torch_ckpt.errors import CheckpointNotFoundError, ConfigError
from torch_ckpt.format._codec import is_per_rank_key, join_state
from torch_ckpt.format._read import (
    Manifest,
    check_records,
    load_tensors,
    read_manifest,
    read_metadata,
    read_rank_doc,
    tensor_items,
    tensor_keys,
    verify_files,
)

__all__ = ["load_full_state", "export_torch", "export_safetensors", "model_weights"]


def _resolve(checkpoint: str | Path, allow_symlinks: bool) -> tuple[Path, Manifest]:
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a checkpoint directory (expected a directory holding a "
                                      "torch-ckpt manifest.json, e.g. ROOT/step_000001000)")
    return path, read_manifest(path, allow_symlinks=allow_symlinks)


def load_full_state(checkpoint: str | Path, *, verify: bool = True,
                    allow_symlinks: bool = False) -> tuple[dict[str, Any], Manifest]:
    """Load a committed checkpoint as one nested dict of full tensors and Python values (one process).

    Goes through the same validation as a restore (:mod:`torch_ckpt.format._read`): only the manifest's
    files, as regular files inside the checkpoint; metadata whose chunks cover every tensor exactly
    and fit in the files (checked before any tensor is allocated); tensor records that match the
    metadata's dtypes, sizes and shapes; bounded, well-formed rank files.

    Args:
        checkpoint: a committed step directory.
        verify: check every file's CRC-32 first (sizes are always checked).
        allow_symlinks: follow symlinked files (refused by default, like restore).

    Returns:
        ``(state, manifest)``. ``state`` is rank 0's nested state with full tensors; when the
        checkpoint was written by several ranks, ``state["per_rank"]`` lists each rank's rank-local
        values (RNG, dataloader position) and every top-level entry that holds per-rank tensors
        (e.g. ``extras``), as that rank saved it.

    Raises:
        CheckpointNotFoundError: not a committed checkpoint directory.
        CheckpointCorruptError: a file fails verification or its content is malformed (named).
        UnsafeCheckpointError: the metadata references code, or an item is pickled.
    """
    path, manifest = _resolve(checkpoint, allow_symlinks)
    verify_files(path, manifest, checksums=verify, allow_symlinks=allow_symlinks)
    md = read_metadata(path, manifest, allow_symlinks=allow_symlinks)
    check_records(path, manifest, md, allow_symlinks=allow_symlinks)
    specs = tensor_items(md)
    trees = [read_rank_doc(path, manifest, r, allow_symlinks=allow_symlinks, tensor_keys=specs.__contains__)["tree"]
             for r in range(manifest.world_size)]
    # sizes are bounded by the files (read_metadata) and every element is covered by a chunk, so
    # every element of these buffers is overwritten by the load
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in specs.items()}
    if tensors:
        load_tensors(tensors, path, md, set(manifest.files), no_dist=True, allow_symlinks=allow_symlinks)
    state = join_state(trees[0], tensors)
    if manifest.world_size > 1:
        # rank-local parts, and every top-level entry holding a per-rank tensor (__rank<r>__. keys) on some rank
        per_rank = {"rng", "dataloader"} | {k for t in trees[1:] if isinstance(t, dict) for k, v in t.items()
                                            if any(is_per_rank_key(key) for key in tensor_keys(v))}
        state["per_rank"] = [join_state({k: v for k, v in t.items() if k in per_rank}, tensors)
                             if isinstance(t, dict) else {} for t in trees]
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


def export_torch(checkpoint: str | Path, out: str | Path, *, allow_symlinks: bool = False) -> dict[str, Any]:
    """Write the full state of ``checkpoint`` as one ``torch.save`` file; returns a summary dict.

    The file loads with ``torch.load(out, weights_only=True)`` (numpy arrays become tensors).

    Raises:
        CheckpointNotFoundError, CheckpointCorruptError, UnsafeCheckpointError: see :func:`load_full_state`.
    """
    state, manifest = load_full_state(checkpoint, allow_symlinks=allow_symlinks)
    torch.save(_weights_only_safe(state), out)
    return {"step": manifest.step, "out": str(out), "bytes": Path(out).stat().st_size}


def _flat_weights(node: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a (nested) state dict under dotted names (other values are left out)."""
    weights: dict[str, torch.Tensor] = {}
    for k, v in node.items():
        if isinstance(v, torch.Tensor):
            weights[f"{prefix}{k}"] = v.contiguous()
        elif isinstance(v, dict):
            weights.update(_flat_weights(v, f"{prefix}{k}."))
    return weights


def model_weights(state: dict[str, Any], *, model: str | None = None,
                  source: str = "checkpoint") -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model weights of a loaded state (:func:`load_full_state`), keyed as the model's ``state_dict()``.

    A :class:`~torch_ckpt.TrainState` of one model saves its state dict under ``model``; one of
    several models (a mapping, as the Accelerate adapter always saves: ``{"0": ...}``) saves one
    state dict per model name; a Lightning checkpoint saves ``state_dict``. With one model the keys
    are the model's own; with several, each key is prefixed by its model's name and a dot
    (``"1.fc.weight"``), unless ``model`` picks one of them (its own keys, no prefix).

    Args:
        state: the nested state.
        model: with several models, the name of the one to take.
        source: the checkpoint, for messages.

    Returns:
        ``(weights, model names)``; the names are empty for a single model's state dict.

    Raises:
        ConfigError: no model tensors, or ``model`` is not one of the saved models (or there is one model).
    """
    tree = state.get("model") or state.get("state_dict")  # TrainState / Lightning checkpoints
    if not isinstance(tree, dict) or not tree:
        raise ConfigError(f"{source}: no 'model' (TrainState) or 'state_dict' (Lightning) entry to export")
    # a model's state dict maps flat names to tensors; a mapping of several models maps names to dicts
    several = "model" in state and all(isinstance(v, dict) for v in tree.values())
    names = sorted(tree) if several else []
    if model is not None:
        if model not in names:
            raise ConfigError(f"{source}: no model named {model!r} to export; the checkpoint holds "
                              + (f"models {names}" if names else "one model (leave the model name out)"))
        weights = _flat_weights(tree[model])
    elif len(names) == 1:
        weights = _flat_weights(tree[names[0]])
    else:
        weights = _flat_weights(tree)
    if not weights:
        raise ConfigError(f"{source}: the model entry holds no tensors to export")
    return weights, names


def export_safetensors(checkpoint: str | Path, out: str | Path, *, model: str | None = None,
                       allow_symlinks: bool = False) -> dict[str, Any]:
    """Write the model weights of ``checkpoint`` as safetensors, keyed as the model's ``state_dict()``.

    The weights are the ``model`` entry of a :class:`~torch_ckpt.TrainState` checkpoint (the
    Accelerate adapter's too), or the ``state_dict`` entry of a Lightning one. With one model (an
    Accelerate run with one prepared model included) the keys are the model's own, without any
    prefix, so ``model.load_state_dict(safetensors.torch.load_file(out))`` works. With several
    models, each key is prefixed by the model's name and a dot (``"0.fc.weight"``, ``"1.fc.weight"``),
    and the names are listed in the file's metadata (``"models"``); ``model`` exports one of them
    alone, without the prefix.

    Args:
        checkpoint: a committed checkpoint directory.
        out: the file to write.
        model: with several models, the name of the one to export.
        allow_symlinks: follow symlinked files (refused by default, like restore).

    Returns:
        ``{"step", "out", "tensors", "bytes", "models"}``; ``models`` lists the model names whose
        weights are in the file (prefixed when several), empty for a single model.

    Raises:
        ConfigError: the checkpoint has no model tensors, ``model`` is not one of its models, or
            ``safetensors`` is not installed.
        CheckpointNotFoundError, CheckpointCorruptError, UnsafeCheckpointError: see :func:`load_full_state`.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError("exporting to safetensors needs the 'safetensors' package: pip install safetensors") from exc
    state, manifest = load_full_state(checkpoint, allow_symlinks=allow_symlinks)
    weights, names = model_weights(state, model=model, source=str(checkpoint))
    prefixed = names if model is None and len(names) > 1 else []
    save_file(weights, str(out), metadata={"step": str(manifest.step), "format": "torch-ckpt export",
                                           "models": ",".join(prefixed)})
    return {"step": manifest.step, "out": str(out), "tensors": len(weights), "bytes": Path(out).stat().st_size,
            "models": prefixed}
