"""Peer replication of the memory tier: each node's copy of a memory step, held in a partner node's RAM too.

Node ``k`` of ``N`` sends to its *partners* ``(k + stride * i) % N`` for ``i = 1..replicas`` (a ring with a
stride, e.g. a rack size, so that a copy leaves the rack) and receives from ``(k - stride * i) % N``. After
every memory commit each node's leader runs one *round* in a background thread, over a private gloo group,
with point-to-point messages only: it sends each partner the newest committed step it has not sent yet
(nothing when a backlog already sent it: a backlog coalesces to the newest step), in chunks, and receives
its sources' steps. Rounds pair up because every node commits the same memory saves (the commit agreement).

A round sends only what a partner lacks: the header lists each tensor chunk of the sender's data files (its
DCP metadata view: file, byte range, key and chunk offset) with the CRC-32 of its bytes as read now; the partner
looks each up in its own committed copy of the same step and answers with those it does not hold with that CRC
(missing, gone with retention, or other bytes); the stream then carries only those and the bytes around the
chunks, and the partner copies the others from its own files. Under data parallelism the partner holds every
replicated tensor, so a round sends the per-rank state and the small files (kilobytes).

The receiver checks every file's size and CRC-32 against the sender's manifest before renaming the copy to
``memory_root/.peers/node-<k>/<step>`` (atomic) and acknowledging it; a step is *node-loss-safe* for node
``k`` once every partner acknowledged it. At restore, a node that lost its memory copy gets it back from a
partner's replica (:func:`repair`), checked the same way, before the ordinary node-local restore reads it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import queue
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointError, ConfigError
from torch_ckpt.format._files import MANIFEST_NAME, open_listed, read_manifest, read_metadata
from torch_ckpt.policy._lineage import Lineage
from torch_ckpt.root._layout import discard_step_dir, is_committed, retire_step_dir, scan_manifests
from torch_ckpt.root._nodes import NodeLayout
from torch_ckpt.storage._crc import crc32

__all__ = ["PEERS_DIR", "PeerReplicator", "partners", "replica_dir", "replica_inventory", "repair"]

log = get_logger(__name__)

#: The directory of ``memory_root`` holding the other nodes' replicas, one ``node-<k>`` folder per source node.
PEERS_DIR = ".peers"
#: Bytes per point-to-point message of a file stream.
CHUNK_BYTES = 16 << 20
_TMP = ".incoming."
_TAG_HEADER, _TAG_DATA, _TAG_ACK, _TAG_NEED = 11, 13, 15, 17


def partners(node: int, count: int, replicas: int, stride: int) -> list[int]:
    """The nodes holding ``node``'s replicas: ``(node + stride * i) % count`` for ``i = 1..replicas``.

    Raises:
        ConfigError: they are not ``replicas`` distinct nodes other than ``node`` (e.g. ``stride % count == 0``),
            naming ``memory_replicas`` and ``memory_partner_stride``.
    """
    ring = [(node + stride * i) % count for i in range(1, replicas + 1)]
    if node in ring or len(set(ring)) != len(ring):
        most = count // math.gcd(count, stride) - 1  # the other nodes the stride reaches before it comes back
        raise ConfigError(f"memory_replicas={replicas} with memory_partner_stride={stride} on {count} nodes does not "
                          f"give {replicas} distinct partner node(s) (node {node} would send to {ring}): this stride "
                          f"reaches {most} other node(s), so use memory_replicas <= {most}, or a stride that shares no "
                          f"factor with {count} (e.g. 1: up to {count - 1})")
    return ring


def replica_dir(root: Path, source: int, name: str) -> Path:
    """Where ``memory_root`` holds node ``source``'s replica of the step directory ``name``."""
    return root / PEERS_DIR / f"node-{source}" / name


def replica_inventory(root: Path, naming: Any, layout: NodeLayout) -> dict[int, dict[int, Lineage]]:
    """``{source node: {step: lineage}}``: the intact replicas (every listed file present at its size) this node
    holds, written with the current rank layout."""
    found: dict[int, dict[int, Lineage]] = {}
    base = root / PEERS_DIR
    if not base.is_dir():
        return found
    for folder in base.iterdir():
        match = re.fullmatch(r"node-(\d+)", folder.name)
        if match is None or not folder.is_dir():
            continue
        source = int(match.group(1))
        for step, (path, manifest) in scan_manifests(folder, naming).items():
            if manifest.node == source and tuple(manifest.nodes["rank_node"]) == layout.rank_node \
                    and is_committed(path):
                found.setdefault(source, {})[step] = manifest.lineage
    return found


