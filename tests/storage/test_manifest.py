"""manifest.json (torch_ckpt.format._files): bounded parsing and validation of an untrusted manifest.

Each hostile input of issue 14 (items 3 and 4) is fed to the module's functions directly; the
manager, CLI and convert paths that use them are covered in test_bad_input.py and test_cli_tools.py.
"""

from __future__ import annotations

import json

import pytest

from tests._format_fixtures import STEP, manifest_doc, rewrite, tampered_metadata, weight_item  # noqa: F401
from torch_ckpt import CheckpointCorruptError
from torch_ckpt.format._files import Manifest, parse_manifest, read_manifest


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
    doc = manifest_doc(ckpt)
    doc[field] = value
    with pytest.raises(CheckpointCorruptError, match=field):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def test_manifest_file_entry_with_a_negative_size_is_corrupt(ckpt):
    """A listed file whose size is negative raises CheckpointCorruptError naming the file."""
    doc = manifest_doc(ckpt)
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


def test_manifest_built_in_code_passes_its_own_validation(saved):
    """A Manifest serialised by to_json parses back equal (the writer's output is always accepted)."""
    manifest = read_manifest(saved)
    again = parse_manifest(json.dumps(manifest.to_json()).encode(), "m.json")
    assert isinstance(again, Manifest) and again == manifest
