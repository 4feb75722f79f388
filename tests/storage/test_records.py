"""Tensor records inside DCP data files (torch_ckpt.format._records): checked against .metadata without unpickling.

Records are built with ``torch.save`` (zip CRC included, as plain DCP writes them) and with
torch-ckpt's own writer (tests/storage/, tests/tools/test_cli_tools.py and test_bad_input.py cover the
whole-checkpoint paths); here each record is declared by hand to test one check at a time.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from torch_ckpt.format._records import storage_record_problems

FILE = "__0_0.distcp"


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.size = data, len(data)

    def read_at(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]


def _record(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _problems(records: list[bytes], declared: list[tuple[torch.dtype, tuple[int, ...]]], *,
              lengths: list[int] | None = None) -> list[tuple[str, str]]:
    """Problems of ``records`` laid end to end in one file, record i declared as ``declared[i]`` (dtype, shape)."""
    data = b"".join(records)
    tensors, storage, at = {}, {}, 0
    for i, (record, (dtype, shape)) in enumerate(zip(records, declared)):
        key, offsets = f"t{i}", torch.Size([0] * len(shape))
        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                             [ChunkStorageMetadata(offsets, torch.Size(shape))])
        length = len(record) if lengths is None else lengths[i]
        storage[MetadataIndex(key, offsets)] = _StorageInfo(FILE, at, length)
        at += len(record)
    md = Metadata(state_dict_metadata=dict(tensors), storage_data=storage)

    @contextmanager
    def open_file(name: str):
        assert name == FILE
        yield _Bytes(data)

    return storage_record_problems(md, tensors, open_file)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.uint16, torch.uint32])
def test_records_of_every_common_dtype_match_their_declaration(dtype):
    """A torch.save record of each common dtype, declared as saved, has no problem."""
    tensor = torch.ones(3, 5).to(dtype)
    assert _problems([_record(tensor)], [(dtype, (3, 5))]) == []


@pytest.mark.parametrize("tensor", [torch.tensor(3.0), torch.empty(0, 4), torch.arange(12.0).reshape(3, 4).t(),
                                    torch.arange(10.0)[2:7]], ids=["0-dim", "empty", "transposed", "view-at-offset"])
def test_unusual_layouts_are_accepted(tensor):
    """0-dim, empty, non-contiguous and offset views are plain tensors of their shape."""
    assert _problems([_record(tensor)], [(tensor.dtype, tuple(tensor.shape))]) == []


def test_several_records_in_one_file_are_each_checked():
    """Of three consecutive records, only the misdeclared middle one is reported, naming its key and bytes."""
    records = [_record(torch.ones(4)), _record(torch.ones(2, 2)), _record(torch.ones(3))]
    problems = _problems(records, [(torch.float32, (4,)), (torch.float64, (2, 2)), (torch.float32, (3,))])
    start, end = len(records[0]), len(records[0]) + len(records[1])
    assert [(f, "'t1'" in p and f"bytes {start}..{end}" in p) for f, p in problems] == [(FILE, True)], problems


@pytest.mark.parametrize("delta", [-8, -1, 8])
def test_byte_range_not_ending_at_the_record_end_is_reported(delta):
    """A storage length a few bytes short of (or past) the record is reported: the archive must end at the range end."""
    records = [_record(torch.ones(16)), _record(torch.zeros(16))]
    problems = _problems(records, [(torch.float32, (16,))] * 2, lengths=[len(records[0]) + delta, len(records[1])])
    assert [f for f, _ in problems] == [FILE] and "'t0'" in problems[0][1], problems


def test_range_past_the_end_of_the_file_is_reported():
    """A record whose declared range runs past the real end of the file is reported, not read short."""
    record = _record(torch.ones(16))
    problems = _problems([record], [(torch.float32, (16,))], lengths=[len(record) + 100])
    assert len(problems) == 1 and "past the end of the file" in problems[0][1], problems


@pytest.mark.parametrize("declared,words", [
    ((torch.float64, (16,)), ["float32", "declares float64"]),
    ((torch.int32, (16,)), ["float32", "declares int32"]),
    ((torch.float32, (4, 4)), ["shape [16]", "[4, 4]"]),
    ((torch.float32, (17,)), ["shape [16]", "[17]"]),
    ((torch.float8_e4m3fn, (16,)), ["float32", "declares float8_e4m3fn"]),
])
def test_declared_dtype_or_shape_other_than_stored_is_reported(declared, words):
    """A float32 (16,) record declared with another dtype (even of the same size) or shape is reported as such."""
    problems = _problems([_record(torch.ones(16))], [declared])
    assert len(problems) == 1 and all(w in problems[0][1] for w in words), problems


def test_pickle_calling_anything_else_is_reported_and_never_run(tmp_path):
    """A record whose data.pkl calls os.system is reported as not a plain tensor, and the command never runs."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    record = bytearray(_record(torch.ones(4)))
    evil = pickle.dumps(Evil(), protocol=2)
    info = zipfile.ZipFile(io.BytesIO(bytes(record))).getinfo("archive/data.pkl")
    name_len, extra_len = struct.unpack_from("<HH", record, info.header_offset + 26)
    at, old_len = info.header_offset + 30 + name_len + extra_len, info.file_size
    assert old_len >= len(evil) and record[at:at + 2] == b"\x80\x02"
    record[at:at + len(evil)] = evil
    record[at + len(evil):at + old_len] = b"." * (old_len - len(evil))  # STOP opcodes pad the rest
    problems = _problems([bytes(record)], [(torch.float32, (4,))])
    assert len(problems) == 1 and "not a plain tensor" in problems[0][1], problems
    assert not marker.exists()


def test_garbage_in_place_of_a_record_is_reported():
    """Random bytes where a record should be are reported (no zip end-of-central-directory)."""
    problems = _problems([os.urandom(300)], [(torch.float32, (4,))])
    assert len(problems) == 1 and "end-of-central-directory" in problems[0][1], problems


def test_untyped_storage_record_declared_as_another_dtype_is_reported():
    """A float8 record (rebuilt from untyped bytes and a dtype) declared as uint8 is reported with both dtypes."""
    problems = _problems([_record(torch.ones(16).to(torch.float8_e4m3fn))], [(torch.uint8, (16,))])
    assert len(problems) == 1 and "float8_e4m3fn data but .metadata declares uint8" in problems[0][1], problems


def test_view_reaching_past_its_storage_is_reported():
    """A record whose pickled stride makes the view read past its storage is reported (torch.load would fail)."""
    record = bytearray(_record(torch.ones(16)))
    info = zipfile.ZipFile(io.BytesIO(bytes(record))).getinfo("archive/data.pkl")
    name_len, extra_len = struct.unpack_from("<HH", record, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len
    pkl = bytes(record[at:at + info.file_size])
    assert pkl.count(b"K\x01\x85") == 1  # the stride tuple (1,)
    record[at:at + info.file_size] = pkl.replace(b"K\x01\x85", b"K\x02\x85")
    problems = _problems([bytes(record)], [(torch.float32, (16,))])
    assert len(problems) == 1 and "outside its 16-element storage" in problems[0][1], problems
