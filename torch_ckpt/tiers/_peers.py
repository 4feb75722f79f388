"""Peer replication of the memory tier: each node's copy of a memory step, held in a partner node's RAM too.

Node ``k`` of ``N`` sends to its *partners* ``(k + stride * i) % N`` for ``i = 1..replicas`` (a ring with a
stride, e.g. a rack size, so that a copy leaves the rack) and receives from ``(k - stride * i) % N``. After
every memory commit each node's leader runs one *round* in a background thread, over a private gloo group,
with point-to-point messages only: it sends each partner the newest committed step it has not sent yet
(nothing when a backlog already sent it: a backlog coalesces to the newest step), in chunks, and receives
its sources' steps. Rounds pair up because every node commits the same memory saves (the commit agreement).

The receiver checks every file's size and CRC-32 against the sender's manifest before renaming the copy to
``memory_root/.peers/node-<k>/<step>`` (atomic) and acknowledging it; a step is *node-loss-safe* for node
``k`` once every partner acknowledged it. At restore, a node that lost its memory copy gets it back from a
partner's replica (:func:`repair`), checked the same way, before the ordinary node-local restore reads it.
"""

from __future__ import annotations

import json
import math
import queue
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import CheckpointError, ConfigError
from torch_ckpt.format._files import MANIFEST_NAME, read_manifest
from torch_ckpt.policy._lineage import Lineage
from torch_ckpt.root._layout import is_committed, retire_step_dir, scan_manifests
from torch_ckpt.root._nodes import NodeLayout
from torch_ckpt.storage._crc import crc32

__all__ = ["PEERS_DIR", "PeerReplicator", "partners", "replica_dir", "replica_inventory", "repair"]

log = get_logger(__name__)

#: The directory of ``memory_root`` holding the other nodes' replicas, one ``node-<k>`` folder per source node.
PEERS_DIR = ".peers"
#: Bytes per point-to-point message of a file stream.
CHUNK_BYTES = 16 << 20
_TMP = ".incoming."
_TAG_HEADER, _TAG_DATA, _TAG_ACK = 11, 13, 15


def partners(node: int, count: int, replicas: int, stride: int) -> list[int]:
    """The nodes holding ``node``'s replicas: ``(node + stride * i) % count`` for ``i = 1..replicas``.

    Raises:
        ConfigError: they are not ``replicas`` distinct nodes other than ``node`` (e.g. ``stride % count == 0``),
            naming ``memory_replicas`` and ``memory_partner_stride``.
    """
    ring = [(node + stride * i) % count for i in range(1, replicas + 1)]
    if node in ring or len(set(ring)) != len(ring):
        raise ConfigError(f"memory_replicas={replicas} with memory_partner_stride={stride} on {count} nodes does not "
                          f"give {replicas} distinct partner node(s) (node {node} would send to {ring}): use fewer "
                          "replicas (at most nodes - 1) or a stride that does not divide into the node count")
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


class _Reader:
    """The listed files of a directory as one byte stream. A file that is shorter than listed, or cannot be read
    (e.g. deleted meanwhile), reads as zeros there: the stream keeps its length (the partner's protocol goes on)
    and the receiver's CRC check refuses the copy."""

    def __init__(self, directory: Path, files: list[tuple[str, int, int]]) -> None:
        self.pending = [(directory / name, size) for name, size, _ in files]
        self.file: Any = None
        self.left = 0

    def read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            if self.left == 0:
                if self.file is not None:
                    self.file.close()
                path, self.left = self.pending.pop(0)
                try:
                    self.file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed when its bytes are read
                except OSError:
                    self.file = None
                continue
            k = 0
            if self.file is not None:
                try:
                    k = self.file.readinto(view[got:got + min(n - got, self.left)]) or 0
                except OSError:
                    self.file = None
            if k == 0:  # truncated or unreadable: zeros, which the CRC check refuses
                k = min(n - got, self.left)
            got, self.left = got + k, self.left - k
        if self.left == 0 and self.file is not None:
            self.file.close()
            self.file = None
        return buf


