"""Single-pass restore (torch_ckpt.restore._restore.load_direct): one read per byte, CRC-32 checked in the same pass."""

from __future__ import annotations

import os

import pytest
import torch

from torch_ckpt import CheckpointManager
from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.format._dcp_write import record_framing
from torch_ckpt.format._files import read_manifest, read_metadata
from torch_ckpt.restore._restore import load_direct


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g),
            "h": torch.randn(16, generator=g).to(torch.bfloat16), "i": torch.arange(7)}


@pytest.fixture()
def ckpt(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state()).wait()
    return next(tmp_path.glob("step_*"))


def _targets() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


def _data_pos(info, key) -> int:
    """File offset of the first data byte of ``key``'s record."""
    head, _ = record_framing(_state()[key])
    return info.offset + len(head)


def _data_file(ckpt, key):
    md = read_metadata(ckpt, read_manifest(ckpt))
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == key]
    return ckpt / info.relative_path, info


def test_every_tensor_is_placed_from_one_pass(ckpt):
    """All tensors of a checkpoint written by torch-ckpt are placed directly, with the saved values."""
    targets = _targets()
    manifest = read_manifest(ckpt)
    rest = load_direct(targets, ckpt, read_metadata(ckpt, manifest), manifest, verify=True)
    assert rest == set()
    for key, value in _state().items():
        assert torch.equal(targets[key], value), key


@pytest.mark.parametrize("where", ["data", "framing"])
def test_flipped_byte_is_a_corrupt_file(ckpt, where):
    """A byte flipped in a tensor's data or in its record framing fails the CRC-32 check naming the file."""
    path, info = _data_file(ckpt, "w")
    pos = _data_pos(info, "w") + 1000 if where == "data" else info.offset + 10
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    manifest = read_manifest(ckpt)
    with pytest.raises(CheckpointCorruptError, match=f"{path.name}.*CRC-32"):
        load_direct(_targets(), ckpt, read_metadata(ckpt, manifest), manifest, verify=True)


def test_truncated_file_is_corrupt(ckpt):
    """A data file shorter than the manifest says is refused before any tensor is placed."""
    path, _ = _data_file(ckpt, "w")
    os.truncate(path, path.stat().st_size - 1)
    manifest = read_manifest(ckpt)
    targets = _targets()
    with pytest.raises(CheckpointCorruptError, match=f"{path.name}.*size"):
        load_direct(targets, ckpt, read_metadata(ckpt, manifest), manifest, verify=True)
    assert all(torch.count_nonzero(t) == 0 for t in targets.values())


def test_unexpected_framing_is_left_to_dcp(ckpt):
    """Without verification, a record whose framing differs from torch.save's is not placed but returned."""
    path, info = _data_file(ckpt, "w")
    raw = bytearray(path.read_bytes())
    raw[info.offset + 10] ^= 0x01
    path.write_bytes(bytes(raw))
    manifest = read_manifest(ckpt)
    targets = _targets()
    rest = load_direct(targets, ckpt, read_metadata(ckpt, manifest), manifest, verify=False)
    assert rest == {"w"}
    assert torch.equal(targets["b"], _state()["b"])


def test_non_contiguous_target_is_left_to_dcp(ckpt):
    """A target the reader cannot fill byte for byte (a transposed view) is returned for DCP's reader."""
    targets = _targets()
    targets["w"] = torch.zeros(32, 64).t()
    manifest = read_manifest(ckpt)
    rest = load_direct(targets, ckpt, read_metadata(ckpt, manifest), manifest, verify=True)
    assert rest == {"w"}