def _listing(step_dir: Path) -> list[tuple[str, int, int]]:
    """``[(file, bytes, crc32)]`` of a node's copy: its manifest (checksummed as read now), then the files the
    manifest lists for the node, with the sizes and CRC-32 recorded at commit."""
    manifest = read_manifest(step_dir)
    raw = (step_dir / MANIFEST_NAME).read_bytes()
    return [(MANIFEST_NAME, len(raw), crc32(raw)),
            *((name, info["bytes"], info["crc32"]) for name, info in sorted(manifest.local_files().items()))]


def _blocks(fd: int, offset: int, length: int) -> Iterator[bytes]:
    """Bytes ``offset .. offset + length`` of an open file, at most :data:`CHUNK_BYTES` at a time (zeros past its
    end, which a CRC check rejects)."""
    for at in range(offset, offset + length, CHUNK_BYTES):
        n = min(CHUNK_BYTES, offset + length - at)
        data = os.pread(fd, n, at)
        yield data + bytes(n - len(data))


def _range_crc(fd: int, offset: int, length: int) -> int:
    crc = 0
    for data in _blocks(fd, offset, length):
        crc = crc32(data, crc)
    return crc


def _chunks(step_dir: Path) -> list[list[Any]]:
    """``[[file, offset, length, fqn, chunk offset, crc32]]``: the storage entries of a node's copy that lie in its
    own files (its DCP metadata view), in file order, each with the CRC-32 of its bytes as read now."""
    manifest = read_manifest(step_dir)
    held = manifest.local_files()
    entries = sorted((str(info.relative_path), info.offset, info.length, index.fqn,
                      None if index.offset is None else list(index.offset))
                     for index, info in read_metadata(step_dir, manifest).storage_data.items()
                     if str(info.relative_path) in held and info.length)
    fds: dict[str, int] = {}
    try:
        for name, *_ in entries:
            if name not in fds:
                fds[name] = open_listed(step_dir, manifest, name)
        return [[*entry, _range_crc(fds[entry[0]], entry[1], entry[2])] for entry in entries]
    finally:
        for fd in fds.values():
            os.close(fd)


def _reusable(own: Path, step: int, node: int | None, chunks: list[list[Any]], sizes: dict[str, int]
              ) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """The chunks of a partner's copy of ``step`` (:func:`_chunks`) that this node's own committed copy ``own``
    holds with the same CRC-32, each inside its file and after the one before: ``({chunk index: (descriptor,
    offset)}, descriptors to close)``; none when ``own`` is gone or unreadable (everything is then sent)."""
    found: dict[int, tuple[int, int]] = {}
    fds: dict[str, int] = {}
    try:
        manifest = read_manifest(own)
        if manifest.node != node or manifest.step != step or not is_committed(own):
            return found, []
        held, where = manifest.local_files(), read_metadata(own, manifest).storage_data
        end = dict.fromkeys(sizes, 0)
        for k, (name, offset, length, fqn, chunk, crc) in enumerate(chunks):
            info = where.get(MetadataIndex(fqn, chunk))
            if info is None or info.length != length or str(info.relative_path) not in held or name not in end \
                    or not end[name] <= offset <= sizes[name] - length:
                continue
            path = str(info.relative_path)
            if path not in fds:
                fds[path] = open_listed(own, manifest, path)
            if _range_crc(fds[path], info.offset, length) == crc:
                found[k], end[name] = (fds[path], info.offset), offset + length
    except (OSError, CheckpointError) as exc:
        log.info("memory tier: the own copy %s cannot give a partner's chunks (they are sent): %s", own, exc)
    return found, list(fds.values())


def _pieces(files: list[tuple[str, int, int]], excluded: dict[str, list[tuple[int, int]]]
            ) -> list[tuple[str, int, int]]:
    """``[(file, offset, length)]``: the stream of the listed files in order, less the ``excluded`` ranges
    (``{file: [(offset, length)]}``), each piece at most :data:`CHUNK_BYTES`: one message each. Sender and
    receiver compute the same list (their excluded ranges are the chunks the receiver holds)."""
    out: list[tuple[str, int, int]] = []
    for name, size, _ in files:
        pos = 0
        for offset, length in [*sorted(excluded.get(name, [])), (size, 0)]:
            out += [(name, at, min(CHUNK_BYTES, offset - at)) for at in range(pos, offset, CHUNK_BYTES)]
            pos = max(pos, offset + length)
    return out


