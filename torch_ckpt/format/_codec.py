"""Split a nested state dict into DCP tensors and a JSON tree, and join them back.

Tensors go to ``torch.distributed.checkpoint`` (DCP) under flat, dot-joined keys (those of DCP's own
flattening); every other value goes to a JSON tree recording its exact Python type (``tuple`` stays
``tuple``, ``np.float32`` stays ``np.float32``), so loading never unpickles anything. Tensors of
*rank-local* subtrees (RNG states, dataloader positions) are embedded in the tree as base64: DCP
would deduplicate same-named tensors of several ranks as replicas.

For the same reason, with ``replicated_keys`` (the state's declaration, e.g. TrainState's
``("model", "optimizer")``) only plain tensors under those key prefixes and every
``DTensor``/``ShardedTensor`` are global tensors of the job; any other tensor is *per rank*: rank 0
stores it under its own key, rank ``r`` under ``__rank<r>__.<key>`` (:func:`rank_key`), and the
rank's tree names that key (:func:`logical_key` strips the prefix).

Supported values (each comes back with its exact type and value; also listed in ``docs/values.md``):

* ``None``, ``bool``, ``int`` (any size), ``float`` (nan and +-inf included), ``complex``, ``str``,
  ``bytes``, ``bytearray``;
* ``list``, ``tuple``, ``set`` and ``frozenset`` (set elements: hashable values of this list);
* ``dict`` and ``collections.OrderedDict`` (each comes back as its own type, same keys, same
  order) with keys of any hashable type of this list;
* numpy scalars of every boolean, integer, float, complex, ``str_``, ``bytes_``, ``datetime64``
  and ``timedelta64`` dtype; numpy arrays of those dtypes (exactly ``np.ndarray``; they come back
  C-contiguous);
* dense (strided) tensors, ``nn.Parameter``, ``DTensor`` and ``ShardedTensor``.

Everything else is refused by :func:`split_state` with a :class:`ConfigError` naming the key
path and what to store instead, before anything is written: subclasses of the types above (an
``IntEnum``, a namedtuple, a ``defaultdict``), ``Enum`` members, ``pathlib.Path``, dataclasses,
``datetime`` objects, numpy object or structured arrays and array subclasses, sparse, quantized,
nested and meta tensors, raw-bit and sub-byte dtypes, other tensor subclasses, containers that
contain themselves and nesting deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import functools
import json
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from torch_ckpt.errors import CheckpointCorruptError, ConfigError

__all__ = ["split_state", "join_state", "TENSOR_TAG", "MAX_DEPTH", "rank_key", "logical_key", "is_per_rank_key",
           "tensor_kind"]

TENSOR_TAG, INLINE_TENSOR_TAG, NDARRAY_TAG = "__tensor__", "__tensor_b64__", "__ndarray_b64__"
NPSCALAR_TAG, _NPSCALAR_RAW, TUPLE_TAG, DICT_TAG = "__np_scalar__", "__np_scalar_b64__", "__tuple__", "__dict__"
BYTES_TAG, _BYTEARRAY, FLOAT_TAG, _COMPLEX = "__bytes_b64__", "__bytearray_b64__", "__float__", "__complex__"
_BIGINT, _SET, _FROZENSET = "__int_hex__", "__set__", "__frozenset__"
ODICT_TAG = "__odict__"  # wraps the encoding of an OrderedDict's items (a plain dict node or a __dict__ node)
_TAGS = {TENSOR_TAG, INLINE_TENSOR_TAG, NDARRAY_TAG, NPSCALAR_TAG, _NPSCALAR_RAW, TUPLE_TAG, DICT_TAG, BYTES_TAG,
         _BYTEARRAY, FLOAT_TAG, _COMPLEX, _BIGINT, _SET, _FROZENSET, ODICT_TAG}

#: Deepest nesting of containers (dicts, lists, tuples, sets) a state may have.
MAX_DEPTH = 100
# ints beyond this many bits are stored as hex text (Python's JSON refuses more than 4300 decimal digits)
_JSON_INT_BITS = 4096
# numpy scalar kinds stored as a JSON value (exact for these item sizes), and those stored as raw bytes
_NP_VALUE_KINDS, _NP_RAW_KINDS = {"b", "i", "u", "U"}, {"f", "c", "M", "m", "S"}
_RANK_PREFIX = "__rank"
_RANK_KEY_RE = re.compile(r"__rank(\d+)__\.")


def rank_key(key: str, rank: int) -> str:
    """The DCP key of rank ``rank``'s own (per-rank) tensor at state key ``key``: ``key`` itself on rank 0."""
    return key if rank == 0 else f"{_RANK_PREFIX}{rank}__.{key}"


