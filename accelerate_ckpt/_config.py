"""The adapter's settings: the core's :class:`~torch_ckpt.CheckpointConfig` plus two adapter keys.

Where a value comes from (later wins):

1. the defaults (the core's, except ``keep_last``: when not given, ``ProjectConfiguration.total_limit``);
2. the YAML file: the path in the environment variable ``ACCELERATE_CKPT_CONFIG`` if it is set,
   otherwise the ``config=`` argument of :func:`~accelerate_ckpt.attach`;
3. keyword arguments passed to :func:`~accelerate_ckpt.attach`.

So an operator can change any setting the code does not pass explicitly, by editing the file or
by pointing the environment variable at another file, without touching the training script.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_ckpt import CheckpointConfig, ConfigError

__all__ = ["ENV_VAR", "CkptSettings", "load_settings"]

#: Environment variable holding the path of a YAML settings file; it wins over ``config=``.
ENV_VAR = "ACCELERATE_CKPT_CONFIG"
_ADAPTER_KEYS = ("enabled", "log_stats")
_FIXED = ("naming", "read_only")  # the adapter sets these itself


@dataclass(frozen=True)
class CkptSettings:
    """The merged settings.

    Attributes:
        config: every core setting (:class:`~torch_ckpt.CheckpointConfig`: same names, units and
            defaults as ``CheckpointManager``), validated.
        keep_last_given: True when ``keep_last`` was set; otherwise automatic checkpoints follow
            ``ProjectConfiguration.total_limit`` (None there: keep all).
        enabled: False leaves the ``Accelerator`` untouched (Accelerate's own synchronous saves).
        log_stats: send per-save statistics to ``accelerator.log`` when trackers are configured.
    """

    config: CheckpointConfig
    keep_last_given: bool = False
    enabled: bool = True
    log_stats: bool = True


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the accelerate_ckpt config file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return dict(data or {})


def load_settings(config: str | os.PathLike | None = None, **overrides: Any) -> CkptSettings:
    """Merge the defaults, the settings file and ``overrides`` (see the module docstring).

    Args:
        config: YAML file used when ``ACCELERATE_CKPT_CONFIG`` is not set.
        overrides: settings given in code; they win over the file.

    Raises:
        ConfigError: an unreadable file, unknown keys, ``naming``/``read_only`` (set by the adapter)
            or invalid values (the message names the file and the key).
    """
    path = os.environ.get(ENV_VAR) or config
    values = _read_yaml(Path(path).expanduser()) if path else {}
    source = str(path) if path else "attach()"
    values.update(overrides)
    fixed = [k for k in _FIXED if k in values]
    if fixed:
        raise ConfigError(f"{source}: {fixed[0]} is set by accelerate_ckpt itself (Accelerate's checkpoint_N "
                          "folders, a writable root); leave it out")
    adapter = {k: values.pop(k) for k in _ADAPTER_KEYS if k in values}
    for name, value in adapter.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {name} must be true or false, got {value!r}")
    return CkptSettings(CheckpointConfig.from_dict(values, source=source), "keep_last" in values, **adapter)
