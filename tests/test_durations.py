"""Tests for torch_ckpt.durations: duration strings in, seconds out, and back."""

from __future__ import annotations

import math

import pytest

from torch_ckpt.durations import DURATION_FORMS, format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("8h", 28800.0),
        ("15m", 900.0),
        ("2s", 2.0),
        ("1.5d", 129600.0),
        ("250ms", 0.25),
        ("15min", 900.0),
        ("1w", 604800.0),
        ("90", 90.0),
        ("2.5", 2.5),
        ("1e3", 1000.0),
        (" 8 H ", 28800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        (".5h", 1800.0),
        ("2 hours", 7200.0),
        ("1e3s", 1000.0),
    ],
)
def test_parse_accepts_documented_forms(text, seconds):
    """Every documented string form parses to the right number of seconds."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [0, 7, 2.5, -3])
def test_parse_passes_numbers_through_as_seconds(value):
    """Ints and floats are already seconds and come back as floats."""
    result = parse_duration(value)
    assert isinstance(result, float) and result == value


def test_parse_leaves_sign_checks_to_callers():
    """Zero and negative durations parse; rejecting them is the caller's job."""
    assert parse_duration("-5s") == -5.0
    assert parse_duration("0h") == 0.0


@pytest.mark.parametrize("text", ["", "   ", "abc", "8x", "h", "1h30", "8hh", "1..5s", "--5", "5 y", "8h-1m"])
def test_parse_rejects_garbage_naming_the_string_and_forms(text):
    """A bad string raises ValueError quoting it and listing the accepted forms."""
    with pytest.raises(ValueError) as info:
        parse_duration(text)
    assert repr(text) in str(info.value)
    assert DURATION_FORMS in str(info.value)


@pytest.mark.parametrize("value", ["inf", "nan", float("inf"), float("nan"), "1e309", "-1e309"])
def test_parse_rejects_non_finite(value):
    """Infinite and NaN durations are refused."""
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("value", [None, True, [1], b"8h"])
def test_parse_rejects_other_types(value):
    """Only str, int and float are accepted (bool is not a duration)."""
    with pytest.raises(TypeError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.25, "250 ms"),
        (2, "2 s"),
        (59.9999, "1 min"),
        (339.41, "5.66 min"),
        (3600, "1 h"),
        (7002, "1.95 h"),
        (129600, "1.5 d"),
        (-3, "-3 s"),
        (0, "0 s"),
        (math.inf, "inf"),
    ],
)
def test_format_picks_unit_and_three_digits(seconds, text):
    """format_duration uses the largest fitting unit with three significant digits."""
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [0.004, 0.3, 1.0, 42.0, 599.0, 5000.0, 90000.0, 1e7])
def test_format_round_trips_through_parse(seconds):
    """What format_duration prints parses back to the same value within its rounding."""
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=5e-3)


def test_format_rejects_nan():
    """NaN has no duration rendering."""
    with pytest.raises(ValueError):
        format_duration(math.nan)