class _Sink:
    """Writes one byte stream into the listed files of a new directory, checking each file's CRC-32."""

    def __init__(self, directory: Path, files: list[tuple[str, int, int]]) -> None:
        directory.mkdir(parents=True)
        self.directory, self.files = directory, files
        self.index, self.left, self.crc = -1, 0, 0
        self.file: Any = None
        self.problems: list[str] = []
        self._advance()

    def _advance(self) -> None:
        """Close a finished file (checking its CRC) and open the next, until one expects bytes or none is left."""
        while self.left == 0 and self.index < len(self.files):
            if self.file is not None:
                self.file.close()
                self.file = None
                name, _, want = self.files[self.index]
                if self.crc != want:
                    self.problems.append(f"{name}: CRC-32 {self.crc:#010x}, the sender's manifest says {want:#010x}")
            self.index += 1
            if self.index < len(self.files):
                name, self.left, _ = self.files[self.index]
                self.file, self.crc = open(self.directory / name, "wb"), 0  # noqa: SIM115 - closed once written

    def write(self, data: memoryview) -> None:
        while len(data) and self.file is not None:
            k = min(len(data), self.left)
            self.file.write(data[:k])
            self.crc = crc32(data[:k], self.crc)
            data, self.left = data[k:], self.left - k
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
              bytes_per_second: int | None) -> int:
    """Send and receive byte streams in lockstep chunks (group ranks, streams of known lengths); bytes sent."""
    streams = [total for _, _, total in outgoing + incoming]
    chunks = max((math.ceil(total / CHUNK_BYTES) for total in streams), default=0)
    start, sent = time.monotonic(), 0
    for i in range(chunks):
        works: list[Any] = []
        received = []
        for dst, reader, total in outgoing:
            n = min(CHUNK_BYTES, total - i * CHUNK_BYTES)
            if n > 0:
                works.append(dist.isend(torch.frombuffer(reader.read(n), dtype=torch.uint8), group=group,
                                        group_dst=dst, tag=_TAG_DATA))
                sent += n
        for src, sink, total in incoming:
            n = min(CHUNK_BYTES, total - i * CHUNK_BYTES)
            if n > 0:
                buf = torch.empty(n, dtype=torch.uint8)
                works.append(dist.irecv(buf, group=group, group_src=src, tag=_TAG_DATA))
                received.append((sink, buf))
        _wait(works)
        for sink, buf in received:
            sink.write(memoryview(buf.numpy()))  # type: ignore[arg-type]
        if bytes_per_second:
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
        self.stats: dict[str, Any] = {"rounds": 0, "coalesced": 0, "sent_bytes": 0, "transfer_s": 0.0, "refused": 0,
                                      "last_error": None}
        self._thread: threading.Thread | None = None
        if layout.is_leader:
            for folder in (root / PEERS_DIR).glob("node-*"):
                for leftover in folder.glob(f"{_TMP}*"):  # a receive a kill interrupted
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
        header, files = b"", []
        if step is None:
            self.stats["coalesced"] += 1
        else:
            try:
                files = _listing(self.root / self.naming.name(step))
                header = json.dumps({"step": step, "name": self.naming.name(step), "files": files}).encode()
            except (OSError, CheckpointError) as exc:
                log.warning("memory tier: step %d of node %d cannot be replicated: %s", step, self.layout.node, exc)
        got = _exchange(self.group, {leader(p): header for p in self.partners}, [leader(s) for s in self.sources],
                        _TAG_HEADER)
        incoming = []
        for src in self.sources:
            if got[leader(src)]:
                doc = json.loads(got[leader(src)])
                listed = [(str(n), int(b), int(c)) for n, b, c in doc["files"]]
                tmp = replica_dir(self.root, src, f"{_TMP}{doc['name']}.{secrets.token_hex(4)}")
                incoming.append((src, doc, _Sink(tmp, listed), _total(listed)))
        outgoing = [(leader(p), _Reader(self.root / self.naming.name(step), files), _total(files))
                    for p in self.partners] if header else []
        t0 = time.monotonic()
        self.stats["sent_bytes"] += _transfer(self.group, outgoing, [(leader(s), k, n) for s, _, k, n in incoming],
                                              bytes_per_second=self.bytes_per_second)
        self.stats["transfer_s"] += time.monotonic() - t0
        acks = {leader(s): b"" for s in self.sources}
        newly_safe = False
        for src, doc, sink, _ in incoming:
            final = replica_dir(self.root, src, doc["name"])
            problem = _receive_into(final, sink, source=src, step=int(doc["step"]))
            if problem is None:
                for older in final.parent.iterdir():  # the newest replica of each source is kept
                    if older != final and self.naming.step_of(older.name) is not None:
                        shutil.rmtree(older, ignore_errors=True)
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

    def drop_newer(self, limit: int) -> None:
        """Leader: delete replicas of steps newer than ``limit`` (an abandoned timeline, see ``MemoryTier._drop``)."""
        for folder in (self.root / PEERS_DIR).glob("node-*"):
            for entry in folder.iterdir():
                step = self.naming.step_of(entry.name)
                if step is not None and step > limit:
                    shutil.rmtree(entry, ignore_errors=True)


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
