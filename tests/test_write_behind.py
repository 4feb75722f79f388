"""Write-behind (torch_ckpt.format._dcp_write): writeback started per window, bounded dirty data, safe fallbacks."""

from __future__ import annotations

import errno
import os
import zlib

import pytest

import torch_ckpt.format._dcp_write as wb
from torch_ckpt.format._dcp_write import WriteBehind

WINDOW = 64 << 10


@pytest.fixture()
def calls(monkeypatch):
    """Record every sync_file_range call (then run the real one) with a 64 KiB window and a lag of 2."""
    real = wb._SYNC_FILE_RANGE
    seen: list[tuple[int, int, int]] = []

    def spy(fd, offset, nbytes, flags):
        seen.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags) if real is not None else 0

    monkeypatch.setattr(wb, "WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(wb, "LAG_WINDOWS", 2)
    monkeypatch.setattr(wb, "_SYNC_FILE_RANGE", spy)
    return seen


def _write(path, behind_enabled: bool, chunks: list[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        behind, done = WriteBehind(fd, path, enabled=behind_enabled), 0
        for c in chunks:
            done += os.write(fd, c)
            behind.advance(done)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_every_written_window_is_handed_to_the_disk_in_order_and_waited_for_two_windows_behind(tmp_path, calls):
    """Writeback starts for each complete window at once; the window two behind the writer is waited for."""
    chunks = [os.urandom(16 << 10) for _ in range(40)]  # 640 KiB in 16 KiB writes: 10 windows
    _write(tmp_path / "f", True, chunks)
    starts = [(o, n) for o, n, f in calls if f == wb._WRITE]
    waits = [(o, n) for o, n, f in calls if f == wb._WAIT]
    assert starts == [(i * WINDOW, WINDOW) for i in range(10)]
    assert waits == [(i * WINDOW, WINDOW) for i in range(8)]  # never the last two windows
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)


def test_file_bytes_are_identical_with_and_without_write_behind(tmp_path, calls):
    """Write-behind changes when bytes reach the disk, never which bytes (same size and CRC-32)."""
    chunks = [os.urandom(n) for n in (1, 70 << 10, 3, 200 << 10, 5 << 10, 64 << 10)]
    _write(tmp_path / "a", True, chunks)
    _write(tmp_path / "b", False, chunks)
    a, b = (tmp_path / "a").read_bytes(), (tmp_path / "b").read_bytes()
    assert len(a) == len(b) == sum(map(len, chunks)) and zlib.crc32(a) == zlib.crc32(b)


def test_disabled_write_behind_makes_no_call(tmp_path, calls):
    """enabled=False (files that are not fsynced) never calls sync_file_range."""
    _write(tmp_path / "f", False, [os.urandom(WINDOW)] * 4)
    assert calls == []


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.EPERM])
def test_unsupported_file_system_switches_write_behind_off(tmp_path, monkeypatch, code):
    """A refusal meaning 'not supported here' turns write-behind off for the file; the write goes on."""
    tries = []

    def refuse(fd, offset, nbytes, flags):
        tries.append(offset)
        import ctypes

        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(wb, "WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(wb, "_SYNC_FILE_RANGE", refuse)
    chunks = [os.urandom(WINDOW)] * 5
    _write(tmp_path / "f", True, chunks)
    assert tries == [0] and (tmp_path / "f").read_bytes() == b"".join(chunks)


def test_a_write_error_reported_for_a_window_raises_with_the_path(tmp_path, monkeypatch):
    """EIO from the kernel for a window is raised as OSError naming the file (the fsync would report it too)."""
    def fail(fd, offset, nbytes, flags):
        import ctypes

        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(wb, "WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(wb, "_SYNC_FILE_RANGE", fail)
    with pytest.raises(OSError) as info:
        _write(tmp_path / "f", True, [os.urandom(WINDOW)] * 2)
    assert info.value.errno == errno.EIO and info.value.filename == str(tmp_path / "f")


@pytest.mark.parametrize("code", [errno.ENOMEM, errno.EAGAIN, errno.EINTR])
def test_a_transient_refusal_postpones_the_window_and_never_fails_the_write(tmp_path, monkeypatch, code):
    """ENOMEM/EAGAIN/EINTR for one call only postpones that window: no error, same bytes, later windows go on."""
    real = wb._SYNC_FILE_RANGE
    tries: list[int] = []

    def once(fd, offset, nbytes, flags):
        tries.append(offset)
        if len(tries) == 1:
            import ctypes

            ctypes.set_errno(code)
            return -1
        return real(fd, offset, nbytes, flags) if real is not None else 0

    monkeypatch.setattr(wb, "WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(wb, "_SYNC_FILE_RANGE", once)
    chunks = [os.urandom(WINDOW)] * 4
    _write(tmp_path / "f", True, chunks)
    assert len(tries) > 1 and (tmp_path / "f").read_bytes() == b"".join(chunks)


def test_a_refused_page_cache_hint_never_fails_the_write(tmp_path, monkeypatch, calls):
    """posix_fadvise(DONTNEED) raising (e.g. denied by seccomp) is ignored: the bytes are on disk already."""
    def refuse(*args):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    chunks = [os.urandom(WINDOW)] * 5
    _write(tmp_path / "f", True, chunks)
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)
