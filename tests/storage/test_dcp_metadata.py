"""DCP metadata (torch_ckpt.format._files): type checks, chunk coverage and bounds, record checks end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from tests._format_fixtures import STEP, manifest_doc, rewrite, tampered_metadata, weight_item  # noqa: F401
from torch_ckpt import CheckpointCorruptError, CheckpointManager
from torch_ckpt.format._files import metadata_problems, read_dcp_metadata, read_manifest, read_metadata


# -- DCP metadata ----------------------------------------------------------------------------------
def test_metadata_with_storage_data_5_is_corrupt_naming_the_file(ckpt):
    """.metadata of an allowed class whose storage_data is 5 raises CheckpointCorruptError (no AttributeError)."""
    tampered_metadata(ckpt, lambda md: setattr(md, "storage_data", 5))
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: storage_data is a int"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_declared_shape_larger_than_its_chunks_is_corrupt(ckpt):
    """A tensor declared (20, 16) whose chunks cover (16, 16) raises CheckpointCorruptError naming the tensor."""
    def grow(md):
        key, item = weight_item(md)
        item.size = torch.Size([20, 16])

    tampered_metadata(ckpt, grow)
    with pytest.raises(CheckpointCorruptError, match=r"model.weight.*256 of the 320 elements"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_overlapping_chunks_are_corrupt(ckpt):
    """Two chunks covering the same rows (total count still right) raise CheckpointCorruptError naming both."""
    def overlap(md):
        key, item = weight_item(md)
        old = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data.pop(old)
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([8, 16])),
                       ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([8, 16]))]
        for chunk in item.chunks:
            md.storage_data[MetadataIndex(key, chunk.offsets)] = info

    tampered_metadata(ckpt, overlap)
    with pytest.raises(CheckpointCorruptError, match=r"model.weight.*overlap"):
        read_metadata(ckpt, read_manifest(ckpt))


@pytest.mark.parametrize("grid", [(2, 2), (1, 4), (4, 1)])
def test_exact_tiling_by_several_chunks_is_accepted(ckpt, grid):
    """Chunks tiling the (16, 16) weight exactly (2x2 blocks, column or row strips) raise no problem."""
    def tile(md):
        key, item = weight_item(md)
        old = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data.pop(old)
        rows, cols = 16 // grid[0], 16 // grid[1]
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([r * rows, c * cols]), sizes=torch.Size([rows, cols]))
                       for r in range(grid[0]) for c in range(grid[1])]
        for chunk in item.chunks:
            md.storage_data[MetadataIndex(key, chunk.offsets)] = info

    tampered_metadata(ckpt, tile)
    md = read_dcp_metadata(ckpt / ".metadata")
    assert metadata_problems(md, read_manifest(ckpt))[0] == []


def test_declared_2_40_element_tensor_is_bounded_by_its_storage(ckpt):
    """A tensor and chunk declaring 2^40 elements is refused: its storage entry holds far fewer bytes."""
    def huge(md):
        key, item = weight_item(md)
        old = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data.pop(old)
        item.size = torch.Size([2**40])
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2**40]))]
        md.storage_data[MetadataIndex(key, torch.Size([0]))] = info

    tampered_metadata(ckpt, huge)
    with pytest.raises(CheckpointCorruptError, match=r"model.weight.*declares 4398046511104 bytes"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_storage_path_rewritten_to_another_file_is_corrupt(ckpt, tmp_path):
    """Storage entries rewritten to a file elsewhere (manifest re-checksummed) raise CheckpointCorruptError."""
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(next(ckpt.glob("*.distcp")).read_bytes())

    def elsewhere(md):
        for info in md.storage_data.values():
            info.relative_path = str(outside)

    tampered_metadata(ckpt, elsewhere)
    with pytest.raises(CheckpointCorruptError, match=r"stored in .*elsewhere.distcp.*not a data file the manifest"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_storage_path_pointing_at_a_rank_json_is_corrupt(ckpt):
    """A storage entry pointing into a listed non-data file (rank JSON) is refused."""
    def into_rank_file(md):
        next(iter(md.storage_data.values())).relative_path = "rank_00000.json"
        next(iter(md.storage_data.values())).offset = 0

    tampered_metadata(ckpt, into_rank_file)
    with pytest.raises(CheckpointCorruptError, match="rank_00000.json"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_intact_metadata_has_no_problems_and_lists_every_tensor(saved):
    """The metadata of an intact checkpoint passes, with every DCP tensor returned."""
    manifest = read_manifest(saved)
    md = read_dcp_metadata(saved / ".metadata")
    problems, tensors = metadata_problems(md, manifest)
    assert problems == []
    assert set(tensors) == {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert len(tensors) >= 4  # weight, bias and their two AdamW moments


def test_metadata_problems_do_not_mutate_the_metadata(saved):
    """Validation leaves the metadata object unchanged (it is handed to DCP afterwards)."""
    md = read_dcp_metadata(saved / ".metadata")
    before = copy.deepcopy(md)
    metadata_problems(md, read_manifest(saved))
    assert md == before


def test_dcp_reader_opens_only_listed_files_even_with_unchecked_metadata(ckpt, tmp_path):
    """load_tensors refuses to open a file outside the allowed names, even if metadata validation was skipped."""
    from torch_ckpt.format._files import load_tensors

    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(next(ckpt.glob("*.distcp")).read_bytes())
    md = read_dcp_metadata(ckpt / ".metadata")
    for info in md.storage_data.values():
        info.relative_path = str(outside)
    key, item = weight_item(md)
    target = {key: torch.zeros(tuple(item.size))}
    with pytest.raises(CheckpointCorruptError, match="does not list"):
        load_tensors(target, ckpt, md, set(read_manifest(ckpt).files))
    assert torch.count_nonzero(target[key]) == 0


@pytest.mark.parametrize("persist,thread_count", [("thread", 1), ("thread", 2), ("thread", 4),
                                                  pytest.param("process", 2, marks=pytest.mark.slow)])
def test_records_of_every_dtype_written_by_the_manager_pass_and_restore(tmp_path, persist, thread_count):
    """Tensors of typed and untyped-storage dtypes (float8, uint16, bool, complex...) pass the record check, restore."""
    from torch_ckpt.format._files import record_problems

    dtypes = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint16, torch.bool, torch.complex64, torch.int8]
    state = {f"t{i}": torch.arange(12).reshape(3, 4).to(d) for i, d in enumerate(dtypes)}
    state["transposed"] = torch.arange(12.0).reshape(3, 4).t()
    with CheckpointManager(tmp_path, persist=persist, thread_count=thread_count) as mgr:
        mgr.save(1, state).wait()
    step_dir = tmp_path / STEP
    manifest = read_manifest(step_dir)
    assert record_problems(step_dir, manifest, read_metadata(step_dir, manifest)) == []
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(live) == 1
    assert all(torch.equal(live[k], v) for k, v in state.items())


def _problems_after(saved, edit) -> list[str]:
    """Texts of metadata_problems for a copy of the saved metadata changed by ``edit(md)``."""
    md = read_dcp_metadata(saved / ".metadata")
    edit(md)
    return [text for _file, text in metadata_problems(md, read_manifest(saved))[0]]


@pytest.mark.parametrize("size", [(True, 16), (16, -1), (16.0, 16), (16, 16) + (1,) * 63])
def test_declared_shape_of_bools_floats_negatives_or_too_many_dims_is_refused(saved, size):
    """A declared shape holding a bool, a float or a negative int, or too many dimensions, is a problem."""
    problems = _problems_after(saved, lambda md: setattr(weight_item(md)[1], "size", size))
    assert any("model.weight" in p and "is not a tuple of non-negative integers" in p for p in problems)


def test_chunk_offsets_holding_a_bool_are_refused(saved):
    """A chunk whose offsets hold a bool (equal to 0, but not an int) is a problem."""
    def edit(md):
        item = weight_item(md)[1]
        item.chunks = [ChunkStorageMetadata(offsets=(False, 0), sizes=item.chunks[0].sizes)]

    assert any("'model.weight': chunks are not a list" in p for p in _problems_after(saved, edit))


def test_single_chunk_at_the_origin_larger_than_the_shape_lies_outside(saved):
    """One chunk at offset (0, 0) of size (17, 16) in a (16, 16) tensor is reported outside its shape."""
    def edit(md):
        item = weight_item(md)[1]
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([17, 16]))]

    assert any("model.weight" in p and "lies outside" in p for p in _problems_after(saved, edit))


def test_single_chunk_at_the_origin_smaller_than_the_shape_is_incomplete(saved):
    """One chunk at offset (0, 0) of size (8, 16) in a (16, 16) tensor lies inside but covers half of it."""
    def edit(md):
        item = weight_item(md)[1]
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([8, 16]))]

    problems = _problems_after(saved, edit)
    assert any("model.weight" in p and "128 of the 256 elements" in p for p in problems)
    assert not any("lies outside" in p for p in problems)


def test_every_storage_entry_is_checked_against_its_file_not_only_the_first(saved):
    """The last storage entry pointing past the end of a data file the others fit in is a problem."""
    def edit(md):
        last = list(md.storage_data.values())[-1]
        last.offset = read_manifest(saved).files[str(last.relative_path)]["bytes"]

    assert any("past the end of the file" in p for p in _problems_after(saved, edit))


def test_last_storage_entry_pointing_at_a_rank_json_is_refused(saved):
    """A storage entry into the rank JSON is refused even when earlier entries point at real data files."""
    def edit(md):
        list(md.storage_data.values())[-1].relative_path = "rank_00000.json"

    assert any("rank_00000.json" in p and "not a data file" in p for p in _problems_after(saved, edit))
