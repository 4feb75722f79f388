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


class _Reader:
    """The listed files of a directory as one byte stream, less the ``skip`` ranges (``{file: [(offset,
    length)]}``, which the receiver holds); a file shorter than listed reads as zeros there, which the receiver's
    CRC check rejects."""

    def __init__(self, directory: Path, files: list[tuple[str, int, int]],
                 skip: dict[str, list[tuple[int, int]]] | None = None) -> None:
        self.pending: list[tuple[Path, int, int]] = []
        for name, size, _ in files:
            pos = 0
            for offset, length in [*sorted((skip or {}).get(name, [])), (size, 0)]:
                if offset > pos:
                    self.pending.append((directory / name, pos, offset - pos))
                pos = offset + length
        self.total = sum(length for _, _, length in self.pending)
        self.file: Any = None
        self.path: Path | None = None
        self.left = 0

    def read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            if self.left == 0:
                path, offset, self.left = self.pending.pop(0)
                if path != self.path:
                    self._close()
                    try:  # unreadable (e.g. deleted meanwhile): zeros, the partner's protocol goes on
                        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed when read
                    except OSError:
                        self.file = None
                    self.path = path
                if self.file is not None:
                    self.file.seek(offset)
                continue
            k = 0
            if self.file is not None:
                try:
                    k = self.file.readinto(view[got:got + min(n - got, self.left)]) or 0
                except OSError:
                    self.file = None
            if k == 0:  # truncated or unreadable: pad, the CRC check refuses it
                k = min(n - got, self.left)
            got, self.left = got + k, self.left - k
        if self.left == 0 and not self.pending:
            self._close()
        return buf

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file, self.path = None, None


class _Sink:
    """Writes one byte stream into the listed files of a new directory, with the ``local`` ranges (``{file:
    [(offset, length, descriptor, offset there)]}``) copied from this node's own files, checking each file's
    CRC-32."""

    def __init__(self, directory: Path, files: list[tuple[str, int, int]],
                 local: dict[str, list[tuple[int, int, int, int]]] | None = None) -> None:
        directory.mkdir(parents=True)
        self.directory, self.files, self.local = directory, files, local or {}
        self.total = _total(files) - sum(piece[1] for pieces in self.local.values() for piece in pieces)
        self.index, self.left, self.crc, self.pos = -1, 0, 0, 0
        self.pieces: list[tuple[int, int, int, int]] = []
        self.file: Any = None
        self.problems: list[str] = []
        self._advance()

    def _room(self) -> int:
        """Stream bytes the current file takes before its next local range (or its end)."""
        return self.pieces[0][0] - self.pos if self.pieces else self.left

    def _put(self, data: memoryview | bytes) -> None:
        self.file.write(data)
        self.crc = crc32(data, self.crc)
        self.pos, self.left = self.pos + len(data), self.left - len(data)

    def _advance(self) -> None:
        """Copy the local ranges due now; close a finished file (checking its CRC) and open the next, until one
        expects stream bytes or none is left."""
        while self._room() == 0 and self.index < len(self.files):
            if self.pieces:
                _, length, fd, offset = self.pieces.pop(0)
                for data in _blocks(fd, offset, length):
                    self._put(data)
                continue
            if self.file is not None:
                self.file.close()
                self.file = None
                name, _, want = self.files[self.index]
                if self.crc != want:
                    self.problems.append(f"{name}: CRC-32 {self.crc:#010x}, the sender's manifest says {want:#010x}")
            self.index += 1
            if self.index < len(self.files):
                name, self.left, _ = self.files[self.index]
                self.pieces, self.pos = sorted(self.local.get(name, [])), 0
                self.file, self.crc = open(self.directory / name, "wb"), 0  # noqa: SIM115 - closed once written

    def write(self, data: memoryview) -> None:
        while len(data) and self.file is not None:
            k = min(len(data), self._room())
            self._put(data[:k])
            data = data[k:]
            self._advance()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            self.problems.append(f"{self.files[self.index][0]}: {self.left} byte(s) short")


def _total(files: list[tuple[str, int, int]]) -> int:
    return sum(size for _, size, _ in files)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _transfer(group: Any, outgoing: list[tuple[int, _Reader, int]], incoming: list[tuple[int, _Sink, int]], *,
              bytes_per_second: int | None, already: int = 0) -> int:
    """Send and receive byte streams in chunks (group ranks, streams of known lengths), double-buffered: chunk
    ``i + 1`` is read and in flight while chunk ``i`` is written and checksummed; bytes sent, with the ``already``
    sent before (messages the bandwidth cap counts too)."""
    streams = [total for _, _, total in outgoing + incoming]
    chunks = max((math.ceil(total / CHUNK_BYTES) for total in streams), default=0)
    start, sent = time.monotonic(), already

    def post(i: int) -> tuple[list[Any], list[tuple[_Sink, torch.Tensor]]]:
        nonlocal sent
        works: list[Any] = []
        received = []
        for src, sink, total in incoming:  # receives first: the partner's sends land in posted buffers
            n = min(CHUNK_BYTES, total - i * CHUNK_BYTES)
            if n > 0:
                buf = torch.empty(n, dtype=torch.uint8)
                works.append(dist.irecv(buf, group=group, group_src=src, tag=_TAG_DATA))
                received.append((sink, buf))
        for dst, reader, total in outgoing:
            n = min(CHUNK_BYTES, total - i * CHUNK_BYTES)
            if n > 0:
                works.append(dist.isend(torch.frombuffer(reader.read(n), dtype=torch.uint8), group=group,
                                        group_dst=dst, tag=_TAG_DATA))
                sent += n
        return works, received

    pending = post(0) if chunks else ([], [])
    for i in range(chunks):
        works, received = pending
        if i + 1 < chunks:
            pending = post(i + 1)
        _wait(works)
        for sink, buf in received:
            sink.write(memoryview(buf.numpy()))  # type: ignore[arg-type]
        if bytes_per_second:
            time.sleep(max(0.0, sent / bytes_per_second - (time.monotonic() - start)))
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
    if problem is not None:
        shutil.rmtree(sink.directory, ignore_errors=True)
        return problem
    if final.exists():
        shutil.rmtree(retire_step_dir(final), ignore_errors=True)
    sink.directory.rename(final)
    return None


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
                outgoing.append((leader(p), reader, reader.total))
                self.stats["reused_bytes"] += _total(files) - reader.total
            control = len(header) * len(self.partners) + sum(map(len, needs.values()))
            t0 = time.monotonic()
            streams = [(leader(s), sink, sink.total) for s, _, sink in incoming]
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
                for older in final.parent.iterdir():  # the newest replica of each source is kept
                    if older != final and self.naming.step_of(older.name) is not None:
                        discard_step_dir(older)  # renamed hidden first: a kill never leaves part of it listed
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
            outgoing = [(layout.leader_of(t), _Reader(replica_dir(root, t, name), listings[t]), _total(listings[t]))
                        for t, h in repairs.items() if h == node]
            incoming = []
            if node in repairs:
                sink = _Sink(root / f"{_TMP}{name}.{secrets.token_hex(4)}", listings[node])
                incoming.append((layout.leader_of(repairs[node]), sink, _total(listings[node])))
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