class _Reader:
    """The sender's side of a stream: the listed files of a directory, less the ``skip`` ranges (``{file:
    [(offset, length)]}``, which the receiver holds), one piece (:func:`_pieces`) at a time; a file shorter than
    listed or unreadable reads as zeros there, which the receiver's CRC check rejects."""

    def __init__(self, directory: Path, files: list[tuple[str, int, int]],
                 skip: dict[str, list[tuple[int, int]]] | None = None) -> None:
        self.directory = directory
        self.pieces = _pieces(files, skip or {})
        self.total = sum(length for _, _, length in self.pieces)
        self._fd: int | None = None
        self._name: str | None = None
        self._bufs: list[mmap.mmap] = []  # anonymous mappings: unmapped when the stream is done, never left resident

    def read(self, i: int) -> memoryview:
        """The bytes of piece ``i`` (pieces are read in order), in one of two buffers: valid until piece ``i + 2``
        is read."""
        name, offset, length = self.pieces[i]
        if len(self._bufs) < 2:
            self._bufs.append(mmap.mmap(-1, max(size for *_, size in self.pieces)))
        if name != self._name:
            self.close()
            self._name = name
            try:  # unreadable (e.g. deleted meanwhile): zeros, the partner's protocol goes on
                self._fd = os.open(self.directory / name, os.O_RDONLY)
            except OSError:
                self._fd = None
        buf = memoryview(self._bufs[i % 2])[:length]
        got = 0
        while self._fd is not None and got < length:
            try:
                k = os.preadv(self._fd, [buf[got:]], offset + got)
            except OSError:
                k = 0
            if k == 0:
                break
            got += k
        if got < length:  # truncated or unreadable: zeros for the rest
            buf[got:] = bytes(length - got)
        if i == len(self.pieces) - 1:
            self.close()
        return buf

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._name = None, None


