"""torch_ckpt.format._dcp_write: a tensor's torch.save record in pieces (data by reference) and its fixed framing."""

from __future__ import annotations

import io

import pytest
import torch

from torch_ckpt.format import _dcp_write as dcp_record
from torch_ckpt.format._dcp_write import record_framing, serialize_tensor

CASES = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(5, dtype=torch.float64),
    torch.ones(2, 3, 4, dtype=torch.bfloat16),
    torch.tensor(7, dtype=torch.int64),
    torch.zeros(0, 3, dtype=torch.uint8),
    torch.tensor([True, False]),
    torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
    torch.arange(10, dtype=torch.int32)[3:],
]


def load(pieces) -> torch.Tensor:
    return torch.load(io.BytesIO(b"".join(bytes(p) for p in pieces)), weights_only=True)


def framing_or_skip(tensor):
    if not dcp_record._SAVE_WITHOUT_ZIP_CRC:
        pytest.skip("this torch gives no fixed record framing")
    return record_framing(tensor)


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}-{list(t.shape)}-{t.stride()}")
def test_record_loads_back_equal(tensor):
    """The joined pieces are a torch.save record that torch.load(weights_only=True) reads back equal."""
    out = load(serialize_tensor(tensor))
    assert out.dtype == tensor.dtype and out.stride() == tensor.stride() and torch.equal(out, tensor)


@pytest.mark.parametrize("tensor", [t for t in CASES if t.numel()], ids=lambda t: f"{t.dtype}-{list(t.shape)}")
def test_framing_surrounds_the_data(tensor):
    """The record is exactly framing-before + the storage's bytes + framing-after."""
    before, after = framing_or_skip(tensor)
    record = b"".join(bytes(p) for p in serialize_tensor(tensor))
    data = bytes(tensor.untyped_storage())
    assert record == before + data + after


def test_data_is_kept_by_reference():
    """The data piece views the tensor's storage: a later change of the tensor shows in it (no copy)."""
    tensor = torch.zeros(1024)
    pieces = serialize_tensor(tensor)
    tensor.fill_(1.0)
    assert torch.equal(load(pieces), torch.ones(1024))


def test_framing_does_not_depend_on_values():
    """Two tensors of the same signature and different values share the framing."""
    a, b = torch.zeros(3, 4), torch.randn(3, 4)
    assert framing_or_skip(a) == record_framing(b)


@pytest.mark.parametrize("other", [torch.zeros(4, 3), torch.zeros(3, 4, dtype=torch.float64),
                                   torch.zeros(4, 3).t(), torch.zeros(13)[:12].view(3, 4)],
                         ids=["shape", "dtype", "strides", "storage-size"])
def test_framing_differs_with_the_signature(other):
    """Shape, dtype, strides or storage size change the framing."""
    assert framing_or_skip(torch.zeros(3, 4)) != record_framing(other)


def test_views_at_different_offsets_of_one_storage_keep_their_own_offset():
    """Equal-shaped views of one storage at different offsets get their own framing and values."""
    base = torch.arange(13, dtype=torch.float32)
    first, second = base[:12].view(3, 4), base[1:].view(3, 4)
    assert framing_or_skip(first) != record_framing(second)
    assert torch.equal(load(serialize_tensor(first)), first)
    assert torch.equal(load(serialize_tensor(second)), second)


def test_cached_framing_still_gives_the_current_values():
    """A second tensor of a cached signature is recorded with its own values, not the first one's."""
    serialize_tensor(torch.zeros(2, 5))
    second = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    assert torch.equal(load(serialize_tensor(second)), second)


def test_tensor_subclass_has_no_fixed_framing():
    """A tensor subclass (nn.Parameter) gets no fixed framing, so the direct reader never assumes one."""
    assert record_framing(torch.nn.Parameter(torch.zeros(3))) is None


def test_record_framing_is_compact():
    """A small tensor's record carries under half the bytes torch.save puts around the same data."""
    tensor = torch.zeros(8, 384)
    if dcp_record._ZIP_VERSION is None:
        pytest.skip("this torch gives no compact records")
    before, after = record_framing(tensor)
    buf = io.BytesIO()
    torch.save(tensor, buf)
    assert len(before) + len(after) < 0.5 * (len(buf.getvalue()) - tensor.numel() * 4)


def test_record_small_entries_pass_a_standard_zip_reader():
    """Python's zipfile reads a record's pickle, byte order and version entries with their CRC-32s."""
    import zipfile
    record = b"".join(bytes(p) for p in serialize_tensor(torch.arange(6.0)))
    with zipfile.ZipFile(io.BytesIO(record)) as archive:
        names = archive.namelist()
        assert archive.read("archive/byteorder") == b"little" and archive.read("archive/version").strip()
        assert archive.read("archive/data.pkl").startswith(b"\x80")
    assert "archive/data/0" in names


def test_record_of_data_beyond_the_compact_limit_is_written_by_torch(monkeypatch):
    """Data too large for 32-bit zip fields gets torch's own zip writer, and still loads back equal."""
    monkeypatch.setattr(dcp_record, "_ZIP32_DATA_MAX", 16)
    monkeypatch.setattr(dcp_record, "_RECORD_CACHE", {})
    tensor = torch.arange(64, dtype=torch.float32)
    assert dcp_record._compact_framing(tensor, b"3\n") is None
    assert torch.equal(load(serialize_tensor(tensor)), tensor)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint32, torch.complex64],
                         ids=["float8_e4m3fn", "uint32", "complex64"])
def test_record_of_untyped_storage_dtypes_loads_back(dtype):
    """Dtypes without a typed storage (float8, uint32) and complex ones get records torch.load reads back."""
    tensor = torch.ones(5).to(dtype)
    out = load(serialize_tensor(tensor))
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))


def test_record_through_dcp_file_view_loads_back():
    """A record in the middle of a file, read as DCP's reader reads it (a byte-range view), loads back equal."""
    from torch.distributed.checkpoint.filesystem import _create_file_view
    tensor = torch.randn(4, 7)
    record = b"".join(bytes(p) for p in serialize_tensor(tensor))
    view = _create_file_view(io.BytesIO(b"x" * 11 + record + b"y" * 5), 11, len(record))
    assert torch.equal(torch.load(view, map_location="cpu", weights_only=True), tensor)
