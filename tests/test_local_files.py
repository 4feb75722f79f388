"""torch_ckpt.storage._locations: checkpoint files are opened only as regular files and read within limits."""

from __future__ import annotations

import os

import pytest

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.storage._locations import open_range, open_regular, read_fd, reading


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"0123456789")
    return path


def test_regular_file_is_opened(data_file):
    """A regular file opens and reads back its bytes."""
    fd = open_regular(data_file, allow_symlinks=False, what="file")
    assert read_fd(fd, 100, str(data_file)) == b"0123456789"


def test_symlink_is_refused_naming_the_file(tmp_path, data_file):
    """A symbolic link raises CheckpointCorruptError naming it and how to allow links."""
    link = tmp_path / "link.bin"
    link.symlink_to(data_file)
    with pytest.raises(CheckpointCorruptError, match=r"link\.bin.*symbolic link.*allow_symlinks"):
        open_regular(link, allow_symlinks=False, what="file")


def test_symlink_is_followed_when_allowed(tmp_path, data_file):
    """With allow_symlinks, a link to a regular file is read through."""
    link = tmp_path / "link.bin"
    link.symlink_to(data_file)
    fd = open_regular(link, allow_symlinks=True, what="file")
    assert read_fd(fd, 100, str(link)) == b"0123456789"


def test_symlink_to_a_fifo_is_refused_even_when_allowed(tmp_path):
    """Following links still requires the target to be a regular file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(CheckpointCorruptError, match="not a regular file"):
        open_regular(link, allow_symlinks=True, what="file")


def test_fifo_is_refused_without_hanging(tmp_path):
    """A FIFO without a writer is refused at once (opened non-blocking), never waited on."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointCorruptError, match=r"pipe: file is not a regular file"):
        open_regular(fifo, allow_symlinks=False, what="file")


def test_directory_is_refused(tmp_path):
    """A directory where a file is expected raises CheckpointCorruptError."""
    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointCorruptError, match="d: file is"):
        open_regular(tmp_path / "d", allow_symlinks=False, what="file")


def test_missing_file_raises_file_not_found(tmp_path):
    """A missing file raises FileNotFoundError (callers turn it into their own message)."""
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "absent", allow_symlinks=False, what="file")


def test_file_larger_than_the_limit_is_refused(data_file):
    """read_fd refuses a file larger than the limit, naming its size and the limit."""
    fd = open_regular(data_file, allow_symlinks=False, what="file")
    with pytest.raises(CheckpointCorruptError, match="is 10 bytes, more than the 9 accepted"):
        read_fd(fd, 9, str(data_file))


def test_file_of_exactly_the_limit_is_read(data_file):
    """A file of exactly the limit is read whole."""
    fd = open_regular(data_file, allow_symlinks=False, what="file")
    assert read_fd(fd, 10, str(data_file)) == b"0123456789"


def test_open_range_reads_at_offsets(data_file):
    """open_range gives pread-style reads at any offset and the file's size."""
    with open_range(data_file) as f:
        assert f.size == 10
        assert f.read_at(3, 4) == b"3456"
        assert f.read_at(8, 10) == b"89"


def test_open_range_refuses_a_symlink(tmp_path, data_file):
    """open_range refuses a link unless allowed."""
    link = tmp_path / "link.bin"
    link.symlink_to(data_file)
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        with open_range(link):
            pass


def test_io_error_while_reading_becomes_corruption_naming_the_file():
    """An OSError inside reading() becomes CheckpointCorruptError naming the file and the cause."""
    with pytest.raises(CheckpointCorruptError, match=r"/ckpt/a: shard cannot be read \(Input/output error\)"):
        with reading("/ckpt/a", "shard"):
            raise OSError(5, "Input/output error")


def test_corruption_inside_reading_passes_unchanged():
    """A CheckpointCorruptError inside reading() is not wrapped again."""
    original = CheckpointCorruptError("/ckpt/a: bad crc")
    with pytest.raises(CheckpointCorruptError) as info:
        with reading("/ckpt/a", "shard"):
            raise original
    assert info.value is original


def test_other_errors_pass_through_reading():
    """Errors that are not I/O errors are not disguised as corruption."""
    with pytest.raises(KeyError):
        with reading("/ckpt/a", "shard"):
            raise KeyError("x")
