"""Which Lightning checkpoint values are stored as they are, under a marker, or (on request) pickled.

As they are: tensors, numpy values, exact ``None``/``bool``/``int``/``float``/``str``/``bytes``, plain
``list``/``tuple`` and mappings with scalar keys (back as ``dict``). Under a marker, never pickled:
``pathlib`` paths, enum members (the member if its class is imported, else its value), dataclasses
(their fields, as a ``dict``). Anything else: :class:`~torch_ckpt.ConfigError` naming the key with
``unsafe_values="error"``, pickled with ``"pickle"`` (loading it then needs ``weights_only=False``).
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import pickle
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torch_ckpt import ConfigError, UnsafeCheckpointError

__all__ = ["RANK_LOCAL_KEYS", "UNSAFE_VALUE_MODES", "decode_values", "encode_values"]

#: Top-level keys stored once per rank: loop progress (dataloader position) and callback states (RNG).
RANK_LOCAL_KEYS = ("loops", "callbacks")
UNSAFE_VALUE_MODES = ("error", "pickle")
PICKLED, PATH, ENUM = "__lightning_ckpt_pickled__", "__lightning_ckpt_path__", "__lightning_ckpt_enum__"
_KEYS = (type(None), bool, int, float, str)
_PATH_KINDS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


def encode_values(checkpoint: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """A copy of ``checkpoint`` (containers copied, leaves shared) that torch-ckpt can store.

    Args:
        checkpoint: the dict Lightning passes to ``CheckpointIO.save_checkpoint``.
        mode: ``"error"`` or ``"pickle"``.

    Raises:
        ConfigError: a value needs pickling and ``mode`` is ``"error"``; the message names its key.
    """

    def enc(obj: Any, path: str) -> Any:
        if type(obj) in (*_KEYS, bytes) or isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
            return obj
        if isinstance(obj, Mapping) and all(type(k) in _KEYS for k in obj):
            return {k: enc(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(enc(v, f"{path}.{i}") for i, v in enumerate(obj))
        if isinstance(obj, pathlib.PurePath):
            return {PATH: [type(obj).__name__, str(obj)]}
        if isinstance(obj, enum.Enum):
            return {ENUM: [type(obj).__module__, type(obj).__qualname__, obj.name, enc(obj.value, f"{path}.value")]}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: enc(getattr(obj, f.name), f"{path}.{f.name}") for f in dataclasses.fields(obj)}
        if mode == "pickle":
            return {PICKLED: pickle.dumps(obj)}
        raise ConfigError(
            f"checkpoint key {path!r} holds a {type(obj).__module__}.{type(obj).__qualname__}, which cannot be stored "
            "without pickling. Store a tensor or a JSON value instead (for hyper-parameters: "
            "save_hyperparameters(ignore=[...]) or convert the value), or pass AsyncDCPCheckpointIO("
            "unsafe_values='pickle') to store it pickled (loading it then needs weights_only=False).")

    return enc(dict(checkpoint), "")


def _decode_enum(module: str, qualname: str, name: str, value: Any) -> Any:
    cls: Any = sys.modules.get(module)  # nothing is imported from a checkpoint
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    return cls.__members__[name] if isinstance(cls, enum.EnumMeta) and name in cls.__members__ else value


def decode_values(checkpoint: dict[str, Any], *, allow_pickle: bool) -> dict[str, Any]:
    """Undo :func:`encode_values` in place; pickled values only with ``allow_pickle``.

    Raises:
        UnsafeCheckpointError: pickled values and ``allow_pickle`` is False; the message lists their keys.
    """
    refused: list[str] = []

    def dec(obj: Any, path: str) -> Any:
        if isinstance(obj, (list, tuple)):
            return type(obj)(dec(v, f"{path}.{i}") for i, v in enumerate(obj))
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1 and PATH in obj:
            kind, text = obj[PATH]
            return getattr(pathlib, kind if kind in _PATH_KINDS else "Path")(text)
        if len(obj) == 1 and ENUM in obj:
            return _decode_enum(*obj[ENUM])
        if len(obj) == 1 and PICKLED in obj:
            if allow_pickle:
                return pickle.loads(obj[PICKLED])
            refused.append(path)
            return obj
        for k, v in obj.items():
            obj[k] = dec(v, f"{path}.{k}" if path else str(k))
        return obj

    out = dec(checkpoint, "")
    if refused:
        raise UnsafeCheckpointError(
            f"checkpoint values {refused[:10]}{' ...' if len(refused) > 10 else ''} were stored pickled "
            "(unsafe_values='pickle'). Loading them runs code from the checkpoint: pass weights_only=False "
            "(e.g. trainer.fit(..., weights_only=False)) only if you trust it.")
    return out
