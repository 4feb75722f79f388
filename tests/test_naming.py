"""Tests of torch_ckpt.policy._naming: the directory-name seam (StepNaming, PatternNaming)."""

import pytest

from torch_ckpt import ConfigError, PatternNaming, StepNaming
from torch_ckpt.policy import Naming


def test_step_naming_round_trips():
    """StepNaming names step 42 step_000000042 and parses it back."""
    n = StepNaming()
    assert n.name(42) == "step_000000042" and n.step_of("step_000000042") == 42


def test_step_naming_refuses_non_canonical_names():
    """Names StepNaming cannot produce (unpadded, hidden, other prefixes) parse as None."""
    n = StepNaming()
    assert [n.step_of(x) for x in ("step_42", ".step_000000042", "checkpoint_1", "step_000000042.tmp")] == [None] * 4


@pytest.mark.parametrize("pattern,step,name", [("checkpoint_{step}", 12, "checkpoint_12"),
                                               ("ckpt-{step:06d}", 7, "ckpt-000007"),
                                               ("{step}", 3, "3")])
def test_pattern_naming_round_trips(pattern, step, name):
    """PatternNaming produces the pattern's name and parses exactly that name back."""
    n = PatternNaming(pattern)
    assert n.name(step) == name and n.step_of(name) == step


def test_pattern_naming_parses_only_canonical_names():
    """'checkpoint_007' and 'checkpoint_x' are not names of 'checkpoint_{step}'."""
    n = PatternNaming("checkpoint_{step}")
    assert n.step_of("checkpoint_007") is None and n.step_of("checkpoint_x") is None
    assert n.step_of("checkpoint_7_old") is None


@pytest.mark.parametrize("pattern", ["checkpoint", "{step}_{step}", "{epoch}", "{step!r}", "a/{step}", ".{step}",
                                     "{step:.2f}", 5])
def test_bad_patterns_are_refused(pattern):
    """Patterns without exactly one integer {step} field, or producing bad names, raise ConfigError."""
    with pytest.raises(ConfigError):
        PatternNaming(pattern)


def test_namings_satisfy_the_protocol():
    """Both built-in namings are Naming instances (runtime-checkable Protocol)."""
    assert isinstance(StepNaming(), Naming) and isinstance(PatternNaming("c_{step}"), Naming)
