"""Tests of the pure retention policies."""

import pytest

from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._retention import KeepAny, KeepEveryNSteps, KeepLatest, apply_retention


def test_keep_latest_orders_numerically():
    """Steps 9, 10, 11 keep the numerically newest, not the string-newest."""
    assert apply_retention(KeepLatest(count=2), [9, 10, 11, 100]) == [9, 10]


def test_keep_every_n_plus_latest():
    """Multiples of n survive next to the latest ones."""
    policy = KeepAny((KeepLatest(count=1), KeepEveryNSteps(every_steps=10)))
    assert apply_retention(policy, [5, 10, 15, 20, 25]) == [5, 15]


def test_newest_is_never_deleted():
    """Even a policy keeping nothing cannot delete the newest committed step."""

    class KeepNothing:
        def keep(self, steps):
            return set()

    assert apply_retention(KeepNothing(), [1, 2, 3]) == [1, 2]


def test_protected_steps_survive():
    """Protected steps are kept whatever the policy says."""
    assert apply_retention(KeepLatest(count=1), [1, 2, 3], protected=[1]) == [2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_counts_rejected(bad):
    """Counts below one or non-integers (bools included) raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match="count"):
        KeepLatest(count=bad)
