"""The storage/format layer (torch_ckpt.format): bounded parsing and validation of untrusted checkpoint content.

Each hostile input of issue 14 (items 3 and 4) is fed to the layer's functions directly; the
manager, CLI and convert paths that use them are covered in test_bad_input.py and test_cli_tools.py.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from torch_ckpt import CheckpointCorruptError, CheckpointManager, TrainState
from torch_ckpt.dcp_io import read_dcp_metadata
from torch_ckpt.format import (
    MAX_STATE_DEPTH,
    check_files,
    metadata_problems,
    parse_manifest,
    parse_rank_doc,
    rank_file_problems,
    read_manifest,
    read_metadata,
    read_rank_tree,
    walk_tree,
)
from torch_ckpt.layout import Manifest

STEP = "step_000000001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A committed checkpoint of a small TrainState (a (16, 16) weight, AdamW state, RNG)."""
    root = tmp_path_factory.mktemp("format")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=opt))
    return root / STEP


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint directory (to damage)."""
    import shutil

    dst = tmp_path / STEP
    shutil.copytree(saved, dst)
    return dst


def _rewrite(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a file and make the manifest agree with it (a consistent, deliberate tampering)."""
    (step_dir / name).write_bytes(data)
    doc = json.loads((step_dir / "manifest.json").read_text())
    doc["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (step_dir / "manifest.json").write_text(json.dumps(doc))


def _manifest_doc(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def _tampered_metadata(step_dir: Path, edit) -> None:
    md = read_dcp_metadata(step_dir / ".metadata")
    edit(md)
    _rewrite(step_dir, ".metadata", pickle.dumps(md))


def _weight(md) -> tuple[str, TensorStorageMetadata]:
    return next((k, v) for k, v in md.state_dict_metadata.items() if k.endswith("model.weight"))


# -- manifest --------------------------------------------------------------------------------------
def test_manifest_with_a_5000_digit_integer_is_corrupt_naming_the_file(ckpt):
    """A valid-JSON manifest with a 5000-digit integer raises CheckpointCorruptError naming it (no raw ValueError)."""
    raw = (ckpt / "manifest.json").read_text().replace('"step":1,', '"step":' + "9" * 5000 + ",", 1)
    assert "9" * 5000 in raw
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*5000 digits"):
        parse_manifest(raw.encode(), str(ckpt / "manifest.json"))


def test_manifest_nested_200k_deep_is_corrupt_naming_the_file(ckpt):
    """A manifest whose 'tiers' nests 200k arrays deep raises CheckpointCorruptError (no RecursionError)."""
    deep = "[" * 200_000 + "]" * 200_000
    raw = (ckpt / "manifest.json").read_text().replace('"tiers":{}', f'"tiers":{{"x":{deep}}}', 1)
    assert deep in raw
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*nested"):
        parse_manifest(raw.encode(), str(ckpt / "manifest.json"))


@pytest.mark.parametrize("field,value", [("step", "1"), ("world_size", 0), ("world_size", True),
                                         ("files", []), ("wall_time", "now"), ("torch_version", 2),
                                         ("timings", {"x": "slow"}), ("tiers", {"durable": 5})])
def test_manifest_field_of_the_wrong_type_is_corrupt_naming_the_field(ckpt, field, value):
    """Every manifest field is type- and range-checked: a wrong one raises CheckpointCorruptError naming it."""
    doc = _manifest_doc(ckpt)
    doc[field] = value
    with pytest.raises(CheckpointCorruptError, match=field):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def test_manifest_file_entry_with_a_negative_size_is_corrupt(ckpt):
    """A listed file whose size is negative raises CheckpointCorruptError naming the file."""
    doc = _manifest_doc(ckpt)
    doc["files"][".metadata"]["bytes"] = -1
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def test_symlinked_manifest_is_refused_unless_allowed(ckpt):
    """manifest.json that is a symlink (even to a valid manifest) is refused; allow_symlinks=True follows it."""
    real = ckpt.parent / "real_manifest.json"
    (ckpt / "manifest.json").rename(real)
    (ckpt / "manifest.json").symlink_to(real)
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*symbolic link"):
        read_manifest(ckpt)
    assert read_manifest(ckpt, allow_symlinks=True).step == 1


# -- listed files ----------------------------------------------------------------------------------
def test_symlinked_shard_to_a_file_outside_is_refused(ckpt, tmp_path):
    """A shard replaced by a symlink to an identical copy outside the checkpoint is refused, naming the shard."""
    shard = next(ckpt.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    manifest = read_manifest(ckpt)
    with pytest.raises(CheckpointCorruptError, match=f"{shard.name}.*symbolic link"):
        check_files(ckpt, manifest, checksums=True)
    check_files(ckpt, manifest, checksums=True, allow_symlinks=True)  # the explicit option follows it


def test_listed_file_that_is_a_fifo_is_refused_without_blocking(ckpt):
    """A listed file replaced by a FIFO is refused as not a regular file (opening it does not hang)."""
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointCorruptError, match=f"{shard.name}.*not a regular file"):
        check_files(ckpt, read_manifest(ckpt), checksums=False)


# -- per-rank JSON ---------------------------------------------------------------------------------
def _rank_doc(step_dir: Path) -> dict:
    return json.loads((step_dir / "rank_00000.json").read_text())


def _first_inline(node):
    if isinstance(node, dict):
        if "__tensor_b64__" in node:
            return node
        node = list(node.values())
    if isinstance(node, list):
        for v in node:
            found = _first_inline(v)
            if found is not None:
                return found
    return None


def test_rank_json_nested_200k_deep_is_corrupt_naming_the_file(ckpt):
    """A rank JSON with 200k-deep nesting raises CheckpointCorruptError naming the file (no RecursionError)."""
    doc = _rank_doc(ckpt)
    raw = json.dumps(doc).replace('"tree": {', '"tree": {"deep": ' + "[" * 200_000 + "]" * 200_000 + ", ", 1)
    manifest = read_manifest(ckpt)
    with pytest.raises(CheckpointCorruptError, match="rank_00000.json.*nested"):
        parse_rank_doc(raw.encode(), str(ckpt / "rank_00000.json"), manifest, 0)


def test_rank_json_just_within_the_depth_limit_parses(ckpt):
    """A tree nested to MAX_STATE_DEPTH levels in total is accepted (the bound is not off by one)."""
    doc = _rank_doc(ckpt)
    inner: dict = {}
    node = inner
    for _ in range(MAX_STATE_DEPTH - 4):  # the document, "tree", "extras" and the innermost dict
        node["k"] = {}
        node = node["k"]
    doc["tree"]["extras"] = inner
    parse_rank_doc(json.dumps(doc).encode(), "r.json", read_manifest(ckpt), 0)
    node["k"] = {"k": {}}
    with pytest.raises(CheckpointCorruptError, match="nested"):
        parse_rank_doc(json.dumps(doc).encode(), "r.json", read_manifest(ckpt), 0)


def test_inline_tensor_declaring_2_40_elements_is_refused_before_allocation(ckpt):
    """An embedded tensor declaring shape [2^40] raises CheckpointCorruptError naming the file and key."""
    doc = _rank_doc(ckpt)
    node = _first_inline(doc["tree"])
    assert node is not None, "the TrainState's RNG state should be embedded per rank"
    node["shape"] = [2**40]
    with pytest.raises(CheckpointCorruptError, match=r"rank_00000.json.*rng.*shape \[1099511627776\]"):
        parse_rank_doc(json.dumps(doc).encode(), str(ckpt / "rank_00000.json"), read_manifest(ckpt), 0)


@pytest.mark.parametrize("node", [
    {"__ndarray_b64__": "AAAAAAAAAAA=", "dtype": "O", "shape": [1]},
    {"__ndarray_b64__": "AAAA", "dtype": [["a", "O"]], "shape": [1]},
    {"__tensor_b64__": "AAAA", "dtype": "float32", "shape": [1.5]},
    {"__tensor_b64__": "not base64!", "dtype": "uint8", "shape": [3]},
    {"__tensor_b64__": "AAAA", "dtype": "__class__", "shape": [3]},
    {"__dict__": [[["unhashable"], 1]]},
    {"__tuple__": {"a": 1}},
    {"__np_scalar__": 1000, "dtype": "int8"},
    {"__float__": "pi"},
], ids=["object-array", "object-field", "float-shape", "bad-base64", "not-a-dtype", "unhashable-key",
        "tuple-of-dict", "scalar-overflow", "bad-float"])
def test_malformed_tree_node_is_refused_naming_its_key(node):
    """walk_tree refuses every node join_state could not decode safely, naming its dotted key."""
    with pytest.raises(ValueError, match="extras.bad"):
        list(walk_tree({"extras": {"bad": node}}))


def test_rank_doc_of_another_step_is_corrupt(ckpt):
    """A rank JSON whose 'step' differs from the manifest raises CheckpointCorruptError naming both files and values."""
    doc = _rank_doc(ckpt)
    doc["step"] = 2
    with pytest.raises(CheckpointCorruptError,
                       match=r"step 2 in this per-rank state file disagrees with step 1 in .*manifest.json"):
        parse_rank_doc(json.dumps(doc).encode(), "r.json", read_manifest(ckpt), 0)


def test_world_size_2_40_is_refused_by_the_manifest_schema(ckpt):
    """A manifest declaring world_size 2^40 is corrupt (out of range), naming the field."""
    doc = _manifest_doc(ckpt)
    doc["world_size"] = 2**40
    with pytest.raises(CheckpointCorruptError, match="world_size 1099511627776 is out of range"):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def test_huge_world_size_is_reported_once_without_iterating_ranks(ckpt):
    """A world size of 2^31-1 with one rank file listed yields one problem, from the file list alone."""
    doc = _manifest_doc(ckpt)
    doc["world_size"] = 2**31 - 1
    manifest = parse_manifest(json.dumps(doc).encode(), "m.json")
    problems = rank_file_problems(manifest)
    assert len(problems) == 1 and "world size 2147483647" in problems[0][1] and "rank_00001.json" in problems[0][1]
    with pytest.raises(CheckpointCorruptError, match="world size 2147483647"):
        read_rank_tree(ckpt, manifest, 0)


# -- DCP metadata ----------------------------------------------------------------------------------
def test_metadata_with_storage_data_5_is_corrupt_naming_the_file(ckpt):
    """.metadata of an allowed class whose storage_data is 5 raises CheckpointCorruptError (no AttributeError)."""
    _tampered_metadata(ckpt, lambda md: setattr(md, "storage_data", 5))
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: storage_data is a int"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_declared_shape_larger_than_its_chunks_is_corrupt(ckpt):
    """A tensor declared (20, 16) whose chunks cover (16, 16) raises CheckpointCorruptError naming the tensor."""
    def grow(md):
        key, item = _weight(md)
        item.size = torch.Size([20, 16])

    _tampered_metadata(ckpt, grow)
    with pytest.raises(CheckpointCorruptError, match=r"model.weight.*256 of the 320 elements"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_overlapping_chunks_are_corrupt(ckpt):
    """Two chunks covering the same rows (total count still right) raise CheckpointCorruptError naming both."""
    def overlap(md):
        key, item = _weight(md)
        old = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data.pop(old)
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([8, 16])),
                       ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([8, 16]))]
        for chunk in item.chunks:
            md.storage_data[MetadataIndex(key, chunk.offsets)] = info

    _tampered_metadata(ckpt, overlap)
    with pytest.raises(CheckpointCorruptError, match=r"model.weight.*overlap"):
        read_metadata(ckpt, read_manifest(ckpt))


