"""Which Lightning checkpoint values are stored as they are, under a typed marker, or pickled.

As they are: tensors, numpy values, exact ``None``/``bool``/``int``/``float``/``str``/``bytes``, plain
``list``/``tuple`` and mappings with scalar keys (back as ``dict``). Under a typed marker, never
pickled, each back with its exact type: mappings with other keys (back as ``dict``); ``pathlib``
paths; torch dtypes and devices; enum members; classes (``hparams_type``), by import path; dataclass
instances and namedtuples, by import path and fields; OmegaConf ``DictConfig``/``ListConfig``
(``OmegaConf.to_container`` without resolving interpolations, re-created by ``OmegaConf.create`` with
their read-only/struct flags). Loading never imports a module named by a checkpoint (except
``omegaconf`` and Lightning's own packages) and never runs a constructor: a class is looked up in the
modules already imported (``getattr`` only), a dataclass or namedtuple is rebuilt from its fields
without calling ``__init__``. Anything else: pickled with ``unsafe_values="pickle"`` (the default;
loading it needs ``weights_only=False``), :class:`~torch_ckpt.ConfigError` naming the key with ``"error"``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import pathlib
import pickle
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torch_ckpt import CheckpointCorruptError, ConfigError, UnsafeCheckpointError

__all__ = ["RANK_LOCAL_KEYS", "UNSAFE_VALUE_MODES", "decode_values", "encode_values"]

log = logging.getLogger(__name__)

#: Top-level keys stored once per rank: loop progress (dataloader position) and callback states (RNG).
RANK_LOCAL_KEYS = ("loops", "callbacks")
UNSAFE_VALUE_MODES = ("pickle", "error")
PICKLED, PATH, ENUM = "__lightning_ckpt_pickled__", "__lightning_ckpt_path__", "__lightning_ckpt_enum__"
CLASS, DATACLASS = "__lightning_ckpt_class__", "__lightning_ckpt_dataclass__"
NAMEDTUPLE, OMEGACONF = "__lightning_ckpt_namedtuple__", "__lightning_ckpt_omegaconf__"
MAPPING, DTYPE, DEVICE = "__lightning_ckpt_mapping__", "__lightning_ckpt_dtype__", "__lightning_ckpt_device__"
_KEYS = (type(None), bool, int, float, str)
_PATH_KINDS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
#: Packages a load may import to resolve a class (installed libraries, not modules named by the checkpoint).
_IMPORTABLE = ("omegaconf", "lightning", "pytorch_lightning", "lightning_fabric")
#: Top-level keys whose class Lightning calls with the checkpoint's hyper-parameters (``_convert_loaded_hparams``).
_HPARAMS_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")
_warned_pickled: set[tuple[str, ...]] = set()


def _lookup(module: str, qualname: str) -> Any:
    """The attribute ``qualname`` of the imported module ``module`` (``getattr`` only), or None."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _reference(cls: type) -> list[str] | None:
    """``[module, qualname]`` of ``cls`` if a load finds it again there (not a local or renamed class)."""
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and _lookup(module, qualname) is cls:
        return [module, qualname]
    return None


def _omegaconf_kind(obj: Any) -> str | None:
    """"DictConfig"/"ListConfig" for an OmegaConf container, "structured" for a structured config (its
    dataclass schema is not kept by ``to_container``: no typed encoding), None for anything else."""
    omegaconf = sys.modules.get("omegaconf")  # a container exists only once omegaconf is imported
    if omegaconf is None or not isinstance(obj, omegaconf.Container):
        return None
    if isinstance(obj, omegaconf.DictConfig) and omegaconf.OmegaConf.get_type(obj) not in (dict, None):
        return "structured"
    return type(obj).__name__ if type(obj) in (omegaconf.DictConfig, omegaconf.ListConfig) else "structured"


