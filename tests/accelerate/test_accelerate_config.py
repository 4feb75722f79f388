"""Settings: the core's CheckpointConfig from the YAML file, the environment variable and keyword arguments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accelerate_ckpt import ENV_VAR, load_settings
from torch_ckpt import CheckpointConfig, ConfigError, EveryNSteps, YoungDaly
from torch_ckpt.policy import AnyOf


def write(tmp_path, text: str, name: str = "ckpt.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_are_the_core_defaults_and_keep_last_is_not_given():
    """Without a file the settings are CheckpointConfig's defaults, enabled, with keep_last left to total_limit."""
    s = load_settings()
    assert s.config == CheckpointConfig() and s.enabled and s.log_stats and not s.keep_last_given


def test_file_values_replace_defaults(tmp_path):
    """Keys in the config file replace the defaults; durations become seconds."""
    s = load_settings(write(tmp_path, "async_save: false\nkeep_last: 2\ntimeout_seconds: 2m\nthread_count: 1\n"))
    assert (s.config.async_save, s.config.keep_last, s.config.timeout_seconds, s.config.thread_count) == (
        False, 2, 120.0, 1)
    assert s.keep_last_given


def test_environment_variable_file_wins_over_config_argument(tmp_path, monkeypatch):
    """The file named by ACCELERATE_CKPT_CONFIG is read instead of the config= argument."""
    code_file = write(tmp_path, "keep_last: 5\n", "code.yaml")
    monkeypatch.setenv(ENV_VAR, str(write(tmp_path, "keep_last: 7\n", "ops.yaml")))
    assert load_settings(code_file).config.keep_last == 7


def test_keyword_settings_win_over_the_file(tmp_path):
    """A setting passed in code overrides the same key in the file."""
    path = write(tmp_path, "async_save: false\nenabled: false\n")
    s = load_settings(path, async_save=True, enabled=True)
    assert s.config.async_save is True and s.enabled is True


def test_unknown_key_is_rejected_by_name(tmp_path):
    """A misspelt key raises ConfigError naming the file, the key, the closest valid key and the valid keys."""
    with pytest.raises(ConfigError, match=r"ckpt.yaml: unknown setting\(s\) \['async_sav'\] \(did you mean "
                                          r"'async_save'\?\).*Valid settings: .*'log_stats'"):
        load_settings(write(tmp_path, "async_sav: false\n"))


def test_unknown_file_key_lists_no_setting_the_file_would_refuse(tmp_path):
    """A file's unknown-key error omits the code-only fields and naming/read_only, which the file may not hold."""
    with pytest.raises(ConfigError, match="unknown setting") as info:
        load_settings(write(tmp_path, "keep_lst: 2\n"))
    listed = re.findall(r"'(\w+)'", str(info.value).split("Valid settings:")[1])
    assert {"keep_last", "enabled", "log_stats"} <= set(listed)
    assert not {"retention", "save_policy", "process_group", "naming", "read_only"} & set(listed)


def test_unknown_keyword_lists_code_only_fields_but_not_the_adapter_s_own(tmp_path):
    """An unknown attach() keyword lists the code-only fields (valid there) but not naming/read_only."""
    with pytest.raises(ConfigError, match=r"attach\(\): unknown setting.*did you mean 'save_policy'") as info:
        load_settings(save_polcy=3)
    listed = set(re.findall(r"'(\w+)'", str(info.value).split("Valid settings:")[1]))
    assert "save_policy" in listed and not {"naming", "read_only"} & listed


def test_misspelt_adapter_key_suggests_it(tmp_path):
    """A misspelt adapter key (not a core field) is suggested as well."""
    with pytest.raises(ConfigError, match=r"did you mean 'enabled'"):
        load_settings(write(tmp_path, "enable: false\n"))


def test_bad_value_given_in_code_names_attach_not_the_file(tmp_path):
    """A bad keyword value is reported as attach()'s, over the file, while a bad file value names the file."""
    path = write(tmp_path, "keep_last: 2\n")
    with pytest.raises(ConfigError, match=r"^attach\(\) over .*ckpt.yaml: thread_count must be an integer"):
        load_settings(path, thread_count=0)
    with pytest.raises(ConfigError, match=r"^attach\(\): enabled must be true or false"):
        load_settings(enabled="no")


