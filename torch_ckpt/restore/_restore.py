"""The restore engine: load one committed checkpoint directory into a live state, complete or not at all.

:func:`load_into` verifies the files, plans against the live state (:func:`plan_restore`), reads
every tensor into new buffers (:func:`load_direct` in a single process, else DCP's reader), and
only then writes the live state (:func:`swap_in`), with a Ctrl-C held until that write is done:
a restore that fails before the write leaves the live state as it was, and the write runs to its end.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import ctypes
import dataclasses
import errno
import gc
import os
import queue
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.utils import swap_tensors

from torch_ckpt import errors as errors_module
from torch_ckpt._logging import get_logger
from torch_ckpt.config import RANK_LOCAL_POLICIES
from torch_ckpt.distributed._context import DistContext
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReadError,
    ConfigError,
    StateMismatchError,
)
from torch_ckpt.format._dcp_write import record_framing
from torch_ckpt.format._files import (
    ODICT_TAG,
    TENSOR_TAG,
    Manifest,
    check_records,
    is_per_rank_key,
    join_state,
    load_tensors,
    logical_key,
    open_listed,
    read_metadata,
    read_rank_doc,
    split_state,
    tensor_items,
    tensor_keys,
    verify_files,
)
from torch_ckpt.storage._crc import crc32

__all__ = ["load_into", "copy_into_live", "copy_tensors", "swap_in", "restore_buffers", "owners_in",
           "collector_paused", "InterruptHold", "RANK_LOCAL_POLICIES"]

log = get_logger(__name__)

DATA_SUFFIX = ".distcp"
_Targets = dict[str, torch.Tensor]
_OPAQUE = ("extras", "rng", "dataloader")  # replaced as a whole on load: their structure is not compared


# -- guards: the collector and Ctrl-C --------------------------------------------------------------
@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector: a restore allocates many small objects and frees almost none."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class InterruptHold:
    """Holds a Ctrl-C from :meth:`start` to :meth:`release`, then raises it; a second one is raised at once.

    Only on the main thread while ``SIGINT`` has Python's default handler (a framework's is left alone)."""

    def __init__(self) -> None:
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self.held = False

    def _handler(self, signum: int, frame: object) -> None:
        if self.held:  # a second Ctrl-C: the user insists (e.g. a component's load_state_dict hangs)
            raise KeyboardInterrupt
        self.held = True

    def start(self) -> None:
        """From now on a Ctrl-C is recorded instead of raised."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handler)

    def release(self) -> None:
        """Put the default handler back; raise ``KeyboardInterrupt`` if a Ctrl-C came meanwhile."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self.held:
            self.held = False
            raise KeyboardInterrupt


# -- planning: checks against the live state, new buffers -------------------------------------------
def _is_tagged(node: Any) -> bool:
    """A codec node (tensor placeholder, tuple, numpy value...), not a user dict."""
    return isinstance(node, dict) and len(node) == 1 and next(iter(node)).startswith("__")


def _mapping(node: Any) -> Any:
    """The items of an encoded OrderedDict (compared as a dict's, as in checkpoints written before its tag)."""
    while isinstance(node, dict) and len(node) == 1 and ODICT_TAG in node:
        node = node[ODICT_TAG]
    return node


def _structure_keys(tree: Any, *, deep: bool) -> set[str]:
    """Dotted paths of the non-tensor structure (top-level keys only unless ``deep``); tensors are
    compared on their own, and subtrees replaced as a whole on load are not descended into."""
    keys: set[str] = set()
    tree = _mapping(tree)
    if not isinstance(tree, dict) or _is_tagged(tree):
        return keys
    stack = [(tree, "", 0)]
    while stack:
        node, prefix, depth = stack.pop()
        for k, v in node.items():
            v = _mapping(v)
            if isinstance(v, dict) and len(v) == 1 and TENSOR_TAG in v:
                continue
            path = f"{prefix}{k}"
            if deep and isinstance(v, dict) and not _is_tagged(v) and not (depth == 0 and k in _OPAQUE):
                stack.append((v, f"{path}.", depth + 1))
            else:
                keys.add(path)
    return keys


def staging_like(live: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor (DTensor: local shard, same sharding) to load a checkpoint tensor into."""
    if isinstance(live, DTensor):
        local = torch.empty(live._local_tensor.shape, dtype=dtype, device="cpu")
        spec = live._spec
        if spec.tensor_meta is not None and spec.tensor_meta.dtype != dtype:
            spec = copy.copy(spec)
            assert spec.tensor_meta is not None
            spec.tensor_meta = spec.tensor_meta._replace(dtype=dtype)
        return DTensor(local, spec, requires_grad=False)
    return torch.empty(live.shape, dtype=dtype, device="cpu")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` (a shard, for a DTensor) share memory, e.g. an expand() view."""
    t = local_tensor(t)
    if t.layout != torch.strided or t.numel() <= 1:
        return False
    return torch._debug_has_internal_overlap(t) == 1  # 0: no, 1: yes, 2: too hard to tell


def _listed(keys: list[str]) -> str:
    return f"{keys[:20]}{' ...' if len(keys) > 20 else ''}"


def plan_restore(state: Any, step_dir: Path, manifest: Manifest, md: Any, tree: Any, ctx: DistContext, *,
                 on_world_size_change: str, allow_cast: bool) -> tuple[_Targets, Any, _Targets, bool]:
    """Check ``state`` against the checkpoint and allocate the buffers to read into; writes nothing live.

    Returns ``(live tensors, tree, {key: new buffer}, whether the state copies the buffers itself)``;
    raises as :func:`load_into`.
    """
    same_world = manifest.world_size == ctx.world_size
    live_sd = state.state_dict() if hasattr(state, "state_dict") else state
    rank_local = tuple(getattr(state, "rank_local_keys", ()))
    live_tensors, live_tree = split_state(live_sd, rank_local_keys=rank_local)
    if not same_world and rank_local and on_world_size_change == "error":
        raise ConfigError(
            f"{step_dir} was saved with world size {manifest.world_size}, this run has {ctx.world_size}: the "
            f"rank-local state {list(rank_local)} (RNG, dataloader position) cannot be mapped to the new ranks. "
            "Pass on_world_size_change='keep_live' to CheckpointManager to keep this run's own rank-local state.")
    if not same_world:
        for key in rank_local:
            if isinstance(live_tree, dict) and key in live_tree:
                tree[key] = live_tree[key]

    saved_tensor_keys = tensor_keys(tree)
    # a per-rank tensor of rank r > 0 is stored as __rank<r>__.<key>: the live tensor of <key> takes that name
    own = {logical_key(k): k for k in saved_tensor_keys if is_per_rank_key(k)}
    if own:
        live_tensors = {own.get(k, k): t for k, t in live_tensors.items()}
    optional = getattr(state, "load_optional_key", None)
    deep = not hasattr(state, "state_dict")
    saved_keys = saved_tensor_keys | _structure_keys(tree, deep=deep)
    live_keys = set(live_tensors) | _structure_keys(live_tree, deep=deep)
    missing = sorted(k for k in live_keys - saved_keys if not (callable(optional) and optional(logical_key(k))))
    unexpected = sorted(k for k in saved_keys - live_keys if not (callable(optional) and optional(logical_key(k))))
    if missing or unexpected:
        raise StateMismatchError(
            f"{step_dir}: state does not match the checkpoint. Missing from checkpoint: {_listed(missing)}; "
            f"unexpected in checkpoint: {_listed(unexpected)}. Build the same model/optimizer as the saved run.",
            missing=missing, unexpected=unexpected)
    saved_meta: dict[str, torch.Tensor] = {}
    for key in sorted(saved_tensor_keys):
        smd = md.state_dict_metadata.get(key)
        if smd is None or not isinstance(getattr(getattr(smd, "properties", None), "dtype", None), torch.dtype):
            raise CheckpointCorruptError(f"{step_dir}: tensor {key!r} is listed in the state but not in DCP metadata")
        saved_meta[key] = torch.empty(tuple(smd.size), dtype=smd.properties.dtype, device="meta")
    bad_dtype: list[str]
    casts: list[str]
    bad_shape, bad_dtype, casts, inference = [], [], [], []
    for key, t in live_tensors.items():
        meta = saved_meta.get(key)
        if meta is None:
            continue
        if tuple(meta.shape) != tuple(t.shape):
            bad_shape.append(f"{key}: checkpoint {tuple(meta.shape)} vs live {tuple(t.shape)}")
        elif meta.dtype != t.dtype:
            (casts if allow_cast else bad_dtype).append(f"{key}: checkpoint {meta.dtype}, live {t.dtype}")
        if local_tensor(t).is_inference():
            inference.append(key)
    if bad_shape:
        raise StateMismatchError(f"{step_dir}: tensor shapes differ: {bad_shape[:20]}. Build the model and optimizer "
                                 "with the saved run's sizes (`torch-ckpt inspect` lists the saved shapes), or start "
                                 "the changed model in a new root", missing=[], unexpected=[])
    if inference:  # they cannot be written in place: refuse before the first write
        raise StateMismatchError(
            f"{step_dir}: live tensors created under torch.inference_mode() cannot be restored in place: "
            f"{_listed(sorted(inference))}. Build the model/optimizer outside inference_mode (torch.no_grad() is "
            "fine), restore, then enter inference_mode.", missing=[], unexpected=[])
    if bad_dtype:
        raise StateMismatchError(
            f"{step_dir}: tensor dtypes differ (restore never casts silently): {_listed(bad_dtype)}. Build the "
            "state with the saved dtypes, or pass allow_cast=True to cast them.", missing=[], unexpected=[])
    check = getattr(state, "check_load", None)
    staged_aware = callable(check)
    if staged_aware or not hasattr(state, "load_state_dict"):  # the restore itself writes the live tensors
        overlapping = sorted(k for k, t in live_tensors.items() if k in saved_meta and _overlaps_itself(t))
        if overlapping:  # copying into them fails half way through the write: refuse before the first write
            raise StateMismatchError(
                f"{step_dir}: live tensors whose elements share memory (e.g. expand() views) cannot receive "
                f"the saved values: {_listed(overlapping)}. Put a tensor with its own memory (e.g. .clone()) in "
                "the state.", missing=[], unexpected=[])
    if staged_aware:
        assert check is not None
        casts += check(join_state(tree, saved_meta), allow_cast=allow_cast)

    make_target = getattr(state, "load_target", None)
    targets: _Targets = {}
    for key, meta in saved_meta.items():
        target = make_target(logical_key(key), tuple(meta.shape), meta.dtype) if callable(make_target) else None
        if target is None:
            if key not in live_tensors:  # an optional key the state cannot place: not loadable here
                raise StateMismatchError(f"{step_dir}: unexpected in checkpoint: [{key!r}]", unexpected=[key])
            target = staging_like(live_tensors[key], meta.dtype)
        targets[key] = target
    logged: set[str] = set()
    for line in casts:  # a key may be reported by the tensor check and by the state's own check: log it once
        key = line.split(":", 1)[0]
        if key not in logged:
            logged.add(key)
            log.warning("%s: casting %s (allow_cast=True)", step_dir, line)
    return live_tensors, tree, targets, staged_aware


# -- writing the live tensors: exchanged or copied --------------------------------------------------
#: threads for :func:`copy_tensors` (memory bandwidth is shared: a few are enough)
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_PIECE_BYTES = 32 << 20  # largest piece of one copy handed to a thread, so a single large tensor is split too
_THREADED_BYTES = 16 << 20  # below this many bytes in all, one thread copies
_SMALL_BYTES = 64 << 10  # plain pairs under this size are copied together by one torch._foreach_copy_
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: ids of the new buffers the restore in progress owns (only those may be swapped into live tensors)
_OWNED: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("torch_ckpt_restore_buffers",
                                                                        default=frozenset())


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when ``dst.copy_(src)`` is exactly a byte copy of ``src``'s memory into ``dst``'s."""
    if type(dst) not in _PLAIN or type(src) not in _PLAIN:
        return False
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape:
        return False
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.layout != torch.strided or src.layout != torch.strided:
        return False
    if dst.is_quantized or src.is_quantized or dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg():
        return False
    nbytes = dst.numel() * dst.element_size()
    a, b = dst.data_ptr(), src.data_ptr()
    return nbytes > 0 and (a + nbytes <= b or b + nbytes <= a)


def _move(pieces: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)  # a foreign call: the GIL is released while it copies


@torch.no_grad()
def copy_tensors(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair; :func:`_plain` ones as ``memmove`` pieces over :data:`COPY_THREADS`
    threads (torch's intra-op threads stall on busy cores), those under 64 KiB by one ``_foreach_copy_``."""
    fast: list[torch.Tensor] = []
    pieces: list[tuple[int, int, int]] = []
    small_dst: list[torch.Tensor] = []
    small_src: list[torch.Tensor] = []
    for dst, src in pairs:
        if not _plain(dst, src):
            dst.copy_(src)
        elif dst.numel() * dst.element_size() < _SMALL_BYTES:
            small_dst.append(dst)
            small_src.append(src)
        else:
            fast += (dst, src)  # kept alive until every piece is copied
            a, b, n = dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()
            pieces.extend((a + i, b + i, min(_PIECE_BYTES, n - i)) for i in range(0, n, _PIECE_BYTES))
    if small_dst:
        torch._foreach_copy_(small_dst, small_src)  # below the intra-op grain size: no OpenMP region
    workers = 1 if sum(n for _, _, n in pieces) < _THREADED_BYTES else min(COPY_THREADS, len(pieces))
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(max(workers, 1))]
    loads = [0] * len(shares)
    for piece in sorted(pieces, key=lambda p: -p[2]):  # largest first, each to the least loaded thread
        i = loads.index(min(loads))
        shares[i].append(piece)
        loads[i] += piece[2]
    if len(shares) == 1:
        _move(shares[0])
    else:
        with ThreadPoolExecutor(len(shares), thread_name_prefix="torch_ckpt_copy") as pool:
            list(pool.map(_move, shares))  # raises the first error, once every share is done
    for dst in fast[::2]:
        torch.autograd.graph.increment_version(dst)  # as copy_: autograd refuses a backward through the old values


@contextlib.contextmanager
def restore_buffers(buffers: Iterable[torch.Tensor]) -> Iterator[None]:
    """Within this block, :func:`swap_in` may exchange live tensors with these new buffers (kept alive
    by the caller: ids are compared); any other tensor, e.g. another optimizer's values, is only copied from."""
    token = _OWNED.set(_OWNED.get() | {id(t) for t in buffers})
    try:
        yield
    finally:
        _OWNED.reset(token)


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``t``'s storage, ``t`` included."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the temporary storage object


def _swappable(live: torch.Tensor, new: torch.Tensor, aliases: int) -> bool:
    """True when exchanging ``live``'s and ``new``'s contents is indistinguishable from ``live.copy_(new)``:
    nothing else can see either storage. Host memory only: device memory may be known by address to a
    captured CUDA graph."""
    if type(new) is not torch.Tensor or type(live) not in _PLAIN or live is new or id(new) not in _OWNED.get():
        return False
    if new.requires_grad or new.grad is not None:
        return False
    if type(live) is torch.Tensor and (live.requires_grad or live.grad is not None):
        return False
    if live._backward_hooks or getattr(live, "_post_accumulate_grad_hooks", None):
        return False
    if (live.device != new.device or live.dtype != new.dtype or live.shape != new.shape
            or live.stride() != new.stride() or live.layout != torch.strided or new.layout != torch.strided):
        return False
    for t, others in ((live, aliases), (new, 0)):
        if (t._is_view() or t.is_inference() or t.is_quantized or t.is_conj() or t.is_neg()
                or not t.is_contiguous() or t.storage_offset() != 0 or t.device.type != "cpu"):
            return False
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():  # part of a larger buffer
            return False
        if t._use_count() != 1 or _storage_users(t) != 1 + others or weakref.getweakrefs(t):  # type: ignore[attr-defined]
            return False
    return True


def _swap(live: torch.Tensor, new: torch.Tensor) -> None:
    """Exchange the contents of a :func:`_swappable` pair; ``live`` keeps its ``__dict__``, gradient and class."""
    grad = live.grad
    other = torch.nn.Parameter(new, requires_grad=live.requires_grad) if type(live) is not type(new) else new
    kept, theirs = live.__dict__, other.__dict__
    swap_tensors(live, other)  # raises before changing anything when it finds other references
    live.__dict__, other.__dict__ = kept, theirs
    if grad is not None:
        live.grad = grad  # the gradient belongs to the parameter, not to its values


@torch.no_grad()
def swap_in(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], aliases: Mapping[int, int] | None = None) -> int:
    """Give each live tensor its new buffer's values; returns how many pairs were exchanged, not copied.

    A :func:`_swappable` pair (``new`` given once, ``live`` not seen before) is exchanged by :func:`_swap`
    (``live`` keeps its identity; ``new`` must not be used afterwards), any other goes to :func:`copy_tensors`.
    ``aliases``: ``id(live) -> n`` for a live tensor sharing its storage with ``n`` tensors the caller drops.
    """
    pairs = list(pairs)
    aliases = aliases or {}
    uses: dict[int, int] = {}
    for _, new in pairs:
        uses[id(new)] = uses.get(id(new), 0) + 1
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    swapped = 0
    for live, new in pairs:
        first = id(live) not in seen
        seen.add(id(live))
        if not (first and uses[id(new)] == 1 and _swappable(live, new, aliases.get(id(live), 0))):
            copies.append((live, new))
            continue
        try:
            _swap(live, new)
        except RuntimeError:  # refused before changing anything (references found): copy instead
            copies.append((live, new))
            continue
        torch.autograd.graph.increment_version(live)
        swapped += 1
    copy_tensors(copies)
    return swapped


