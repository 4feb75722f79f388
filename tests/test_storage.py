"""torch_ckpt.storage._locations: Location over a local directory and an fsspec store (memory://, no network)."""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
import zlib

import fsspec
import pytest

from torch_ckpt.errors import CheckpointCorruptError, ConfigError
from torch_ckpt.storage._locations import (
    DurableUnavailableError,
    Location,
    as_location,
    is_url,
    object_mtime,
    url_to_fs,
)


@pytest.fixture
def mem():
    """A fresh memory:// directory holding a.bin (10 bytes) and sub/b.bin; removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/mirror4-{uuid.uuid4().hex}"
    fs.pipe(f"{root}/a.bin", b"0123456789")
    fs.pipe(f"{root}/sub/b.bin", b"b")
    yield fs, f"memory://{root}"
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("text,expected", [("s3://b/run", True), ("memory://x", True), ("file:///tmp/x", False),
                                           ("/tmp/x", False), ("relative/dir", False)])
def test_is_url(text, expected):
    """Only fsspec URLs other than file:// count as URLs."""
    assert is_url(text) is expected


@pytest.fixture
def non_utc_zone(monkeypatch):
    """Run with a local time zone other than UTC (so a naive time read as local time would be off)."""
    monkeypatch.setenv("TZ", "EST+05")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("info,expected", [
    ({"mtime": 5.5}, 5.5),
    ({"LastModified": dt.datetime(1970, 1, 1, 0, 1, tzinfo=dt.timezone.utc)}, 60.0),
    ({"last_modified": dt.datetime(1970, 1, 1, 0, 2)}, 120.0),
    ({"updated": "1970-01-01T00:03:00Z"}, 180.0),
    ({"mtime": True, "created": 7}, 7.0),
    ({"updated": "not a date", "created": 8}, 8.0),
    ({"mtime": 0}, None),
    ({}, None),
], ids=["number", "aware", "naive-is-utc", "iso-z", "bool-skipped", "bad-string-skipped", "zero", "none"])
def test_object_mtime_reads_every_backend_spelling(non_utc_zone, info, expected):
    """Numbers, datetimes (naive read as UTC) and ISO strings under any known key give Unix seconds."""
    assert object_mtime(info) == expected


def test_unknown_protocol_is_a_config_error():
    """A URL whose protocol fsspec does not know raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="nosuchproto://x"):
        url_to_fs("nosuchproto://x")


def test_file_url_is_a_local_path(tmp_path):
    """file:// URLs become local absolute paths, described as such."""
    loc = Location(f"file://{tmp_path}")
    assert not loc.remote and loc.path == str(tmp_path) and loc.describe("m.json") == str(tmp_path / "m.json")


def test_child_and_name(tmp_path, mem):
    """child() addresses an entry; name is the last component, locally and on a store."""
    assert Location(tmp_path).child("step_1").name == "step_1"
    remote = Location(mem[1]).child("sub")
    assert remote.name == "sub" and remote.describe("b.bin") == f"{mem[1]}/sub/b.bin"


def test_as_location_returns_a_location_unchanged(tmp_path):
    """as_location passes a Location through and wraps paths."""
    loc = Location(tmp_path)
    assert as_location(loc) is loc and as_location(tmp_path).path == str(tmp_path)


def test_local_entries_classify_every_kind(tmp_path):
    """Files, directories, symlinks, links to directories, dangling links and FIFOs are listed by kind."""
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "lf").symlink_to(tmp_path / "f")
    (tmp_path / "ld").symlink_to(tmp_path / "d")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "p")
    kinds = {name: e["type"] for name, e in Location(tmp_path).entries().items()}
    assert kinds == {"f": "file", "d": "directory", "lf": "symlink", "ld": "directory", "dangling": "symlink",
                     "p": "other"}
    assert Location(tmp_path).entries()["f"]["size"] == 3


def test_local_symlink_listed_as_file_when_allowed(tmp_path):
    """With allow_symlinks, a link to a file is listed as the file it points to."""
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "lf").symlink_to(tmp_path / "f")
    assert Location(tmp_path, allow_symlinks=True).entries()["lf"] == {"type": "file", "size": 3,
                                                                        "mtime": pytest.approx(
                                                                            (tmp_path / "f").stat().st_mtime)}


def test_local_read_over_the_limit_is_corrupt(tmp_path):
    """A local file larger than max_bytes raises CheckpointCorruptError naming it."""
    (tmp_path / "f").write_bytes(b"x" * 11)
    with pytest.raises(CheckpointCorruptError, match=r"f: is 11 bytes"):
        Location(tmp_path).read_bytes("f", 10)


def test_local_read_of_a_symlink_is_refused(tmp_path):
    """Reading a symlinked file is refused unless links are allowed."""
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "lf").symlink_to(tmp_path / "f")
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        Location(tmp_path).read_bytes("lf")
    assert Location(tmp_path, allow_symlinks=True).read_bytes("lf") == b"abc"


