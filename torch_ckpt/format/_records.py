"""Checks of the ``torch.save`` records in DCP data files against ``.metadata``, unpickling nothing.

DCP ``torch.load``-s a record's byte range and copies it into its target, casting silently, so
metadata that disagrees with the records (a range a few bytes short, another dtype or shape) fails
deep inside the load or loads wrong values. :func:`storage_record_problems` parses each record's zip
structure with ``struct`` and its ``data.pkl`` with :func:`pickled_tensor` (opcodes decoded into
inert values) and checks: the archive ends exactly where the range does, its entries lie inside it
uncompressed, the pickle is exactly a plain tensor of one storage of the declared dtype, whose data
entry holds exactly that storage and whose view has the chunk's shape inside it. Only the header
bytes of each record are read.
"""

from __future__ import annotations

import io
import math
import pickletools
import struct
import zipfile
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from functools import cache, lru_cache
from typing import Any, Protocol

import torch

__all__ = ["MAX_PICKLE_BYTES", "RangeReader", "RecordProblem", "pickled_tensor", "storage_identity",
           "storage_record_problems", "stored_dtype"]

MAX_PICKLE_BYTES = 64 << 10
"""Largest ``data.pkl`` entry read from a tensor record (bytes); a plain tensor's is ~200."""
_MAX_ENTRIES = 64  # most zip entries in one record (torch.save of one tensor writes 7)
_BLOCK_BYTES = 64 << 10

_EOCD, _EOCD_SIZE = b"PK\x05\x06", 22
_LOCATOR, _LOCATOR_SIZE = b"PK\x06\x07", 20
_EOCD64, _EOCD64_SIZE = b"PK\x06\x06", 56
_CENTRAL, _CENTRAL_SIZE = b"PK\x01\x02", 46
_LOCAL, _LOCAL_SIZE = b"PK\x03\x04", 30
_SAT16, _SAT32 = 0xFFFF, 0xFFFFFFFF


class RecordProblem(ValueError):
    """One problem of a record (message without file or key; it continues "the stored record ...")."""


class RangeReader(Protocol):
    """A readable file: its size in bytes, and ``read_at(offset, length) -> bytes`` (short at its end)."""

    size: int

    def read_at(self, offset: int, length: int) -> bytes: ...


# ---------------------------------------------------------------------------------------------
# the pickle of a plain tensor