def owners_in(module: torch.nn.Module, live: Mapping[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor],
                                                                                    dict[int, int]]:
    """``(id(entry) -> tensor, id(tensor) -> n)``: the parameter or buffer of ``module`` that each
    ``state_dict()`` entry of ``live`` is the whole of, and how many other entries alias it (for
    :func:`swap_in`'s ``aliases``). DTensors and other subclasses are left out (copied)."""
    by_ptr: dict[int, list[torch.Tensor]] = {}
    for _, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if type(t) in _PLAIN and t.numel():
            same = by_ptr.setdefault(t.data_ptr(), [])
            if all(x is not t for x in same):
                same.append(t)
    owner: dict[int, torch.Tensor] = {}
    entries: dict[int, dict[int, torch.Tensor]] = {}
    for dst in live.values():
        found = by_ptr.get(dst.data_ptr()) if type(dst) in _PLAIN and dst.numel() else None
        if found is None or len(found) != 1:
            continue
        o = found[0]
        if (o.device, o.dtype, o.shape, o.stride(), o.storage_offset()) == (
                dst.device, dst.dtype, dst.shape, dst.stride(), dst.storage_offset()):
            owner[id(dst)] = o
            if dst is not o:
                entries.setdefault(id(o), {})[id(dst)] = dst
    return owner, {k: len(v) for k, v in entries.items()}