def logical_key(key: str) -> str:
    """The state key of DCP key ``key`` (``__rank<r>__.`` removed; other keys unchanged)."""
    m = _RANK_KEY_RE.match(key) if key.startswith(_RANK_PREFIX) else None
    return key if m is None else key[m.end():]


def is_per_rank_key(key: str) -> bool:
    """True for the DCP key of a per-rank tensor of a rank other than 0 (``__rank<r>__.<key>``)."""
    return key.startswith(_RANK_PREFIX) and _RANK_KEY_RE.match(key) is not None


@functools.lru_cache(maxsize=64)
def _prefixes(replicated_keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p + "." for p in replicated_keys)


def tensor_kind(key: str, t: torch.Tensor, replicated_keys: tuple[str, ...] | None) -> str:
    """How DCP key ``key`` of :func:`split_state` is stored: "sharded", "replicated" or "rank" (per rank)."""
    if isinstance(t, _distributed_tensor_types()):
        return "sharded"
    if is_per_rank_key(key):
        return "rank"
    if replicated_keys is None or key.startswith(_prefixes(tuple(replicated_keys))) or key in replicated_keys:
        return "replicated"
    return "rank"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _refuse(path: str, what: str, advice: str) -> ConfigError:
    return ConfigError(f"state key {path or '<root>'!r} holds {what}, which cannot be checkpointed exactly without "
                       f"pickling; {advice}")


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}".removeprefix("builtins.")


@functools.lru_cache(maxsize=1)
def _distributed_tensor_types() -> tuple[type, ...]:
    """Tensor subclasses DCP stores as shards (imported lazily: torch.distributed is heavy)."""
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return ()
    return DTensor, ShardedTensor


# raw-bit and sub-byte dtypes: DCP's planner or the staging copy fail on them (in the background)
_UNSUPPORTED_DTYPES = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and (
    str(d).startswith("torch.bits") or re.fullmatch(r"torch\.u?int[1-7]", str(d))))


def _check_tensor(t: torch.Tensor, path: str, *, inline: bool) -> None:
    """Refuse tensors that DCP (or the inline encoding) cannot store and restore exactly."""
    kind = type(t)
    if t.dtype in _UNSUPPORTED_DTYPES:
        raise _refuse(path, f"a tensor of dtype {t.dtype}", "store it as a tensor of a byte-sized dtype (e.g. "
                      "t.view(torch.uint8) or a packed uint8 tensor)")
    if kind is not torch.Tensor:
        if inline:
            raise _refuse(path, f"a {_type_name(t)} in a rank-local part of the state", "only plain tensors can be "
                          "stored per rank; move it out of the rank-local part of the state")
        if kind is not torch.nn.Parameter:
            if isinstance(t, _distributed_tensor_types()):
                return  # DTensor / ShardedTensor: DCP saves and loads their local shards
            raise _refuse(path, f"a tensor subclass {_type_name(t)}", "store a plain tensor (e.g. t.detach().clone() "
                          "or its plain components) instead; supported are torch.Tensor, nn.Parameter, DTensor and "
                          "ShardedTensor")
    if t.layout is not torch.strided:
        raise _refuse(path, f"a sparse tensor (layout {t.layout})", "store t.to_dense(), or its indices()/values() "
                      "and its shape as separate entries")
    if t.is_quantized:
        raise _refuse(path, f"a quantized tensor ({t.dtype})", "store t.dequantize(), or t.int_repr() with its scale "
                      "and zero point as separate entries")
    if t.is_nested:
        raise _refuse(path, "a nested tensor", "store its components (t.unbind()) as a list of tensors")
    if t.device.type == "meta":
        raise _refuse(path, "a meta tensor (no data)", "materialise it (e.g. module.to_empty(device=...) and "
                      "initialise it) before saving")


