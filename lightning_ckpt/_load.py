"""Lightning's checkpoint dict to and from the core: typed values, local directories, fsspec URLs."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from torch_ckpt import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    DurableTier,
    TrainState,
    TypedValues,
    UnsafeCheckpointError,
    is_committed,
    load_full_state,
    rank_and_world,
    read_manifest,
)

log = logging.getLogger(__name__)

#: Top-level keys stored once per rank: loop progress (dataloader position) and callback states (RNG).
RANK_LOCAL_KEYS = ("loops", "callbacks")
_IMPORTABLE = ("omegaconf", "lightning", "pytorch_lightning", "lightning_fabric")
_warned_pickled: set[tuple[str, ...]] = set()


def _values(mode: str) -> TypedValues:  # the markers of every lightning_ckpt version
    return TypedValues(mode, prefix="__lightning_ckpt_", importable=_IMPORTABLE)


def encode_values(checkpoint: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """A copy of ``checkpoint`` the core stores (:class:`torch_ckpt.TypedValues`; ``mode``: ``"pickle"``/``"error"``);
    raises ConfigError naming the key of a value refused or failing to pickle."""
    pickled: list[str] = []
    try:
        out = _values(mode).encode(dict(checkpoint), "", pickled)
    except ConfigError as exc:
        raise ConfigError(f"{exc}. For hyper-parameters: save_hyperparameters(ignore=[...]); "
                          "AsyncDCPCheckpointIO(unsafe_values='pickle') (the default) stores picklable ones") from None
    if pickled and tuple(pickled) not in _warned_pickled:
        _warned_pickled.add(tuple(pickled))
        log.warning("checkpoint values %s have no pickle-free encoding and are stored pickled; loading them needs "
                    "weights_only=False (AsyncDCPCheckpointIO(unsafe_values='error') refuses them instead)",
                    pickled[:10])
    return out


def decode_values(checkpoint: dict[str, Any], *, allow_pickle: bool) -> dict[str, Any]:
    """Undo :func:`encode_values` in place (pickled values only with ``allow_pickle``; ``hparams_type``: only a
    mapping class, Lightning calls it), else UnsafeCheckpointError."""
    out = _values("pickle").decode(checkpoint, allow_pickle=allow_pickle)
    omegaconf = sys.modules.get("omegaconf")
    for key in ("hparams_type", "datamodule_hparams_type"):
        cls = out.get(key)
        if not (cls is None or isinstance(cls, str) or isinstance(cls, type) and (issubclass(cls, Mapping) or (
                omegaconf is not None and issubclass(cls, omegaconf.Container)))):
            raise UnsafeCheckpointError(f"checkpoint key {key!r} holds {cls!r}, which Lightning would call with the "
                                        "hyper-parameters; only mapping classes (dict, AttributeDict, DictConfig) "
                                        "are loaded")
    return out


def is_url(text: str) -> bool:
    """True for an fsspec URL (``s3://``, ``memory://``, ``http://``...); ``file://`` is a local path."""
    return "://" in text and not text.startswith("file://")


class _OneName:
    """The naming (:class:`torch_ckpt.StepNaming`'s interface) of one checkpoint: ``name`` whatever the step."""

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self, step: int) -> str:
        return self._name

    def step_of(self, name: str) -> int | None:
        return 0 if name == self._name else None


