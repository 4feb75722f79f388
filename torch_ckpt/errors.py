"""Exception tree of torch-ckpt.

Every error the library raises on purpose derives from :class:`CheckpointError`; each subclass
also inherits the builtin a caller would naturally catch, so ``except OSError`` or
``except FileNotFoundError`` keeps working::

    CheckpointError(Exception)
    ├── CheckpointNotFoundError(CheckpointError, FileNotFoundError)  no such checkpoint / root
    │   └── PathNotFoundError(CheckpointNotFoundError)               the path or URL given does not exist
    ├── CheckpointCorruptError(CheckpointError, ValueError)          checksum, size or structure mismatch
    ├── UnsafeCheckpointError(CheckpointError, ValueError)           would need arbitrary unpickling
    ├── StateMismatchError(CheckpointError, KeyError)                live state and checkpoint keys differ
    ├── CheckpointWriteError(CheckpointError, OSError)               a save failed (disk full, permission...)
    ├── CheckpointReadError(CheckpointError, OSError)                reading a checkpoint failed (I/O error, permission)
    ├── CheckpointTimeoutError(CheckpointError, TimeoutError)        ranks did not agree in time
    ├── DurableUnavailableError(CheckpointError, ConnectionError)    the durable store cannot be reached
    └── ConfigError(CheckpointError, ValueError)                     invalid argument or configuration
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CheckpointCorruptError", "UnsafeCheckpointError",
           "StateMismatchError", "CheckpointWriteError", "CheckpointTimeoutError", "ConfigError", "CheckpointReadError",
           "DurableUnavailableError", "PathNotFoundError"]


class CheckpointError(Exception):
    """Base class of every error raised by torch-ckpt."""

    def __str__(self) -> str:
        """The message; for the subclasses that are ``OSError`` s, without the ``[Errno N]`` prefix that
        ``OSError`` puts before it (the code stays in ``errno``)."""
        if isinstance(self, OSError) and self.errno is not None and self.strerror:
            return self.strerror if self.filename is None else f"{self.strerror}: {self.filename!r}"
        return super().__str__()


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint root, step or file does not exist (or is not a committed checkpoint)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A committed checkpoint fails its checksum, size or structure checks."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """Loading would require unpickling arbitrary objects; refused."""


class StateMismatchError(CheckpointError, KeyError):
    """The live state and the checkpoint do not have the same keys (or shapes).

    Attributes:
        missing: keys the live state expects but the checkpoint lacks.
        unexpected: keys the checkpoint has but the live state does not.
    """

    def __init__(self, message: str, *, missing: list[str] | None = None,
                 unexpected: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class CheckpointWriteError(CheckpointError, OSError):
    """Persisting a checkpoint failed; the step was not committed."""


class CheckpointReadError(CheckpointError, OSError):
    """Reading a committed checkpoint failed with an operating-system error (I/O error, permission, limits)."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """Ranks did not reach a checkpoint agreement point within the configured timeout."""


class ConfigError(CheckpointError, ValueError):
    """An argument or configuration value is invalid."""


class DurableUnavailableError(CheckpointError, ConnectionError):
    """The durable store could not be reached (an outage, not an empty store)."""


class PathNotFoundError(CheckpointNotFoundError):
    """The path or URL given does not exist (a bad argument rather than a damaged checkpoint)."""