@torch.no_grad()
def copy_into_live(live: Mapping[str, torch.Tensor], staged: Mapping[str, torch.Tensor],
                   module: torch.nn.Module | None = None) -> None:
    """Give each live tensor the staged tensor of its key: DTensor shards copied, plain tensors :func:`swap_in`
    (staged buffers unusable afterwards). With ``module``, ``live`` is its ``state_dict()`` (to be dropped)."""
    pairs = [(dst, staged[key]) for key, dst in live.items() if key in staged]
    owner, aliases = owners_in(module, live) if module is not None else ({}, {})
    copy_tensors([(local_tensor(d), local_tensor(s)) for d, s in pairs
                  if isinstance(d, DTensor) or isinstance(s, DTensor)])
    swap_in([(owner.get(id(d), d), s) for d, s in pairs if not (isinstance(d, DTensor) or isinstance(s, DTensor))],
            aliases)


# -- single-pass read of a single process's data files ----------------------------------------------
_CHUNK_BYTES = 8 << 20  # bytes per readinto call and per CRC-32 work item
_BUFFER_BYTES = 1 << 20  # read-ahead buffer for small pieces; larger pieces are read straight into place
_QUEUE_DEPTH = 8  # chunks read ahead of the CRC-32 thread (bounds the transient memory)
_READERS = 2  # data files read at the same time (DCP writes two per rank)