class RemoteCheckpoints:
    """Uploads, downloads and deletes checkpoints at fsspec URLs, staged in local directories."""

    def __init__(self) -> None:
        self._staged: set[Path] = set()  # removed at close() by rank 0 (the uploader)
        self._keep = False  # an upload failed: its staged copy is the only one, never removed

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        parent, _, name = url.rstrip("/").rpartition("/")
        if not name or parent.endswith(":/") or parent.endswith(":"):
            raise ConfigError(f"checkpoint URL {url!r} names no checkpoint inside a bucket or folder")
        return parent, name

    def _tier(self, url: str, storage_options: Any = None) -> tuple[DurableTier, str]:
        parent, name = self._split(url)
        return DurableTier(parent, storage_options=storage_options, naming=_OneName(name)), name

    def local_path(self, url: str) -> Path:
        """Where ``url``'s checkpoint is committed before its upload (the same on every rank of a node)."""
        parent, name = self._split(url)
        digest = hashlib.sha1(parent.encode(), usedforsecurity=False).hexdigest()[:16]
        staging = Path(tempfile.gettempdir()) / f"lightning_ckpt_upload_{os.getuid()}_{digest}"
        self._staged.add(staging)
        return staging / name

    def upload(self, local: Path, url: str, storage_options: Any = None) -> None:
        """Upload the committed ``local`` checkpoint to ``url``, then delete ``local``.

        Raises:
            CheckpointWriteError: the upload failed; ``local`` is kept, even at :meth:`close`.
        """
        try:
            tier, name = self._tier(url, storage_options)
            manifest = read_manifest(local)
            if tier.fs.exists(f"{tier.root}/{name}"):
                tier.delete(0)  # the old checkpoint at this URL: manifest first, then its files
            tier.upload(local, manifest)
        except Exception as exc:  # noqa: BLE001 - any backend error (botocore, aiohttp...) fails the save
            self._keep = True
            raise CheckpointWriteError(getattr(exc, "errno", None), f"checkpoint {url} was committed locally at "
                                       f"{local} but its upload failed ({type(exc).__name__}: {exc}); older "
                                       "checkpoints are kept") from exc
        shutil.rmtree(local, ignore_errors=True)

    def is_checkpoint(self, url: str, storage_options: Any = None) -> bool:
        tier, name = self._tier(url, storage_options)
        tier.refresh()
        return bool(tier.fs.exists(f"{tier.root}/{name}/manifest.json"))

    def download(self, url: str, storage_options: Any = None) -> Path:
        """Fetch the checkpoint at ``url`` into a new local directory (verified); the caller deletes its parent."""
        return self._tier(url, storage_options)[0].download(0, Path(tempfile.mkdtemp(prefix="lightning_ckpt_dl_")))

    def remove(self, url: str, storage_options: Any = None) -> None:
        """Delete the checkpoint (manifest first) or file at ``url``; nothing there is a no-op."""
        tier, name = self._tier(url, storage_options)
        if tier.fs.isdir(path := f"{tier.root}/{name}"):
            tier.delete(0)
        elif tier.fs.exists(path):
            tier.fs.rm_file(path)

    def close(self) -> None:  # once every upload is done
        for staging in () if self._keep or rank_and_world()[0] != 0 else self._staged:
            shutil.rmtree(staging, ignore_errors=True)
        self._staged.clear()


class _AllValues:
    """A load target reading every value into new tensors (checked against ``live``)."""

    loaded: dict[str, Any]

    def __init__(self, rank_local: tuple[str, ...], live: dict[str, Any] | None, strict: bool) -> None:
        self.rank_local_keys, self.loaded, self._live, self._strict = rank_local, {}, live or {}, strict

    def state_dict(self) -> dict[str, Any]:
        return self._live

    def load_optional_key(self, key: str) -> bool:
        return not (self._strict and self._live and key.split(".", 1)[0] == "state_dict")

    def load_target(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def check_load(self, state: Any, *, allow_cast: bool = False) -> list[str]:
        return []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


def load_checkpoint_dir(candidates: Sequence[Path | str], *, allow_pickle: bool, manager: Any = None,
                        verify: bool = True, map_location: Any = None, live: dict[str, Any] | None = None,
                        strict: bool = True, allow_cast: bool = False, storage_options: Any = None) -> dict[str, Any]:
    """The first intact checkpoint of ``candidates`` (newest first; one URL: downloaded) as Lightning's dict; with
    ``manager`` (attached, every rank) checked against ``live``, each rank its own loop and callback states.
    Raises as ``CheckpointManager.restore``; TypeError: ``map_location`` names no device."""
    if len(candidates) == 1 and is_url(str(candidates[0])):
        local = RemoteCheckpoints().download(str(candidates[0]), storage_options)
        try:
            return load_checkpoint_dir([local], verify=verify, allow_pickle=allow_pickle, map_location=map_location)
        finally:
            shutil.rmtree(local.parent, ignore_errors=True)
    if skipped := [str(p) for p in candidates[:-1] if not is_committed(p)]:
        log.warning("checkpoints %s are not intact; falling back to older ones", skipped)
    candidates = [p for p in candidates[:-1] if is_committed(p)] + [Path(candidates[-1])]
    if not is_committed(candidates[0]) and not (Path(candidates[0]) / "manifest.json").is_file():
        raise CheckpointNotFoundError(f"{candidates[0]} is a directory but not a committed torch-ckpt checkpoint (no "
                                      "manifest.json); was it written by another CheckpointIO?")
    if manager is not None:
        saved, world = read_manifest(candidates[0]).world_size, rank_and_world()[1]
        if saved != world:
            rank_zero_warn(f"{candidates[0]} was saved by {saved} ranks and is loaded by {world}: every rank "
                           "restores rank 0's loop progress and callback states (RNG included)")
        target = _AllValues(RANK_LOCAL_KEYS if saved == world else (), live, strict)
        restore_candidates(manager, target, candidates, allow_cast=allow_cast)
        state = target.loaded
    else:  # one process reading alone (not attached: no fallback candidates); rank 0's rank-local values
        state, _ = load_full_state(candidates[0], verify=verify)
        state.pop("per_rank", None)
    state = decode_values(state, allow_pickle=allow_pickle)
    device = _device(map_location, candidates[0])
    return state if device is None else move_data_to_device(state, device)


def restore_candidates(manager: Any, target: Any, candidates: Sequence[Path | str], *, allow_cast: bool) -> None:
    """``manager.restore`` of the first intact of ``candidates``; the first in ``memory_root``: the newest step of
    every tier as the core chooses it."""
    memory = manager.config.memory_root
    newest = memory is not None and Path(candidates[0]).parent == Path(memory).expanduser().absolute()
    manager.restore(target, allow_cast=allow_cast, **({} if newest else {"path": list(candidates)}))


def _device(map_location: Any, path: Any) -> torch.device | None:
    """Where ``torch.load``'s ``map_location`` (device, string, dict or callable) puts CPU tensors; None: CPU."""
    if callable(map_location):
        mapped = map_location(torch.empty(0).untyped_storage(), "cpu")
        map_location = None if mapped is None else mapped.device
    elif isinstance(map_location, dict):
        map_location = map_location.get("cpu")
    if map_location is None:
        return None
    try:
        device = torch.device(map_location)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"map_location for {path} names no device: {map_location!r}") from exc
    return None if device.type == "cpu" else device


