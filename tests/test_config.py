"""Tests of the typed configuration (torch_ckpt.config) and how the manager builds from it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointConfig, CheckpointManager, ConfigError
from torch_ckpt.config import DEFAULT
from torch_ckpt.policy._naming import PatternNaming
from torch_ckpt.policy._retention import KeepAny, KeepLatest
from torch_ckpt.policy._schedule import AnyOf, EveryNSteps, YoungDaly

CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


# --- the dataclass -------------------------------------------------------------------------------


def test_config_is_frozen():
    """Fields cannot be reassigned after validation."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        CheckpointConfig().keep_last = 5  # type: ignore[misc]


def test_config_is_keyword_only():
    """Positional arguments are refused (fields are only ever named)."""
    with pytest.raises(TypeError):
        CheckpointConfig(5)  # type: ignore[misc]


def test_durations_and_sizes_are_normalised_once():
    """'8h', '10m' and '4GB' are stored as 28800.0 s, 600.0 s and 4e9 bytes."""
    cfg = CheckpointConfig(mtbf_seconds="8h", timeout_seconds="10m", staging_budget_bytes="4GB",
                           preemption_signals=["SIGTERM"])
    assert (cfg.mtbf_seconds, cfg.timeout_seconds, cfg.staging_budget_bytes) == (28800.0, 600.0, 4 * 10**9)
    assert cfg.preemption_signals == ("SIGTERM",)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": True}, "keep_last"),
        ({"keep_every_n_steps": -5}, "keep_every_n_steps"),
        ({"thread_count": 0}, "thread_count"),
        ({"thread_count": 2.0}, "thread_count"),
        ({"writer_niceness": 20}, "writer_niceness"),
        ({"persist": "fork"}, "persist"),
        ({"async_save": "yes"}, "async_save"),
        ({"verify_on_load": 1}, "verify_on_load"),
        ({"on_world_size_change": "ignore"}, "on_world_size_change"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": "soon"}, "timeout_seconds"),
        ({"staging_budget_bytes": "lots"}, "staging_budget_bytes"),
        ({"staging_budget_bytes": 0}, "staging_budget_bytes"),
        ({"staging_budget_bytes": 1.5}, "staging_budget_bytes"),
        ({"mtbf_seconds": "-8h"}, "mtbf_seconds"),
        ({"save_every_seconds": 0}, "save_every_seconds"),
        ({"save_every_n_steps": 0}, "save_every_n_steps"),
        ({"initial_cost_seconds": -1}, "initial_cost_seconds"),
        ({"formula": "optimal"}, "formula"),
        ({"min_interval_steps": 0}, "min_interval_steps"),
        ({"replicate_every_n_saves": 0}, "replicate_every_n_saves"),
        ({"durable_url": ""}, "durable_url"),
        ({"durable_url": "memory://x", "storage_options": ["key"]}, "storage_options"),
        ({"durable_keep_last": 2}, "durable_keep_last"),
        ({"durable_url": "memory://x", "durable_verify": "md5"}, "durable_verify"),
        ({"durable_flush_timeout_seconds": -1}, "durable_flush_timeout_seconds"),
        ({"preemption_signals": "SIGTERM"}, "preemption_signals"),
        ({"preemption_signals": ["SIGNOPE"]}, "SIGNOPE"),
        ({"preemption_timeout_seconds": 0}, "preemption_timeout_seconds"),
        ({"on_write_error": "ignore"}, "on_write_error"),
        ({"on_existing_newer": "overwrite"}, "on_existing_newer"),
        ({"read_only": True, "durable_url": "memory://x"}, "read_only"),
        ({"retention": 3}, "retention"),
        ({"save_policy": "daly"}, "save_policy"),
        ({"save_policy": EveryNSteps(10), "mtbf_seconds": "8h"}, "mtbf_seconds"),
        ({"naming": "step_{step}"}, "naming"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_field(kwargs, field):
    """Every out-of-range or mistyped value is refused once, in __post_init__, naming the field."""
    with pytest.raises(ConfigError, match=re.escape(field)):
        CheckpointConfig(**kwargs)


def test_replace_validates_the_change():
    """replace() returns a validated copy and leaves the original unchanged."""
    base = CheckpointConfig(keep_last=5)
    assert base.replace(keep_last=1, mtbf_seconds="1h").mtbf_seconds == 3600.0
    assert base.keep_last == 5
    with pytest.raises(ConfigError, match="thread_count"):
        base.replace(thread_count=0)


def test_storage_options_are_copied():
    """Editing the caller's dict after construction does not change the config."""
    options = {"anon": True}
    cfg = CheckpointConfig(durable_url="memory://x", storage_options=options)
    options["anon"] = False
    assert cfg.storage_options == {"anon": True}


# --- what a config builds ------------------------------------------------------------------------


def test_flat_schedule_fields_build_an_any_of():
    """mtbf_seconds plus save_every_n_steps build AnyOf(YoungDaly, EveryNSteps) with the given settings."""
    policy = CheckpointConfig(mtbf_seconds="8h", save_every_n_steps=1000, min_interval_steps=7).build_save_policy()
    assert isinstance(policy, AnyOf)
    young_daly, every = policy.policies
    assert isinstance(young_daly, YoungDaly) and young_daly.mtbf_s == 28800.0
    assert "min_interval_steps=7" in repr(young_daly)
    assert isinstance(every, EveryNSteps) and every.n == 1000


def test_no_schedule_fields_build_no_policy():
    """Without save_policy or flat schedule fields there is no policy."""
    assert CheckpointConfig().build_save_policy() is None


def test_keep_fields_build_the_retention():
    """keep_last with keep_every_n_steps gives KeepAny(KeepLatest, KeepEveryNSteps); keep_last=None keeps all."""
    assert isinstance(CheckpointConfig(keep_last=2, keep_every_n_steps=100).build_retention(), KeepAny)
    assert CheckpointConfig(keep_last=None).build_retention() is None
    custom = KeepLatest(count=9)
    assert CheckpointConfig(retention=custom).build_retention() is custom


# --- from_dict / from_yaml -----------------------------------------------------------------------


def test_from_dict_builds_a_validated_config():
    """A mapping with strings for durations and sizes gives the same config as keyword arguments."""
    assert CheckpointConfig.from_dict({"mtbf_seconds": "8h", "staging_budget_bytes": "4GB"}) == CheckpointConfig(
        mtbf_seconds=28800.0, staging_budget_bytes=4 * 10**9)


def test_from_dict_unknown_key_names_it_and_the_valid_ones():
    """A misspelt key is a ConfigError naming the key, the closest valid one and every valid setting."""
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['keep_lats'\] \(did you mean 'keep_last'\?\); "
                                          r"rename or remove it. Valid settings: .*'durable_upload_threads'"):
        CheckpointConfig.from_dict({"keep_lats": 2})


def test_from_dict_unknown_key_without_a_close_match_has_no_suggestion():
    """A key like no valid one is named without a guess."""
    with pytest.raises(ConfigError, match=r"\['zzz'\]; rename or remove it") as info:
        CheckpointConfig.from_dict({"zzz": 1})
    assert "did you mean" not in str(info.value)


def test_from_dict_with_extras_returns_the_integration_keys_apart():
    """Declared extra keys are validated against their defaults' types and returned beside the config."""
    cfg, extra = CheckpointConfig.from_dict_with_extras({"keep_last": 2, "enabled": False},
                                                        {"enabled": True, "log_stats": True, "ratio": 0.5})
    assert cfg == CheckpointConfig(keep_last=2)
    assert extra == {"enabled": False, "log_stats": True, "ratio": 0.5}


@pytest.mark.parametrize(("value", "expected"), [("yes", "true or false"), (1, "true or false")])
def test_from_dict_with_extras_refuses_a_wrong_type_naming_source_and_key(value, expected):
    """An extra key of another type than its default is a ConfigError naming the source, the key and the type."""
    with pytest.raises(ConfigError, match=rf"^run.yaml: enabled must be {expected}, got {value!r}"):
        CheckpointConfig.from_dict_with_extras({"enabled": value}, {"enabled": True}, source="run.yaml")


def test_from_dict_with_extras_suggests_extra_keys_too():
    """A misspelt extra key is unknown, with the extra key as the suggestion."""
    with pytest.raises(ConfigError, match=r"did you mean 'log_stats'"):
        CheckpointConfig.from_dict_with_extras({"log_stat": True}, {"log_stats": True})


def test_from_dict_with_extras_accepts_an_int_for_a_float_extra():
    """A number written without a decimal point is a valid float extra."""
    assert CheckpointConfig.from_dict_with_extras({"ratio": 2}, {"ratio": 0.5})[1] == {"ratio": 2}


def test_from_dict_with_extras_refuses_extras_that_are_fields():
    """An integration cannot redeclare a core field as its own key (a programming error: TypeError)."""
    with pytest.raises(TypeError, match="keep_last"):
        CheckpointConfig.from_dict_with_extras({}, {"keep_last": 3})


def test_read_yaml_returns_the_unvalidated_mapping(tmp_path):
    """read_yaml gives the file's mapping as written; validation is from_dict's job."""
    path = tmp_path / "ckpt.yaml"
    path.write_text("keep_last: 0\nenabled: false\n")
    assert CheckpointConfig.read_yaml(path) == {"keep_last": 0, "enabled": False}


def test_from_dict_refuses_a_non_mapping():
    """A list is not a configuration."""
    with pytest.raises(ConfigError, match="expected a mapping"):
        CheckpointConfig.from_dict(["keep_last", 2])  # type: ignore[arg-type]


def test_from_yaml_reads_durations_sizes_and_lists(tmp_path):
    """A YAML file with 8h, 8GB and a signal list gives the normalised config."""
    path = tmp_path / "ckpt.yaml"
    path.write_text("keep_last: 5\nmtbf_seconds: 8h\nstaging_budget_bytes: 8GB\n"
                    "preemption_signals: [SIGTERM, SIGUSR1]\ndurable_url: memory://bucket/run\n")
    cfg = CheckpointConfig.from_yaml(path)
    assert cfg == CheckpointConfig(keep_last=5, mtbf_seconds=28800.0, staging_budget_bytes=8 * 10**9,
                                   preemption_signals=("SIGTERM", "SIGUSR1"), durable_url="memory://bucket/run")


def test_from_yaml_empty_file_gives_the_defaults(tmp_path):
    """An empty file is the default configuration."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert CheckpointConfig.from_yaml(path) == CheckpointConfig()


@pytest.mark.parametrize(
    ("text", "match"),
    [("keep_last: [1\n", "not valid YAML"), ("- keep_last\n", "expected a mapping"),
     ("keep_lats: 1\n", "keep_lats"), ("thread_count: many\n", "thread_count")],
)
def test_from_yaml_bad_file_names_the_path_and_problem(tmp_path, text, match):
    """Invalid YAML, a non-mapping, an unknown key or a bad value raise ConfigError naming the file."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        CheckpointConfig.from_yaml(path)
    assert str(info.value).startswith(str(path))


def _listed(message: str) -> list[str]:
    """The names after "Valid settings:" in an unknown-key error."""
    return re.findall(r"'(\w+)'", message.split("Valid settings:")[1])


def test_from_yaml_unknown_key_lists_only_the_fields_a_file_may_hold(tmp_path):
    """A file's unknown-key error neither lists nor suggests a code-only field, which the file would refuse."""
    path = tmp_path / "run.yaml"
    path.write_text("save_polcy: 3\n")
    with pytest.raises(ConfigError, match="unknown setting") as info:
        CheckpointConfig.from_yaml(path)
    listed = _listed(str(info.value))
    assert "keep_last" in listed and "durable_upload_threads" in listed
    assert not {"retention", "save_policy", "process_group", "naming"} & set(listed)
    assert "did you mean 'save_policy'" not in str(info.value)


def test_from_dict_unknown_key_still_lists_the_code_only_fields():
    """In code every field can be given, so a mapping's unknown-key error lists the code-only fields too."""
    with pytest.raises(ConfigError, match=r"did you mean 'save_policy'") as info:
        CheckpointConfig.from_dict({"save_polcy": 3})
    assert {"retention", "save_policy", "process_group", "naming"} <= set(_listed(str(info.value)))


def test_from_yaml_missing_file_is_a_config_error(tmp_path):
    """A missing file raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="missing.yaml"):
        CheckpointConfig.from_yaml(tmp_path / "missing.yaml")


# --- the manager builds from the config ----------------------------------------------------------


def test_manager_keywords_are_exactly_the_config_fields():
    """One set of names: every manager keyword (besides directory and config) is a config field, and back."""
    params = inspect.signature(CheckpointManager.__init__).parameters
    keywords = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "config"]
    assert keywords == list(CheckpointConfig.field_names())
    assert all(params[n].default is DEFAULT for n in keywords)


def test_manager_uses_the_given_config(tmp_path):
    """CheckpointManager(config=...) keeps that config's retention (keep_last=1 leaves one step)."""
    state = {"w": torch.arange(4.0)}
    with CheckpointManager(tmp_path, config=CheckpointConfig(keep_last=1, async_save=False)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
        assert mgr.all_steps() == [3]


def test_manager_keywords_override_the_config(tmp_path):
    """Keywords given next to config= replace just those fields."""
    cfg = CheckpointConfig(keep_last=5, thread_count=1, naming=PatternNaming("ckpt_{step}"))
    with CheckpointManager(tmp_path, config=cfg, keep_last=1) as mgr:
        assert (mgr.config.keep_last, mgr.config.thread_count) == (1, 1)
        assert mgr.config.naming is cfg.naming


def test_manager_builds_the_policy_from_flat_fields(tmp_path):
    """mtbf_seconds='8h' on the manager gives a YoungDaly policy with that MTBF."""
    with CheckpointManager(tmp_path, mtbf_seconds="8h") as mgr:
        mgr.should_save(1)
        assert mgr.schedule_info()["policy"] == "YoungDaly"
        assert mgr.schedule_info()["mtbf_s"] == 28800.0


def test_manager_rejects_a_config_of_the_wrong_type(tmp_path):
    """config= must be a CheckpointConfig (a dict goes through CheckpointConfig.from_dict)."""
    with pytest.raises(ConfigError, match="CheckpointConfig"):
        CheckpointManager(tmp_path, config={"keep_last": 1})  # type: ignore[arg-type]


def test_manager_invalid_keyword_value_names_the_field(tmp_path):
    """A bad keyword value fails in the config's validation, naming the field, before the root is touched."""
    with pytest.raises(ConfigError, match="thread_count"):
        CheckpointManager(tmp_path / "root", thread_count=0)
    assert not (tmp_path / "root").exists()


def test_docs_configuration_lists_every_field_with_its_default():
    """docs/configuration.md's Fields section names every field and shows its default."""
    text = CONFIG_DOC.read_text(encoding="utf-8")
    section = text[text.index("## Fields"):] + "\n## "
    section = section[:section.index("\n## ", 1)]
    for field in dataclasses.fields(CheckpointConfig):
        row = next((line for line in section.splitlines() if line.startswith(f"| `{field.name}`")), None)
        assert row is not None, f"docs/configuration.md lacks {field.name}"
        shown = row.split("|")[2].strip()
        assert shown == f"`{field.default!r}`", (field.name, shown)


def test_from_yaml_overflowing_duration_string_is_refused(tmp_path):
    """A duration written as '1e309' (inf once parsed) is refused naming the file and key, like .inf."""
    path = tmp_path / "huge.yaml"
    path.write_text("timeout_seconds: '1e309'\n")
    with pytest.raises(ConfigError, match=r"huge\.yaml.*timeout_seconds"):
        CheckpointConfig.from_yaml(path)


def test_read_yaml_binary_file_is_a_config_error_naming_it(tmp_path):
    """A file that is not UTF-8 text raises ConfigError naming it, not a UnicodeDecodeError."""
    path = tmp_path / "ckpt.yaml"
    path.write_bytes(b"\xff\xfe\x00keep_last: 3")
    with pytest.raises(ConfigError, match=r"ckpt\.yaml: not a UTF-8 text file"):
        CheckpointConfig.read_yaml(path)


def test_read_yaml_deeply_nested_file_is_a_config_error_naming_it(tmp_path):
    """A file nested past Python's recursion limit raises ConfigError naming it, not RecursionError."""
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml: nested too deeply"):
        CheckpointConfig.read_yaml(path)


@pytest.mark.parametrize("field", ["timeout_seconds", "initial_cost_seconds", "durable_flush_timeout_seconds",
                                   "preemption_timeout_seconds", "durable_timeout_seconds"])
def test_none_for_a_required_duration_is_a_config_error_naming_it(field):
    """None for a duration that has a default is refused (it was stored as None), naming the field."""
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(**{field: None})