class Stopped(Exception):
    """A reader gave up because the caller was interrupted."""


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of the contiguous CPU tensor ``t`` (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                   (t.numel() * t.element_size(),))  # type: ignore[call-overload]
    return memoryview(flat.numpy())


def _placeable(key: str, target: Any, md: Metadata) -> bool:
    """True when ``target`` can receive checkpoint tensor ``key`` straight from its record."""
    if type(target) is not torch.Tensor or target.device.type != "cpu" or not target.is_contiguous():
        return False
    if target.is_quantized or target.is_conj() or target.is_neg() or target.numel() == 0:
        return False
    smd = md.state_dict_metadata.get(key)
    if not isinstance(smd, TensorStorageMetadata) or len(smd.chunks) != 1:
        return False
    chunk = smd.chunks[0]
    return (tuple(smd.size) == tuple(target.shape) and tuple(chunk.sizes) == tuple(target.shape)
            and not any(chunk.offsets) and smd.properties.dtype == target.dtype)


class _Crc:
    """CRC-32 and byte count of one file, computed by a helper thread over views queued in file order."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.crc = 0
        self.nbytes = 0
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._thread = threading.Thread(target=self._run, name="torch_ckpt_restore_crc", daemon=True)
        if enabled:
            try:
                self._thread.start()
            except BaseException:  # e.g. a Ctrl-C in start(): a thread that did start ends at once
                self._q.put(None)
                raise

    def _run(self) -> None:
        while (view := self._q.get()) is not None:
            try:
                self.crc = crc32(view, self.crc)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the reading thread in finish()
                self.error = exc

    def add(self, view: Any) -> None:
        self.nbytes += memoryview(view).nbytes
        if self.enabled:
            self._q.put(view)

    def finish(self) -> int:
        self.close()
        if self.error is not None:
            raise self.error
        return self.crc

    def close(self) -> None:
        if self.enabled and self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


class _FileReader:
    """Sequential reads of one open data file, every byte handed to a :class:`_Crc` once, in order. Small
    pieces come from a 1 MiB read-ahead buffer: many small records cost a few reads, not three calls each."""

    def __init__(self, fd: int, path: Path, crc: _Crc, stop: threading.Event) -> None:
        self._f = os.fdopen(fd, "rb", buffering=0)
        self._stop = stop
        self.path = path
        self.crc = crc
        self.pos = 0  # bytes consumed by the caller
        self._buf = memoryview(b"")
        self._off = 0

    def _truncated(self, at: int) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: ends at byte {at}, before the data DCP's metadata places "
                                      "there (truncated?)")

    def into(self, view: memoryview) -> None:
        """Fill ``view`` from the current position (raises on a file shorter than that)."""
        done, n = 0, view.nbytes
        while done < n:
            if self._stop.is_set():
                raise Stopped()
            avail = self._buf.nbytes - self._off
            if avail:
                k = min(avail, n - done)
                view[done:done + k] = self._buf[self._off:self._off + k]
                self._off += k
                done += k
            elif n - done >= _BUFFER_BYTES:
                k = min(_CHUNK_BYTES, n - done)
                part = view[done:done + k]
                got = 0
                while got < k:
                    r = self._f.readinto(part[got:])
                    if not r:
                        raise self._truncated(self.pos + done + got)
                    got += r
                self.crc.add(part)
                done += k
            else:  # a new buffer each time: the CRC-32 thread may still hold the last one
                buf = bytearray(_BUFFER_BYTES)
                got = self._f.readinto(buf)
                if not got:
                    raise self._truncated(self.pos + done)
                self._buf, self._off = memoryview(buf)[:got], 0
                self.crc.add(self._buf)
        self.pos += n

    def bytes(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        if self._buf.nbytes - self._off >= n:  # the common case: framing inside the read-ahead buffer
            out = self._buf[self._off:self._off + n].tobytes()
            self._off += n
            self.pos += n
            return out
        buf = bytearray(n)
        self.into(memoryview(buf))
        return bytes(buf)

    def skip(self, n: int) -> None:
        """Read (and checksum) the next ``n`` bytes without keeping them."""
        while n > 0:
            k = min(_CHUNK_BYTES, n)
            self.into(memoryview(bytearray(k)))
            n -= k

    def rest(self) -> None:
        """Read to the end of the file."""
        self.pos += self._buf.nbytes - self._off
        self._off = self._buf.nbytes
        while chunk := self._f.read(_CHUNK_BYTES):
            if self._stop.is_set():
                raise Stopped()
            self.crc.add(chunk)
            self.pos += len(chunk)


def _open_checked(step_dir: Path, name: str, manifest: Manifest, *, allow_symlinks: bool) -> int:
    """Open the listed data file ``name``, check its size against the manifest, hint sequential reads."""
    path = step_dir / name
    expected = manifest.files[name]["bytes"]
    fd = open_listed(step_dir, manifest, name, allow_symlinks=allow_symlinks)
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise CheckpointCorruptError(f"{path}: size {size} bytes, manifest says {expected} (truncated?)")
        if hasattr(os, "posix_fadvise"):
            try:  # (POSIX_FADV_WILLNEED on the data files was measured slower: benchmarks/README.md)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # only a hint (a security policy, an odd file system): the reads report any real error
    except OSError as exc:
        os.close(fd)
        raise CheckpointCorruptError(f"{path}: data file cannot be read ({exc.strerror or exc})") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_file(fd: int, path: Path, expected: dict[str, int], entries: list[tuple[int, int, str | None]],
               targets: _Targets, placeable: set[str], *, verify: bool, stop: threading.Event) -> set[str]:
    """Read one opened data file (see :func:`load_direct`) and close it; returns the keys placed from it."""
    placed: set[str] = set()
    crc = reader = None
    try:
        crc = _Crc(verify)
        reader = _FileReader(fd, path, crc, stop)
        for offset, length, key in entries:
            if key not in placeable or offset < reader.pos or offset + length > expected["bytes"]:
                continue  # bytes read (and checksummed) as part of the gaps
            target = targets[key]
            framing = record_framing(target)
            if framing is None:
                continue
            head, tail = framing
            nbytes = target.numel() * target.element_size()
            if len(head) + nbytes + len(tail) != length:
                continue
            reader.skip(offset - reader.pos)
            if reader.bytes(len(head)) != head:
                reader.skip(nbytes + len(tail))
                continue
            reader.into(_byte_view(target))
            if reader.bytes(len(tail)) == tail:
                placed.add(key)
        if verify:
            reader.rest()
        got = crc.finish()
        if verify and crc.nbytes != expected["bytes"]:
            raise CheckpointCorruptError(f"{path}: read {crc.nbytes} bytes, manifest says {expected['bytes']} "
                                         "(the file changed while it was read?)")
        if verify and got != expected["crc32"]:
            raise CheckpointCorruptError(f"{path}: CRC-32 {got:#010x} does not match the manifest "
                                         f"({expected['crc32']:#010x}); the file is corrupt")
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: data file cannot be read ({exc.strerror or exc})") from exc
    finally:
        if crc is not None:
            crc.close()
        if reader is not None:
            reader._f.close()
        else:
            os.close(fd)
    return placed


def load_direct(targets: _Targets, step_dir: str | os.PathLike, md: Metadata, manifest: Manifest, *,
                verify: bool, allow_symlinks: bool = False, share: tuple[int, int] = (0, 1)) -> set[str]:
    """Read the data files of a copy once each (two at a time, CRC-32 on a second thread), placing a tensor
    straight into its target when its record's framing is byte for byte ``torch.save``'s.

    ``share`` ``(part, parts)``: the ranks of one node read its copy side by side, each the files holding
    its own tensors; the CRC-32 of every ``parts``-th data file from ``part`` is this rank's to check (read
    whole), the others' are its mates' (a vote after the read tells every rank whether all passed).
    Sizes are checked before the first byte is placed, CRC-32s after (``CheckpointCorruptError`` naming
    the first failing file); an interrupt stops every reader. Returns the keys left for DCP's reader.
    """
    step_dir = Path(step_dir)
    held = manifest.local_files()
    by_file: dict[str, list[tuple[int, int, str | None]]] = {}
    seen: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if name not in held:
            continue  # DCP's reader refuses it with a clear error
        key = index.fqn if index.fqn in targets and not getattr(info, "transform_descriptors", None) else None
        by_file.setdefault(name, []).append((int(info.offset), int(info.length), key))
        if key is not None:
            seen[key] = seen.get(key, 0) + 1
    placeable = {k for k, n in seen.items() if n == 1 and _placeable(k, targets[k], md)}
    jobs = [(name, sorted(by_file.get(name, []))) for name in sorted(held) if name.endswith(DATA_SUFFIX)]
    checked = {name for i, (name, _) in enumerate(jobs) if verify and i % share[1] == share[0]}
    jobs = [(name, entries) for name, entries in jobs if name in checked or any(k in placeable for _, _, k in entries)]
    fds: list[int] = []
    try:  # every file's size is checked before the first byte is placed
        for name, _ in jobs:
            fds.append(_open_checked(step_dir, name, manifest, allow_symlinks=allow_symlinks))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    stop = threading.Event()
    todo = list(range(len(jobs)))
    results: list[Any] = [None] * len(jobs)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            if stop.is_set():
                os.close(fds[i])
                continue
            name, entries = jobs[i]
            try:
                results[i] = _read_file(fds[i], step_dir / name, manifest.files[name], entries, targets, placeable,
                                        verify=name in checked, stop=stop)
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                results[i] = exc
                if not isinstance(exc, Exception):  # an interrupt: the other reader stops too
                    stop.set()

    helper = threading.Thread(target=work, name="torch_ckpt_restore", daemon=True) \
        if len(jobs) > 1 and _READERS > 1 else None
    interrupted: BaseException | None = None
    try:
        if helper is not None:
            helper.start()
        work()
    except BaseException as exc:  # noqa: BLE001 - re-raised once no reader works any more
        interrupted = exc
        stop.set()
    while helper is not None and helper.is_alive():
        try:
            helper.join()
        except BaseException as exc:  # noqa: BLE001 - re-raised once the helper has stopped
            interrupted = interrupted or exc
            stop.set()
    with lock:
        for i in todo:  # never begun (the helper did not start, or the caller was interrupted)
            os.close(fds[i])
    if interrupted is not None:
        raise interrupted
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, Stopped)]
    if errors:
        raise errors[0]  # the first error, in file order
    return set(targets).difference(*results)


# -- the whole restore ------------------------------------------------------------------------------
def load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
              on_world_size_change: str = "error", allow_cast: bool = False,
              before_write: Callable[[], Any] | None = None) -> None:
    """Load ``step_dir`` into ``state`` (a ``Stateful`` or a mutable dict) in place, all or nothing.

    Files, keys, shapes, dtypes and (with ``check_load``, as :class:`~torch_ckpt.TrainState` has)
    every component's structure are checked, and the tensors read into new host buffers (about the
    size of this rank's state), before the first write to the live state.

    Optional methods of the state: ``load_optional_key(key) -> bool`` (a tensor either side may
    lack), ``load_target(key, shape, dtype) -> Tensor | None`` (a buffer placed where the tensor will
    live), ``check_load(saved, allow_cast=...)`` (structural checks, tensors as meta tensors) and
    ``load_session()`` (a context manager held from ``state_dict()`` to ``load_state_dict()``). A state
    with ``load_state_dict`` and no DTensors gets the new buffers and copies them itself, so one that
    refuses them changes nothing it did not change itself.

    Args:
        state: the live state.
        step_dir: the committed checkpoint directory.
        manifest: its manifest (as read once by the caller).
        ctx: ranks taking part.
        verify: check CRC-32 of every file (sizes are always checked).
        on_world_size_change: "error" or "keep_live" (rank-local state when the world size changed).
        allow_cast: cast tensors whose dtype differs from the live one (each key logged once).
        before_write: called on every rank once every rank has read and checked everything, before the first
            write to the live state (e.g. a collective that may still call the restore off by raising: the live
            state then stays unchanged).

    Raises:
        CheckpointCorruptError: files fail verification or the structure is inconsistent (a tensor
            record that disagrees with the metadata, a tree referring to a tensor it lacks).
        CheckpointReadError: a file could not be read (on this or another rank).
        StateMismatchError: tensor keys, shapes or dtypes differ (lists missing and unexpected keys).
        ConfigError: the world size changed and ``on_world_size_change`` is "error", or an unknown policy.
    """
    if on_world_size_change not in RANK_LOCAL_POLICIES:
        raise ConfigError(f"on_world_size_change must be one of {RANK_LOCAL_POLICIES}, got {on_world_size_change!r}")
    session = getattr(state, "load_session", None)  # e.g. TrainState: work shared by its hooks, once per restore
    with collector_paused(), (session() if callable(session) else contextlib.nullcontext()):
        _load_into(state, Path(step_dir), manifest, ctx, verify=verify, on_world_size_change=on_world_size_change,
                   allow_cast=allow_cast, before_write=before_write)


def _verified(step_dir: Path, manifest: Manifest, ctx: DistContext, *, direct: bool, verify: bool,
              same_world: bool) -> tuple[Any, Any]:
    """Verify this rank's share of the files and read the metadata and this rank's tree; ``(md, tree)``."""
    part, parts = (0, 1) if direct else (ctx.rank, ctx.world_size)
    if manifest.node is not None and same_world and not direct:  # one node's copy: checked by its ranks
        mates = [r for r, n in enumerate(manifest.nodes["rank_node"]) if n == manifest.node]
        part, parts = (mates.index(ctx.rank), len(mates)) if ctx.rank in mates else (0, 1)
    if direct:  # data files: sizes now, CRC-32 while load_direct reads them (one read per byte)
        verify_files(step_dir, manifest, checksums=False)
        small = {n: i for n, i in manifest.local_files().items() if not n.endswith(DATA_SUFFIX)}
        nodes = {**manifest.nodes, "held": sorted(small)} if "held" in manifest.nodes else manifest.nodes
        verify_files(step_dir, dataclasses.replace(manifest, files=small, nodes=nodes), checksums=verify)
    else:
        verify_files(step_dir, manifest, checksums=verify, part=part, parts=parts)
    md = read_metadata(step_dir, manifest)
    items = tensor_items(md)
    if not direct:  # direct: records are compared while load_direct reads them (no scattered header reads)
        check_records(step_dir, manifest, md, part=part, parts=parts)
    tree = read_rank_doc(step_dir, manifest, ctx.rank if same_world else 0, tensor_keys=items.__contains__)["tree"]
    return md, tree


def _vote(ctx: DistContext, step_dir: Path, error: BaseException | None, what: str, *, path: bool | None = None
          ) -> None:
    """Every rank learns whether any rank failed ``what``; a rank raises its own error, the others the
    failing rank's error class naming that rank (a ``StateMismatchError`` stays one), with ``failed_ranks``.
    ``path``: this rank's read path (one pass or collective); ranks that differ would wait in different
    collectives, so every rank raises ``CheckpointReadError`` instead (the restore moves on to another copy)."""
    votes = ctx.all_gather((None if error is None else (type(error).__name__, str(error)), path), what=what)
    if error is not None:
        raise error
    if len({p for _, p in votes}) > 1:
        raise CheckpointReadError(errno.EIO, f"{step_dir}: the ranks would read this copy in different ways "
                                  f"(one pass: ranks {[r for r, (_, p) in enumerate(votes) if p]}); not read here")
    failed = [(rank, vote) for rank, (vote, _) in enumerate(votes) if vote is not None]
    if not failed:
        return
    rank, (kind, text) = failed[0]
    relayed: CheckpointError
    if what == "verify":  # every rank raises the same class (no fallback on one rank only)
        relayed = CheckpointReadError(errno.EIO, f"{step_dir}: reading failed on another rank: {text}") \
            if kind == CheckpointReadError.__name__ else \
            CheckpointCorruptError(f"{step_dir}: verification failed on another rank: {text}")
    else:
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        message = f"{step_dir}: not restored: rank {rank}{others} cannot load this checkpoint: {kind}: {text}"
        cls = StateMismatchError if kind == "StateMismatchError" else \
            getattr(errors_module, kind, None) if kind in errors_module.__all__ else None
        relayed = (cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else CheckpointError)(message)
    relayed.failed_ranks = [r for r, _ in failed]  # type: ignore[attr-defined]  # (a rank's own error has none)
    raise relayed


def _one_pass(manifest: Manifest, ctx: DistContext) -> tuple[bool, tuple[int, int]]:
    """Whether this rank reads the copy in one pass (one process, or a node's copy read by the ranks of that
    node: each file read once, checksummed while placing), and its ``(part, parts)`` of the CRC-32 checks."""
    mates = [r for r, n in enumerate(manifest.nodes["rank_node"]) if n == manifest.node] \
        if manifest.node is not None and manifest.world_size == ctx.world_size and ctx.enabled else []
    return not ctx.enabled or ctx.rank in mates, (mates.index(ctx.rank), len(mates)) if ctx.rank in mates else (0, 1)


def _load_into(state: Any, step_dir: Path, manifest: Manifest, ctx: DistContext, *, verify: bool,
               on_world_size_change: str, allow_cast: bool, before_write: Callable[[], Any] | None) -> None:
    """The body of :func:`load_into` (same arguments and errors), run with the collector paused."""
    same_world = manifest.world_size == ctx.world_size
    direct, share = _one_pass(manifest, ctx)
    err: BaseException | None = None
    md = tree = None
    try:  # every rank's reads and checks are agreed on before any rank loads anything
        md, tree = _verified(step_dir, manifest, ctx, direct=direct, verify=verify, same_world=same_world)
    except CheckpointError as exc:
        err = exc
    except OSError as exc:  # e.g. EIO or EACCES on this rank: typed, and shared so no rank waits for the timeout
        err = CheckpointReadError(exc.errno, f"reading checkpoint {step_dir} failed on rank {ctx.rank}: "
                                             f"{exc.strerror or exc} ({exc.filename or step_dir})")
        err.__cause__ = exc
    _vote(ctx, step_dir, err, "verify", path=direct)
    assert md is not None  # _vote raised unless _verified returned on every rank
    try:
        live_tensors, tree, targets, staged_aware = plan_restore(
            state, step_dir, manifest, md, tree, ctx, on_world_size_change=on_world_size_change, allow_cast=allow_cast)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below, before any rank reads
        if direct and isinstance(exc, CheckpointError):  # records not checked up front: a record that
            check_records(step_dir, manifest, md, tensors=tensor_items(md))  # disagreeing with the metadata explains it
        _vote(ctx, step_dir, exc, "restore plan agreement")
        raise
    _vote(ctx, step_dir, None, "restore plan agreement")

    if direct:
        try:
            _load_direct(targets, step_dir, md, manifest, verify=verify, share=share)
        except (CheckpointError, OSError) as exc:
            err = exc if isinstance(exc, CheckpointError) else CheckpointReadError(
                exc.errno, f"reading checkpoint {step_dir} failed on rank {ctx.rank}: {exc.strerror or exc}")
            if not ctx.enabled:
                raise err from exc
        if ctx.enabled:  # the ranks read their own copies alone: every rank learns whether all reads succeeded
            _vote(ctx, step_dir, err, "verify")
    else:  # collective: a rank with nothing to read still joins it, or the others would wait for it
        load_tensors(targets, step_dir, md, set(manifest.files), process_group=ctx.fg if ctx.enabled else None,
                     no_dist=not ctx.enabled)
    if before_write is not None:
        before_write()
    hold = InterruptHold()  # every read succeeded: a Ctrl-C from here on is raised once the live state is written
    hold.start()
    try:
        with restore_buffers(targets.values()):
            _write_live(state, live_tensors, tree, targets, staged_aware)
    finally:  # also when a second Ctrl-C (raised at once while one is held) lands in the write
        hold.release()


def _load_direct(targets: _Targets, step_dir: Path, md: Any, manifest: Manifest, *, verify: bool,
                 share: tuple[int, int] = (0, 1)) -> None:
    """Read ``targets`` from a copy without a collective: :func:`load_direct` (``share`` as there), then DCP's
    reader for the tensors it could not place. With no targets, this rank's share of the CRC-32s is still
    checked (its mates rely on it)."""
    rest = load_direct(targets, step_dir, md, manifest, verify=verify, share=share)
    # a placed tensor's record was compared byte for byte with torch.save's framing for its declared dtype
    # and shape; the records DCP's reader opens next are checked first, the others' in this rank's share
    items = tensor_items(md)
    if rest:
        check_records(step_dir, manifest, md, tensors={k: v for k, v in items.items() if k in rest})
    others = {k: v for k, v in items.items() if k not in targets}
    if others:
        check_records(step_dir, manifest, md, tensors=others, part=share[0], parts=share[1])
    if rest:
        load_tensors({k: targets[k] for k in rest}, step_dir, md, set(manifest.files), no_dist=True)


def _assign(target: MutableMapping, loaded: Mapping) -> None:
    for k, v in loaded.items():
        if isinstance(v, Mapping) and isinstance(target.get(k), MutableMapping):
            _assign(target[k], v)
        elif not (isinstance(v, torch.Tensor) and isinstance(target.get(k), torch.Tensor)):  # tensors: copied in
            target[k] = v


def _write_live(state: Any, live_tensors: _Targets, tree: Any, targets: _Targets, staged_aware: bool) -> None:
    """Write the loaded ``targets`` into ``state`` (the last step of :func:`load_into`; every check passed)."""
    if staged_aware:
        live_tensors.clear()  # aliases of the live tensors (state_dict() entries): gone, so those can be exchanged
        state.load_state_dict(join_state(tree, targets))
        return
    if hasattr(state, "load_state_dict") and not any(isinstance(t, DTensor) for t in live_tensors.values()):
        # the state gets the new buffers (on its tensors' devices) and copies them itself, so a
        # load_state_dict that refuses them (e.g. other optimizer param groups) leaves it unchanged
        state.load_state_dict(join_state(tree, {k: t if (live := live_tensors.get(k)) is None or live.device == t.device
                                                else t.to(live.device) for k, t in targets.items()}))
        return
    copy_into_live(live_tensors, targets)
    full = join_state(tree, live_tensors)
    if hasattr(state, "load_state_dict"):
        state.load_state_dict(full)
    elif isinstance(state, MutableMapping):
        _assign(state, full)
    else:
        raise ConfigError(f"cannot restore into a {type(state).__name__}: pass a dict or an object with "
                          "state_dict()/load_state_dict()")
