"""Helpers of the storage/format layer tests (tests/storage/): ways to tamper with a checkpoint."""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torch_ckpt.format._files import read_dcp_metadata

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


def storage_data_not_a_dict(step_dir: Path) -> str:
    """Tampering: .metadata's ``storage_data`` replaced by the int 5 (re-checksummed); returns the file's name."""
    tampered_metadata(step_dir, lambda md: setattr(md, "storage_data", 5))
    return ".metadata"


def inline_shape_2_40(step_dir: Path) -> str:
    """Tampering: rank 0's first inline tensor declared with shape [2^40] (re-checksummed); returns the file's name."""
    doc = json.loads((step_dir / "rank_00000.json").read_text())
    first_inline(doc["tree"])["shape"] = [2**40]
    rewrite(step_dir, "rank_00000.json", json.dumps(doc).encode())
    return "rank_00000.json"


def rank_json_nested_200k(step_dir: Path, rank: int = 0) -> str:
    """Tampering: a 200k-deep list added to ``rank``'s JSON tree (re-checksummed); returns the file's name."""
    name = f"rank_{rank:05d}.json"
    raw = (step_dir / name).read_text()
    deep = raw.replace('"tree":{', '"tree":{"deep":' + "[" * 200_000 + "]" * 200_000 + ",", 1)
    assert deep != raw, f"{name} has no tree to nest into"
    rewrite(step_dir, name, deep.encode())
    return name


def weight_item(md) -> tuple[str, TensorStorageMetadata]:
    """``(key, metadata)`` of the model weight."""
    return next((k, v) for k, v in md.state_dict_metadata.items() if k.endswith("model.weight"))
