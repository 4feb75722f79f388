"""The ``torch.save`` record of one tensor, as torch-ckpt's DCP writer lays it out in a ``.distcp`` file.

:func:`serialize_tensor` turns a tensor into the pieces of that record (its data kept by reference,
never copied) for :class:`torch_ckpt.format._dcp_write.ChecksumFileSystemWriter`; :func:`record_framing` gives
the bytes around the data, which depend only on the tensor's dtype, shape and strides, so
:func:`torch_ckpt.restore._restore.load_direct` can recognise a record and read its data straight into place.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch

__all__ = ["serialize_tensor", "record_framing"]

def _probe_torch_save_without_zip_crc() -> bool:
    """True when this torch exposes the pieces of ``torch.save`` needed to skip its zip CRC-32."""
    try:
        buf = io.BytesIO()
        zf = torch._C.PyTorchFileWriter(buf, False, torch.serialization._get_storage_alignment())
        torch.serialization._save(torch.zeros(2), zf, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
        buf.seek(0)
        return bool(torch.equal(torch.load(buf, weights_only=True), torch.zeros(2)))
    except Exception:  # noqa: BLE001 - any incompatibility: use plain torch.save
        return False


_SAVE_WITHOUT_ZIP_CRC = _probe_torch_save_without_zip_crc()


class _Capture:
    """File-like target of ``torch.save`` that only collects the pieces it is given.

    The tensor's data arrives as a view of its own storage and is kept by reference (no copy);
    every other piece (zip headers, pickle, padding) is small and copied, because its memory
    belongs to the serializer. Nothing here can fail, so no I/O error ever crosses torch's C++
    zip writer (which aborts the process when its destructor meets one).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._ptr = tensor.untyped_storage().data_ptr()
        self._nbytes = tensor.untyped_storage().nbytes()
        self.pieces: list[Any] = []

    def write(self, b) -> int:
        view = memoryview(b)
        n = view.nbytes
        if n and n == self._nbytes and np.frombuffer(view, dtype=np.uint8).ctypes.data == self._ptr:
            self.pieces.append(view)
        else:
            self.pieces.append(bytes(view))
        return n

    def flush(self) -> None:
        pass


#: ``{tensor signature: (bytes before the data, bytes after it)}`` of ``torch.save`` records; see serialize_tensor
_RECORD_CACHE: dict[tuple, tuple[bytes, bytes]] = {}
_RECORD_CACHE_MAX = 4096


def _record_key(tensor: torch.Tensor) -> tuple | None:
    """What a ``torch.save`` record's non-data bytes depend on (None: do not cache this tensor)."""
    if type(tensor) is not torch.Tensor or tensor.is_quantized or not _SAVE_WITHOUT_ZIP_CRC:
        return None
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
            tensor.untyped_storage().nbytes(), tensor.is_conj(), tensor.is_neg())


def serialize_tensor(tensor: torch.Tensor) -> list[Any]:
    """``tensor`` as one ``torch.save`` record (what DCP's reader ``torch.load``\\ s), as a list of pieces.

    The zip container's own per-record CRC-32 is skipped when this torch allows it: it is computed
    while holding the GIL (about 3 GB/s) and duplicates the file CRC-32 recorded in the manifest;
    ``torch.load`` does not check it. Without that CRC, the bytes around the tensor's data depend
    only on its dtype, shape and strides, so they are serialized once per signature and reused
    (a state of many small tensors then costs a few microseconds per tensor instead of ~150 us).
    """
    key = _record_key(tensor)
    cached = _RECORD_CACHE.get(key) if key is not None else None
    if cached is not None:
        return [cached[0], _data_view(tensor), cached[1]]
    capture = _Capture(tensor)
    if _SAVE_WITHOUT_ZIP_CRC:
        zf = torch._C.PyTorchFileWriter(capture, False, torch.serialization._get_storage_alignment())
        torch.serialization._save(tensor, zf, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
    else:
        torch.save(tensor, capture)
    pieces = capture.pieces
    data_at = [i for i, p in enumerate(pieces) if isinstance(p, memoryview)]
    if key is not None and len(data_at) == 1:
        if len(_RECORD_CACHE) >= _RECORD_CACHE_MAX:
            _RECORD_CACHE.clear()
        i = data_at[0]
        _RECORD_CACHE[key] = (b"".join(pieces[:i]), b"".join(pieces[i + 1:]))
    return pieces


def record_framing(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes torch-ckpt's DCP writer puts before and after ``tensor``'s data in its ``torch.save`` record.

    They depend only on the tensor's dtype, shape and strides (not its values), so a reader can
    compare a record's framing with them and, on an exact match, read the data straight into a
    tensor of that signature. None when this torch or tensor gives no fixed framing.
    """
    key = _record_key(tensor)
    if key is None:
        return None
    if key not in _RECORD_CACHE:
        serialize_tensor(tensor)
    return _RECORD_CACHE.get(key)


def _data_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s whole storage, without a copy (the view keeps the storage alive)."""
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy())
