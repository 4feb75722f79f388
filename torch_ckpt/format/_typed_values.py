"""``TypedValues``: values the codec refuses, stored pickle-free under typed markers (for the adapters).

Stored as they are: tensors, numpy values, exact scalars, ``bytes``, sets (the core's codec stores them), plain
``list``/``tuple``, mappings with scalar keys (back as ``dict``, or ``OrderedDict``). Under a one-key marker ``{prefix + tag + "__":
payload}``, each back with its exact type: mappings with other keys, ``pathlib`` paths, torch dtypes and devices,
enum members, classes (by import path), dataclasses and namedtuples (import path and fields), OmegaConf
``DictConfig``/``ListConfig`` (unresolved, with their read-only/struct flags). Decoding never imports a module a
checkpoint names (except ``importable`` packages) and never runs a constructor. Anything else is pickled
(``unsafe="pickle"``; decoding it needs ``allow_pickle``) or refused with a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pathlib
import pickle
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torch_ckpt.errors import CheckpointCorruptError, ConfigError, UnsafeCheckpointError

__all__ = ["TypedValues"]

_SCALARS = (type(None), bool, int, float, str)
_AS_IS = (*_SCALARS, bytes, bytearray, complex, set, frozenset)  # the core's codec stores these exactly
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


def _lookup(module: Any, qualname: Any) -> Any:
    obj: Any = sys.modules.get(module) if isinstance(module, str) and isinstance(qualname, str) else None
    for part in qualname.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj


def _reference(cls: type) -> list[str] | None:
    """``[module, qualname]`` of ``cls`` if a decode finds it there again (not a local or renamed class)."""
    ref = [getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)]
    return ref if _lookup(*ref) is cls else None  # type: ignore[return-value]


class TypedValues:
    """Encode values for :class:`~torch_ckpt.CheckpointManager` and decode them back (see the module docstring).

    Args:
        unsafe: ``"pickle"`` stores values without a typed encoding pickled; ``"error"`` refuses them.
        prefix: Start of every marker key (an adapter keeps its own, so its older checkpoints still decode).
        importable: Top-level packages a decode may import to find a class (installed libraries only).
        plain_dicts: Mappings come back as ``dict`` (False: ``OrderedDict`` stays one).

    Raises:
        ConfigError: ``unsafe`` is neither mode.
    """

    def __init__(self, unsafe: str = "error", *, prefix: str = "__torch_ckpt_",
                 importable: tuple[str, ...] = ("omegaconf",), plain_dicts: bool = True) -> None:
        if unsafe not in ("pickle", "error"):
            raise ConfigError(f"unsafe values must be 'pickle' or 'error', got {unsafe!r}")
        self.unsafe, self.importable, self._dict = unsafe, importable, dict if plain_dicts else None
        self._tags = {t: f"{prefix}{t}__" for t in ("pickled", "path", "enum", "class", "dataclass", "namedtuple",
                                                     "omegaconf", "mapping", "dtype", "device")}
        self._tag_of = {v: k for k, v in self._tags.items()}

    def encode(self, value: Any, key: str = "", pickled: list[str] | None = None) -> Any:
        """A copy of ``value`` (containers copied, leaves shared) that the core stores; ``pickled`` collects the
        keys of pickled values.

        Raises:
            ConfigError: a value needs pickling and ``unsafe`` is ``"error"``, or pickling fails (names the key).
        """
        t = self._tags

        def sub(k: Any) -> str:
            return f"{key}.{k}" if key else str(k)

        if type(value) in _AS_IS or isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
            return value
        omegaconf = sys.modules.get("omegaconf")  # a container exists only once omegaconf is imported
        if omegaconf is not None and type(value) in (omegaconf.DictConfig, omegaconf.ListConfig) and (
                type(value) is omegaconf.ListConfig or omegaconf.OmegaConf.get_type(value) in (dict, None)):
            oc = omegaconf.OmegaConf
            flags = [f for f, on in (("readonly", oc.is_readonly(value)), ("struct", oc.is_struct(value))) if on]
            content = oc.to_container(value, resolve=False, enum_to_str=False)
            return {t["omegaconf"]: [type(value).__name__, self.encode(content, key, pickled), flags]}
        structured = omegaconf is not None and isinstance(value, omegaconf.Container)  # schema not kept: pickled
        if not structured and isinstance(value, Mapping) and all(type(k) in _SCALARS for k in value):
            return (self._dict or (type(value) if type(value) is OrderedDict else dict))(
                (k, self.encode(v, sub(k), pickled)) for k, v in value.items())
        if not structured and isinstance(value, Mapping):
            return {t["mapping"]: [[self.encode(k, sub(f"<key {k!r}>"), pickled), self.encode(v, sub(k), pickled)]
                                   for k, v in value.items()]}
        if type(value) in (list, tuple):
            return type(value)(self.encode(v, sub(i), pickled) for i, v in enumerate(value))
        if isinstance(value, pathlib.PurePath):
            return {t["path"]: [type(value).__name__, str(value)]}
        if isinstance(value, torch.dtype):
            return {t["dtype"]: str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {t["device"]: str(value)}
        if isinstance(value, enum.Enum):
            cls = type(value)
            return {t["enum"]: [cls.__module__, cls.__qualname__, value.name, self.encode(value.value, key, pickled)]}
        ref = None if structured else _reference(value if isinstance(value, type) else type(value))
        if ref is not None and isinstance(value, type):
            return {t["class"]: ref}
        if ref is not None and dataclasses.is_dataclass(value):
            return {t["dataclass"]: [*ref, {f.name: self.encode(getattr(value, f.name), sub(f.name), pickled)
                                            for f in dataclasses.fields(value) if hasattr(value, f.name)}]}
        if ref is not None and isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple):
            return {t["namedtuple"]: [*ref, [self.encode(v, sub(i), pickled) for i, v in enumerate(value)]]}
        what = f"{type(value).__module__}.{type(value).__qualname__}"
        if self.unsafe == "error":
            raise ConfigError(f"checkpoint key {key!r} holds a {what}, which cannot be stored without pickling. Store "
                              "a tensor or a JSON value instead, or allow pickled values (loading them then needs "
                              "weights_only=False / allow_pickle)")
        try:
            data = pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - pickling runs the object's own code: any error
            raise ConfigError(f"checkpoint key {key!r} holds a {what}, which has no typed encoding and cannot be "
                              f"pickled either ({type(exc).__name__}: {exc}); store a plain value instead") from exc
        if pickled is not None:
            pickled.append(key)
        return {t["pickled"]: data}

    def decode(self, value: Any, *, allow_pickle: bool = False) -> Any:
        """Undo :meth:`encode` (dicts in place); pickled values only with ``allow_pickle``.

        Raises:
            UnsafeCheckpointError: pickled values without ``allow_pickle`` (their keys listed), or a class a value
                names is not in the imported modules.
            CheckpointCorruptError: a malformed marker.
        """
        refused: list[str] = []
        try:
            out = self._decode(value, "", allow_pickle, refused)
        except (TypeError, ValueError, KeyError) as exc:
            if isinstance(exc, (UnsafeCheckpointError, CheckpointCorruptError)):
                raise
            raise CheckpointCorruptError(f"malformed value marker in the checkpoint ({exc})") from exc
        if refused:
            raise UnsafeCheckpointError(f"checkpoint values {refused[:10]}{' ...' if len(refused) > 10 else ''} were "
                                        "stored pickled. Loading them runs code from the checkpoint: pass "
                                        "weights_only=False (e.g. trainer.fit(..., weights_only=False)) only if you "
                                        "trust it.")
        return out

    def _decode(self, obj: Any, key: str, allow_pickle: bool, refused: list[str]) -> Any:
        def dec(v: Any, k: str = key) -> Any:
            return self._decode(v, k, allow_pickle, refused)

        if isinstance(obj, (list, tuple)):
            return type(obj)(dec(v, f"{key}.{i}") for i, v in enumerate(obj))
        if not isinstance(obj, dict):
            return obj
        tag = self._tag_of.get(next(iter(obj))) if len(obj) == 1 else None
        if tag is None:
            for k, v in obj.items():
                obj[k] = dec(v, f"{key}.{k}" if key else str(k))
            return obj
        (payload,) = obj.values()
        if tag == "path":
            return getattr(pathlib, payload[0] if payload[0] in _PATHS else "Path")(payload[1])
        if tag == "enum":
            cls = _lookup(payload[0], payload[1])  # nothing imported; an unknown enum comes back as its value
            return cls.__members__[payload[2]] if isinstance(cls, enum.EnumMeta) and payload[2] in cls.__members__ \
                else dec(payload[3])
        if tag == "dtype":
            if not isinstance(dtype := getattr(torch, str(payload), None), torch.dtype):
                raise CheckpointCorruptError(f"checkpoint key {key!r}: unknown torch dtype {payload!r}")
            return dtype
        if tag == "device":
            return torch.device(payload)
        if tag == "class":
            return self._resolve(payload[0], payload[1], key)
        if tag == "dataclass":
            cls, fields = self._resolve(payload[0], payload[1], key), dec(payload[2])
            if not dataclasses.is_dataclass(cls) or set(fields) - {f.name for f in dataclasses.fields(cls)}:
                raise UnsafeCheckpointError(f"checkpoint key {key!r}: {cls} is not the dataclass it was saved as")
            made = object.__new__(cls)  # no __init__/__post_init__; frozen ones too, as pickle does
            for name, v in fields.items():
                object.__setattr__(made, name, v)
            return made
        if tag == "namedtuple":
            cls, values = self._resolve(payload[0], payload[1], key), dec(payload[2])
            if not (issubclass(cls, tuple) and len(getattr(cls, "_fields", ())) == len(values)):
                raise UnsafeCheckpointError(f"checkpoint key {key!r}: {cls} is not the namedtuple it was saved as")
            return tuple.__new__(cls, values)
        if tag == "omegaconf":
            return self._omegaconf(payload[0], dec(payload[1]), payload[2], key)
        if tag == "mapping":
            items = [(dec(k), dec(v, f"{key}.{k}")) for k, v in payload]
            return obj if any(isinstance(k, dict) for k, _ in items) else dict(items)  # a refused key: raised later
        if allow_pickle:
            return pickle.loads(payload)
        refused.append(key)
        return obj

    def _resolve(self, module: Any, qualname: Any, key: str) -> Any:
        """The class ``module.qualname`` from the imported modules (``importable`` ones imported if needed)."""
        if isinstance(module, str) and module not in sys.modules and module.split(".")[0] in self.importable:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise UnsafeCheckpointError(f"checkpoint key {key!r} holds a {module}.{qualname}, but {module} "
                                            f"cannot be imported ({exc}); install it to load this checkpoint") from exc
        if not isinstance(cls := _lookup(module, qualname), type):
            raise UnsafeCheckpointError(f"checkpoint key {key!r} holds a {module}.{qualname}, which is not a class of "
                                        f"an imported module. A checkpoint never imports modules: import {module} "
                                        "before loading it")
        return cls

    def _omegaconf(self, kind: str, content: Any, flags: list[str], key: str) -> Any:
        try:
            from omegaconf import OmegaConf
        except ImportError as exc:
            raise UnsafeCheckpointError(f"checkpoint key {key!r} holds an OmegaConf {kind}: install omegaconf to "
                                        "load this checkpoint") from exc
        if not isinstance(content, {"DictConfig": dict, "ListConfig": list}.get(kind, ())):
            raise CheckpointCorruptError(f"checkpoint key {key!r}: malformed OmegaConf {kind!r} value")
        cfg = OmegaConf.create(content)
        for flag in set(flags) & {"struct", "readonly"}:
            getattr(OmegaConf, f"set_{flag}")(cfg, True)
        return cfg