def test_local_checksum_and_stat(tmp_path):
    """checksum gives (bytes, CRC-32) of the file; stat gives its size and no digest."""
    (tmp_path / "f").write_bytes(b"hello world")
    loc = Location(tmp_path)
    assert loc.checksum("f") == (11, zlib.crc32(b"hello world"))
    assert loc.stat("f") == (11, None)


def test_remote_reads_lists_and_checksums(mem):
    """On a memory:// store, files are listed with kinds and sizes, read whole, checksummed and range-read."""
    loc = Location(mem[1])
    assert loc.remote and loc.exists("a.bin") and loc.is_dir()
    entries = loc.entries()
    assert entries["a.bin"]["type"] == "file" and entries["a.bin"]["size"] == 10
    assert entries["sub"]["type"] == "directory"
    assert loc.read_bytes("a.bin") == b"0123456789"
    assert loc.checksum("a.bin") == (10, zlib.crc32(b"0123456789"))
    with loc.open_range("a.bin") as f:
        assert f.size == 10 and f.read_at(4, 3) == b"456"


def test_remote_read_over_the_limit_is_refused_before_reading(mem, monkeypatch):
    """A remote object larger than max_bytes is refused from its listed size, without downloading it."""
    fs, url = mem
    real_open = fs.open

    def unread(*args, **kwargs):
        f = real_open(*args, **kwargs)
        f.read = lambda *a: pytest.fail("object was downloaded")
        return f

    monkeypatch.setattr(fs, "open", unread)
    with pytest.raises(CheckpointCorruptError, match="10 bytes, more than the 9 accepted"):
        Location(url).read_bytes("a.bin", 9)


def test_remote_stat_of_a_directory_is_corrupt(mem):
    """A listed file that is a prefix (directory) on the store is refused as not a regular file."""
    with pytest.raises(CheckpointCorruptError, match="is a directory"):
        Location(mem[1]).stat("sub")


def test_remote_backend_error_is_an_outage(mem, monkeypatch):
    """Any backend exception on a store becomes DurableUnavailableError naming the URL."""
    fs, url = mem

    def broken(*args, **kwargs):
        raise RuntimeError("connection reset")

    monkeypatch.setattr(fs, "open", broken)
    with pytest.raises(DurableUnavailableError, match=f"{url}.*connection reset"):
        Location(url).read_bytes("a.bin")


def test_remote_missing_file_is_not_an_outage(mem):
    """A missing object raises FileNotFoundError, not DurableUnavailableError."""
    with pytest.raises(FileNotFoundError):
        Location(mem[1]).read_bytes("absent.bin")


def _serve(handler):
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def http_dir(tmp_path):
    """A loopback HTTP server (127.0.0.1) serving tmp_path, which holds a.bin; its base URL."""
    import functools
    import http.server

    (tmp_path / "a.bin").write_bytes(b"0123456789")
    server = _serve(functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_http_path_the_server_answers_404_for_does_not_exist(http_dir):
    """Over HTTP, a 404 is a path that does not exist; an existing file is found."""
    assert Location(http_dir).exists("a.bin")
    assert not Location(http_dir).exists("missing.bin")


def test_an_unreachable_http_server_is_unavailable_not_missing():
    """A server nobody listens on raises DurableUnavailableError naming the URL (fsspec calls it not found)."""
    import socket

    with socket.socket() as s:  # a loopback port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/run"
    with pytest.raises(DurableUnavailableError, match=f"cannot read {url}.*connect"):
        Location(url).exists()


def test_an_http_server_answering_503_is_unavailable_not_missing():
    """A server that answers 503 Service Unavailable raises DurableUnavailableError, not "does not exist"."""
    import http.server

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the name http.server calls
            self.send_error(503)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = _serve(Busy)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run"
        with pytest.raises(DurableUnavailableError, match=f"cannot read {url}.*503"):
            Location(url).exists()
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_directory_listing_is_a_directory_and_a_file_is_not(http_dir):
    """Over HTTP (whose info calls everything a file) a served directory is a directory, a file is not."""
    assert Location(http_dir).is_dir()
    assert not Location(f"{http_dir}/a.bin").is_dir()
    assert not Location(f"{http_dir}/missing").is_dir()


def test_a_checkpoint_served_over_http_lists_and_verifies(tmp_path, capsys):
    """`torch-ckpt ls` and `verify` of a run root served by a loopback HTTP server exit 0."""
    import functools
    import http.server

    import torch

    from torch_ckpt import CheckpointManager, TrainState
    from torch_ckpt.tools.cli import main

    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(10, TrainState(model=torch.nn.Linear(4, 4), rng=False))
    server = _serve(functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run"
        assert main(["ls", url]) == 0 and "step_000000010" in capsys.readouterr().out
        assert main(["verify", url]) == 0 and "all OK" in capsys.readouterr().out
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_drops_the_connection_is_unavailable_not_missing():
    """A server that accepts and closes without answering raises DurableUnavailableError, not "does not exist"."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def drop():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(1024)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/run"
        with pytest.raises(DurableUnavailableError, match=f"cannot read {url}"):
            Location(url).exists()
    finally:
        listener.close()
