"""torch_ckpt.storage._crc: the checkpoint CRC-32 (ISA-L when installed) equals zlib's."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from torch_ckpt.storage._crc import crc32, file_crc32


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 1 << 20, (1 << 20) + 7])
def test_crc32_equals_zlib_with_a_running_value(nbytes):
    """crc32 of a buffer, continued from another buffer's value, equals zlib.crc32's."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    head = b"torch-ckpt"
    assert crc32(memoryview(data), crc32(head)) == zlib.crc32(data.tobytes(), zlib.crc32(head))


def test_crc32_reads_a_slice_of_a_memoryview():
    """A memoryview slice (how writers and readers hand over their buffers) is checksummed as its bytes."""
    data = bytearray(range(256)) * 64
    view = memoryview(data)[100:9000]
    assert crc32(view) == zlib.crc32(bytes(data[100:9000]))


@pytest.mark.parametrize("nbytes", [0, 1, 16 << 20, (16 << 20) + 5, (32 << 20) + 1])
def test_file_crc32_matches_zlib_across_chunk_boundaries(tmp_path, nbytes):
    """The double-buffered file CRC equals zlib.crc32 of the whole content, at and around 16 MiB chunks."""
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    assert file_crc32(path) == (nbytes, zlib.crc32(data.tobytes()))