def _encode_inline_tensor(t: torch.Tensor, path: str) -> dict:
    _check_tensor(t, path, inline=True)
    cpu = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {INLINE_TENSOR_TAG: _b64(raw), "dtype": str(cpu.dtype).removeprefix("torch."), "shape": list(cpu.shape),
            "device": str(t.device)}


def _decode_inline_tensor(node: dict) -> torch.Tensor:
    dtype = getattr(torch, node["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"unknown tensor dtype {node['dtype']!r} in checkpoint JSON")
    raw = bytearray(base64.b64decode(node[INLINE_TENSOR_TAG]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(node["shape"]).clone()


def _np_dtype_name(obj: np.generic) -> str | None:
    """A dtype string that maps back to ``type(obj)`` exactly (``np.longlong`` is not ``np.int64``), or None."""
    for name in (obj.dtype.str, obj.dtype.char):
        try:
            if np.dtype(name).type is type(obj):
                return name
        except TypeError:
            continue
    return None


def _encode_np_scalar(obj: np.generic, path: str) -> dict:
    kind = obj.dtype.kind
    name = _np_dtype_name(obj)
    if name is None or kind not in _NP_VALUE_KINDS | _NP_RAW_KINDS:
        raise _refuse(path, f"a numpy scalar of type {_type_name(obj)} (dtype {obj.dtype})",
                      "store a numpy scalar of a boolean, integer, float, complex, str, bytes, datetime64 or "
                      "timedelta64 dtype, or its .item()")
    if kind in _NP_VALUE_KINDS:
        return {NPSCALAR_TAG: str(obj) if kind == "U" else obj.item(), "dtype": name}  # numpy ints: <= 64 bits
    raw = bytes(obj) if kind == "S" else np.array(obj).tobytes()
    return {_NPSCALAR_RAW: _b64(raw), "dtype": name}


def _decode_np_scalar_raw(node: dict) -> np.generic:
    dtype, raw = np.dtype(node["dtype"]), base64.b64decode(node[_NPSCALAR_RAW])
    return dtype.type(raw) if dtype.kind == "S" else np.frombuffer(raw, dtype=dtype)[0]


def _encode_ndarray(arr: np.ndarray, path: str) -> dict:
    if type(arr) is not np.ndarray:
        raise _refuse(path, f"a numpy array subclass {_type_name(arr)}", "store np.asarray(value) (a plain ndarray)")
    if arr.dtype.kind in ("O", "V") or arr.dtype.hasobject or arr.dtype.names is not None:
        what = "an object array" if arr.dtype.kind == "O" else f"a structured or void array (dtype {arr.dtype})"
        raise _refuse(path, f"a numpy {what}", "store an array of a numeric, bool, str, bytes, datetime64 or "
                      "timedelta64 dtype (for structured arrays: one array per field), or a list of plain values")
    if np.dtype(arr.dtype.str) != arr.dtype:
        raise _refuse(path, f"a numpy array of dtype {arr.dtype}", "store an array of a standard dtype")
    return {NDARRAY_TAG: _b64(np.ascontiguousarray(arr).tobytes()), "dtype": arr.dtype.str, "shape": list(arr.shape)}


def _advice_for(obj: Any) -> str:
    if isinstance(obj, enum.Enum):
        return "store its .value or .name and rebuild the enum member after loading"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "store it as a dict (obj._asdict()) or a plain tuple"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "store dataclasses.asdict(obj) and rebuild it after loading"
    if hasattr(obj, "__fspath__"):
        return "store str(path)"
    if isinstance(obj, (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)):
        return "convert it to the plain builtin type (int, float, str, bytes, list, tuple, dict, set)"
    if hasattr(obj, "state_dict"):
        return "store obj.state_dict() instead"
    return ("store tensors, numpy arrays or scalars, or plain Python values (None, bool, int, float, complex, str, "
            "bytes, list, tuple, dict, set)")


def split_state(state: Any, *, rank_local_keys: tuple[str, ...] = (), replicated_keys: tuple[str, ...] | None = None,
                rank: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    """Separate the tensors of a nested state dict from its plain values, refusing what cannot round-trip.

    Args:
        state: nested containers whose leaves are values of the supported set (module docstring).
        rank_local_keys: top-level keys whose tensors are embedded per rank in the JSON tree.
        replicated_keys: key prefixes (``"model"``, ``"extras.ema"``) whose plain tensors are the
            same on every rank (stored once by DCP); every other plain tensor is stored per rank,
            under :func:`rank_key` of ``rank``. None: every tensor is global (DCP's own semantics).
        rank: this rank (names the keys of per-rank tensors).

    Returns:
        ``(tensors, tree)``: a flat ``{dotted_key: tensor}`` dict for DCP (the live tensors, not
        copies) and a JSON-serialisable tree with ``{"__tensor__": key}`` placeholders.

    Raises:
        ConfigError: a value is outside the supported set, a container contains itself or is
            nested deeper than :data:`MAX_DEPTH`, two paths flatten to the same key, or a tensor key
            starts with the reserved ``__rank<N>__.``; the message names the key path and what to
            store instead. Raised before anything is written.
    """
    tensors: dict[str, torch.Tensor] = {}
    replicated = None if replicated_keys is None else tuple(replicated_keys)

    def dcp_key(obj: torch.Tensor, key: str) -> str:
        if is_per_rank_key(key):
            raise ConfigError(f"state key {key!r} starts with '__rank<N>__.', which names per-rank tensors in "
                              "checkpoints; rename it")
        return rank_key(key, rank) if rank and tensor_kind(key, obj, replicated) == "rank" else key

    active: set[int] = set()  # ids of the containers on the current path (cycle detection)

    def enter(obj: Any, key: str, depth: int) -> None:
        if id(obj) in active:
            raise _refuse(key, f"a {_type_name(obj)} that contains itself", "break the reference cycle")
        if depth > MAX_DEPTH:
            raise ConfigError(f"state key {key!r} is nested deeper than {MAX_DEPTH} containers; flatten the state")
        active.add(id(obj))

    def enc_hashable(obj: Any, key: str, depth: int) -> Any:
        """A dict key or set element: a hashable value of the supported set, never a tensor or array."""
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            raise _refuse(key, f"a {_type_name(obj)} as a dict key or set element", "use plain values as keys")
        return enc(obj, key, False, depth)

    def enc(obj: Any, key: str, local: bool, depth: int, path: tuple[str, ...] = ()) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            if local:
                return _encode_inline_tensor(obj, key)
            _check_tensor(obj, key, inline=False)
            name = dcp_key(obj, key)
            if name in tensors:
                raise ConfigError(f"state key {key!r} occurs twice after flattening nested keys with '.'; rename one")
            tensors[name] = obj
            return {TENSOR_TAG: name}
        if obj is None or kind is bool or kind is str:
            return obj
        if kind is int:
            return obj if obj.bit_length() <= _JSON_INT_BITS else {_BIGINT: hex(obj)}
        if kind is float:
            return obj if obj == obj and obj not in (float("inf"), float("-inf")) else {FLOAT_TAG: repr(obj)}
        if kind is complex:
            return {_COMPLEX: [enc(obj.real, key, local, depth), enc(obj.imag, key, local, depth)]}
        if kind is bytes:
            return {BYTES_TAG: _b64(obj)}
        if kind is bytearray:
            return {_BYTEARRAY: _b64(bytes(obj))}
        if isinstance(obj, np.ndarray):
            return _encode_ndarray(obj, key)
        if isinstance(obj, np.generic):
            return _encode_np_scalar(obj, key)
        if kind is dict or kind is OrderedDict:
            enter(obj, key, depth)
            sub_local = lambda k: local or (not path and k in rank_local_keys)  # noqa: E731
            if all(type(k) is str for k in obj) and not any(k in _TAGS for k in obj):
                out = {k: enc(v, _join(key, k), sub_local(k), depth + 1, path + (k,)) for k, v in obj.items()}
            else:
                items = []
                for k, v in obj.items():
                    name = k if type(k) is str else str(k)
                    items.append([enc_hashable(k, _join(key, name), depth + 1),
                                  enc(v, _join(key, name), sub_local(name), depth + 1, path + (name,))])
                out = {DICT_TAG: items}
            active.discard(id(obj))
            return {ODICT_TAG: out} if kind is OrderedDict else out
        if kind is list or kind is tuple:
            enter(obj, key, depth)
            out = [enc(v, _join(key, str(i)), local, depth + 1, path + (str(i),)) for i, v in enumerate(obj)]
            active.discard(id(obj))
            return {TUPLE_TAG: out} if kind is tuple else out
        if kind is set or kind is frozenset:
            enter(obj, key, depth)
            elems = [enc_hashable(v, key, depth + 1) for v in obj]
            active.discard(id(obj))
            elems.sort(key=lambda e: json.dumps(e, sort_keys=True))  # deterministic on every rank
            return {_SET if kind is set else _FROZENSET: elems}
        raise _refuse(key, f"a value of type {_type_name(obj)}", _advice_for(obj))

    tree = enc(state, "", False, 0)
    return tensors, tree


def _join(key: str, part: str) -> str:
    return f"{key}.{part}" if key else part


def join_state(tree: Any, tensors: dict[str, torch.Tensor] | Any) -> Any:
    """Rebuild the nested state from a JSON tree and loaded tensors (inverse of :func:`split_state`).

    Raises:
        CheckpointCorruptError: a placeholder names a tensor that ``tensors`` lacks, or a tagged node
            is malformed.
    """

    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if node:
            if TENSOR_TAG in node and len(node) == 1:
                key = node[TENSOR_TAG]
                if key not in tensors:
                    raise CheckpointCorruptError(f"state refers to tensor {key!r}, which the checkpoint does not hold "
                                                 "as a tensor")
                return tensors[key]
            if INLINE_TENSOR_TAG in node:
                return _decode_inline_tensor(node)
            if NDARRAY_TAG in node:
                return np.frombuffer(base64.b64decode(node[NDARRAY_TAG]), dtype=np.dtype(node["dtype"])).reshape(
                    node["shape"]).copy()
            if NPSCALAR_TAG in node:
                return np.dtype(node["dtype"]).type(node[NPSCALAR_TAG])
            if _NPSCALAR_RAW in node:
                return _decode_np_scalar_raw(node)
            if len(node) == 1:
                tag, value = next(iter(node.items()))
                if tag in single:
                    return single[tag](value)
        return {k: dec(v) for k, v in node.items()}

    def odict(value: Any) -> OrderedDict:
        inner = dec(value)
        if not isinstance(inner, dict):
            raise TypeError(f"{ODICT_TAG} holds a {type(inner).__name__}, not a mapping")
        return OrderedDict(inner)

    single = {BYTES_TAG: base64.b64decode, _BYTEARRAY: lambda v: bytearray(base64.b64decode(v)), FLOAT_TAG: float,
              _BIGINT: lambda v: int(v, 16), _COMPLEX: lambda v: complex(dec(v[0]), dec(v[1])),
              TUPLE_TAG: lambda v: tuple(dec(x) for x in v), _SET: lambda v: {dec(x) for x in v},
              _FROZENSET: lambda v: frozenset(dec(x) for x in v), DICT_TAG: lambda v: {dec(k): dec(x) for k, x in v},
              ODICT_TAG: odict}

    try:
        return dec(tree)
    except CheckpointCorruptError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise CheckpointCorruptError(f"malformed value in the checkpoint's state tree ({type(exc).__name__}: {exc})") \
            from exc
