"""Reading a YAML settings file for :class:`~torch_ckpt.CheckpointConfig` and the adapters.

Plain data only (PyYAML's safe loader, never Python objects). Everything that makes a file
ambiguous or unusable is a :class:`~torch_ckpt.errors.ConfigError` naming the file: unreadable,
not UTF-8, not YAML, nested too deeply, not a mapping, a key written twice (YAML would silently
keep the last one), or a setting that only code can give (a Python object such as a process group).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch_ckpt.errors import ConfigError

__all__ = ["read_settings_file"]


def _loader(path: Path) -> type:
    import yaml  # PyYAML is a dependency; imported here so `import torch_ckpt` stays fast

    class _NoDuplicates(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no annotations
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise ConfigError(f"{path}: setting {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                      "keep one")
                seen.add(key)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
            return mapping

    return _NoDuplicates


def read_settings_file(path: str | os.PathLike[str], *, code_only: Iterable[str] = ()) -> dict[str, Any]:
    """The mapping in a YAML settings file (``{}`` for an empty file), keys not yet validated.

    Args:
        path: The file (``~`` is expanded).
        code_only: Setting names that take Python objects and so cannot come from a file.

    Returns:
        The file's top-level mapping.

    Raises:
        ConfigError: The file cannot be read, is not UTF-8 text, is not valid YAML, is nested too
            deeply, is not a mapping, gives a key twice, or gives a setting of ``code_only``
            (every message names the file).
    """
    import yaml

    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}); save it as UTF-8 YAML") from exc
    try:
        data = yaml.load(text, Loader=_loader(path))  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{path}: nested too deeply to be a settings file (setting: value lines)") from None
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    data = dict(data or {})
    objects = sorted(str(k) for k in data if k in set(code_only))
    if objects:
        raise ConfigError(f"{path}: {objects} can only be given in code (they take Python objects); remove "
                          f"{'it' if len(objects) == 1 else 'them'} from the file and pass "
                          f"{'it' if len(objects) == 1 else 'them'} to the constructor")
    return data
