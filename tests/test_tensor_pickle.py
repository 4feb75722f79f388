"""torch_ckpt.format._records: a plain tensor's pickle decoded without executing it; anything else refused."""

from __future__ import annotations

import io
import pickle
import sys
import zipfile

import pytest
import torch

from torch_ckpt.format._records import RecordProblem, pickled_tensor, storage_identity, stored_dtype

CALLED: list[str] = []


def mark_called(*args):
    """Target of a forged pickle: records that it ran."""
    CALLED.append("called")


def data_pkl(tensor: torch.Tensor) -> bytes:
    """The data.pkl of ``torch.save(tensor)``."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    with zipfile.ZipFile(buf) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


CASES = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.zeros(5, dtype=torch.float64),
    torch.ones(2, 3, 4, dtype=torch.bfloat16),
    torch.tensor(7, dtype=torch.int64),
    torch.zeros(0, 3, dtype=torch.uint8),
    torch.tensor([True, False]),
    torch.zeros(4, dtype=torch.complex64),
    torch.zeros(6, dtype=torch.float8_e4m3fn),
]


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}-{list(t.shape)}")
def test_plain_tensor_pickle_is_decoded(tensor):
    """A torch.save pickle gives the dtype's identity, the shape, strides, offset 0 and a string key."""
    identity, key, numel, offset, size, stride = pickled_tensor(data_pkl(tensor))
    assert identity == storage_identity(tensor.dtype)
    assert size == tuple(tensor.shape) and stride == tuple(tensor.stride()) and offset == 0
    assert isinstance(key, str) and numel >= tensor.numel()


def test_view_records_its_offset_and_strides():
    """A transposed slice of a storage keeps its storage offset and strides."""
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    view = base[1:].t()
    _, _, numel, offset, size, stride = pickled_tensor(data_pkl(view))
    assert (offset, size, stride) == (5, (5, 3), (1, 5)) and numel == 20


def test_requires_grad_tensor_is_a_plain_tensor():
    """A leaf tensor with requires_grad is still recognised."""
    assert pickled_tensor(data_pkl(torch.zeros(2, requires_grad=True)))[4] == (2,)


def test_forged_reduce_is_refused_without_calling_anything():
    """A pickle calling a function through GLOBAL + REDUCE is refused and the function never runs."""
    forged = f"c{__name__}\nmark_called\n(tR.".encode()
    CALLED.clear()
    with pytest.raises(RecordProblem, match="not a plain tensor"):
        pickled_tensor(forged)
    pickle.loads(forged)  # the same bytes do run the function when unpickled for real
    assert CALLED == ["called"]
    CALLED.clear()
    with pytest.raises(RecordProblem):
        pickled_tensor(forged + b" ")  # a different cache entry: decoded again, still nothing runs
    assert CALLED == []


def test_forged_global_does_not_import_its_module():
    """A GLOBAL naming a module that is not loaded is not imported while decoding."""
    forged = b"ctorch_ckpt_never_imported_xyz\nboom\n(tR."
    with pytest.raises(RecordProblem):
        pickled_tensor(forged)
    assert "torch_ckpt_never_imported_xyz" not in sys.modules


def test_opcode_a_tensor_pickle_never_uses_is_refused_by_name():
    """A pickle using an opcode outside a plain tensor's set (STACK_GLOBAL) is refused naming it."""
    with pytest.raises(RecordProblem, match="STACK_GLOBAL"):
        pickled_tensor(pickle.dumps(mark_called, protocol=4))


def test_tensor_rebuilt_by_another_function_is_refused():
    """The plain tensor structure with a different rebuild function is refused."""
    raw = data_pkl(torch.zeros(2))
    forged = raw.replace(b"_rebuild_tensor_v2", b"_rebuild_parameter")
    assert forged != raw
    with pytest.raises(RecordProblem, match="not a plain tensor"):
        pickled_tensor(forged)


def test_requires_grad_that_is_not_a_bool_is_refused():
    """A tensor pickle whose requires_grad is an int instead of a bool is not a plain tensor's."""
    raw = data_pkl(torch.zeros(2))
    forged = raw.replace(b"\x89cc", b"K\x00cc", 1)  # NEWFALSE before the OrderedDict global -> BININT1 0
    assert forged != raw
    with pytest.raises(RecordProblem, match="not a plain tensor"):
        pickled_tensor(forged)


@pytest.mark.parametrize("raw", [b"", b"\x80\x02", b"(((", b"\x80\x02K\x01K\x02."], ids=["empty", "truncated",
                                                                                          "marks", "two-ints"])
def test_malformed_pickle_is_a_record_problem(raw):
    """Truncated or unbalanced opcode streams raise RecordProblem, never another error."""
    with pytest.raises(RecordProblem):
        pickled_tensor(raw)


def test_stored_dtype_names_typed_and_untyped_identities():
    """stored_dtype maps identities back to dtype names and unknown ones to 'unknown'."""
    assert stored_dtype(storage_identity(torch.float32)) == "float32"
    assert stored_dtype(storage_identity(torch.int16)) == "int16"
    assert stored_dtype(("untyped", "float8_e5m2")) == "float8_e5m2"
    assert stored_dtype(("typed", "NoSuchStorage")) == "unknown"


def test_different_dtypes_have_different_identities():
    """Records of float32 and int32 (same element size) are told apart by their identity."""
    assert storage_identity(torch.float32) != storage_identity(torch.int32)