class _Sink:
    """The receiver's side of a stream: the listed files of a new directory, written piece by piece
    (:func:`_pieces`) from two receive buffers, with the ``local`` ranges (``{file: [(offset, length, descriptor,
    offset there)]}``) copied from this node's own files in their places; each file's CRC-32 is computed in file
    order as its bytes land, and :meth:`close` checks it against the sender's manifest.

    A failure to write (ENOSPC on a full tmpfs, EIO) never raises: it becomes a problem, writing stops, and the
    pieces are still received, so the sender's stream completes instead of waiting for the group's timeout."""

    def __init__(self, directory: Path, files: list[tuple[str, int, int]],
                 local: dict[str, list[tuple[int, int, int, int]]] | None = None) -> None:
        self.directory, self.files, local = directory, files, local or {}
        self.problems: list[str] = []
        self.pieces = _pieces(files, {n: [(at, length) for at, length, *_ in r] for n, r in local.items()})
        self.total = sum(length for _, _, length in self.pieces)
        self._local = {n: sorted(r) for n, r in local.items()}
        self._bufs: list[torch.Tensor] = []
        self._scratch: mmap.mmap | None = None  # the local ranges' copy buffer, one for the whole stream
        self._file = -1  # index into files of the open file
        self._fd: int | None = None
        self._pos = self._crc = 0  # bytes of the open file written, and their CRC-32
        self._failed = False
        self._writing(self._open)

    def _open(self) -> None:
        self.directory.mkdir(parents=True)
        self._next(self.pieces[0][0] if self.pieces else None)

    def view(self, i: int) -> torch.Tensor:
        """Where piece ``i`` is received: one of two buffers, free again once piece ``i`` :meth:`landed`."""
        length = self.pieces[i][2]
        if len(self._bufs) < 2:
            self._bufs.append(torch.frombuffer(mmap.mmap(-1, max(size for *_, size in self.pieces)), dtype=torch.uint8))
        return self._bufs[i % 2][:length]

    def landed(self, i: int) -> None:
        """Piece ``i`` (received into :meth:`view`) is complete: write it (and the local ranges before it)."""
        name, at, length = self.pieces[i]

        def write() -> None:
            self._next(name)
            self._locals(at)
            self._put(memoryview(self._bufs[i % 2].numpy())[:length])  # type: ignore[arg-type]

        self._writing(write)

    def close(self) -> None:
        """Write what is left (local ranges, empty files) and check the files' CRC-32s; call once every receive
        is done. Problems go into :attr:`problems`."""
        self._writing(lambda: self._next(None))

    def _writing(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` unless writing already failed; an ``OSError`` becomes a problem and stops writing."""
        if self._failed:
            return
        try:
            fn()
        except OSError as exc:
            self._failed = True
            self.problems.append(f"writing into {self.directory}: {exc}")
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _put(self, data: memoryview) -> None:
        assert self._fd is not None
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], self._pos + done)
        self._crc = crc32(data, self._crc)
        self._pos += len(data)

    def _locals(self, until: int) -> None:
        """Copy the open file's local ranges that start before ``until``."""
        ranges = self._local.get(self.files[self._file][0], [])
        while ranges and ranges[0][0] < until:
            _, length, fd, offset = ranges.pop(0)
            if self._scratch is None:
                self._scratch = mmap.mmap(-1, CHUNK_BYTES)  # unmapped with the sink, never left resident
            for done in range(0, length, CHUNK_BYTES):
                with memoryview(self._scratch)[:min(CHUNK_BYTES, length - done)] as buf:
                    _fill(fd, buf, offset + done)  # past the end of the own file: zeros, the CRC refuses them
                    self._put(buf)

    def _next(self, name: str | None) -> None:
        """Finish files until ``name`` is the open one (None: finish them all)."""
        while self._file < len(self.files) and (self._file < 0 or self.files[self._file][0] != name):
            if self._fd is not None:
                listed, size, want = self.files[self._file]
                self._locals(size)
                os.close(self._fd)
                self._fd = None
                if self._pos != size:
                    self.problems.append(f"{listed}: {size - self._pos} byte(s) short")
                elif self._crc != want:
                    self.problems.append(f"{listed}: CRC-32 {self._crc:#010x}, the sender's manifest says "
                                         f"{want:#010x}")
            self._file += 1
            if self._file < len(self.files):
                self._fd = os.open(self.directory / self.files[self._file][0],
                                   os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                self._pos = self._crc = 0


def _fill(fd: int, view: memoryview, offset: int) -> None:
    """Read ``view``'s bytes from ``offset`` of an open file (past its end: zeros, which the CRC rejects)."""
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k == 0:
            view[got:] = bytes(len(view) - got)
            return
        got += k


def _total(files: list[tuple[str, int, int]]) -> int:
    return sum(size for _, size, _ in files)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _transfer(group: Any, outgoing: list[tuple[int, _Reader]], incoming: list[tuple[int, _Sink]], *,
              bytes_per_second: int | None, already: int = 0) -> int:
    """Send and receive streams piece by piece (group ranks; :func:`_pieces`), pieces ``i`` and ``i + 1`` in
    flight at once (each received into one of its sink's two buffers, written while the next arrives); bytes
    sent, with the ``already`` sent before (messages the bandwidth cap counts too)."""
    rounds = max([len(reader.pieces) for _, reader in outgoing] + [len(sink.pieces) for _, sink in incoming],
                 default=0)
    start, sent = time.monotonic(), already

    def post(i: int) -> list[Any]:
        nonlocal sent
        works: list[Any] = []
        for src, sink in incoming:  # receives first: the partner's sends land in posted buffers
            if i < len(sink.pieces):
                works.append(dist.irecv(sink.view(i), group=group, group_src=src, tag=_TAG_DATA))
        for dst, reader in outgoing:
            if i < len(reader.pieces):
                data = reader.read(i)
                works.append(dist.isend(torch.frombuffer(data, dtype=torch.uint8), group=group, group_dst=dst,
                                        tag=_TAG_DATA))
                sent += len(data)
        return works

    try:
        pending = post(0) if rounds else []
        for i in range(rounds):
            works = pending
            pending = post(i + 1) if i + 1 < rounds else []
            _wait(works)
            for _, sink in incoming:
                if i < len(sink.pieces):
                    sink.landed(i)
            if bytes_per_second:
                time.sleep(max(0.0, sent / bytes_per_second - (time.monotonic() - start)))
    finally:
        for _, reader in outgoing:
            reader.close()
    if bytes_per_second:  # also when nothing was streamed: the control messages count against the cap
        time.sleep(max(0.0, sent / bytes_per_second - (time.monotonic() - start)))
    return sent


def _exchange(group: Any, out: dict[int, bytes], sources: list[int], tag: int) -> dict[int, bytes]:
    """Send ``out[dst]`` to each ``dst`` and receive one message from each of ``sources`` (group ranks)."""
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
    works: list[Any] = [dist.isend(torch.tensor([len(data)], dtype=torch.int64), group=group, group_dst=dst, tag=tag)
             for dst, data in out.items()]
    works += [dist.irecv(lengths[src], group=group, group_src=src, tag=tag) for src in sources]
    _wait(works)
    bufs = {src: torch.empty(int(n.item()), dtype=torch.uint8) for src, n in lengths.items()}
    works = [dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), group=group, group_dst=dst, tag=tag + 1)
             for dst, data in out.items() if data]
    works += [dist.irecv(buf, group=group, group_src=src, tag=tag + 1) for src, buf in bufs.items() if buf.numel()]
    _wait(works)
    return {src: buf.numpy().tobytes() for src, buf in bufs.items()}


def _receive_into(final: Path, sink: _Sink, *, source: int, step: int) -> str | None:
    """Check a received copy and rename it to ``final`` (replacing an older copy there); the problem, or None."""
    sink.close()
    problem = "; ".join(sink.problems) or None
    if problem is None:
        try:
            manifest = read_manifest(sink.directory)
            if manifest.node != source or manifest.step != step:
                problem = f"its manifest is node {manifest.node}'s step {manifest.step}"
        except CheckpointError as exc:
            problem = str(exc)
    if problem is None:
        try:
            if final.exists():
                shutil.rmtree(retire_step_dir(final), ignore_errors=True)
            sink.directory.rename(final)
            return None
        except OSError as exc:  # raised, it would leave the partners waiting in the next exchange
            problem = f"renaming {sink.directory} to {final.name}: {exc}"
    shutil.rmtree(sink.directory, ignore_errors=True)
    return problem


class PeerReplicator:
    """The replication thread of one node's leader (see the module doc); built on every rank (collective).

    Args:
        root: ``memory_root``. naming: the manager's naming. layout: the memory tier's node-local layout.
        ctx: the manager's ``DistContext``. replicas: partners per node (>= 1). stride: ring stride (>= 1).
        bytes_per_second: cap on the bytes this node sends per second, or None.
        on_safe: called (replication thread) when a newer step became node-loss-safe: retention may drop older ones.

    Raises:
        ConfigError: the ring gives no ``replicas`` distinct partners (:func:`partners`).
    """

    def __init__(self, root: Path, naming: Any, layout: NodeLayout, ctx: Any, *, replicas: int, stride: int,
                 bytes_per_second: int | None, on_safe: Callable[[], None] = lambda: None) -> None:
        count = layout.node_count
        self._on_safe = on_safe
        self.root, self.naming, self.layout, self.bytes_per_second = root, naming, layout, bytes_per_second
        self.partners = partners(layout.node, count, replicas, stride)
        self.sources = [(layout.node - stride * i) % count for i in range(1, replicas + 1)]
        self.group = ctx.new_group()  # collective on every rank; only the leaders use it
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.newest: int | None = None  # the newest committed memory step of this node
        self.pinned: int | None = None  # the step being sent (retention keeps it)
        self.sent: int | None = None
        self.safe: int | None = None  # the newest step every partner acknowledged
        self.stats: dict[str, Any] = {"rounds": 0, "coalesced": 0, "sent_bytes": 0, "reused_bytes": 0,
                                      "transfer_s": 0.0, "refused": 0, "last_error": None}
        self._thread: threading.Thread | None = None
        if layout.is_leader:
            for folder in (root / PEERS_DIR).glob("node-*"):
                for leftover in folder.glob(".*"):  # a receive or a deletion a kill interrupted
                    shutil.rmtree(leftover, ignore_errors=True)
            self._thread = threading.Thread(target=self._run, name="torch-ckpt-peer-replication", daemon=True)
            self._thread.start()

    def committed(self, step: int) -> None:
        """Writer thread, leader: ``step`` was committed in memory; a round follows in the background."""
        with self._lock:
            self.newest = step if self.newest is None else max(self.newest, step)
        self._queue.put(step)

    def keeps(self) -> set[int]:
        """Steps memory retention must keep: the one being sent and the newest node-loss-safe one."""
        with self._lock:
            return {s for s in (self.pinned, self.safe) if s is not None}

    def close(self, timeout_s: float) -> None:
        """Finish the rounds of the commits so far (up to ``timeout_s``), then stop."""
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("memory tier: peer replication still waits for a partner after %.0f s at close; "
                            "leaving it (the newest memory step may not be node-loss-safe)", timeout_s)
                return
        if dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError):
                pass

    def _run(self) -> None:
        while self._queue.get() is not None:
            if self.stats["last_error"] is None:
                try:
                    self._round()
                except Exception as exc:  # noqa: BLE001 - reported by health(); training goes on
                    self.stats["last_error"] = f"{type(exc).__name__}: {exc}"
                    log.warning("memory tier: peer replication of node %d stopped: %s: %s (memory steps are no "
                                "longer node-loss-safe; a node loss falls back to the disk and durable tiers)",
                                self.layout.node, type(exc).__name__, exc)

    def _round(self) -> None:
        with self._lock:
            step = self.newest if self.newest != self.sent else None
            self.pinned = step
        self.stats["rounds"] += 1
        leader = self.layout.leader_of
        header, files, chunks = b"", [], []
        step_dir = self.root / self.naming.name(step) if step is not None else self.root
        if step is None:
            self.stats["coalesced"] += 1
        else:
            try:
                files, chunks = _listing(step_dir), _chunks(step_dir)
                header = json.dumps({"step": step, "name": self.naming.name(step), "files": files,
                                     "chunks": chunks}).encode()
            except (OSError, CheckpointError) as exc:
                log.warning("memory tier: step %d of node %d cannot be replicated: %s", step, self.layout.node, exc)
        got = _exchange(self.group, {leader(p): header for p in self.partners}, [leader(s) for s in self.sources],
                        _TAG_HEADER)
        incoming = []
        held: list[int] = []  # descriptors of this node's own files the sinks copy from
        needs = {leader(s): b"" for s in self.sources}
        try:
            for src in self.sources:
                if got[leader(src)]:
                    doc = json.loads(got[leader(src)])
                    sink, wanted = self._sink(src, doc, held)
                    incoming.append((src, doc, sink))
                    needs[leader(src)] = json.dumps(wanted).encode()
            answers = _exchange(self.group, needs, [leader(p) for p in self.partners], _TAG_NEED)
            outgoing = []
            for p in self.partners if header else []:
                need = set(json.loads(answers[leader(p)]))
                skip: dict[str, list[tuple[int, int]]] = {}
                for k, (name, at, length, *_) in enumerate(chunks):
                    if k not in need:
                        skip.setdefault(name, []).append((at, length))
                reader = _Reader(step_dir, files, skip)
                outgoing.append((leader(p), reader))
                self.stats["reused_bytes"] += _total(files) - reader.total
            control = len(header) * len(self.partners) + sum(map(len, needs.values()))
            t0 = time.monotonic()
            streams = [(leader(s), sink) for s, _, sink in incoming]
            self.stats["sent_bytes"] += _transfer(self.group, outgoing, streams, bytes_per_second=self.bytes_per_second,
                                                  already=control)
            self.stats["transfer_s"] += time.monotonic() - t0
        finally:
            for fd in held:
                os.close(fd)
        acks = {leader(s): b"" for s in self.sources}
        newly_safe = False
        for src, doc, sink in incoming:
            final = replica_dir(self.root, src, doc["name"])
            problem = _receive_into(final, sink, source=src, step=int(doc["step"]))
            if problem is None:
                try:
                    for older in final.parent.iterdir():  # the newest replica of each source is kept
                        if older != final and self.naming.step_of(older.name) is not None:
                            discard_step_dir(older)  # renamed hidden first: a kill never leaves part of it listed
                except OSError as exc:  # the next round retries; raised, it would leave the partner waiting
                    log.warning("memory tier: an older replica of node %d could not be removed: %s", src, exc)
            else:
                self.stats["refused"] += 1
                log.warning("memory tier: the replica of node %d's step %s was refused: %s", src, doc["step"], problem)
            acks[leader(src)] = json.dumps({"step": doc["step"], "problem": problem}).encode()
        answers = _exchange(self.group, acks, [leader(p) for p in self.partners], _TAG_ACK)
        with self._lock:
            self.pinned = None
            if header:
                self.sent = step
                replies = [json.loads(answers[leader(p)]) for p in self.partners]
                newly_safe = all(r["step"] == step and r["problem"] is None for r in replies)
                if newly_safe:
                    self.safe = step
        if header and newly_safe:
            self._on_safe()

    def _sink(self, src: int, doc: dict[str, Any], held: list[int]) -> tuple[_Sink, list[int]]:
        """The sink of node ``src``'s copy (its header ``doc``) taking the chunks this node's own copy of the step,
        or a replica of that step it already holds (a restart replicates its restored step again), holds from
        there (their descriptors are added to ``held``), and the indices of the chunks to be sent."""
        listed = [(str(n), int(b), int(c)) for n, b, c in doc["files"]]
        step, sizes = int(doc["step"]), {n: b for n, b, _ in listed}
        found, fds = _reusable(self.root / doc["name"], step, self.layout.node, doc["chunks"], sizes)
        held += fds
        if len(found) < len(doc["chunks"]):
            again, fds = _reusable(replica_dir(self.root, src, doc["name"]), step, src, doc["chunks"], sizes)
            held += fds
            found = {**again, **found}
        local: dict[str, list[tuple[int, int, int, int]]] = {}
        for k, (fd, offset) in found.items():
            name, at, length = doc["chunks"][k][:3]
            local.setdefault(name, []).append((at, length, fd, offset))
        tmp = replica_dir(self.root, src, f"{_TMP}{doc['name']}.{secrets.token_hex(4)}")
        return _Sink(tmp, listed, local), [k for k in range(len(doc["chunks"])) if k not in found]

    def drop_newer(self, limit: int) -> None:
        """Leader: delete replicas of steps newer than ``limit`` (an abandoned timeline, see ``MemoryTier._drop``)."""
        for folder in (self.root / PEERS_DIR).glob("node-*"):
            for entry in folder.iterdir():
                step = self.naming.step_of(entry.name)
                if step is not None and step > limit:
                    discard_step_dir(entry)


def repair(layout: NodeLayout, ctx: Any, root: Path, naming: Any, step: int, repairs: dict[int, int]) -> str | None:
    """Collective: give each node ``t`` of ``repairs`` (``{t: holder node}``) its copy of ``step`` back from the
    holder's replica, checked file by file against the replica's manifest (CRC-32) and renamed into
    ``memory_root`` (atomic). Returns the first problem of any node (the same on every rank), or None."""
    name, node = naming.name(step), layout.node
    mine: dict[int, Any] = {}
    if layout.is_leader:
        for target, holder in repairs.items():
            if holder == node:
                try:
                    mine[target] = _listing(replica_dir(root, target, name))
                except (OSError, CheckpointError) as exc:
                    mine[target] = f"node {node}'s replica of node {target}: {exc}"
    listings = {t: lst for part in ctx.all_gather(mine, what="memory replica listing") for t, lst in part.items()}
    problem = next((v for v in listings.values() if isinstance(v, str)), None)
    if problem is not None:
        return problem
    local: str | None = None
    if layout.is_leader:
        sink = None
        try:
            outgoing = [(layout.leader_of(t), _Reader(replica_dir(root, t, name), listings[t]))
                        for t, h in repairs.items() if h == node]
            incoming = []
            if node in repairs:
                sink = _Sink(root / f"{_TMP}{name}.{secrets.token_hex(4)}", listings[node])
                incoming.append((layout.leader_of(repairs[node]), sink))
            _transfer(ctx.fg, outgoing, incoming, bytes_per_second=None)
            if sink is not None:
                local = _receive_into(root / name, sink, source=node, step=step)
                if local is None:
                    log.info("[node %d] memory tier: step %d restored into %s from node %d's replica", node, step,
                             root, repairs[node])
        except (OSError, RuntimeError) as exc:
            local = f"{type(exc).__name__}: {exc}"
            if sink is not None:
                shutil.rmtree(sink.directory, ignore_errors=True)
        if local is not None:
            local = f"node {node}: {local}"
    return next((p for p in ctx.all_gather(local, what="memory replica repair") if p is not None), None)
