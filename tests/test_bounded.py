"""torch_ckpt.storage._locations: JSON from untrusted bytes with bounded nesting and integer length."""

from __future__ import annotations

import pytest

from torch_ckpt.errors import CheckpointCorruptError
from torch_ckpt.storage._locations import Malformed, corrupt, loads_bounded, short_repr


def load(raw: bytes, *, depth: int = 4, digits: int = 5):
    return loads_bounded(raw, "/ckpt/x.json", what="manifest", max_depth=depth, max_int_digits=digits)


def test_valid_json_within_bounds_is_returned():
    """JSON within the depth and integer limits parses to the same value."""
    assert load(b'{"a": [1, -99999, {"b": 2.5}]}') == {"a": [1, -99999, {"b": 2.5}]}


def test_depth_equal_to_the_limit_is_accepted():
    """Nesting exactly max_depth levels deep is accepted."""
    assert load(b"[[[[]]]]", depth=4) == [[[[]]]]


def test_one_level_deeper_than_the_limit_is_corrupt():
    """Nesting max_depth + 1 levels raises CheckpointCorruptError naming the file and the depth."""
    with pytest.raises(CheckpointCorruptError, match=r"/ckpt/x\.json: manifest is nested 5 levels deep"):
        load(b"[[[[[]]]]]", depth=4)


def test_nesting_beyond_the_parser_recursion_limit_is_corrupt():
    """Nesting deep enough to exhaust the parser's recursion raises CheckpointCorruptError, not RecursionError."""
    with pytest.raises(CheckpointCorruptError, match="nested too deeply"):
        load(b"[" * 200_000 + b"]" * 200_000)


def test_integer_longer_than_the_limit_is_corrupt():
    """An integer literal of more digits than allowed raises CheckpointCorruptError naming the digit count."""
    with pytest.raises(CheckpointCorruptError, match="integer of 6 digits"):
        load(b'{"step": 123456}')


def test_minus_sign_is_not_counted_as_a_digit():
    """A negative integer with exactly max_int_digits digits is accepted."""
    assert load(b"-12345", digits=5) == -12345


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00", b""], ids=["syntax", "not-utf8", "empty"])
def test_invalid_json_is_corrupt_naming_the_file(raw):
    """Bytes that are not UTF-8 JSON raise CheckpointCorruptError naming the file and what it is."""
    with pytest.raises(CheckpointCorruptError, match=r"/ckpt/x\.json: manifest is not valid JSON"):
        load(raw)


def test_corrupt_prefixes_the_source():
    """corrupt() builds a CheckpointCorruptError whose message starts with the file."""
    exc = corrupt("/a/b", "is empty")
    assert isinstance(exc, CheckpointCorruptError) and str(exc) == "/a/b: is empty"


def test_short_repr_keeps_short_values_whole():
    """A repr of up to 120 characters is returned unchanged."""
    assert short_repr("x" * 100) == repr("x" * 100)


def test_short_repr_shortens_long_values_to_120_characters():
    """A long repr is cut to its head and tail, 120 characters in all."""
    text = short_repr("a" * 500 + "END")
    assert len(text) == 120 and text.startswith("'aaa") and text.endswith("END'") and "..." in text


def test_malformed_is_a_value_error():
    """Malformed (raised by inner validators) is a ValueError callers may catch as such."""
    assert issubclass(Malformed, ValueError)
