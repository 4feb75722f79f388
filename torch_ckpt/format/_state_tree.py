"""The one walker of encoded state trees (the JSON side of :mod:`torch_ckpt.format._codec`).

:func:`walk_tree` visits every node of a per-rank tree as :func:`torch_ckpt.format._codec.join_state` will
decode it, validating each one on the way (iteratively: a tree nested deeply never exhausts the
stack), and yields its leaves: DCP tensor placeholders, embedded tensors and arrays (whose declared
bytes :func:`embedded_info` checks against their base64 data before anything is decoded), and
plain values. Restore, ``verify``, ``inspect`` and ``convert`` all walk trees through it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from functools import cache, lru_cache
from typing import Any

import numpy as np
import torch

from torch_ckpt.format._codec import (
    BYTES_TAG,
    DICT_TAG,
    FLOAT_TAG,
    INLINE_TENSOR_TAG,
    NDARRAY_TAG,
    NPSCALAR_TAG,
    ODICT_TAG,
    TENSOR_TAG,
    TUPLE_TAG,
)
from torch_ckpt.storage._locations import Malformed, short_repr

__all__ = ["MAX_NDIM", "embedded_info", "tensor_keys", "walk_tree"]

MAX_NDIM = 64
"""Most dimensions of an embedded tensor or array."""
_B64_RE = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@cache
def _torch_dtype(name: str) -> Any:
    """The torch dtype ``name`` if an embedded tensor may use it (raw bytes viewable as it), else None."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        return None
    try:
        torch.empty(dtype.itemsize, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError):
        return None
    return dtype


@lru_cache(maxsize=256)
def _numpy_dtype(name: str) -> Any:
    """The numpy dtype ``name`` if an embedded array may use it (no objects, non-empty items), else None."""
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        return None
    if dtype.hasobject or dtype.itemsize == 0:
        return None
    return dtype


def _shape(value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in value):
        raise Malformed(f"invalid shape {short_repr(value)}")
    return value


def _b64_bytes(text: Any) -> int:
    """Bytes that base64 ``text`` decodes to; raises for anything but canonical base64."""
    if not isinstance(text, str) or len(text) % 4 or not _B64_RE.fullmatch(text):
        raise Malformed("embedded data is not base64")
    return len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))


def embedded_info(kind: str, node: dict) -> tuple[list[int], str, int]:
    """``(shape, dtype name, bytes)`` of an embedded tensor (``kind`` "inline") or array ("ndarray").

    Raises:
        ValueError: unknown or unsafe dtype, invalid shape, data that is not base64, or data whose
            length differs from what the shape and dtype need (checked before any allocation).
    """
    name = node.get("dtype")
    dtype = (_torch_dtype if kind == "inline" else _numpy_dtype)(name) if isinstance(name, str) else None
    if dtype is None:
        raise Malformed(f"unsupported {'tensor' if kind == 'inline' else 'array'} dtype {short_repr(name)}")
    shape = _shape(node.get("shape"))
    nbytes = math.prod(shape) * dtype.itemsize
    got = _b64_bytes(node.get(INLINE_TENSOR_TAG if kind == "inline" else NDARRAY_TAG))
    if got != nbytes:
        raise Malformed(f"embedded data holds {got} bytes, its shape {shape} and dtype need {nbytes}")
    dtype_name = str(dtype).removeprefix("torch.") if kind == "inline" else dtype.name
    return shape, dtype_name, nbytes


def _is_tag_node(node: dict, tag: str) -> bool:
    return len(node) == 1 and tag in node


def walk_tree(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """Yield ``(path, kind, node)`` for every leaf of a per-rank tree, validating every node on the way.

    ``kind`` is "tensor" (a DCP placeholder), "inline" (an embedded tensor), "ndarray" (an embedded
    numpy array) or "value". Every node is checked the way :func:`torch_ckpt.format._codec.join_state` will
    decode it, so a tree this walk accepts decodes without error. Iterative (no recursion).

    Raises:
        ValueError: a malformed node; the message names its dotted path.
    """
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, path)]
    while stack:
        node, where = stack.pop()
        try:
            if isinstance(node, list):
                stack.extend((v, where + (str(i),)) for i, v in reversed(list(enumerate(node))))
            elif not isinstance(node, dict):
                yield where, "value", node
            elif len(node) == 1 and TENSOR_TAG in node:
                if not isinstance(node[TENSOR_TAG], str):
                    raise Malformed(f"tensor placeholder {short_repr(node[TENSOR_TAG])} is not a key")
                yield where, "tensor", node
            elif INLINE_TENSOR_TAG in node:
                embedded_info("inline", node)
                yield where, "inline", node
            elif NDARRAY_TAG in node:
                embedded_info("ndarray", node)
                yield where, "ndarray", node
            elif NPSCALAR_TAG in node:
                name = node.get("dtype")
                dtype = _numpy_dtype(name) if isinstance(name, str) else None
                value = node[NPSCALAR_TAG]
                if dtype is None or isinstance(value, (dict, list)):
                    raise Malformed(f"invalid numpy scalar {short_repr(node)}")
                try:
                    dtype.type(value)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise Malformed(f"invalid numpy scalar {short_repr(node)} ({exc})") from None
                yield where, "value", node
            elif len(node) == 1 and BYTES_TAG in node:
                _b64_bytes(node[BYTES_TAG])
                yield where, "value", node
            elif len(node) == 1 and FLOAT_TAG in node:
                if not isinstance(node[FLOAT_TAG], str):
                    raise Malformed(f"invalid float {short_repr(node[FLOAT_TAG])}")
                try:
                    float(node[FLOAT_TAG])
                except ValueError:
                    raise Malformed(f"invalid float {short_repr(node[FLOAT_TAG])}") from None
                yield where, "value", node
            elif len(node) == 1 and TUPLE_TAG in node:
                if not isinstance(node[TUPLE_TAG], list):
                    raise Malformed(f"malformed {TUPLE_TAG} node")
                stack.extend((v, where + (str(i),)) for i, v in reversed(list(enumerate(node[TUPLE_TAG]))))
            elif len(node) == 1 and ODICT_TAG in node:  # an OrderedDict: its items, encoded as a dict's
                inner = node[ODICT_TAG]
                if not isinstance(inner, dict) or _is_tag_node(inner, ODICT_TAG):
                    raise Malformed(f"malformed {ODICT_TAG} node")
                stack.append((inner, where))
            elif len(node) == 1 and DICT_TAG in node:
                items = node[DICT_TAG]
                if not isinstance(items, list) or not all(isinstance(it, list) and len(it) == 2 and
                                                          not isinstance(it[0], list) for it in items):
                    raise Malformed(f"malformed {DICT_TAG} node")
                for key, value in reversed(items):  # a key is an encoded value too (tuple, bytes, numpy...)
                    label = str(key) if not isinstance(key, dict) else f"<key {short_repr(key)}>"
                    stack.append((value, where + (label,)))
                    if isinstance(key, dict):
                        stack.append((key, where + (label,)))
            else:
                stack.extend((v, where + (str(k),)) for k, v in reversed(list(node.items())))
        except Malformed as exc:
            raise Malformed(f"{'.'.join(where) or '<root>'}: {exc}") from None


def tensor_keys(tree: Any) -> set[str]:
    """Keys of the DCP tensors that a (validated) encoded tree refers to."""
    return {node[TENSOR_TAG] for _, kind, node in walk_tree(tree) if kind == "tensor"}
