"""torch_ckpt.save._persist: the writer's helpers (error wrapping, on-disk checks, owner check, extra entries).

The full write path (persist_checkpoint) is exercised through the manager in test_manager.py,
test_write_failures.py and test_crash_safety.py.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from torch_ckpt.errors import CheckpointCorruptError, CheckpointWriteError
from torch_ckpt.save._persist import (
    SaveRequest,
    as_write_error,
    check_extra_name,
    check_on_disk,
    check_owner,
    describe_error,
    move_extra_entries,
    unwrap_dcp_error,
)


def request(owner_alive=None) -> SaveRequest:
    return SaveRequest(final=Path("/ckpt/step_000000003"), step=3, tensors={}, tree={}, tensor_bytes=0,
                          owner_alive=owner_alive)


@pytest.mark.parametrize("code,hint", [(errno.ENOSPC, "disk is full"), (errno.EACCES, "permission denied"),
                                       (errno.EROFS, "read-only"), (errno.EFBIG, "file-size limit"),
                                       (errno.EIO, "check the location")])
def test_os_error_becomes_a_write_error_with_a_hint(code, hint):
    """An OSError becomes CheckpointWriteError keeping its errno, naming the directory, file and what to do."""
    exc = as_write_error(OSError(code, "boom", "/ckpt/.tmp/__0_0.distcp"), Path("/ckpt/.tmp"))
    assert isinstance(exc, CheckpointWriteError) and exc.errno == code
    assert "/ckpt/.tmp" in str(exc) and "(__0_0.distcp)" in str(exc) and hint in str(exc)


def test_checkpoint_error_passes_unchanged():
    """A CheckpointError (of any kind) is returned as is, not wrapped."""
    original = CheckpointCorruptError("bad")
    assert as_write_error(original, Path("/x")) is original


def test_other_error_becomes_a_write_error_naming_its_type():
    """A non-OS error becomes CheckpointWriteError naming its type and message."""
    exc = as_write_error(RuntimeError("CUDA error"), Path("/ckpt/.tmp"))
    assert isinstance(exc, CheckpointWriteError) and "RuntimeError: CUDA error" in str(exc)


def test_describe_error_names_the_type():
    """describe_error gives 'Type: message'."""
    assert describe_error(KeyError("k")) == "KeyError: 'k'"


def test_on_disk_sizes_matching_pass(tmp_path):
    """Files whose sizes on disk equal the bytes written pass."""
    (tmp_path / "a").write_bytes(b"xyz")
    check_on_disk(tmp_path, {"a": {"bytes": 3, "crc32": 0}})


def test_on_disk_size_mismatch_is_refused(tmp_path):
    """A file of another size on disk than written raises CheckpointWriteError (EIO) naming it."""
    (tmp_path / "a").write_bytes(b"xy")
    with pytest.raises(CheckpointWriteError, match="has 2 bytes on disk but 3 were written") as info:
        check_on_disk(tmp_path, {"a": {"bytes": 3, "crc32": 0}})
    assert info.value.errno == errno.EIO


def test_on_disk_vanished_file_is_refused(tmp_path):
    """A written file that is gone raises CheckpointWriteError naming it."""
    with pytest.raises(CheckpointWriteError, match="vanished"):
        check_on_disk(tmp_path, {"a": {"bytes": 0, "crc32": 0}})


def test_owner_alive_passes_and_no_owner_check_passes():
    """A live owner, or no owner check at all, lets the save go on."""
    check_owner(request(lambda: True), Path("/ckpt/step_000000003"))
    check_owner(request(None), Path("/ckpt/step_000000003"))


def test_dead_owner_stops_the_save():
    """A dead owner raises CheckpointWriteError naming the step and directory."""
    with pytest.raises(CheckpointWriteError, match="step 3 is gone.*/ckpt/step_000000003"):
        check_owner(request(lambda: False), Path("/ckpt/step_000000003"))


@pytest.mark.parametrize("name", ["manifest.json", "manifest.json.tmp", ".metadata", "__0_0.distcp",
                                  "rank_00001.json", ".lock", ".lock.pid"])
def test_reserved_extra_names_are_refused(name):
    """An extra entry named like a checkpoint file or the root lock raises CheckpointWriteError naming it."""
    with pytest.raises(CheckpointWriteError, match="reserved"):
        check_extra_name(Path("/x") / name)


@pytest.mark.parametrize("name", ["trainer_state.json", "rank_file.json", "metadata", "scaler.pt"])
def test_other_extra_names_are_accepted(name):
    """Names that only resemble checkpoint files are accepted."""
    check_extra_name(Path("/x") / name)


def test_extra_entries_move_into_the_checkpoint(tmp_path):
    """Files and folders of extra_dir move into the temporary directory, and extra_dir is removed."""
    extra, tmp = tmp_path / "extra", tmp_path / "tmp"
    (extra / "sub").mkdir(parents=True)
    (extra / "a.json").write_text("{}")
    (extra / "sub" / "b").write_text("b")
    tmp.mkdir()
    move_extra_entries(extra, tmp)
    assert (tmp / "a.json").read_text() == "{}" and (tmp / "sub" / "b").read_text() == "b"
    assert not extra.exists()


def test_missing_extra_dir_moves_nothing(tmp_path):
    """A missing extra_dir is not an error and moves nothing."""
    (tmp_path / "tmp").mkdir()
    move_extra_entries(tmp_path / "absent", tmp_path / "tmp")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_one_reserved_extra_name_moves_nothing(tmp_path):
    """Every name is checked before anything moves: one reserved name leaves all entries in place."""
    extra, tmp = tmp_path / "extra", tmp_path / "tmp"
    extra.mkdir()
    tmp.mkdir()
    (extra / "a.json").write_text("{}")
    (extra / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointWriteError, match="manifest.json"):
        move_extra_entries(extra, tmp)
    assert sorted(p.name for p in extra.iterdir()) == ["a.json", "manifest.json"]
    assert list(tmp.iterdir()) == []


def test_unwrap_dcp_error_prefers_the_os_error_behind_a_checkpoint_exception():
    """DCP's CheckpointException of (error, traceback) pairs yields the OSError with its errno."""
    from torch.distributed.checkpoint.api import CheckpointException

    cause = OSError(errno.ENOSPC, "No space left on device", "/ckpt/.tmp/.metadata.tmp")
    wrapped = CheckpointException("finish failed", {0: (RuntimeError("other"), None), 1: (cause, None)})
    assert unwrap_dcp_error(wrapped) is cause
    plain = ValueError("x")
    assert unwrap_dcp_error(plain) is plain


def test_disk_full_while_writing_dcp_metadata_is_enospc(tmp_path, monkeypatch):
    """ENOSPC writing .metadata (inside DCP's finish) raises CheckpointWriteError(ENOSPC); step 1 stays."""
    import torch

    import torch_ckpt.format._dcp_write as dcp_io
    from torch_ckpt import CheckpointManager

    real = dcp_io._FileSink._write_all

    def full_for_metadata(self, view):
        if self.path.name.startswith(".metadata") and full:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, view)

    full = False
    monkeypatch.setattr(dcp_io._FileSink, "_write_all", full_for_metadata)
    with CheckpointManager(tmp_path / "ckpt", keep_last=1) as mgr:
        mgr.save(1, {"w": torch.full((1000,), 1.0)})
        mgr.wait()
        full = True
        mgr.save(2, {"w": torch.full((1000,), 2.0)})
        with pytest.raises(CheckpointWriteError) as info:
            mgr.wait()
        full = False
        assert info.value.errno == errno.ENOSPC and ".metadata" in str(info.value)
        assert mgr.all_steps() == [1]
        target = {"w": torch.zeros(1000)}
        assert mgr.restore(target) == 1 and float(target["w"][0]) == 1.0