def test_bad_file_value_names_the_file_even_when_code_overrides_others(tmp_path):
    """The file is checked on its own first, so its error names the file."""
    with pytest.raises(ConfigError, match=r"^.*ckpt.yaml: log_stats must be true or false"):
        load_settings(write(tmp_path, "log_stats: sometimes\n"), keep_last=2)


def test_keep_last_null_in_the_file_follows_total_limit(tmp_path):
    """keep_last: null is "not given" (ProjectConfiguration.total_limit decides), as documented."""
    assert not load_settings(write(tmp_path, "keep_last: null\n")).keep_last_given


@pytest.mark.parametrize(("text", "key"), [
    ("persist: disk\n", "persist"),
    ("mtbf_seconds: -1h\n", "mtbf_seconds"),
    ("keep_last: 0\n", "keep_last"),
    ("async_save: maybe\n", "async_save"),
    ("enabled: maybe\n", "enabled"),
    ("writer_niceness: 25\n", "writer_niceness"),
    ("save_every_seconds: soon\n", "save_every_seconds"),
    ("staging_budget_bytes: 4 parsecs\n", "staging_budget_bytes"),
    ("naming: step\n", "naming"),
])
def test_invalid_value_names_the_key(tmp_path, text, key):
    """An invalid value (or a key the adapter sets itself) raises ConfigError naming the key."""
    with pytest.raises(ConfigError, match=key):
        load_settings(write(tmp_path, text))


def test_memory_tier_settings_from_the_file_and_code_reach_the_core_config(tmp_path):
    """memory_* keys of the file go into CheckpointConfig; a keyword setting wins over the file's."""
    s = load_settings(write(tmp_path, "memory_root: /dev/shm/run\nmemory_every_n_steps: 5\nmemory_keep_last: 3\n"),
                      memory_every_seconds="1m")
    assert (s.config.memory_root, s.config.memory_every_n_steps, s.config.memory_keep_last,
            s.config.memory_every_seconds) == ("/dev/shm/run", 5, 3, 60.0)


@pytest.mark.parametrize(("text", "key"), [
    ("memory_root: /dev/shm/run\nmemory_every_n_steps: 0\n", "memory_every_n_steps"),
    ("memory_root: /dev/shm/run\nmemory_every_seconds: soon\n", "memory_every_seconds"),
    ("memory_root: /dev/shm/run\nmemory_keep_last: 0\n", "memory_keep_last"),
    ("memory_every_n_steps: 5\n", "memory_root"),
])
def test_invalid_memory_tier_value_names_the_key(tmp_path, text, key):
    """A bad memory tier value (or a cadence without memory_root) raises ConfigError naming the file and key."""
    with pytest.raises(ConfigError, match=f"ckpt.yaml.*{key}"):
        load_settings(write(tmp_path, text))


def test_file_that_is_not_a_mapping_is_rejected(tmp_path):
    """A YAML list instead of a mapping raises ConfigError naming the file."""
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_settings(write(tmp_path, "- async_save\n"))


def test_missing_file_is_reported(tmp_path):
    """A config path that does not exist raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_settings(tmp_path / "nope.yaml")


def test_save_policy_follows_the_schedule_keys(tmp_path):
    """save_every_n_steps, mtbf_seconds and both together give EveryNSteps, YoungDaly and AnyOf."""
    assert isinstance(load_settings(save_every_n_steps=10).config.build_save_policy(), EveryNSteps)
    assert isinstance(load_settings(mtbf_seconds="8h").config.build_save_policy(), YoungDaly)
    both = load_settings(write(tmp_path, "mtbf_seconds: 8h\nsave_every_n_steps: 100\n"))
    assert isinstance(both.config.build_save_policy(), AnyOf)


def test_staging_budget_accepts_sizes_with_units():
    """staging_budget_bytes takes "4GB" like the other sizes."""
    assert load_settings(staging_budget_bytes="4GB").config.staging_budget_bytes == 4 * 10**9


def test_shipped_example_config_is_valid():
    """examples/accelerate/ckpt.yaml parses and selects the Young/Daly policy it documents."""
    path = Path(__file__).resolve().parents[2] / "examples" / "accelerate" / "ckpt.yaml"
    settings = load_settings(path)
    assert isinstance(settings.config.build_save_policy(), YoungDaly) and settings.config.keep_last == 3
