"""The pickle of a plain tensor inside a ``torch.save`` record, decoded without executing it.

:func:`pickled_tensor` walks the opcodes of a record's ``data.pkl`` with :func:`pickletools.genops`
into inert values (nothing is imported or called) and matches the one structure ``torch.save``
writes for a plain tensor: its storage (type, key, element count) and its view (offset, shape,
stride). :func:`storage_identity` gives what a record of a given dtype must declare, from a real
record. :mod:`torch_ckpt.format._records` checks the zip structure around it and the declared chunks.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from functools import cache, lru_cache
from typing import Any

import torch

__all__ = ["RecordProblem", "pickled_tensor", "storage_identity", "stored_dtype"]


class RecordProblem(ValueError):
    """One problem of a record (message without file or key; it continues "the stored record ...")."""


_PUSH_ARG = {"BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_CONST = {"NEWFALSE": False, "NEWTRUE": True, "NONE": None, "EMPTY_TUPLE": (), "EMPTY_DICT": {}}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_MARK = object()


@lru_cache(maxsize=1024)  # records of tensors of one dtype and shape share their pickle bytes
def pickled_tensor(data: bytes) -> tuple[tuple[str, str], str, int, int, tuple[int, ...], tuple[int, ...]]:
    """``(identity, storage key, storage numel, offset, size, stride)`` of a pickled plain tensor.

    ``identity`` is ``("typed", "FloatStorage")`` for a tensor rebuilt from a typed storage (whose
    numel counts elements) or ``("untyped", "float8_e4m3fn")`` for one rebuilt from an untyped
    storage and a dtype (whose numel counts bytes).

    Interprets the opcodes of ``data`` into inert values (a global is a ``("global", module,
    name)`` tuple, a call a ``("call", f, args)`` tuple) without importing or calling anything,
    then matches the one structure ``torch.save`` writes for a plain tensor.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        if _MARK not in stack:
            raise RecordProblem("has a malformed tensor pickle")
        at = len(stack) - 1 - stack[::-1].index(_MARK)
        items = stack[at + 1:]
        del stack[at:]
        return items

    result = None
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name in _PUSH_ARG:
                stack.append(arg)
            elif name in _CONST:
                stack.append(_CONST[name])
            elif name == "GLOBAL":
                module, _, attr = arg.partition(" ")
                stack.append(("global", module, attr))
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif name in _TUPLES:
                n = _TUPLES[name]
                items, stack[-n:] = tuple(stack[-n:]), []
                stack.append(items)
            elif name == "BINPERSID":
                stack.append(("persid", stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(("call", stack.pop(), args))
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "STOP":
                result = stack.pop()
                break
            else:
                raise RecordProblem(f"has a tensor pickle using opcode {name}, which a plain tensor's does not")
    except (ValueError, IndexError, KeyError) as exc:
        if isinstance(exc, RecordProblem):
            raise
        raise RecordProblem(f"has a malformed tensor pickle ({exc})") from None
    if result is None or stack:
        raise RecordProblem("has a malformed tensor pickle")
    try:
        kind, func, args = result
        storage, offset, size, stride, requires_grad, hooks, *dtype = args
        tag, (what, stype, key, location, numel) = storage
        stype_kind, stype_module, stype_name = stype
    except (TypeError, ValueError):
        raise RecordProblem("has a pickle that is not a plain tensor") from None
    if func == ("global", "torch._utils", "_rebuild_tensor_v2") and not dtype and stype_module == "torch":
        identity = ("typed", stype_name)  # a typed storage (FloatStorage...): numel counts elements
    elif func == ("global", "torch._utils", "_rebuild_tensor_v3") and len(dtype) == 1 and \
            (stype_module, stype_name) == ("torch.storage", "UntypedStorage") and \
            isinstance(dtype[0], tuple) and dtype[0][:2] == ("global", "torch"):
        identity = ("untyped", dtype[0][2])  # dtypes without a typed storage: numel counts bytes
    else:
        raise RecordProblem("has a pickle that is not a plain tensor")
    ok = (kind == "call" and tag == "persid" and what == "storage" and stype_kind == "global"
          and isinstance(key, str) and isinstance(location, str) and type(numel) is int and numel >= 0
          and type(offset) is int and offset >= 0 and isinstance(size, tuple) and isinstance(stride, tuple)
          and len(size) == len(stride) and all(type(v) is int and v >= 0 for v in size + stride)
          and isinstance(requires_grad, bool) and hooks == ("call", ("global", "collections", "OrderedDict"), ()))
    if not ok:
        raise RecordProblem("has a pickle that is not a plain tensor")
    return identity, key, numel, offset, size, stride


@cache
def storage_identity(dtype: torch.dtype) -> tuple[str, str]:
    """The identity (see :func:`pickled_tensor`) of ``torch.save`` records of ``dtype`` (from a real record)."""
    buf = io.BytesIO()
    torch.save(torch.empty(0, dtype=dtype), buf)  # our own bytes: the standard zip reader is fine here
    with zipfile.ZipFile(buf) as archive:
        return pickled_tensor(archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl"))))[0]


_KNOWN_DTYPES = ("float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32", "int8", "int16",
                 "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def stored_dtype(identity: tuple[str, str]) -> str:
    """The dtype name of records of ``identity`` (for messages), or "unknown"."""
    if identity[0] == "untyped":
        return identity[1]
    for name in _KNOWN_DTYPES:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        try:
            if storage_identity(dtype) == identity:
                return name
        except (RuntimeError, TypeError, ValueError, KeyError, NotImplementedError):  # torch.save cannot write it
            continue
    return "unknown"
