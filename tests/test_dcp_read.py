"""format._files: DCP metadata read with a restricted unpickler, tensors read only from listed regular files."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from torch_ckpt.errors import CheckpointCorruptError, UnsafeCheckpointError
from torch_ckpt.format._files import load_dcp_metadata_bytes, load_tensors, read_dcp_metadata

CALLED: list[str] = []


def mark_called(*args):
    """Target of forged pickles: records that it ran."""
    CALLED.append("called")
    return Metadata(state_dict_metadata={})


@pytest.fixture
def saved(tmp_path):
    """A plain single-process DCP checkpoint of two tensors; returns (directory, tensors, file names)."""
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([7, 8], dtype=torch.int64)}
    dcp.save(tensors, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    directory = tmp_path / "ck"
    return directory, tensors, {p.name for p in directory.iterdir()}


def empty_like(tensors):
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def test_metadata_is_read(saved):
    """The .metadata of a DCP checkpoint is read as Metadata listing its tensors."""
    directory, tensors, _ = saved
    assert set(read_dcp_metadata(directory / ".metadata").state_dict_metadata) == set(tensors)


def test_tensors_load_back(saved):
    """load_tensors fills the given tensors with the saved values."""
    directory, tensors, names = saved
    out = empty_like(tensors)
    load_tensors(out, directory, read_dcp_metadata(directory / ".metadata"), names)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_forged_metadata_calling_a_function_is_refused_without_running_it():
    """A .metadata pickle that calls a function is refused as UnsafeCheckpointError and the function never runs."""
    forged = f"c{__name__}\nmark_called\n(tR.".encode()
    assert isinstance(pickle.loads(forged), Metadata) and CALLED == ["called"]  # it does run when unpickled
    CALLED.clear()
    with pytest.raises(UnsafeCheckpointError, match=f"/x/.metadata: refusing to unpickle {__name__}.mark_called"):
        load_dcp_metadata_bytes(forged, "/x/.metadata")
    assert CALLED == []


@pytest.mark.parametrize("target", ["os system", "torch load", "builtins eval"])
def test_metadata_globals_outside_dcp_are_refused(target):
    """References to os, non-dtype torch attributes or builtins are refused by name."""
    with pytest.raises(UnsafeCheckpointError, match=target.replace(" ", ".")):
        load_dcp_metadata_bytes(f"c{target.replace(' ', chr(10))}\n.".encode(), "m")


def test_torch_dtypes_are_admitted():
    """A reference to a torch dtype (as DCP metadata holds) is admitted by the unpickler."""
    with pytest.raises(CheckpointCorruptError, match="got dtype"):  # admitted, then refused as not Metadata
        load_dcp_metadata_bytes(pickle.dumps(torch.float32, protocol=2), "m")


@pytest.mark.parametrize("data,message", [(b"\x80\x04\x95", "unreadable"), (b"", "unreadable"),
                                          (pickle.dumps({"a": 1}), "not a DCP metadata file")])
def test_truncated_or_foreign_metadata_is_corrupt(data, message):
    """Truncated bytes or a pickle of something else raise CheckpointCorruptError naming the source."""
    with pytest.raises(CheckpointCorruptError, match=f"/x/.metadata: .*{message}"):
        load_dcp_metadata_bytes(data, "/x/.metadata")


def test_unlisted_data_file_is_not_opened(saved):
    """A data file missing from the allowed names is refused instead of read."""
    directory, tensors, names = saved
    data_files = {n for n in names if n.endswith(".distcp")}
    with pytest.raises(CheckpointCorruptError, match="does not list"):
        load_tensors(empty_like(tensors), directory, read_dcp_metadata(directory / ".metadata"), names - data_files)


def test_symlinked_data_file_is_refused(saved, tmp_path):
    """A data file replaced by a symlink is refused unless symlinks are allowed."""
    directory, tensors, names = saved
    data = next(n for n in names if n.endswith(".distcp"))
    os.rename(directory / data, tmp_path / "moved")
    (directory / data).symlink_to(tmp_path / "moved")
    md = read_dcp_metadata(directory / ".metadata")
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        load_tensors(empty_like(tensors), directory, md, names)
    out = empty_like(tensors)
    load_tensors(out, directory, md, names, allow_symlinks=True)
    assert torch.equal(out["w"], tensors["w"])


def test_truncated_data_file_is_corrupt_naming_it(saved):
    """A truncated data file raises CheckpointCorruptError naming the file."""
    directory, tensors, names = saved
    data = next(n for n in names if n.endswith(".distcp"))
    with open(directory / data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointCorruptError, match=f"{data}.*cannot be read"):
        load_tensors(empty_like(tensors), directory, read_dcp_metadata(directory / ".metadata"), names)


def test_pickled_item_is_refused(tmp_path):
    """A non-tensor item (stored pickled by plain DCP) is refused as UnsafeCheckpointError naming its key."""
    dcp.save({"t": torch.zeros(2), "obj": [1, 2]}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    directory = tmp_path / "ck"
    names = {p.name for p in directory.iterdir()}
    with pytest.raises(UnsafeCheckpointError, match="'obj'.*pickled object"):
        load_tensors({"t": torch.ones(2), "obj": None}, directory, read_dcp_metadata(directory / ".metadata"), names)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupt_while_dcp_reads_is_raised_not_called_corruption(saved, monkeypatch, interrupt):
    """A Ctrl-C inside DCP's reader stays a KeyboardInterrupt (a corrupt error would make restore skip the step)."""
    import torch_ckpt.format._files as dcp_read_mod

    def interrupted(*args, **kwargs):
        raise interrupt()

    monkeypatch.setattr(dcp_read_mod.SafeFileSystemReader, "read_data", interrupted)
    directory, tensors, names = saved
    with pytest.raises(interrupt):
        load_tensors(empty_like(tensors), directory, read_dcp_metadata(directory / ".metadata"), names)
