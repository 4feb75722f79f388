"""Checkpoints at fsspec URLs (``ModelCheckpoint(dirpath="s3://...")``, ``memory://``) through the core's durable tier.

A checkpoint for a URL is first committed locally, in a staging directory of the plugin, then uploaded by
:class:`torch_ckpt.tiers._durable.DurableTier` exactly as a durable copy is: every file uploaded and verified (size and
CRC-32, or the store's own MD5), ``manifest.json`` written last, so the URL never shows a partial checkpoint.
Deleting removes the manifest first. Saving again to a URL that holds a checkpoint un-commits the old one
first (object stores have no atomic rename): until the new manifest is written that URL holds none.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch_ckpt import ConfigError, DurableTier, read_manifest

__all__ = ["RemoteCheckpoints", "check_options", "is_url"]

_MANIFEST = "manifest.json"  # a committed checkpoint's manifest (written last on a store)


def is_url(text: str) -> bool:
    """True for an fsspec URL (``s3://``, ``memory://``, ``http://``...); ``file://`` is a local path."""
    return "://" in text and not text.startswith("file://")


class _OneName:
    """The :class:`~torch_ckpt.policy._naming.Naming` of one checkpoint: ``name`` whatever the step."""

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self, step: int) -> str:
        return self._name

    def step_of(self, name: str) -> int | None:
        return 0 if name == self._name else None


def _split(url: str) -> tuple[str, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/") or parent.endswith(":"):
        raise ConfigError(f"checkpoint URL {url!r} names no checkpoint inside a bucket or folder")
    return parent, name


def check_options(storage_options: Any) -> dict[str, Any] | None:
    """``storage_options`` for fsspec (None or a dict).

    Raises:
        ConfigError: anything else.
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options for a checkpoint URL must be a dict of fsspec options, got "
                          f"{type(storage_options).__name__}")
    return storage_options


class RemoteCheckpoints:
    """Uploads, downloads and deletes checkpoints at fsspec URLs, staged in local directories."""

    def __init__(self) -> None:
        self._staged: set[Path] = set()

    def local_path(self, url: str) -> Path:
        """Where the checkpoint for ``url`` is committed locally before its upload: a directory of the system's
        temporary directory named after the URL's parent, the same on every rank of a node (the manager commits
        collectively)."""
        parent, name = _split(url)
        digest = hashlib.sha1(parent.encode(), usedforsecurity=False).hexdigest()[:16]
        staging = Path(tempfile.gettempdir()) / f"lightning_ckpt_upload_{os.getuid()}_{digest}"
        self._staged.add(staging)
        return staging / name

    def _tier(self, url: str, storage_options: Any) -> tuple[DurableTier, str]:
        parent, name = _split(url)
        return DurableTier(parent, storage_options=check_options(storage_options), naming=_OneName(name)), name

    def upload(self, local: Path, url: str, storage_options: Any = None) -> None:
        """Upload the committed ``local`` checkpoint to ``url`` (verified; manifest last), then delete ``local``.

        Raises:
            CheckpointCorruptError: an uploaded object does not match the manifest.
            DurableUnavailableError, OSError: the store failed (``local`` is kept).
        """
        tier, _ = self._tier(url, storage_options)
        manifest = read_manifest(local)
        if tier.fs.exists(f"{tier.root}/{_split(url)[1]}"):
            tier.delete(0)  # the old checkpoint at this URL: manifest first, then its files
        tier.upload(local, manifest)
        shutil.rmtree(local, ignore_errors=True)

    def is_checkpoint(self, url: str, storage_options: Any = None) -> bool:
        """True when ``url`` holds a committed checkpoint (its ``manifest.json``)."""
        tier, name = self._tier(url, storage_options)
        tier.refresh()
        return bool(tier.fs.exists(f"{tier.root}/{name}/{_MANIFEST}"))

    def download(self, url: str, storage_options: Any = None) -> Path:
        """Fetch the checkpoint at ``url`` into a new local directory (verified); the caller deletes it."""
        tier, _ = self._tier(url, storage_options)
        return tier.download(0, Path(tempfile.mkdtemp(prefix="lightning_ckpt_download_")))

    def remove(self, url: str, storage_options: Any = None) -> None:
        """Delete the checkpoint (manifest first) or file at ``url``; nothing there is a no-op."""
        tier, name = self._tier(url, storage_options)
        path = f"{tier.root}/{name}"
        if tier.fs.isdir(path):
            tier.delete(0)
        elif tier.fs.exists(path):
            tier.fs.rm_file(path)

    def close(self) -> None:
        """Remove the staging directories (rank 0, once every upload is done)."""
        for staging in self._staged:
            shutil.rmtree(staging, ignore_errors=True)
        self._staged.clear()
