"""Tests of the value checks behind CheckpointConfig (torch_ckpt._values)."""

from __future__ import annotations

import pytest

from torch_ckpt import ConfigError
from torch_ckpt._values import check_bool, check_int, parse_size, to_bytes, to_seconds


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5tb", 1_500_000_000_000), (" 2 gib ", 2 * 2**30),
     ("1000", 1000), ("10B", 10), (4096, 4096)],
)
def test_parse_size_accepts_decimal_and_binary_units(text, expected):
    """Sizes in B/KB/MB/GB/TB (10^3 steps) and KiB/MiB/GiB/TiB (2^10 steps) become int bytes."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4 GBs", "four GB", "4G", "-1GB", "1e999GB"])
def test_parse_size_rejects_what_is_not_a_size(text):
    """Unknown units, words, negative or infinite sizes raise ValueError repeating the value."""
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("value", [True, 1.5, None])
def test_parse_size_rejects_other_types(value):
    """A bool, float or None is a TypeError, not a silent conversion."""
    with pytest.raises(TypeError):
        parse_size(value)


def test_parse_size_is_reexported_by_config():
    """torch_ckpt.config.parse_size is the same function (older imports keep working)."""
    from torch_ckpt import config

    assert config.parse_size is parse_size


@pytest.mark.parametrize("value", [1, "yes", None])
def test_check_bool_refuses_what_is_not_a_bool(value):
    """Only True/False pass; the message names the setting."""
    with pytest.raises(ConfigError, match=r"^flag must be true or false"):
        check_bool("flag", value)


@pytest.mark.parametrize(("value", "bounds"), [(0, ">= 1"), (2.0, ">= 1"), (True, ">= 1")])
def test_check_int_refuses_out_of_range_and_other_types(value, bounds):
    """0, a float and a bool are refused for an int >= 1, naming the bound."""
    with pytest.raises(ConfigError, match=f"n must be an integer {bounds}"):
        check_int("n", value, 1)


def test_check_int_names_both_bounds_with_a_maximum():
    """With a maximum the message gives the closed range."""
    with pytest.raises(ConfigError, match=r"in \[0, 19\], got 20"):
        check_int("niceness", 20, 0, maximum=19)


def test_to_seconds_converts_durations_and_refuses_zero_when_positive():
    """'15m' is 900.0 s; 0 is refused only where a positive duration is needed."""
    assert to_seconds("t", "15m", positive=True) == 900.0
    assert to_seconds("t", 0, positive=False) == 0.0
    with pytest.raises(ConfigError, match=r"t must be positive \(seconds or a duration"):
        to_seconds("t", 0, positive=True)


def test_to_bytes_refuses_zero_and_non_sizes_naming_the_setting():
    """0 bytes and a word are ConfigErrors starting with the setting's name."""
    assert to_bytes("budget", "1KiB") == 1024
    for value in (0, "lots"):
        with pytest.raises(ConfigError, match="^budget"):
            to_bytes("budget", value)
