"""Settings files (CheckpointConfig.read_yaml): what makes a file ambiguous or unusable is a ConfigError naming it."""

from __future__ import annotations

import pytest

from torch_ckpt import CheckpointConfig, ConfigError


def test_a_key_given_twice_is_refused_naming_the_file_key_and_line(tmp_path):
    """YAML keeps the last of two equal keys silently; a settings file refuses them."""
    path = tmp_path / "ckpt.yaml"
    path.write_text("keep_last: 3\nthread_count: 2\nkeep_last: 5\n")
    with pytest.raises(ConfigError, match=r"ckpt\.yaml: setting 'keep_last' is given twice \(line 3\)"):
        CheckpointConfig.read_yaml(path)


def test_a_key_repeated_in_a_nested_mapping_is_refused(tmp_path):
    """A repeated key below the top level is refused as well."""
    path = tmp_path / "ckpt.yaml"
    path.write_text("storage_options:\n  anon: true\n  anon: false\n")
    with pytest.raises(ConfigError, match="'anon' is given twice"):
        CheckpointConfig.read_yaml(path)


@pytest.mark.parametrize("field", ["process_group", "retention", "save_policy", "naming"])
def test_code_only_settings_are_refused_from_a_file(tmp_path, field):
    """A setting that takes a Python object cannot come from a file (it was silently ignored)."""
    path = tmp_path / "ckpt.yaml"
    path.write_text(f"{field}: gloo\n")
    with pytest.raises(ConfigError, match=rf"ckpt\.yaml: \['{field}'\] can only be given in code"):
        CheckpointConfig.from_yaml(path)


def test_distinct_keys_read_back_as_written(tmp_path):
    """A file without repeated or code-only keys reads back as its mapping."""
    path = tmp_path / "ckpt.yaml"
    path.write_text("keep_last: 3\nstorage_options:\n  anon: true\n")
    assert CheckpointConfig.read_yaml(path) == {"keep_last": 3, "storage_options": {"anon": True}}


@pytest.mark.parametrize("field", ["thread_count", "durable_upload_threads"])
def test_thread_counts_above_256_are_refused(field):
    """Threads (and files) per rank are bounded: a typo such as 20000 is an error, not 20000 threads."""
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(**{field: 20_000})
    assert getattr(CheckpointConfig(**{field: 256}), field) == 256
