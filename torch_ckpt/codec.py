"""Split a nested state dict into DCP tensors and a JSON tree, and join them back.

A training state dict mixes tensors (model, optimizer moments) with plain Python values
(scheduler counters, hyper-parameters, dataloader positions). Tensors go to
``torch.distributed.checkpoint`` (DCP) under flat, dot-joined keys (the same keys DCP's own
flattening produces, so a plain ``dcp.load({"model": sd}, ...)`` finds them). Everything else is
kept in a JSON tree that records the exact Python type (``int`` stays ``int``, ``tuple`` stays
``tuple``), so loading never needs to unpickle anything.

Tensors inside *rank-local* subtrees (RNG states, dataloader positions: small and different on
every rank) are embedded in the JSON tree as base64 instead of going through DCP, where
same-named tensors on different ranks would be deduplicated as replicas.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torch_ckpt.errors import CheckpointCorruptError, ConfigError

__all__ = ["split_state", "join_state", "TENSOR_TAG"]

TENSOR_TAG = "__tensor__"
_INLINE_TENSOR = "__tensor_b64__"
_NDARRAY = "__ndarray_b64__"
_NPSCALAR = "__np_scalar__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_BYTES = "__bytes_b64__"
_FLOAT = "__float__"
_TAGS = {TENSOR_TAG, _INLINE_TENSOR, _NDARRAY, _NPSCALAR, _TUPLE, _DICT, _BYTES, _FLOAT}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _encode_inline_tensor(t: torch.Tensor, path: str) -> dict:
    if type(t) is not torch.Tensor:
        raise ConfigError(
            f"state key {path!r}: a rank-local value holds a {type(t).__name__}; only plain tensors can be "
            "stored per rank. Move it out of the rank-local part of the state."
        )
    cpu = t.detach().to("cpu").contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {_INLINE_TENSOR: _b64(raw), "dtype": str(cpu.dtype).removeprefix("torch."), "shape": list(cpu.shape),
            "device": str(t.device)}


def _decode_inline_tensor(node: dict) -> torch.Tensor:
    dtype = getattr(torch, node["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown tensor dtype {node['dtype']!r} in checkpoint JSON")
    raw = bytearray(base64.b64decode(node[_INLINE_TENSOR]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(node["shape"]).clone()


def split_state(state: Any, *, rank_local_keys: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """Separate the tensors of a nested state dict from its plain values.

    Args:
        state: nested dicts/lists/tuples whose leaves are tensors (incl. DTensor), numpy arrays or
            scalars, bytes, or JSON scalars (None, bool, int, float, str).
        rank_local_keys: top-level keys whose tensors are embedded per rank in the JSON tree.

    Returns:
        ``(tensors, tree)``: a flat ``{dotted_key: tensor}`` dict for DCP (the live tensors, not
        copies) and a JSON-serialisable tree with ``{"__tensor__": key}`` placeholders.

    Raises:
        ConfigError: a leaf has an unsupported type, or two paths flatten to the same key; the
            message names the key.
    """
    tensors: dict[str, torch.Tensor] = {}

    def enc(obj: Any, path: tuple[str, ...], local: bool) -> Any:
        key = ".".join(path)
        if isinstance(obj, torch.Tensor):
            if local:
                return _encode_inline_tensor(obj, key)
            if key in tensors:
                raise ConfigError(f"state key {key!r} occurs twice after flattening nested keys with '.'; rename one")
            tensors[key] = obj
            return {TENSOR_TAG: key}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return obj if obj == obj and obj not in (float("inf"), float("-inf")) else {_FLOAT: repr(obj)}
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return {_NDARRAY: _b64(arr.tobytes()), "dtype": arr.dtype.str, "shape": list(arr.shape)}
        if isinstance(obj, np.generic):
            return {_NPSCALAR: obj.item(), "dtype": obj.dtype.str}
        if isinstance(obj, (bytes, bytearray)):
            return {_BYTES: _b64(bytes(obj))}
        if isinstance(obj, Mapping):
            sub_local = lambda k: local or (not path and k in rank_local_keys)  # noqa: E731
            if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
                return {k: enc(v, path + (k,), sub_local(k)) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, bool, float)) and k is not None:
                    raise ConfigError(f"state key {key!r}: dict key {k!r} of type {type(k).__name__} is not supported")
                items.append([k, enc(v, path + (str(k),), sub_local(str(k)))])
            return {_DICT: items}
        if isinstance(obj, (list, tuple)):
            out = [enc(v, path + (str(i),), local) for i, v in enumerate(obj)]
            return {_TUPLE: out} if isinstance(obj, tuple) else out
        raise ConfigError(
            f"state key {key or '<root>'!r} holds a {type(obj).__module__}.{type(obj).__qualname__}, which cannot be "
            "checkpointed without pickling. Store tensors, numpy arrays, or JSON values (int, float, str, bool, None, "
            "list, tuple, dict) instead."
        )

    tree = enc(state, (), False)
    return tensors, tree


def join_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the nested state from a JSON tree and loaded tensors (inverse of :func:`split_state`).

    Raises:
        CheckpointCorruptError: a placeholder names a tensor that ``tensors`` lacks.
    """

    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) >= 1:
            if TENSOR_TAG in node and len(node) == 1:
                key = node[TENSOR_TAG]
                if key not in tensors:
                    raise CheckpointCorruptError(f"state refers to tensor {key!r}, which the checkpoint does not hold "
                                                 "as a tensor")
                return tensors[key]
            if _INLINE_TENSOR in node:
                return _decode_inline_tensor(node)
            if _NDARRAY in node:
                return np.frombuffer(base64.b64decode(node[_NDARRAY]), dtype=np.dtype(node["dtype"])).reshape(
                    node["shape"]).copy()
            if _NPSCALAR in node:
                return np.dtype(node["dtype"]).type(node[_NPSCALAR])
            if _BYTES in node and len(node) == 1:
                return base64.b64decode(node[_BYTES])
            if _FLOAT in node and len(node) == 1:
                return float(node[_FLOAT])
            if _TUPLE in node and len(node) == 1:
                return tuple(dec(v) for v in node[_TUPLE])
            if _DICT in node and len(node) == 1:
                return {k: dec(v) for k, v in node[_DICT]}
        return {k: dec(v) for k, v in node.items()}

    return dec(tree)