def encode_values(checkpoint: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """A copy of ``checkpoint`` (containers copied, leaves shared) that torch-ckpt can store.

    Args:
        checkpoint: the dict Lightning passes to ``CheckpointIO.save_checkpoint``.
        mode: ``"pickle"`` or ``"error"`` (for values without a typed encoding).

    Raises:
        ConfigError: a value needs pickling and ``mode`` is ``"error"``, or pickling it fails; the message
            names its key.
    """
    pickled: list[str] = []

    def enc(obj: Any, path: str) -> Any:
        if type(obj) in (*_KEYS, bytes) or isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
            return obj
        kind = _omegaconf_kind(obj)
        if kind is not None and kind != "structured":
            omegaconf = sys.modules["omegaconf"].OmegaConf
            flags = [f for f, on in (("readonly", omegaconf.is_readonly(obj)), ("struct", omegaconf.is_struct(obj)))
                     if on]
            content = omegaconf.to_container(obj, resolve=False, enum_to_str=False)
            return {OMEGACONF: [kind, enc(content, path), flags]}
        if kind is None and isinstance(obj, Mapping) and all(type(k) in _KEYS for k in obj):
            return {k: enc(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
        if kind is None and isinstance(obj, Mapping):  # other keys (classes: Lightning's legacy callback states)
            return {MAPPING: [[enc(k, f"{path}.<key {k!r}>"), enc(v, f"{path}.{k}")] for k, v in obj.items()]}
        if type(obj) in (list, tuple):
            return type(obj)(enc(v, f"{path}.{i}") for i, v in enumerate(obj))
        if isinstance(obj, pathlib.PurePath):
            return {PATH: [type(obj).__name__, str(obj)]}
        if isinstance(obj, torch.dtype):
            return {DTYPE: str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {DEVICE: str(obj)}
        if isinstance(obj, enum.Enum):
            return {ENUM: [type(obj).__module__, type(obj).__qualname__, obj.name, enc(obj.value, f"{path}.value")]}
        ref = _reference(obj) if isinstance(obj, type) else _reference(type(obj))
        if ref is not None and isinstance(obj, type):
            return {CLASS: ref}
        if ref is not None and dataclasses.is_dataclass(obj):
            return {DATACLASS: [*ref, {f.name: enc(getattr(obj, f.name), f"{path}.{f.name}")
                                       for f in dataclasses.fields(obj) if hasattr(obj, f.name)}]}
        if ref is not None and isinstance(obj, tuple) and isinstance(getattr(type(obj), "_fields", None), tuple):
            return {NAMEDTUPLE: [*ref, [enc(v, f"{path}.{i}") for i, v in enumerate(obj)]]}
        what = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if mode == "pickle":
            try:
                data = pickle.dumps(obj)
            except Exception as exc:  # noqa: BLE001 - pickling runs the object's own code: any error
                raise ConfigError(f"checkpoint key {path!r} holds a {what}, which has no typed encoding and cannot "
                                  f"be pickled either ({type(exc).__name__}: {exc}); store a plain value instead "
                                  "(for hyper-parameters: save_hyperparameters(ignore=[...]))") from exc
            pickled.append(path)
            return {PICKLED: data}
        raise ConfigError(
            f"checkpoint key {path!r} holds a {what}, which cannot be stored without pickling. Store a tensor or a "
            "JSON value instead (for hyper-parameters: save_hyperparameters(ignore=[...]) or convert the value), "
            "or use AsyncDCPCheckpointIO(unsafe_values='pickle') (the default) to store it pickled (loading it "
            "then needs weights_only=False).")

    out = enc(dict(checkpoint), "")
    if pickled and tuple(pickled) not in _warned_pickled:
        _warned_pickled.add(tuple(pickled))
        log.warning("checkpoint values %s have no pickle-free encoding and are stored pickled; loading them needs "
                    "weights_only=False (AsyncDCPCheckpointIO(unsafe_values='error') refuses them instead)",
                    pickled[:10])
    return out


def _decode_enum(module: str, qualname: str, name: str, value: Any) -> Any:
    cls = _lookup(module, qualname)  # nothing is imported from a checkpoint
    return cls.__members__[name] if isinstance(cls, enum.EnumMeta) and name in cls.__members__ else value


def _resolve_class(module: str, qualname: str, key: str) -> type:
    """The class ``module.qualname``, looked up in imported modules (``_IMPORTABLE`` ones imported if needed).

    Raises:
        UnsafeCheckpointError: its module is not imported, or the name is not a class.
    """
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise CheckpointCorruptError(f"checkpoint key {key!r}: malformed class reference")
    if module not in sys.modules and module.split(".", 1)[0] in _IMPORTABLE:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UnsafeCheckpointError(f"checkpoint key {key!r} holds a {module}.{qualname}, but {module} cannot "
                                        f"be imported ({exc}); install it to load this checkpoint") from exc
    cls = _lookup(module, qualname)
    if not isinstance(cls, type):
        raise UnsafeCheckpointError(
            f"checkpoint key {key!r} holds a {module}.{qualname}, which is not a class of an imported module. A "
            f"checkpoint never imports modules: import {module} before loading it")
    return cls


def _decode_dataclass(module: str, qualname: str, fields: dict[str, Any], key: str) -> Any:
    """A dataclass instance with ``fields`` set, built without running ``__init__``/``__post_init__``."""
    cls = _resolve_class(module, qualname, key)
    if not dataclasses.is_dataclass(cls) or set(fields) - {f.name for f in dataclasses.fields(cls)}:
        raise UnsafeCheckpointError(f"checkpoint key {key!r}: {module}.{qualname} is not the dataclass it was "
                                    f"saved as (fields {sorted(fields)})")
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)  # frozen dataclasses too, as pickle does
    return obj


def _decode_namedtuple(module: str, qualname: str, values: list, key: str) -> Any:
    cls = _resolve_class(module, qualname, key)
    if not (issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)
            and len(cls._fields) == len(values)):
        raise UnsafeCheckpointError(f"checkpoint key {key!r}: {module}.{qualname} is not the namedtuple it was "
                                    f"saved as ({len(values)} fields)")
    return tuple.__new__(cls, values)  # no generated __new__ runs


def _decode_omegaconf(kind: str, content: Any, flags: list[str], key: str) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError as exc:
        raise UnsafeCheckpointError(f"checkpoint key {key!r} holds an OmegaConf {kind}: install omegaconf to load "
                                    "this checkpoint") from exc
    expected = {"DictConfig": (DictConfig, dict), "ListConfig": (ListConfig, list)}.get(kind)
    if expected is None or not isinstance(content, expected[1]):
        raise CheckpointCorruptError(f"checkpoint key {key!r}: malformed OmegaConf {kind!r} value")
    cfg = OmegaConf.create(content)
    if "struct" in flags:
        OmegaConf.set_struct(cfg, True)
    if "readonly" in flags:
        OmegaConf.set_readonly(cfg, True)
    return cfg


def decode_values(checkpoint: dict[str, Any], *, allow_pickle: bool) -> dict[str, Any]:
    """Undo :func:`encode_values` in place; pickled values only with ``allow_pickle``.

    Raises:
        UnsafeCheckpointError: pickled values and ``allow_pickle`` is False (the message lists their keys); a
            class a value refers to is not found in the imported modules; a ``hparams_type`` that is not a
            mapping class (Lightning calls it with the hyper-parameters).
        CheckpointCorruptError: a malformed marker.
    """
    refused: list[str] = []

    def dec(obj: Any, path: str) -> Any:
        if isinstance(obj, (list, tuple)):
            return type(obj)(dec(v, f"{path}.{i}") for i, v in enumerate(obj))
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1:
            (tag, payload), = obj.items()
            if tag == PATH:
                kind, text = payload
                return getattr(pathlib, kind if kind in _PATH_KINDS else "Path")(text)
            if tag == ENUM:
                return _decode_enum(*payload)
            if tag == DTYPE:
                dtype = getattr(torch, payload, None) if isinstance(payload, str) else None
                if not isinstance(dtype, torch.dtype):
                    raise CheckpointCorruptError(f"checkpoint key {path!r}: unknown torch dtype {payload!r}")
                return dtype
            if tag == DEVICE:
                return torch.device(payload)
            if tag == CLASS:
                return _resolve_class(*payload, path)
            if tag == DATACLASS:
                return _decode_dataclass(payload[0], payload[1], dec(payload[2], path), path)
            if tag == NAMEDTUPLE:
                return _decode_namedtuple(payload[0], payload[1], dec(payload[2], path), path)
            if tag == OMEGACONF:
                return _decode_omegaconf(payload[0], dec(payload[1], path), payload[2], path)
            if tag == MAPPING:
                items = [(dec(k, path), dec(v, f"{path}.{k}")) for k, v in payload]
                if any(isinstance(k, dict) for k, _ in items):  # a key stored pickled, refused: raised below
                    return obj
                return dict(items)
            if tag == PICKLED:
                if allow_pickle:
                    return pickle.loads(payload)
                refused.append(path)
                return obj
        for k, v in obj.items():
            obj[k] = dec(v, f"{path}.{k}" if path else str(k))
        return obj

    try:
        out = dec(checkpoint, "")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, (UnsafeCheckpointError, CheckpointCorruptError)):
            raise
        raise CheckpointCorruptError(f"malformed value marker in the checkpoint ({exc})") from exc
    if refused:
        raise UnsafeCheckpointError(
            f"checkpoint values {refused[:10]}{' ...' if len(refused) > 10 else ''} were stored pickled "
            "(unsafe_values='pickle'). Loading them runs code from the checkpoint: pass weights_only=False "
            "(e.g. trainer.fit(..., weights_only=False)) only if you trust it.")
    for key in _HPARAMS_TYPE_KEYS:
        _check_hparams_type(out.get(key), key)
    return out


def _check_hparams_type(cls: Any, key: str) -> None:
    """Lightning calls ``checkpoint[key](hyper_parameters)``: only a mapping class (or none, or a name) may be there."""
    if cls is None or isinstance(cls, str):
        return
    omegaconf = sys.modules.get("omegaconf")
    if isinstance(cls, type) and (issubclass(cls, Mapping) or (omegaconf is not None
                                                               and issubclass(cls, omegaconf.Container))):
        return
    raise UnsafeCheckpointError(f"checkpoint key {key!r} holds {cls!r}, which Lightning would call with the "
                                "hyper-parameters; only mapping classes (dict, AttributeDict, DictConfig) are loaded")
