"""Helpers of the storage/format layer tests (tests/storage/): ways to tamper with a checkpoint."""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torch_ckpt.dcp_read import read_dcp_metadata

STEP = "step_000000001"


def rewrite(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a file and make the manifest agree with it (a consistent, deliberate tampering)."""
    (step_dir / name).write_bytes(data)
    doc = json.loads((step_dir / "manifest.json").read_text())
    doc["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (step_dir / "manifest.json").write_text(json.dumps(doc))


def manifest_doc(step_dir: Path) -> dict:
    """The parsed manifest.json of ``step_dir``."""
    return json.loads((step_dir / "manifest.json").read_text())


def tampered_metadata(step_dir: Path, edit) -> None:
    """Apply ``edit(metadata)`` to .metadata and re-checksum it in the manifest."""
    md = read_dcp_metadata(step_dir / ".metadata")
    edit(md)
    rewrite(step_dir, ".metadata", pickle.dumps(md))


def first_inline(node):
    """The first tensor stored inline (``__tensor_b64__``) in a rank JSON tree, depth first; ``None`` if none."""
    if isinstance(node, dict):
        if "__tensor_b64__" in node:
            return node
        node = list(node.values())
    if isinstance(node, list):
        for v in node:
            found = first_inline(v)
            if found is not None:
                return found
    return None


def weight_item(md) -> tuple[str, TensorStorageMetadata]:
    """``(key, metadata)`` of the model weight."""
    return next((k, v) for k, v in md.state_dict_metadata.items() if k.endswith("model.weight"))
