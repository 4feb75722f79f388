"""The adapter's settings: defaults, a YAML file, and keyword arguments, validated in one place.

Where a value comes from (later wins):

1. the defaults below;
2. the YAML file: the path in the environment variable ``ACCELERATE_CKPT_CONFIG`` if it is set,
   otherwise the ``config=`` argument of :func:`~accelerate_ckpt.attach`;
3. keyword arguments passed to :func:`~accelerate_ckpt.attach`.

So an operator can change any setting the code does not pass explicitly, by editing the file or
by pointing the environment variable at another file, without touching the training script.

The keys are the core ``CheckpointManager``'s knob names with the same defaults (``timeout_seconds``,
``mtbf_seconds``, ``keep_last``, ``staging_budget_bytes``...), plus the adapter's ``enabled`` and
``log_stats``; when the core's typed ``CheckpointConfig`` lands, these settings become it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_ckpt import (
    AnyOf,
    ConfigError,
    EveryNSeconds,
    EveryNSteps,
    YoungDaly,
    parse_duration,
)

__all__ = ["ENV_VAR", "CkptSettings", "load_settings", "read_config_file"]

#: Environment variable holding the path of a YAML settings file; it wins over ``config=``.
ENV_VAR = "ACCELERATE_CKPT_CONFIG"


@dataclass(frozen=True, kw_only=True)
class CkptSettings:
    """Every setting of the adapter; the names and defaults are the core ``CheckpointManager``'s.

    Durations accept ``"15m"``, ``"8h"``, ``"250ms"`` or seconds; sizes accept ``"4GB"`` or bytes.

    Attributes:
        enabled: False leaves the ``Accelerator`` untouched (Accelerate's own synchronous saves).
        async_save: persist in the background (``save_state()`` returns after staging) or inside
            ``save_state()``.
        persist: background writer: ``"thread"`` or ``"process"`` (plain tensors only, not FSDP).
        overlap_staging: copy parameters and optimizer state while the next forward/backward runs;
            the next ``optimizer.step()`` waits for the copy.
        writer_niceness: nice increment (0-19) of the writer thread/process on Linux.
        staging_budget_bytes: host bytes for staging, an int or a size such as ``"4GB"`` (10**9
            bytes) or ``"512MiB"`` (2**20 bytes); default half the available RAM. A larger state is
            saved synchronously.
        thread_count: DCP writer threads per process.
        timeout_seconds: limit for checkpoint agreement between processes (duration).
        verify_on_load: check every file's CRC-32 before loading (sizes are always checked).
        keep_last: committed automatic checkpoints to keep; None uses ``ProjectConfiguration.total_limit``
            (None there too: keep all).
        on_existing_newer: a fresh run saving below committed checkpoints of an earlier run:
            ``"error"`` or ``"supersede"`` (move them aside), as in the core manager.
        save_every_n_steps: ``should_save(step)`` is true every this many steps.
        save_every_seconds: ``should_save(step)`` is true once this much time has passed (duration).
        mtbf_seconds: mean time between failures of the job (duration): ``should_save(step)``
            follows the Young/Daly optimal interval from the measured save cost and step time.
        initial_save_cost_seconds: the save cost assumed by ``mtbf_seconds`` until a save is measured.
        min_interval_steps: with ``mtbf_seconds``, never save more often than every this many steps.
        log_stats: send per-save statistics to ``accelerator.log`` when trackers are configured.
        durable_url: fsspec URL (``s3://bucket/run``, ``gs://``, ``file://``...) where the main process
            replicates every committed automatic checkpoint in the background; ``load_state()``
            falls back to it when the newest checkpoint is not on local disk.
        storage_options: fsspec options for ``durable_url`` (credentials, endpoint...).
        durable_keep_last: durable checkpoints to keep (None: all).
        durable_verify: ``"checksum"`` (read every upload back) or ``"size"``.
        durable_flush_timeout_seconds: how long ``close()`` waits for pending uploads (duration).
    """

    enabled: bool = True
    async_save: bool = True
    persist: str = "thread"
    overlap_staging: bool = False
    writer_niceness: int = 0
    staging_budget_bytes: int | str | None = None
    thread_count: int = 2
    timeout_seconds: float = 600.0
    verify_on_load: bool = True
    keep_last: int | None = None
    on_existing_newer: str = "error"
    save_every_n_steps: int | None = None
    save_every_seconds: float | None = None
    mtbf_seconds: float | None = None
    initial_save_cost_seconds: float = 5.0
    min_interval_steps: int = 1
    log_stats: bool = True
    durable_url: str | None = None
    storage_options: dict | None = None
    durable_keep_last: int | None = None
    durable_verify: str = "checksum"
    durable_flush_timeout_seconds: float = 300.0

    def __post_init__(self) -> None:
        for name in ("enabled", "async_save", "overlap_staging", "verify_on_load", "log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_int("writer_niceness", self.writer_niceness, 0, maximum=19)
        _check_int("thread_count", self.thread_count, 1)
        _check_int("min_interval_steps", self.min_interval_steps, 1)
        if isinstance(self.staging_budget_bytes, str):
            object.__setattr__(self, "staging_budget_bytes", _bytes("staging_budget_bytes", self.staging_budget_bytes))
        for name in ("staging_budget_bytes", "keep_last", "save_every_n_steps", "durable_keep_last"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name, allowed in (("persist", ("thread", "process")), ("on_existing_newer", ("error", "supersede")),
                              ("durable_verify", ("checksum", "size"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("timeout_seconds", "save_every_seconds", "mtbf_seconds", "initial_save_cost_seconds",
                     "durable_flush_timeout_seconds"):
            value = getattr(self, name)
            if value is not None:
                seconds = _seconds(name, value)
                if seconds < 0 or (seconds == 0 and name != "initial_save_cost_seconds"):
                    raise ConfigError(f"{name} must be a positive duration, got {value!r}")
                object.__setattr__(self, name, seconds)
        if self.durable_url is not None and (not isinstance(self.durable_url, str) or not self.durable_url):
            raise ConfigError(f"durable_url must be a non-empty URL string, got {self.durable_url!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options must be a mapping, got {self.storage_options!r}")
        if self.durable_url is None and self.durable_keep_last is not None:
            raise ConfigError("durable_keep_last needs durable_url")

    def save_policy(self) -> Any:
        """The :mod:`torch_ckpt.schedule` policy these settings describe, or None."""
        policies: list[Any] = []
        if self.save_every_n_steps is not None:
            policies.append(EveryNSteps(self.save_every_n_steps))
        if self.save_every_seconds is not None:
            policies.append(EveryNSeconds(self.save_every_seconds))
        if self.mtbf_seconds is not None:
            policies.append(YoungDaly(mtbf_seconds=self.mtbf_seconds, initial_cost_seconds=self.initial_save_cost_seconds,
                                      min_interval_steps=self.min_interval_steps))
        if not policies:
            return None
        return policies[0] if len(policies) == 1 else AnyOf(*policies)


_FIELDS = tuple(f.name for f in dataclasses.fields(CkptSettings))


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be an integer {bound}, got {value!r}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def _bytes(name: str, value: str) -> int:
    """``"4GB"`` (10**9), ``"512MiB"`` (2**20), ``"1.5 GB"`` or ``"1000"`` as a byte count."""
    number = value.strip().rstrip("BbIiKkMmGgTt ")
    unit = value.strip()[len(number):].strip().lower()
    try:
        count = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigError(f"{name} must be a byte count such as 4000000000, '4GB' or '512MiB', got {value!r}") from None
    return int(count)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a duration, got {value!r}")
    try:
        return float(parse_duration(value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML settings file (a mapping of the keys of :class:`CkptSettings`; empty is fine).

    Raises:
        ConfigError: the file is missing, is not YAML, is not a mapping, or has unknown keys.
    """
    import yaml

    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the accelerate_ckpt config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    _check_keys(data, str(path))
    return dict(data)


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {unknown}; valid settings: {list(_FIELDS)}")


def load_settings(config: str | os.PathLike | None = None, **overrides: Any) -> CkptSettings:
    """Merge the defaults, the settings file and ``overrides`` (see the module docstring).

    Args:
        config: YAML file used when ``ACCELERATE_CKPT_CONFIG`` is not set.
        overrides: settings given in code; they win over the file.

    Raises:
        ConfigError: unknown keys or invalid values (the message names the key).
    """
    _check_keys(overrides, "attach()")
    path = os.environ.get(ENV_VAR) or config
    values = read_config_file(path) if path else {}
    values.update(overrides)
    return CkptSettings(**values)
