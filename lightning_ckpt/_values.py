"""Which Lightning checkpoint values are stored as they are; the rest is refused or pickled on request.

Stored as they are: tensors, exact ``None``/``bool``/``int``/``float``/``str``/``bytes``, numpy values,
plain ``list``/``tuple`` and mappings with scalar keys (mappings come back as ``dict``). Stored under
a marker without pickling: ``pathlib`` paths, enum members (the member if its class is already
imported, else its value) and dataclass instances (their fields, as a ``dict``). Anything else,
subclasses included, raises :class:`~torch_ckpt.ConfigError` naming the key with
``unsafe_values="error"``, or is stored pickled with ``"pickle"`` (loading then needs
``weights_only=False``, else :class:`~torch_ckpt.UnsafeCheckpointError`).
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

#: Top-level checkpoint keys stored once per rank: loop progress (with the dataloader position) and
#: callback states (MTBFCheckpoint keeps each rank's RNG there). Every other tensor is written once.
RANK_LOCAL_KEYS = ("loops", "callbacks")

UNSAFE_VALUE_MODES = ("error", "pickle")
PICKLED_TAG = "__lightning_ckpt_pickled__"
PATH_TAG = "__lightning_ckpt_path__"
ENUM_TAG = "__lightning_ckpt_enum__"
_SCALARS = (type(None), bool, int, float, str, bytes)
_KEY_TYPES = (type(None), bool, int, float, str)


def _is_safe_leaf(obj: Any) -> bool:
    return type(obj) in _SCALARS or isinstance(obj, (torch.Tensor, np.ndarray, np.generic))


def encode_values(checkpoint: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """Return a copy of ``checkpoint`` (containers copied, leaves shared) that torch-ckpt can store.

    Args:
        checkpoint: the dict Lightning passes to ``CheckpointIO.save_checkpoint``.
        mode: ``"error"`` or ``"pickle"`` (``AsyncDCPCheckpointIO`` validates it).

    Raises:
        ConfigError: a value would need pickling and ``mode`` is ``"error"``; the message names its key.
    """

    def enc(obj: Any, path: str) -> Any:
        if _is_safe_leaf(obj):
            return obj
        if isinstance(obj, Mapping) and all(type(k) in _KEY_TYPES for k in obj):
            return {k: enc(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(enc(v, f"{path}.{i}") for i, v in enumerate(obj))
        if isinstance(obj, pathlib.PurePath):
            return {PATH_TAG: [type(obj).__name__, str(obj)]}
        if isinstance(obj, enum.Enum):
            cls = type(obj)
            return {ENUM_TAG: [cls.__module__, cls.__qualname__, obj.name, enc(obj.value, f"{path}.value")]}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: enc(getattr(obj, f.name), f"{path}.{f.name}") for f in dataclasses.fields(obj)}
        if mode == "pickle":
            return {PICKLED_TAG: pickle.dumps(obj)}
        what = f"{type(obj).__module__}.{type(obj).__qualname__}"
        raise ConfigError(
            f"checkpoint key {path!r} holds a {what}, which cannot be stored without pickling. Store a tensor or "
            "a JSON value instead (for hyper-parameters: save_hyperparameters(ignore=[...]) or convert the value), "
            "or pass AsyncDCPCheckpointIO(unsafe_values='pickle') to store it pickled (loading it then needs "
            "weights_only=False).")

    return enc(dict(checkpoint), "")


_PATH_KINDS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


def _decode_enum(module: str, qualname: str, name: str, value: Any) -> Any:
    """The enum member if its class is already imported (nothing is imported), else its stored value."""
    cls: Any = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if isinstance(cls, enum.EnumMeta) and name in cls.__members__:
        return cls.__members__[name]
    return value


def decode_values(checkpoint: dict[str, Any], *, allow_pickle: bool) -> dict[str, Any]:
    """Undo :func:`encode_values` in place: unpickle marked values if ``allow_pickle``.

    Raises:
        UnsafeCheckpointError: pickled values are present and ``allow_pickle`` is False; the message
            lists their keys.
    """
    refused: list[str] = []

    def dec(obj: Any, path: str) -> Any:
        if isinstance(obj, dict):
            if len(obj) == 1 and PATH_TAG in obj:
                kind, text = obj[PATH_TAG]
                return getattr(pathlib, kind, pathlib.PurePath)(text) if kind in _PATH_KINDS else pathlib.Path(text)
            if len(obj) == 1 and ENUM_TAG in obj:
                return _decode_enum(*obj[ENUM_TAG])
            if len(obj) == 1 and PICKLED_TAG in obj:
                if not allow_pickle:
                    refused.append(path)
                    return obj
                return pickle.loads(obj[PICKLED_TAG])
            for k, v in obj.items():
                obj[k] = dec(v, f"{path}.{k}" if path else str(k))
            return obj
        if isinstance(obj, list):
            return [dec(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(dec(v, f"{path}.{i}") for i, v in enumerate(obj))
        return obj

    out = dec(checkpoint, "")
    if refused:
        raise UnsafeCheckpointError(
            f"checkpoint values {refused[:10]}{' ...' if len(refused) > 10 else ''} were stored pickled "
            "(unsafe_values='pickle'). Loading them runs code from the checkpoint: pass weights_only=False "
            "(e.g. trainer.fit(..., weights_only=False)) only if you trust it.")
    return out