def is_remote_checkpoint(url: str) -> bool:
    """False also for an unknown protocol or an unreachable store (Lightning's loader then reports the error)."""
    try:
        return is_url(url) and RemoteCheckpoints().is_checkpoint(url)
    except Exception:  # noqa: BLE001 - not ours to report: Lightning's own loader tries the URL next
        return False


def load_from_checkpoint(cls: type[Any], checkpoint_path: str | Path, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for a torch-ckpt directory or URL or a ``.ckpt`` file
    (``kwargs``: Lightning's; ``weights_only=False`` allows pickled values). Installs the plugin's loader hooks.

    Raises:
        CheckpointNotFoundError: ``checkpoint_path`` does not exist.
        CheckpointCorruptError: a file fails verification.
        UnsafeCheckpointError: pickled values and ``weights_only`` is not False.
    """
    from lightning_ckpt._compat import install_hooks

    if not is_url(str(checkpoint_path)) and not Path(checkpoint_path).exists():
        raise CheckpointNotFoundError(f"{checkpoint_path} does not exist")
    install_hooks()
    return cls.load_from_checkpoint(checkpoint_path, **kwargs)


class _ShardedTarget:
    """The live sharded model and optimizers (one ``TrainState`` each) as the core's load target."""

    rank_local_keys: tuple[str, ...] = ()  # loops and callbacks of rank 0 (the same on every rank here)

    def __init__(self, model: Any, optimizers: list) -> None:
        self._states = [TrainState(model=model, optimizer=[o], rng=False) for o in optimizers]
        self.loaded: dict[str, Any] = {}

    def _route(self, key: str) -> tuple[TrainState, str] | None:
        if key.startswith("optimizer_states."):
            index, _, rest = key.removeprefix("optimizer_states.").partition(".")
            return self._states[int(index)], f"optimizer.{rest}"
        return None

    def state_dict(self) -> dict[str, Any]:
        sections = [s.state_dict() for s in self._states]
        return {"state_dict": sections[0]["model"], "optimizer_states": [s["optimizer"] for s in sections]}

    def load_optional_key(self, key: str) -> bool:
        route = self._route(key)
        return route[0].load_optional_key(route[1]) if route else not key.startswith("state_dict.")

    def load_target(self, key: str, shape: tuple[int, ...], dtype: Any) -> Any:
        route = self._route(key)
        if route is not None:
            return route[0].load_target(route[1], shape, dtype)
        return None if key.startswith("state_dict.") else torch.empty(shape, dtype=dtype)

    def _sections(self, state: dict[str, Any], i: int) -> dict[str, Any]:
        saved = state.get("optimizer_states")
        if not isinstance(saved, list) or len(saved) != len(self._states):
            raise ConfigError(f"checkpoint holds {len(saved) if isinstance(saved, list) else 'no'} optimizer states, "
                              f"this run has {len(self._states)} optimizers")
        return {"model": state["state_dict"], "optimizer": saved[i]}

    def check_load(self, state: dict[str, Any], *, allow_cast: bool = False) -> list[str]:
        """Check every optimizer's groups, state and dtypes; change nothing."""
        return [c for i, s in enumerate(self._states) for c in s.check_load(self._sections(state, i),
                                                                              allow_cast=allow_cast)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install every optimizer's state and the (checked, fully read) parameters, in place."""
        for i, s in enumerate(self._states):
            s.load_state_dict(self._sections(state, i))
        self.loaded = dict(state)
