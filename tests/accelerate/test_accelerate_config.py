"""Settings: defaults, the YAML file, the environment variable and keyword arguments."""

from __future__ import annotations

import pytest

from accelerate_ckpt import ENV_VAR, CkptSettings, load_settings
from torch_ckpt import AnyOf, ConfigError, EveryNSteps, YoungDaly


def write(tmp_path, text: str, name: str = "ckpt.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_file_or_environment():
    """Without a file the settings are the documented defaults."""
    assert load_settings() == CkptSettings()
    assert CkptSettings().async_save is True and CkptSettings().save_policy() is None


def test_file_values_replace_defaults(tmp_path):
    """Keys in the config file replace the defaults; durations become seconds."""
    path = write(tmp_path, "async_save: false\nkeep_last: 2\ntimeout_seconds: 2m\nthread_count: 2\n")
    s = load_settings(path)
    assert (s.async_save, s.keep_last, s.timeout_seconds, s.thread_count) == (False, 2, 120.0, 2)


def test_environment_variable_file_wins_over_config_argument(tmp_path, monkeypatch):
    """The file named by ACCELERATE_CKPT_CONFIG is read instead of the config= argument."""
    code_file = write(tmp_path, "keep_last: 5\n", "code.yaml")
    monkeypatch.setenv(ENV_VAR, str(write(tmp_path, "keep_last: 7\n", "ops.yaml")))
    assert load_settings(code_file).keep_last == 7


def test_keyword_settings_win_over_the_file(tmp_path):
    """A setting passed in code overrides the same key in the file."""
    path = write(tmp_path, "async_save: false\npersist: thread\n")
    assert load_settings(path, async_save=True).async_save is True


def test_empty_file_means_defaults(tmp_path):
    """An empty settings file is valid and changes nothing."""
    assert load_settings(write(tmp_path, "")) == CkptSettings()


def test_unknown_key_is_rejected_by_name(tmp_path):
    """A misspelt key raises ConfigError naming it and the valid keys."""
    with pytest.raises(ConfigError, match=r"async_sav\b.*valid settings"):
        load_settings(write(tmp_path, "async_sav: false\n"))


def test_unknown_keyword_is_rejected():
    """A misspelt keyword argument raises ConfigError too."""
    with pytest.raises(ConfigError, match="totl_limit"):
        load_settings(totl_limit=3)


@pytest.mark.parametrize("text, key", [
    ("persist: disk\n", "persist"),
    ("mtbf_seconds: -1h\n", "mtbf_seconds"),
    ("keep_last: 0\n", "keep_last"),
    ("async_save: maybe\n", "async_save"),
    ("writer_niceness: 25\n", "writer_niceness"),
    ("save_every_seconds: soon\n", "save_every_seconds"),
])
def test_invalid_value_names_the_key(tmp_path, text, key):
    """An invalid value raises ConfigError (a ValueError) whose message names the key."""
    with pytest.raises(ConfigError, match=key):
        load_settings(write(tmp_path, text))


def test_file_that_is_not_a_mapping_is_rejected(tmp_path):
    """A YAML list instead of a mapping raises ConfigError naming the file."""
    path = write(tmp_path, "- async_save\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_settings(path)


def test_missing_file_is_reported(tmp_path):
    """A config path that does not exist raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_settings(tmp_path / "nope.yaml")


def test_save_policy_follows_the_schedule_keys(tmp_path):
    """save_every_n_steps, mtbf and both together give EveryNSteps, YoungDaly and AnyOf."""
    assert isinstance(load_settings(save_every_n_steps=10).save_policy(), EveryNSteps)
    assert isinstance(load_settings(mtbf_seconds="8h").save_policy(), YoungDaly)
    assert isinstance(load_settings(write(tmp_path, "mtbf_seconds: 8h\nsave_every_n_steps: 100\n")).save_policy(), AnyOf)


def test_durable_settings_are_validated():
    """durable_keep_last without durable_url, or an unknown durable_verify, raises ConfigError."""
    with pytest.raises(ConfigError, match="durable_keep_last needs durable_url"):
        load_settings(durable_keep_last=2)
    with pytest.raises(ConfigError, match="durable_verify"):
        load_settings(durable_url="memory://x", durable_verify="md5")


def test_shipped_example_config_is_valid():
    """examples/accelerate/ckpt.yaml parses and selects the Young/Daly policy it documents."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "accelerate" / "ckpt.yaml"
    settings = load_settings(path)
    assert isinstance(settings.save_policy(), YoungDaly) and settings.keep_last == 3


@pytest.mark.parametrize(("text", "expected"), [("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GB", 1_500_000_000),
                                                ("1000", 1000)])
def test_staging_budget_accepts_sizes_with_units(text, expected):
    """staging_budget_bytes takes "4GB" (powers of 10) and "512MiB" (powers of 2) like the other sizes."""
    assert CkptSettings(staging_budget_bytes=text).staging_budget_bytes == expected


@pytest.mark.parametrize("text", ["4 parsecs", "GB", "-1GB", ""])
def test_staging_budget_rejects_a_malformed_size_naming_the_setting(text):
    """A size that is not a positive byte count raises ConfigError naming staging_budget_bytes."""
    with pytest.raises(ConfigError, match="staging_budget_bytes"):
        CkptSettings(staging_budget_bytes=text)
