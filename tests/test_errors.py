"""torch_ckpt.errors: every error is a CheckpointError and also the builtin a caller would catch."""

from __future__ import annotations

import pytest

from torch_ckpt import errors
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigError,
    DurableUnavailableError,
    PathNotFoundError,
    StateMismatchError,
    UnsafeCheckpointError,
)

BUILTIN_OF = {
    CheckpointNotFoundError: FileNotFoundError,
    CheckpointCorruptError: ValueError,
    UnsafeCheckpointError: ValueError,
    StateMismatchError: KeyError,
    CheckpointWriteError: OSError,
    CheckpointReadError: OSError,
    CheckpointTimeoutError: TimeoutError,
    ConfigError: ValueError,
    DurableUnavailableError: ConnectionError,
    PathNotFoundError: FileNotFoundError,
}


def test_table_covers_every_exported_error():
    """Every error class errors.py exports (besides the base) is checked below."""
    exported = {getattr(errors, name) for name in errors.__all__} - {CheckpointError}
    assert exported <= set(BUILTIN_OF)


def test_base_is_an_exception_and_not_a_builtin_subtype():
    """CheckpointError derives from Exception only, so it never hides unrelated builtins."""
    assert CheckpointError.__bases__ == (Exception,)


@pytest.mark.parametrize("cls", list(BUILTIN_OF), ids=lambda c: c.__name__)
def test_error_is_caught_by_its_builtin(cls):
    """Catching the builtin (e.g. FileNotFoundError) catches the torch-ckpt error."""
    with pytest.raises(BUILTIN_OF[cls]):
        raise cls("x")


@pytest.mark.parametrize("cls", list(BUILTIN_OF), ids=lambda c: c.__name__)
def test_error_is_caught_as_checkpoint_error(cls):
    """Catching CheckpointError catches every torch-ckpt error."""
    with pytest.raises(CheckpointError):
        raise cls("x")


def test_write_error_keeps_errno_and_strerror():
    """CheckpointWriteError built like OSError(errno, message) exposes errno and strerror."""
    exc = CheckpointWriteError(28, "no space left on /ckpt")
    assert exc.errno == 28 and exc.strerror == "no space left on /ckpt"


def test_not_found_error_is_also_an_oserror():
    """CheckpointNotFoundError is an OSError too (FileNotFoundError's parent)."""
    with pytest.raises(OSError):
        raise CheckpointNotFoundError("no step 3 under /ckpt")


def test_state_mismatch_message_is_not_quoted():
    """str() of StateMismatchError is the message itself, not KeyError's quoted repr."""
    assert str(StateMismatchError("missing key 'model.w'")) == "missing key 'model.w'"


def test_state_mismatch_carries_missing_and_unexpected_keys():
    """StateMismatchError exposes the missing and unexpected keys as lists (empty when not given)."""
    exc = StateMismatchError("differs", missing=("a",), unexpected=["b", "c"])
    assert exc.missing == ["a"] and exc.unexpected == ["b", "c"]
    assert StateMismatchError("differs").missing == []


def test_an_oserror_with_a_code_prints_its_message_without_the_errno_prefix():
    """str() of a CheckpointWriteError built with an errno is its message (and file), not "[Errno N] ..."."""
    exc = CheckpointWriteError(11, "checkpoint root /ckpt is in use by another run")
    assert str(exc) == "checkpoint root /ckpt is in use by another run" and exc.errno == 11
    assert str(CheckpointWriteError(5, "read failed", "/ckpt/a.distcp")) == "read failed: '/ckpt/a.distcp'"