_PUSH_ARG = {"BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_CONST: dict[str, Any] = {"NEWFALSE": False, "NEWTRUE": True, "NONE": None, "EMPTY_TUPLE": (), "EMPTY_DICT": {}}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_MARK = object()


def _interpret(data: bytes) -> Any:
    """The pickle's result as inert values: a global is ``("global", module, name)``, a call ``("call", f, args)``."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    arg: Any
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
                stack.append(("global", *arg.split(" ", 1)))
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                if _MARK not in stack:
                    raise RecordProblem("has a malformed tensor pickle")
                at = len(stack) - 1 - stack[::-1].index(_MARK)
                items = tuple(stack[at + 1:])
                del stack[at:]
                stack.append(items)
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
                if stack:
                    break
                return result
            else:
                raise RecordProblem(f"has a tensor pickle using opcode {name}, which a plain tensor's does not")
    except RecordProblem:
        raise
    except (ValueError, IndexError, KeyError) as exc:
        raise RecordProblem(f"has a malformed tensor pickle ({exc})") from None
    raise RecordProblem("has a malformed tensor pickle")


@lru_cache(maxsize=1024)  # records of tensors of one dtype and shape share their pickle bytes
def pickled_tensor(data: bytes) -> tuple[tuple[str, str], str, int, int, tuple[int, ...], tuple[int, ...]]:
    """``(identity, storage key, storage numel, offset, size, stride)`` of a pickled plain tensor.

    ``identity`` is ``("typed", "FloatStorage")`` (numel counts elements) or ``("untyped",
    "float8_e4m3fn")`` (an untyped storage and a dtype; numel counts bytes). Nothing is imported or
    called; RecordProblem unless the pickle is exactly the structure ``torch.save`` writes.
    """
    result = _interpret(data)
    try:
        kind, func, args = result
        storage, offset, size, stride, requires_grad, hooks, *dtype = args
        tag, (what, stype, key, location, numel) = storage
        stype_kind, stype_module, stype_name = stype
    except (TypeError, ValueError):
        raise RecordProblem("has a pickle that is not a plain tensor") from None
    if func == ("global", "torch._utils", "_rebuild_tensor_v2") and not dtype and stype_module == "torch":
        identity = ("typed", stype_name)
    elif func == ("global", "torch._utils", "_rebuild_tensor_v3") and len(dtype) == 1 and \
            (stype_module, stype_name) == ("torch.storage", "UntypedStorage") and \
            isinstance(dtype[0], tuple) and dtype[0][:2] == ("global", "torch"):
        identity = ("untyped", dtype[0][2])  # dtypes without a typed storage
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
        try:
            if isinstance(dtype, torch.dtype) and storage_identity(dtype) == identity:
                return name
        except (RuntimeError, TypeError, ValueError, KeyError, NotImplementedError):  # torch.save cannot write it
            continue
    return "unknown"


# ---------------------------------------------------------------------------------------------
# the zip structure of a record


class _Blocks:
    """Byte ranges of a file through a small cache of aligned blocks (records of small tensors share blocks)."""

    def __init__(self, reader: RangeReader) -> None:
        self._reader = reader
        self._cache: dict[int, bytes] = {}

    def get(self, offset: int, length: int) -> bytes:
        if length > _BLOCK_BYTES:
            return self._reader.read_at(offset, length)
        first, last = offset // _BLOCK_BYTES, (offset + max(length, 1) - 1) // _BLOCK_BYTES
        parts = []
        for block in range(first, last + 1):
            if block not in self._cache:
                if len(self._cache) >= 8:
                    self._cache.clear()
                self._cache[block] = self._reader.read_at(block * _BLOCK_BYTES, _BLOCK_BYTES)
            parts.append(self._cache[block])
        start = offset - first * _BLOCK_BYTES
        return b"".join(parts)[start:start + length]


def _unpack(fmt: str, data: bytes, at: int = 0) -> tuple:
    return struct.unpack_from("<" + fmt, data, at)


class _Record:
    """One record: a byte range ``[start, start + length)`` of a file read through ``blocks``."""

    def __init__(self, blocks: _Blocks, start: int, length: int) -> None:
        self.blocks, self.start, self.length = blocks, start, length

    def read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RecordProblem(f"has its {what} at record bytes {offset}..{offset + length}, outside its "
                                f"{self.length} bytes")
        data = self.blocks.get(self.start + offset, length)
        if len(data) != length:
            raise RecordProblem(f"lies past the end of the file (its {what} is beyond the file's last byte)")
        return data


def _central_directory(rec: _Record) -> tuple[int, int, int]:
    """``(entries, offset, size)`` of the record's central directory; the archive must end where the range does."""
    if rec.length < _EOCD_SIZE:
        raise RecordProblem(f"is {rec.length} bytes, too short for a torch.save record")
    eocd = rec.read(rec.length - _EOCD_SIZE, _EOCD_SIZE, "end of central directory")
    if eocd[:4] != _EOCD:
        raise RecordProblem("does not end with a zip end-of-central-directory record (the declared byte range is "
                            "truncated or shifted)")
    disk, cd_disk, on_disk, entries, cd_size, cd_offset, comment = _unpack("HHHHIIH", eocd, 4)
    end = rec.length - _EOCD_SIZE
    if comment or disk or cd_disk or on_disk != entries:
        raise RecordProblem("has a zip end-of-central-directory record unlike the one torch.save writes")
    if rec.length >= _EOCD_SIZE + _LOCATOR_SIZE:
        loc = rec.read(end - _LOCATOR_SIZE, _LOCATOR_SIZE, "ZIP64 locator")
        if loc[:4] == _LOCATOR:
            _, eocd64_at, _ = _unpack("IQI", loc, 4)
            if eocd64_at + _EOCD64_SIZE != end - _LOCATOR_SIZE:
                raise RecordProblem("has a ZIP64 end-of-central-directory record that is not where its locator says")
            rec64 = rec.read(eocd64_at, _EOCD64_SIZE, "ZIP64 end of central directory")
            if rec64[:4] != _EOCD64:
                raise RecordProblem("lacks the ZIP64 end-of-central-directory record its locator names")
            _, _, _, _, _, on_disk64, entries64, cd_size64, cd_offset64 = _unpack("QHHIIQQQQ", rec64, 4)
            for small, big, name in ((entries, entries64, "entry count"), (cd_size, cd_size64, "directory size"),
                                     (cd_offset, cd_offset64, "directory offset")):
                if small not in (big, _SAT16 if name == "entry count" else _SAT32):
                    raise RecordProblem(f"has a zip {name} {small} that disagrees with its ZIP64 value {big}")
            entries, cd_size, cd_offset, end = entries64, cd_size64, cd_offset64, eocd64_at
    if _SAT32 in (cd_size, cd_offset) or entries == _SAT16:
        raise RecordProblem("lacks the ZIP64 records its central directory needs")
    if not 1 <= entries <= _MAX_ENTRIES or cd_offset + cd_size != end:
        raise RecordProblem(f"has a zip central directory ({entries} entries, bytes {cd_offset}..{cd_offset + cd_size})"
                            " that does not end where the archive does")
    return entries, cd_offset, cd_size


@lru_cache(maxsize=1024)  # records of tensors of one dtype and shape share their directory bytes
def _parse_directory(cd: bytes, count: int) -> dict[str, tuple[int, int, int, int]]:
    """``{name: (method, compressed, uncompressed, local header offset)}`` of a central directory (do not mutate)."""
    out: dict[str, tuple[int, int, int, int]] = {}
    at = 0
    for _ in range(count):
        if cd[at:at + 4] != _CENTRAL or at + _CENTRAL_SIZE > len(cd):
            raise RecordProblem("has a malformed zip central directory")
        method, = _unpack("H", cd, at + 10)
        comp, size, n_name, n_extra, n_comment = _unpack("IIHHH", cd, at + 20)
        local, = _unpack("I", cd, at + 42)
        name_end = at + _CENTRAL_SIZE + n_name
        if name_end + n_extra + n_comment > len(cd):
            raise RecordProblem("has a malformed zip central directory")
        name = cd[at + _CENTRAL_SIZE:name_end].decode("utf-8", "replace")
        extra = cd[name_end:name_end + n_extra]
        wide = [v == _SAT32 for v in (size, comp, local)]
        if any(wide):  # ZIP64 extended information: the saturated values, in this order
            values, pos = [size, comp, local], 0
            while pos + 4 <= len(extra):
                tag, n = _unpack("HH", extra, pos)
                if tag == 1:
                    field = pos + 4
                    for i in (i for i in range(3) if wide[i]):
                        if field + 8 > pos + 4 + n:
                            raise RecordProblem(f"has a short ZIP64 field in zip entry {name!r}")
                        values[i], field = _unpack("Q", extra, field)[0], field + 8
                    break
                pos += 4 + n
            else:
                raise RecordProblem(f"lacks the ZIP64 field zip entry {name!r} needs")
            size, comp, local = values
        if name in out:
            raise RecordProblem(f"has the zip entry {name!r} twice")
        out[name] = (method, comp, size, local)
        at = name_end + n_extra + n_comment
    return out


def _entry_data(rec: _Record, name: str, entry: tuple[int, int, int, int], cd_offset: int) -> tuple[int, int]:
    """``(offset, size)`` of an entry's data inside the record, after checking its local header."""
    method, comp, size, local = entry
    if method != 0 or comp != size:
        raise RecordProblem(f"has a compressed zip entry {name!r}; torch.save stores entries uncompressed")
    header = rec.read(local, _LOCAL_SIZE, f"local header of {name!r}")
    if header[:4] != _LOCAL:
        raise RecordProblem(f"lacks the zip local header of {name!r}")
    n_name, n_extra = _unpack("HH", header, 26)
    if rec.read(local + _LOCAL_SIZE, n_name, f"name of {name!r}").decode("utf-8", "replace") != name:
        raise RecordProblem(f"has a zip local header of {name!r} that names another entry")
    start = local + _LOCAL_SIZE + n_name + n_extra
    if start + size > cd_offset:
        raise RecordProblem(f"has a zip entry {name!r} ({size} bytes at record byte {start}) overlapping its central "
                            "directory")
    return start, size


def _check(rec: _Record, dtype: torch.dtype, sizes: tuple[int, ...]) -> None:
    count, cd_offset, cd_size = _central_directory(rec)
    entries = _parse_directory(rec.read(cd_offset, cd_size, "zip central directory"), count)
    pickles = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise RecordProblem("is not a torch.save record (no single data.pkl entry)")
    start, size = _entry_data(rec, pickles[0], entries[pickles[0]], cd_offset)
    if size > MAX_PICKLE_BYTES:
        raise RecordProblem(f"has a tensor pickle of {size} bytes, more than the {MAX_PICKLE_BYTES} accepted")
    identity, key, numel, offset, shape, stride = pickled_tensor(rec.read(start, size, "data.pkl"))
    data_name = f"{pickles[0][: -len('data.pkl')]}data/{key}"
    if data_name not in entries:
        raise RecordProblem(f"lacks its tensor data entry {data_name!r}")
    _, data_bytes = _entry_data(rec, data_name, entries[data_name], cd_offset)
    name = str(dtype).removeprefix("torch.")
    if identity != storage_identity(dtype):
        raise RecordProblem(f"holds {stored_dtype(identity)} data but .metadata declares {name}")
    nbytes = numel * dtype.itemsize if identity[0] == "typed" else numel
    if nbytes != data_bytes or nbytes % dtype.itemsize:
        raise RecordProblem(f"holds {data_bytes} bytes of tensor data, but its storage of {name} declares {nbytes}")
    numel = nbytes // dtype.itemsize
    if shape != tuple(sizes):
        raise RecordProblem(f"holds a tensor of shape {list(shape)}, but .metadata declares the chunk as {list(sizes)}")
    if math.prod(shape) and offset + sum((s - 1) * st for s, st in zip(shape, stride)) >= numel:
        raise RecordProblem(f"has a tensor view (offset {offset}, shape {list(shape)}, stride {list(stride)}) outside "
                            f"its {numel}-element storage")


def storage_record_problems(md: Any, tensors: dict[str, Any],
                            open_file: Callable[[str], AbstractContextManager[RangeReader]],
                            files: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """``[(file, problem naming key, chunk and byte range)]`` for the records of ``tensors`` (the well-formed
    ``{key: TensorStorageMetadata}`` of validated ``md``) in ``files`` (None: all).

    ``open_file(name)`` is a context manager yielding a :class:`RangeReader`; its ``OSError`` or
    ``CheckpointCorruptError`` propagates.
    """
    by_file: dict[str, list[tuple[int, int, str, tuple[int, ...]]]] = {}
    chunk_sizes = {(key, tuple(c.offsets)): tuple(c.sizes) for key, item in tensors.items() for c in item.chunks}
    wanted = None if files is None else set(files)
    for index, info in md.storage_data.items():
        rel = str(info.relative_path)
        if index.fqn in tensors and index.offset is not None and (wanted is None or rel in wanted):
            by_file.setdefault(rel, []).append((info.offset, info.length, index.fqn, tuple(index.offset)))
    problems: list[tuple[str, str]] = []
    for rel, items in sorted(by_file.items()):
        with open_file(rel) as reader:
            blocks = _Blocks(reader)
            for offset, length, key, chunk_offset in sorted(items):
                sizes = chunk_sizes.get((key, chunk_offset))
                if sizes is None:
                    continue  # a storage entry without a chunk: reported by metadata_problems
                try:
                    _check(_Record(blocks, offset, length), tensors[key].properties.dtype, sizes)
                except RecordProblem as exc:
                    problems.append((rel, f"tensor {key!r}, chunk at offset {list(chunk_offset)} (bytes "
                                          f"{offset}..{offset + length}): the stored record {exc}"))
    return problems
