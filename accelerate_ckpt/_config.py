"""The adapter's settings: the core's :class:`~torch_ckpt.CheckpointConfig` plus its own ``enabled``, ``log_stats``.

Later wins: the defaults (the core's; ``keep_last`` unset or null follows
``ProjectConfiguration.total_limit``), the YAML file (named by ``ACCELERATE_CKPT_CONFIG`` if set,
else ``attach(config=...)``), the keyword arguments of :func:`~accelerate_ckpt.attach`. So an
operator can change any setting the script does not pass, without touching the script.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch_ckpt import CheckpointConfig, ConfigError

__all__ = ["ENV_VAR", "CkptSettings", "load_settings"]

#: Environment variable holding the path of a YAML settings file; it wins over ``config=``.
ENV_VAR = "ACCELERATE_CKPT_CONFIG"
_EXTRAS = {"enabled": True, "log_stats": True}  # the adapter's own keys and their defaults
_FIXED = ("naming", "read_only", "explicit_paths_only")  # set by the adapter itself


@dataclass(frozen=True)
class CkptSettings:
    """The merged settings.

    Attributes:
        config: every core setting (same names, units and defaults as ``CheckpointManager``), validated.
        keep_last_given: True when ``keep_last`` was set (not null); otherwise automatic checkpoints
            follow ``ProjectConfiguration.total_limit`` (None there: keep all).
        enabled: False leaves the ``Accelerator`` untouched (Accelerate's own synchronous saves).
        log_stats: send per-save statistics to ``accelerator.log`` when trackers are configured.
    """

    config: CheckpointConfig
    keep_last_given: bool = False
    enabled: bool = True
    log_stats: bool = True


def load_settings(config: str | os.PathLike | None = None, **overrides: Any) -> CkptSettings:
    """Merge the defaults, the settings file and ``overrides`` (see the module docstring).

    Args:
        config: YAML file used when ``ACCELERATE_CKPT_CONFIG`` is not set.
        overrides: settings given in code; they win over the file.

    Raises:
        ConfigError: an unreadable file, an unknown key (with the closest valid one), ``naming`` or
            ``read_only`` (set by the adapter), or an invalid value. The message starts with the
            file, or ``attach()`` for a value given in code, and names the key.
    """
    path = os.environ.get(ENV_VAR) or config
    file_values = CheckpointConfig.read_yaml(path) if path else {}
    merged = {**file_values, **overrides}
    layers = [(os.fspath(path), file_values, True)] if path else []
    if overrides or not path:  # the file alone is checked first, so its errors name the file
        layers.append(("attach()" + (f" over {os.fspath(path)}" if path else ""), merged, False))
    for source, values, from_file in layers:
        fixed = [k for k in _FIXED if k in values]
        if fixed:
            raise ConfigError(f"{source}: {fixed[0]} is set by accelerate_ckpt itself (Accelerate's checkpoint_N "
                              "folders, a writable root); leave it out")
        cfg, extra = CheckpointConfig.from_dict_with_extras(values, _EXTRAS, source=source, from_file=from_file,
                                                            reserved=_FIXED)
    return CkptSettings(cfg, merged.get("keep_last") is not None, **extra)
