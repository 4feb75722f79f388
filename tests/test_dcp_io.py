"""Tests of the DCP writer: every thread's error fails the save, sizes and CRCs match the disk."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torch_ckpt.format._dcp_write as dcp_io
from torch_ckpt import CheckpointManager, CheckpointWriteError
from torch_ckpt.root._layout import read_manifest
from torch_ckpt.storage._crc import file_crc32


def _mixed_state() -> dict[str, torch.Tensor]:
    """Large and tiny tensors of several dtypes (exercises both the gathered and the direct writes)."""
    g = torch.Generator().manual_seed(0)
    state = {f"big{i}": torch.randn(300_000 + i, generator=g) for i in range(3)}
    state.update({f"small{i}": torch.randn(17 + i, generator=g).to(torch.float16) for i in range(40)})
    state["ints"] = torch.arange(1000, dtype=torch.int64)
    state["empty"] = torch.empty(0, 3)
    return state


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_manifest_sizes_and_crcs_match_the_files_on_disk(tmp_path, threads):
    """Every file's recorded size and CRC-32 equal those of the bytes on disk."""
    with CheckpointManager(tmp_path, thread_count=threads) as mgr:
        path = Path(mgr.save(1, _mixed_state()).wait())
    manifest = read_manifest(path)
    assert sum(n.endswith(".distcp") for n in manifest.files) == threads
    for name, info in manifest.files.items():
        assert file_crc32(path / name) == (info["bytes"], info["crc32"]), name


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_written_tensors_load_with_plain_dcp(tmp_path, threads):
    """The files keep DCP's format: a plain dcp.load returns every tensor bit for bit."""
    state = _mixed_state()
    with CheckpointManager(tmp_path, thread_count=threads) as mgr:
        path = mgr.save(1, state).wait()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in state.items())


@pytest.mark.parametrize("threads", [2, 4])
def test_error_in_a_non_first_writer_thread_fails_the_save(tmp_path, monkeypatch, threads):
    """EFBIG in the last writer thread (not the caller's) is a typed error with errno; nothing is committed."""
    real = dcp_io._FileSink._write_all
    failing = f"__0_{threads - 1}.distcp"

    def write_all(self, view):
        if self.path.name == failing:
            raise OSError(errno.EFBIG, "File too large", str(self.path))
        return real(self, view)

    # incremental=False: the same state saved again would be hard-linked, with no writer thread writing
    with CheckpointManager(tmp_path, keep_last=1, thread_count=threads, incremental=False) as mgr:
        mgr.save(1, _mixed_state()).wait()
        monkeypatch.setattr(dcp_io._FileSink, "_write_all", write_all)
        with pytest.raises(CheckpointWriteError) as info:
            mgr.save(2, _mixed_state())
            mgr.wait()
        assert info.value.errno == errno.EFBIG and failing in str(info.value)
        assert mgr.all_steps() == [1]
        mgr.wait()  # raised once: nothing pending any more
    assert not list(tmp_path.glob(".step_*"))


def test_file_shorter_on_disk_than_written_is_not_committed(tmp_path, monkeypatch):
    """A file system that silently drops bytes is caught by the on-disk size check before the commit."""
    real = dcp_io._FileSink._write_all

    def lossy(self, view):
        real(self, view[:-1] if self.path.name.endswith(".distcp") and view.nbytes > 1 else view)
        self.nbytes += 1 if self.path.name.endswith(".distcp") and view.nbytes > 1 else 0

    monkeypatch.setattr(dcp_io._FileSink, "_write_all", lossy)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointWriteError, match="bytes on disk") as info:
            mgr.save(1, _mixed_state())
            mgr.wait()
        assert info.value.errno == errno.EIO and mgr.all_steps() == []


def test_failed_open_of_a_data_file_names_it(tmp_path, monkeypatch):
    """An error creating a data file fails the save with that file's name and errno."""
    def refuse(self, path, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(dcp_io._FileSink, "__init__", refuse)
    with CheckpointManager(tmp_path, thread_count=2) as mgr:
        with pytest.raises(CheckpointWriteError, match="distcp") as info:
            mgr.save(1, _mixed_state())
            mgr.wait()
        assert info.value.errno == errno.EACCES and mgr.all_steps() == []
