"""Conversions between torch-ckpt checkpoints and other formats, and interop with plain DCP.

* :func:`load_full_state`, :func:`export_torch`, :func:`export_safetensors`: a committed checkpoint
  as one nested dict of full tensors, a ``torch.save`` file, or the model weights as safetensors.
  They read with the pickle-free path of a restore (restricted metadata unpickler, tensors with
  ``weights_only=True``, plain values from JSON), whatever world size wrote the checkpoint; DCP's
  ``format_utils.dcp_to_torch_save`` is not used because it unpickles every non-tensor item.
* :func:`prepare_dcp_load`: stock ``torch.distributed.checkpoint.load`` on one of our checkpoints.
* :func:`import_dcp`: a folder written by plain ``dcp.save`` (or torchtitan) made a committed step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element

from torch_ckpt.errors import CheckpointNotFoundError, ConfigError
from torch_ckpt.format._files import (
    MANIFEST_NAME,
    METADATA_NAME,
    Manifest,
    check_records,
    is_per_rank_key,
    join_state,
    load_tensors,
    rank_file_name,
    read_dcp_metadata,
    read_manifest,
    read_metadata,
    read_rank_doc,
    split_state,
    tensor_items,
    tensor_keys,
    verify_files,
)
from torch_ckpt.policy._naming import check_step
from torch_ckpt.root._layout import commit_dir, new_incarnation, step_dir_name, temporary_name, write_json_durable
from torch_ckpt.storage._crc import file_crc32
from torch_ckpt.storage._locations import as_location
from torch_ckpt.tools.listing import is_plain_dcp, plain_dcp_reason

__all__ = ["export_safetensors", "export_torch", "import_dcp", "load_full_state", "model_weights", "prepare_dcp_load"]


def _resolve(checkpoint: str | os.PathLike, allow_symlinks: bool) -> tuple[Path, Manifest]:
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a checkpoint directory (expected a directory holding a "
                                      "torch-ckpt manifest.json, e.g. ROOT/step_000001000)")
    if is_plain_dcp(as_location(path).entries()):
        raise CheckpointNotFoundError(f"{path} is a {plain_dcp_reason(as_location(path))}")
    return path, read_manifest(path, allow_symlinks=allow_symlinks)


def load_full_state(checkpoint: str | os.PathLike, *, verify: bool = True,
                    allow_symlinks: bool = False) -> tuple[dict[str, Any], Manifest]:
    """Load a committed checkpoint as one nested dict of full tensors and Python values (one process).

    The checks are a restore's (:mod:`torch_ckpt.format._files`), made before any tensor is allocated;
    ``verify`` adds every file's CRC-32; ``allow_symlinks`` follows symlinked files (refused by default).

    Returns:
        ``(state, manifest)``: rank 0's nested state with full tensors; when several ranks wrote
        the checkpoint, ``state["per_rank"]`` lists each rank's rank-local values (``rng``,
        ``dataloader``) and every top-level entry holding per-rank tensors, as that rank saved it.

    Raises:
        CheckpointNotFoundError: not a committed checkpoint directory (a plain DCP folder: named so).
        CheckpointCorruptError: a file fails verification or is malformed (named).
        UnsafeCheckpointError: the metadata references code, or an item is pickled.
    """
    path, manifest = _resolve(checkpoint, allow_symlinks)
    verify_files(path, manifest, checksums=verify, allow_symlinks=allow_symlinks)
    md = read_metadata(path, manifest, allow_symlinks=allow_symlinks)
    check_records(path, manifest, md, allow_symlinks=allow_symlinks)
    specs = tensor_items(md)
    trees = [read_rank_doc(path, manifest, r, allow_symlinks=allow_symlinks, tensor_keys=specs.__contains__)["tree"]
             for r in range(manifest.world_size)]
    # every element is covered by a chunk (read_metadata), so the load overwrites all of these buffers
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in specs.items()}
    if tensors:
        load_tensors(tensors, path, md, set(manifest.files), no_dist=True, allow_symlinks=allow_symlinks)
    state = join_state(trees[0], tensors)
    if manifest.world_size > 1:
        per_rank = {"rng", "dataloader"} | {k for t in trees[1:] if isinstance(t, dict) for k, v in t.items()
                                            if any(is_per_rank_key(key) for key in tensor_keys(v))}
        state["per_rank"] = [join_state({k: v for k, v in t.items() if k in per_rank}, tensors)
                             if isinstance(t, dict) else {} for t in trees]
    return state, manifest


def _weights_only_safe(node: Any) -> Any:
    """Numpy values as tensors / Python scalars, so ``torch.load(weights_only=True)`` reads the file."""
    import numpy as np

    if isinstance(node, dict):
        return type(node)((k, _weights_only_safe(v)) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return type(node)(_weights_only_safe(v) for v in node)
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node.copy())
    return node.item() if isinstance(node, np.generic) else node


def export_torch(checkpoint: str | os.PathLike, out: str | os.PathLike, *, allow_symlinks: bool = False,
                 overwrite: bool = False) -> dict[str, Any]:
    """Write the full state of ``checkpoint`` as one ``torch.save`` file (``torch-ckpt convert --to torch``).

    The file holds :func:`load_full_state`'s dict: the saved state's top-level keys with full CPU
    tensors. A :class:`~torch_ckpt.TrainState` gives ``model`` (the model's ``state_dict()``),
    ``optimizer`` (``get_optimizer_state_dict``'s layout: ``state`` keyed by parameter name,
    ``param_groups``), ``scheduler``, ``step``, ``epoch``, ``rng``, ``extras`` (and ``dataloader``);
    ``per_rank`` is added when several ranks wrote it; numpy values become tensors or scalars. ``out``
    appears whole or not at all (written beside it, then renamed)::

        sd = torch.load("step100.pt", weights_only=True)
        model.load_state_dict(sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optimizer"])  # torch.distributed.checkpoint.state_dict

    Returns:
        ``{"step", "out", "bytes"}``.

    Raises:
        ConfigError: ``out`` exists (and not ``overwrite``, or is not a regular file), is a directory, lies inside
            ``checkpoint``, or its folder does not exist.
        CheckpointNotFoundError, CheckpointCorruptError, UnsafeCheckpointError: see :func:`load_full_state`.
    """
    state, manifest = load_full_state(checkpoint, allow_symlinks=allow_symlinks)
    with _output_file(out, checkpoint, overwrite) as tmp:
        torch.save(_weights_only_safe(state), tmp)
    return {"step": manifest.step, "out": str(out), "bytes": Path(out).stat().st_size}


def _flat_weights(node: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for k, v in node.items():
        if isinstance(v, torch.Tensor):
            weights[f"{prefix}{k}"] = v.contiguous()
        elif isinstance(v, dict):
            weights.update(_flat_weights(v, f"{prefix}{k}."))
    return weights


def model_weights(state: dict[str, Any], *, model: str | None = None,
                  source: str = "checkpoint") -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(weights, model names)`` of a loaded state (:func:`load_full_state`), keyed as ``state_dict()``.

    ``model`` holds one state dict (names empty) or (Accelerate: ``{"0": ...}``) one per model name;
    Lightning saves ``state_dict``. With several models each key is prefixed by its model's name and a
    dot (``"1.fc.weight"``) unless ``model`` picks one (its own keys). Raises ConfigError: no model
    tensors, or ``model`` is not one of the saved models (or there is one model).
    """
    tree = state.get("model") or state.get("state_dict")
    if not isinstance(tree, dict) or not tree:
        raise ConfigError(f"{source}: no 'model' (TrainState) or 'state_dict' (Lightning) entry to export")
    several = "model" in state and all(isinstance(v, dict) for v in tree.values())
    names = sorted(tree) if several else []
    if model is not None:
        if model not in names:
            raise ConfigError(f"{source}: no model named {model!r} to export; the checkpoint holds "
                              + (f"models {names}" if names else "one model (leave the model name out)"))
        weights = _flat_weights(tree[model])
    else:
        weights = _flat_weights(tree[names[0]] if len(names) == 1 else tree)
    if not weights:
        raise ConfigError(f"{source}: the model entry holds no tensors to export")
    return weights, names


def export_safetensors(checkpoint: str | os.PathLike, out: str | os.PathLike, *, model: str | None = None,
                       allow_symlinks: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Write the model weights of ``checkpoint`` as safetensors, keyed as :func:`model_weights` gives them.

    With one model, ``model.load_state_dict(safetensors.torch.load_file(out))`` works; prefixed names
    are listed in the file's metadata (``"models"``). ``out`` appears whole or not at all.

    Returns:
        ``{"step", "out", "tensors", "bytes", "models"}`` (``models``: the prefixes used, else empty).

    Raises:
        ConfigError: no model tensors, ``model`` unknown, ``safetensors`` is not installed, or ``out`` is
            refused (see :func:`export_torch`).
        CheckpointNotFoundError, CheckpointCorruptError, UnsafeCheckpointError: see :func:`load_full_state`.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError("exporting to safetensors needs the 'safetensors' package: pip install safetensors") from exc
    state, manifest = load_full_state(checkpoint, allow_symlinks=allow_symlinks)
    weights, names = model_weights(state, model=model, source=str(checkpoint))
    prefixed = names if model is None and len(names) > 1 else []
    with _output_file(out, checkpoint, overwrite) as tmp:
        save_file(weights, tmp, metadata={"step": str(manifest.step), "format": "torch-ckpt export",
                                          "models": ",".join(prefixed)})
    return {"step": manifest.step, "out": str(out), "tensors": len(weights), "bytes": Path(out).stat().st_size,
            "models": prefixed}


@contextmanager
def _output_file(out: str | os.PathLike, checkpoint: str | os.PathLike, overwrite: bool) -> Iterator[str]:
    """A new file beside ``out`` to write the export into; renamed onto ``out`` once written (a kill or an error
    leaves ``out`` as it was), with the mode of any new file (not ``mkstemp``'s 0600)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; name the output file, e.g. {out / 'model.safetensors'}")
    if os.path.lexists(out):
        if not overwrite:
            raise ConfigError(f"{out} already exists; choose another output file, or pass overwrite=True "
                              "(torch-ckpt convert --overwrite) to replace it")
        if not stat.S_ISREG(os.lstat(out).st_mode):
            raise ConfigError(f"{out} is not a regular file (a symbolic link, device, FIFO or socket): overwrite "
                              "replaces regular files only; name a new output file")
    if Path(checkpoint).resolve() in out.absolute().resolve().parents:
        raise ConfigError(f"{out} lies inside the checkpoint {checkpoint}, which must stay as committed; write the "
                          "export elsewhere")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.absolute().parent)
    except FileNotFoundError:
        raise ConfigError(f"the folder of {out} does not exist; create it first") from None
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (``/proc`` on Linux; else set and restored)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _Ref:
    """A tensor placeholder of the JSON tree (its DCP key), while the plain values are decoded."""

    def __init__(self, key: str) -> None:
        self.key = key


def _fill(live: Any, saved: Any, flat: dict[str, torch.Tensor], specs: dict[str, Any]) -> Any:
    if isinstance(saved, _Ref):
        if not isinstance(live, torch.Tensor):  # absent (a fresh optimizer): a full-size CPU buffer
            meta = specs[saved.key]
            live = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        flat[saved.key] = live
        return live
    if isinstance(saved, dict):
        out = live if isinstance(live, dict) else type(saved)()
        for k, v in saved.items():
            out[k] = _fill(out.get(k), v, flat, specs)
        return out
    if isinstance(saved, (list, tuple)):
        old = live if isinstance(live, (list, tuple)) and len(live) == len(saved) else [None] * len(saved)
        return type(saved)(_fill(a, b, flat, specs) for a, b in zip(old, saved))
    return saved


def prepare_dcp_load(checkpoint: str | os.PathLike, state_dict: dict[str, Any], *,
                     rank: int = 0) -> dict[str, torch.Tensor]:
    """Make stock ``torch.distributed.checkpoint.load`` restore ``state_dict`` from a torch-ckpt checkpoint.

    Our DCP files hold the tensors only; plain values (learning rates, counters) are in the rank
    files, so ``dcp.load`` alone fails with ``Missing key ... optimizer.param_groups.0.lr``. This fills
    the plain values under ``state_dict``'s top-level keys in place from rank ``rank``'s file, adds
    the tensors it lacks (a fresh optimizer's moments) as full-size CPU tensors, and returns the
    tensors flat under their DCP keys, for ``dcp.load`` to read into; then apply ``state_dict``::

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch_ckpt.tools import prepare_dcp_load

        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(prepare_dcp_load("ckpts/step_000000100", sd), checkpoint_id="ckpts/step_000000100")
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])

    Distributed: call it on every rank with its ``rank``; DTensors of ``state_dict`` load as DTensors.

    Raises:
        ConfigError: a top-level key of ``state_dict`` is not in the checkpoint.
        CheckpointNotFoundError, CheckpointCorruptError, UnsafeCheckpointError: see :func:`load_full_state`.
    """
    path, manifest = _resolve(checkpoint, False)
    specs = tensor_items(read_metadata(path, manifest))
    tree = read_rank_doc(path, manifest, min(rank, manifest.world_size - 1), tensor_keys=specs.__contains__)["tree"]
    saved = join_state(tree, {k: _Ref(k) for k in specs})
    saved = saved if isinstance(saved, dict) else {}
    missing = [k for k in state_dict if k not in saved]
    if missing:
        raise ConfigError(f"{path} holds no {missing[0]!r}; it holds {sorted(saved)}")
    flat: dict[str, torch.Tensor] = {}
    for key in state_dict:
        state_dict[key] = _fill(state_dict[key], saved[key], flat, specs)
    return flat


def import_dcp(src: str | os.PathLike, root: str | os.PathLike, step: int, *, link: bool = False) -> dict[str, Any]:
    """Adopt a folder written by plain ``dcp.save`` (or torchtitan) as committed step ``step`` of ``root``.

    The data files are copied (``link``: hard-linked) into ``root/step_NNNNNNNNN`` unchanged; the
    items DCP pickled are decoded by ``torch.load(weights_only=True)`` (PyTorch's restricted
    unpickler) into ``rank_00000.json`` and dropped from the rewritten ``.metadata``; the manifest
    lists every file with its CRC-32. Nesting follows DCP's unflattening (an integer is a list index).

    Returns:
        ``{"checkpoint", "step", "tensors", "values", "files", "bytes", "linked"}``.

    Raises:
        CheckpointNotFoundError: ``src`` is not a plain DCP folder.
        ConfigError: ``step`` is outside ``[0, 2**63 - 1]``, ``root`` is ``src`` or inside it or inside a
            checkpoint, ``root/step_N`` exists, or an item
            cannot be decoded or stored exactly (named).
        UnsafeCheckpointError: ``.metadata`` references code.
        OSError: a copy or link fails (hard links need one file system).
    """
    check_step(step)
    src, root = Path(src), Path(root)
    if not (src.is_dir() and is_plain_dcp(as_location(src).entries())):
        raise CheckpointNotFoundError(f"{src} is not a plain DCP checkpoint (a folder holding .metadata without a "
                                      "torch-ckpt manifest.json)")
    if inside := next((d for d in (root.resolve(), *root.resolve().parents) if (d / MANIFEST_NAME).is_file()), None):
        raise ConfigError(f"the run root {root} is the checkpoint {inside} or inside it (a retention of that "
                          "checkpoint would delete the import); import into a run root of its own")
    if root.resolve() == src.resolve() or src.resolve() in root.resolve().parents:
        raise ConfigError(f"the run root {root} is the plain DCP folder {src} or inside it; import into a "
                          "separate run root (e.g. a sibling folder)")
    md = read_dcp_metadata(src / METADATA_NAME)
    specs = tensor_items(md)
    values: dict[str, Any] = {k: torch.empty(0) for k in specs}
    for index, info in md.storage_data.items():
        if index.fqn in md.state_dict_metadata and index.fqn not in specs:
            with open(src / str(info.relative_path), "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            try:
                values[index.fqn] = torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as exc:  # noqa: BLE001 - the restricted unpickler refused or the bytes are bad
                raise ConfigError(f"{src}: item {index.fqn!r} cannot be decoded without running code ({exc})") from None
    nested: dict[str, Any] = {}
    for fqn, value in values.items():  # DCP's own unflattening: an integer path element makes a list
        set_element(nested, (md.planner_data or {}).get(fqn, tuple(fqn.split("."))), value)
    tensors, tree = split_state(nested)
    if set(tensors) != set(specs):
        raise ConfigError(f"{src}: its keys do not nest back to their DCP names: "
                          f"{sorted(set(tensors) ^ set(specs))[:3]}")
    final = root / step_dir_name(step)
    if os.path.lexists(final):
        raise ConfigError(f"{final} already exists; choose another --step")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / temporary_name(final.name, new_incarnation())
    tmp.mkdir()
    try:
        data = sorted({str(md.storage_data[i].relative_path) for i in md.storage_data if i.fqn in specs})
        for name in data:
            (os.link if link else shutil.copyfile)(src / name, tmp / name)
        kept = {i: s for i, s in md.storage_data.items() if i.fqn in specs}
        slim = dataclasses.replace(md, state_dict_metadata=dict(specs), storage_data=kept,
                                   planner_data={k: v for k, v in (md.planner_data or {}).items() if k in specs})
        with open(tmp / METADATA_NAME, "wb") as f:
            pickle.dump(slim, f)
            f.flush()
            os.fsync(f.fileno())
        write_json_durable(tmp / rank_file_name(0), {"step": step, "rank": 0, "world_size": 1, "tree": tree})
        files = {name: dict(zip(("bytes", "crc32"), file_crc32(tmp / name)))
                 for name in [*data, METADATA_NAME, rank_file_name(0)]}
        payload = sum(m.properties.dtype.itemsize * int(torch.Size(m.size).numel()) for m in specs.values())
        write_json_durable(tmp / MANIFEST_NAME, Manifest(step=step, world_size=1, files=files,
                                                         tensor_bytes=payload).to_json())
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"checkpoint": str(final), "step": step, "tensors": len(specs), "values": len(values) - len(specs),
            "files": len(files), "bytes": sum(i["bytes"] for i in files.values()), "linked": link}
