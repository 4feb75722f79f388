"""The CRC-32 of checkpoint files (zlib's polynomial, the value stored in ``manifest.json``).

:func:`crc32` is ISA-L's hardware-accelerated implementation when the ``isal`` package is
installed (about 8 GB/s on the reference 2-core machine, against 2-4 GB/s for ``zlib.crc32``),
otherwise ``zlib.crc32``. Both give the same values and release the GIL on large buffers, so the
choice changes speed only, never the format.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["CRC32_IMPLEMENTATION", "crc32"]

try:
    from isal.isal_zlib import crc32 as _isal_crc32

    if _isal_crc32(b"123456789") != zlib.crc32(b"123456789"):  # pragma: no cover - a broken build
        raise ImportError("isal's crc32 disagrees with zlib's")
    crc32: Callable[..., int] = _isal_crc32
    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - depends on the environment
    crc32 = zlib.crc32
    CRC32_IMPLEMENTATION = "zlib"
