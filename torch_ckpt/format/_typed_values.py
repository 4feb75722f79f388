"""``TypedValues``: values the codec refuses (paths, dtypes, devices, enums, classes, dataclasses, namedtuples,
OmegaConf configs, mappings with other keys), stored pickle-free under one-key markers ``{prefix + tag + "__": ...}``
and decoded with their exact type, importing no module a checkpoint names (but ``importable``) and running no
constructor. Tensors, numpy values, scalars, bytes, sets, lists, tuples, dicts are kept; the rest pickled or refused."""

from __future__ import annotations

import dataclasses
import enum
import functools
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


def _lookup(module: Any, qualname: Any) -> Any:  # getattr in an imported module only
    obj: Any = sys.modules.get(module) if isinstance(module, str) and isinstance(qualname, str) else None
    return functools.reduce(lambda o, part: getattr(o, part, None), qualname.split("."), obj) if obj else None


def _reference(cls: type) -> list[str] | None:  # None for a class a decode would not find (local, renamed)
    ref = [getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)]
    return ref if _lookup(*ref) is cls else None  # type: ignore[return-value]


class TypedValues:
    """Encode values for :class:`~torch_ckpt.CheckpointManager` and decode them back.

    Args:
        unsafe: ``"pickle"`` stores values without a typed encoding pickled; else (``"error"``) refuses them.
        prefix: Start of every marker key (an adapter keeps its own: its older checkpoints still decode).
        importable: Top-level packages a decode may import to find a class (installed libraries only).
        plain_dicts: Mappings come back as ``dict`` (False: ``OrderedDict`` stays one).
    """

    def __init__(self, unsafe: str = "error", *, prefix: str = "__torch_ckpt_",
                 importable: tuple[str, ...] = ("omegaconf",), plain_dicts: bool = True) -> None:
        self.unsafe, self.importable, self._dict = unsafe, importable, dict if plain_dicts else None
        self._tags = {t: f"{prefix}{t}__" for t in "pickled path enum class dataclass namedtuple omegaconf mapping "
                                                   "dtype device".split()}
        self._tag_of = {v: k for k, v in self._tags.items()}

    def encode(self, value: Any, key: str = "", pickled: list[str] | None = None) -> Any:
        """A copy of ``value`` (containers copied, leaves shared) that the core stores; ``pickled`` collects the
        keys of pickled values. Raises ConfigError naming ``key`` for a value refused or failing to pickle."""
        t, sub = self._tags, functools.partial("{}.{}".format if key else "{1}".format, key)
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
        if isinstance(value, pathlib.PurePath):  # "PosixPath"... back as the same class
            return {t["path"]: [type(value).__name__, str(value)]}
        if isinstance(value, (torch.dtype, torch.device)):
            return {t[type(value).__name__]: str(value).removeprefix("torch.")}
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
        what = f"checkpoint key {key!r} holds a {type(value).__module__}.{type(value).__qualname__}"
        if self.unsafe != "pickle":
            raise ConfigError(f"{what}, which cannot be stored without pickling. Store a tensor or a JSON value "
                              "instead, or allow pickled values (loading them then needs weights_only=False)")
        try:
            data = {t["pickled"]: pickle.dumps(value)}
        except Exception as exc:  # noqa: BLE001 - pickling runs the object's own code: any error
            raise ConfigError(f"{what}, which has no typed encoding and cannot be pickled either "
                              f"({type(exc).__name__}: {exc}); store a plain value instead") from exc
        (pickled if pickled is not None else []).append(key)
        return data

    def decode(self, value: Any, *, allow_pickle: bool = False) -> Any:
        """Undo :meth:`encode` (dicts in place); pickled values only with ``allow_pickle``.

        Raises:
            UnsafeCheckpointError: pickled values without ``allow_pickle``, or a class not in the imported modules.
            CheckpointCorruptError: a malformed marker.
        """
        refused: list[str] = []
        try:
            out = self._decode(value, "", allow_pickle, refused)  # a pickled value left encoded is refused below
        except (TypeError, ValueError, KeyError) as exc:
            if isinstance(exc, (UnsafeCheckpointError, CheckpointCorruptError)):
                raise
            raise CheckpointCorruptError(f"malformed value marker in the checkpoint ({exc})") from exc
        if refused:
            raise UnsafeCheckpointError(f"checkpoint values {refused[:10]} were stored pickled. Loading them runs code "
                                        "from the checkpoint: pass weights_only=False only if you trust it.")
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
            obj.update((k, dec(v, f"{key}.{k}" if key else str(k))) for k, v in list(obj.items()))
            return obj
        (payload,) = obj.values()
        if tag == "path":
            cls = getattr(pathlib, str(payload[0]), None)
            return (cls if isinstance(cls, type) and issubclass(cls, pathlib.PurePath) else pathlib.Path)(payload[1])
        if tag == "device":
            return torch.device(payload)
        if tag == "enum":
            cls = _lookup(payload[0], payload[1])  # nothing imported; an unknown enum comes back as its value
            return cls.__members__[payload[2]] if isinstance(cls, enum.EnumMeta) and payload[2] in cls.__members__ \
                else dec(payload[3])
        if tag == "dtype":
            if not isinstance(dtype := getattr(torch, str(payload), None), torch.dtype):
                raise CheckpointCorruptError(f"checkpoint key {key!r}: unknown torch dtype {payload!r}")
            return dtype
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
            if not (issubclass(cls, tuple) and len(getattr(cls, "_fields", ())) == len(values)):  # no __new__ runs
                raise UnsafeCheckpointError(f"checkpoint key {key!r}: {cls} is not the namedtuple it was saved as")
            return tuple.__new__(cls, values)
        if tag == "omegaconf":
            oc, content = self._resolve("omegaconf", "OmegaConf", key), dec(payload[1])
            if not isinstance(content, {"DictConfig": dict, "ListConfig": list}.get(payload[0], ())):
                raise CheckpointCorruptError(f"checkpoint key {key!r}: malformed OmegaConf {payload[0]!r} value")
            cfg = oc.create(content)
            for flag in set(payload[2]) & {"struct", "readonly"}:
                getattr(oc, f"set_{flag}")(cfg, True)
            return cfg
        if tag == "mapping":
            items = [(dec(k), dec(v, f"{key}.{k}")) for k, v in payload]
            return obj if any(isinstance(k, dict) for k, _ in items) else dict(items)  # a refused key: raised later
        if allow_pickle:
            return pickle.loads(payload)
        refused.append(key)
        return obj

    def _resolve(self, module: Any, qualname: Any, key: str) -> type[Any]:
        if isinstance(module, str) and module not in sys.modules and module.split(".")[0] in self.importable:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise UnsafeCheckpointError(f"checkpoint key {key!r} holds a {module}.{qualname}, but {module} "
                                            f"cannot be imported ({exc}); install it to load this checkpoint") from exc
        if not isinstance(cls := _lookup(module, qualname), type):
            raise UnsafeCheckpointError(f"checkpoint key {key!r} holds a {module}.{qualname}, not a class of an "
                                        f"imported module (a checkpoint never imports one): import {module} first")
        return cls