@pytest.mark.parametrize("grid", [(2, 2), (1, 4), (4, 1)])
def test_exact_tiling_by_several_chunks_is_accepted(ckpt, grid):
    """Chunks tiling the (16, 16) weight exactly (2x2 blocks, column or row strips) raise no problem."""
    def tile(md):
        key, item = _weight(md)
        old = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data.pop(old)
        rows, cols = 16 // grid[0], 16 // grid[1]
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([r * rows, c * cols]), sizes=torch.Size([rows, cols]))
                       for r in range(grid[0]) for c in range(grid[1])]
        for chunk in item.chunks:
            md.storage_data[MetadataIndex(key, chunk.offsets)] = info

    _tampered_metadata(ckpt, tile)
    md = read_dcp_metadata(ckpt / ".metadata")
    assert metadata_problems(md, read_manifest(ckpt))[0] == []


def test_declared_2_40_element_tensor_is_bounded_by_its_storage(ckpt):
    """A tensor and chunk declaring 2^40 elements is refused: its storage entry holds far fewer bytes."""
    def huge(md):
        key, item = _weight(md)
        old = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data.pop(old)
        item.size = torch.Size([2**40])
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2**40]))]
        md.storage_data[MetadataIndex(key, torch.Size([0]))] = info

    _tampered_metadata(ckpt, huge)
    with pytest.raises(CheckpointCorruptError, match=r"model.weight.*declares 4398046511104 bytes"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_storage_path_rewritten_to_another_file_is_corrupt(ckpt, tmp_path):
    """Storage entries rewritten to a file elsewhere (manifest re-checksummed) raise CheckpointCorruptError."""
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(next(ckpt.glob("*.distcp")).read_bytes())

    def elsewhere(md):
        for info in md.storage_data.values():
            info.relative_path = str(outside)

    _tampered_metadata(ckpt, elsewhere)
    with pytest.raises(CheckpointCorruptError, match=r"stored in .*elsewhere.distcp.*not a data file the manifest"):
        read_metadata(ckpt, read_manifest(ckpt))


def test_storage_path_pointing_at_a_rank_json_is_corrupt(ckpt):
    """A storage entry pointing into a listed non-data file (rank JSON) is refused."""
    def into_rank_file(md):
        next(iter(md.storage_data.values())).relative_path = "rank_00000.json"
        next(iter(md.storage_data.values())).offset = 0

    _tampered_metadata(ckpt, into_rank_file)
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


def test_manifest_built_in_code_passes_its_own_validation(saved):
    """A Manifest serialised by to_json parses back equal (the writer's output is always accepted)."""
    manifest = read_manifest(saved)
    again = parse_manifest(json.dumps(manifest.to_json()).encode(), "m.json")
    assert isinstance(again, Manifest) and again == manifest


def test_dcp_reader_opens_only_listed_files_even_with_unchecked_metadata(ckpt, tmp_path):
    """load_tensors refuses to open a file outside the allowed names, even if metadata validation was skipped."""
    from torch_ckpt.dcp_io import load_tensors

    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(next(ckpt.glob("*.distcp")).read_bytes())
    md = read_dcp_metadata(ckpt / ".metadata")
    for info in md.storage_data.values():
        info.relative_path = str(outside)
    key, item = _weight(md)
    target = {key: torch.zeros(tuple(item.size))}
    with pytest.raises(CheckpointCorruptError, match="does not list"):
        load_tensors(target, ckpt, md, set(read_manifest(ckpt).files))
    assert torch.count_nonzero(target[key]) == 0


@pytest.mark.parametrize("persist,thread_count", [("thread", 1), ("thread", 2), ("thread", 4),
                                                  pytest.param("process", 2, marks=pytest.mark.slow)])
def test_records_of_every_dtype_written_by_the_manager_pass_and_restore(tmp_path, persist, thread_count):
    """Tensors of typed and untyped-storage dtypes (float8, uint16, bool, complex...) pass the record check, restore."""
    from torch_ckpt.format import record_problems

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
