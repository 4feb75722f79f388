"""Listed files and per-rank state files (torch_ckpt.format._files): only listed regular files, bounded rank trees.

Each hostile input of issue 14 (items 3 and 4) is fed to the module's functions directly; the
manager, CLI and convert paths that use them are covered in test_bad_input.py and test_cli_tools.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests._format_fixtures import (  # noqa: F401
    STEP,
    first_inline,
    manifest_doc,
    rewrite,
    tampered_metadata,
    weight_item,
)
from torch_ckpt import CheckpointCorruptError
from torch_ckpt.format._files import (
    MAX_STATE_DEPTH,
    parse_manifest,
    parse_rank_doc,
    rank_file_problems,
    read_manifest,
    read_rank_doc,
    verify_files,
    walk_tree,
)


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
        verify_files(ckpt, manifest, checksums=True)
    verify_files(ckpt, manifest, checksums=True, allow_symlinks=True)  # the explicit option follows it


def test_listed_file_that_is_a_fifo_is_refused_without_blocking(ckpt):
    """A listed file replaced by a FIFO is refused as not a regular file (opening it does not hang)."""
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointCorruptError, match=f"{shard.name}.*not a regular file"):
        verify_files(ckpt, read_manifest(ckpt), checksums=False)


# -- per-rank JSON ---------------------------------------------------------------------------------
def _rank_doc(step_dir: Path) -> dict:
    return json.loads((step_dir / "rank_00000.json").read_text())


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
    node = first_inline(doc["tree"])
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
    doc = manifest_doc(ckpt)
    doc["world_size"] = 2**40
    with pytest.raises(CheckpointCorruptError, match="world_size 1099511627776 is out of range"):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def test_huge_world_size_is_reported_once_without_iterating_ranks(ckpt):
    """A world size of 2^31-1 with one rank file listed yields one problem, from the file list alone."""
    doc = manifest_doc(ckpt)
    doc["world_size"] = 2**31 - 1
    manifest = parse_manifest(json.dumps(doc).encode(), "m.json")
    problems = rank_file_problems(manifest)
    assert len(problems) == 1 and "world size 2147483647" in problems[0][1] and "rank_00001.json" in problems[0][1]
    with pytest.raises(CheckpointCorruptError, match="world size 2147483647"):
        read_rank_doc(ckpt, manifest, 0)


# -- the same check on a store (the durable tier's uploads and fetches, `verify s3://...`) ----------
def _on_store(s3, step_dir: Path):
    """``(Location, file system)`` of a copy of ``step_dir`` uploaded to a new bucket of the moto server."""
    import s3fs

    from torch_ckpt.storage._locations import Location

    bucket = s3.new_bucket()
    fs = s3fs.S3FileSystem(**s3.options)
    for path in step_dir.iterdir():
        fs.put_file(str(path), f"{bucket}/run/{STEP}/{path.name}")
    return Location(f"s3://{bucket}/run/{STEP}", storage_options=s3.options), fs


def _largest(manifest) -> str:
    return max(manifest.files, key=lambda name: manifest.files[name]["bytes"])


def _flip(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    return bytes(flipped)


def test_corrupt_object_on_a_store_is_reported_as_a_corrupt_local_file_is(ckpt, s3):
    """A flipped byte in an object gives the error type and text a flipped byte in the local file gives."""
    manifest = read_manifest(ckpt)
    name = _largest(manifest)
    loc, fs = _on_store(s3, ckpt)
    fs.pipe_file(f"{loc.path}/{name}", _flip(fs.cat_file(f"{loc.path}/{name}")))
    (ckpt / name).write_bytes(_flip((ckpt / name).read_bytes()))
    with pytest.raises(CheckpointCorruptError) as remote:
        verify_files(loc, manifest, checksums=True)
    with pytest.raises(CheckpointCorruptError) as local:
        verify_files(ckpt, manifest, checksums=True)
    assert str(remote.value) == f"{loc.describe(name)}: " + str(local.value).removeprefix(f"{ckpt / name}: ")
    assert "CRC-32" in str(remote.value)


def test_store_digest_equal_to_the_objects_passes_without_reading(saved, s3):
    """With the objects' own ETags as store_digests nothing is read; the check still passes."""
    manifest = read_manifest(saved)
    loc, fs = _on_store(s3, saved)
    digests = {name: fs.info(f"{loc.path}/{name}")["ETag"].strip('"') for name in manifest.files}
    assert verify_files(loc, manifest, checksums=True, store_digests=digests) == 0


def test_store_digest_that_differs_falls_back_to_the_crc32(saved, s3):
    """A digest the store does not report (e.g. an SSE-KMS ETag) costs a read of every byte, not an error."""
    manifest = read_manifest(saved)
    loc, _ = _on_store(s3, saved)
    other = dict.fromkeys(manifest.files, "0" * 32)
    assert verify_files(loc, manifest, checksums=True, store_digests=other) == sum(
        info["bytes"] for info in manifest.files.values())


def test_store_digest_never_hides_a_corrupt_object(ckpt, s3):
    """An object changed after its digest was taken is read back and reported corrupt."""
    manifest = read_manifest(ckpt)
    name = _largest(manifest)
    loc, fs = _on_store(s3, ckpt)
    digests = {name: fs.info(f"{loc.path}/{name}")["ETag"].strip('"')}
    fs.pipe_file(f"{loc.path}/{name}", _flip(fs.cat_file(f"{loc.path}/{name}")))
    with pytest.raises(CheckpointCorruptError, match="CRC-32 .* does not match the manifest"):
        verify_files(loc, manifest, checksums=True, store_digests=digests)


def test_size_only_check_misses_a_same_size_change_that_checksums_catch(ckpt):
    """checksums=False compares sizes only (reads nothing); checksums=True finds the changed byte."""
    manifest = read_manifest(ckpt)
    name = _largest(manifest)
    (ckpt / name).write_bytes(_flip((ckpt / name).read_bytes()))
    assert verify_files(ckpt, manifest, checksums=False) == 0
    with pytest.raises(CheckpointCorruptError, match=f"{name}: CRC-32"):
        verify_files(ckpt, manifest, checksums=True)