def test_manager_restore_detects_a_flipped_data_byte(ckpt):
    """CheckpointManager.restore of a checkpoint with one flipped data byte raises and leaves the state as it was."""
    path, info = _data_file(ckpt, "b")
    raw = bytearray(path.read_bytes())
    raw[_data_pos(info, "b") + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    live = _targets()
    with CheckpointManager(ckpt.parent) as mgr, pytest.raises(CheckpointCorruptError, match="CRC-32"):
        mgr.restore(live, step=1)
    assert all(torch.count_nonzero(t) == 0 for t in live.values())


@pytest.mark.parametrize("buffer_bytes", [64, 4096, 1 << 20])
def test_records_straddling_the_read_ahead_buffer_are_placed_exactly(tmp_path, monkeypatch, buffer_bytes):
    """Small and large records, whatever their position against the read-ahead buffer, load bit for bit."""
    from torch_ckpt.restore import _restore as direct_read
    monkeypatch.setattr(direct_read, "_BUFFER_BYTES", buffer_bytes)
    g = torch.Generator().manual_seed(1)
    state = {f"s{i}": torch.randn(n, generator=g) for i, n in enumerate([1, 7, 300, 5000, 300_000, 3, 262_144, 17])}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
    ckpt = next(tmp_path.glob("step_*"))
    manifest = read_manifest(ckpt)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    assert load_direct(targets, ckpt, read_metadata(ckpt, manifest), manifest, verify=True) == set()
    assert all(torch.equal(targets[k], v) for k, v in state.items())


def _big_state() -> dict[str, torch.Tensor]:
    """Tensors of several sizes and dtypes, spread over two data files."""
    g = torch.Generator().manual_seed(2)
    return {"big": torch.randn(3 << 18, generator=g), "big2": torch.randn(5 << 17, generator=g),
            "small": torch.randn(100, generator=g), "ints": torch.arange(1 << 20)}


@pytest.fixture(params=["thread", pytest.param("process", marks=pytest.mark.slow)])
def two_files(tmp_path, request):
    """A checkpoint of _big_state written in two data files by thread or process persist."""
    with CheckpointManager(tmp_path, persist=request.param, thread_count=2) as mgr:
        mgr.save(1, _big_state()).wait()
    ckpt = next(tmp_path.glob("step_*"))
    assert len(list(ckpt.glob("*.distcp"))) == 2
    return ckpt


@pytest.mark.parametrize("readers", [1, 2])
def test_files_read_one_by_one_or_together_place_the_same_values(two_files, monkeypatch, readers):
    """Two data files, read by one thread or by two at a time, place every tensor with its saved value."""
    from torch_ckpt.restore import _restore as direct_read
    monkeypatch.setattr(direct_read, "_READERS", readers)
    manifest = read_manifest(two_files)
    targets = {k: torch.empty_like(v) for k, v in _big_state().items()}
    assert load_direct(targets, two_files, read_metadata(two_files, manifest), manifest, verify=True) == set()
    assert all(torch.equal(targets[k], v) for k, v in _big_state().items())


@pytest.mark.parametrize("readers", [1, 2])
def test_flipped_byte_in_the_last_file_names_it(two_files, monkeypatch, readers):
    """A byte flipped in the last data file fails its CRC-32 check, naming that file, however many readers run."""
    from torch_ckpt.restore import _restore as direct_read
    monkeypatch.setattr(direct_read, "_READERS", readers)
    last = sorted(two_files.glob("*.distcp"))[-1]
    raw = bytearray(last.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    last.write_bytes(bytes(raw))
    manifest = read_manifest(two_files)
    with pytest.raises(CheckpointCorruptError, match=f"{last.name}.*CRC-32"):
        load_direct({k: torch.empty_like(v) for k, v in _big_state().items()}, two_files,
                    read_metadata(two_files, manifest), manifest, verify=True)


_DTYPES = [torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.uint8, torch.bool,
           torch.complex64, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_every_dtype_is_placed_from_its_record_with_the_saved_bytes(tmp_path, dtype):
    """A tensor of each dtype (saved by the manager) is placed by load_direct, byte for byte."""
    saved = torch.arange(48, dtype=torch.float32).reshape(6, 8).to(dtype)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"t": saved}).wait()
    step_dir = next(tmp_path.glob("step_*"))
    manifest = read_manifest(step_dir)
    targets = {"t": torch.empty(6, 8, dtype=dtype)}
    assert load_direct(targets, step_dir, read_metadata(step_dir, manifest), manifest, verify=True) == set()
    assert torch.equal(targets["t"].view(torch.uint8), saved.view(torch.uint8))


def test_odd_live_tensors_restore_exactly(tmp_path):
    """Non-contiguous, conjugate-view, zero-size, 0-d and tied live tensors get the saved values."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    saved = {"nc": base.t(), "cj": torch.complex(base[0], -base[1]), "z": torch.empty(0, 3),
             "s": torch.tensor(3.5), "tied": base.double()}
    saved["tie2"] = saved["tied"]
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, saved).wait()
    live = {"nc": torch.zeros(4, 6).t(), "cj": torch.zeros(6, dtype=torch.complex64).conj(), "z": torch.empty(0, 3),
            "s": torch.tensor(0.0), "tied": torch.zeros(4, 6, dtype=torch.float64)}
    live["tie2"] = live["tied"]
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(live)
    assert all(torch.equal(live[k].resolve_conj(), saved[k]) for k in saved)
    assert live["tie2"] is live["tied"]


def test_a_refused_read_ahead_hint_is_not_a_damaged_file(two_files, monkeypatch):
    """posix_fadvise raising (a seccomp or security-module denial) is ignored: the restore reads as usual."""
    import torch_ckpt.restore._restore as dr

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(dr.os, "posix_fadvise", refuse)
    manifest = read_manifest(two_files)
    targets = {k: torch.zeros_like(v) for k, v in _big_state().items()}
    assert load_direct(targets, two_files, read_metadata(two_files, manifest), manifest, verify=True) == set()
    assert all(torch.equal(targets[k], v) for k, v in _big_state().items())
