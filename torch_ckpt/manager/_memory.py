"""The memory tier: frequent checkpoints into a tmpfs root that outlives the trainer process.

``memory_root`` (typically under ``/dev/shm``) holds the same checkpoints as the disk root (DCP
files, ``manifest.json`` with CRC-32, the atomic commit), always in the node-local layout
(:class:`~torch_ckpt.root._nodes.NodeLayout`, even for one node): every node keeps its own copy, so
a restarted process on the same nodes resumes from RAM. With ``memory_replicas`` (default 1) and two
nodes or more, each node's newest memory step is also held by partner nodes
(:mod:`torch_ckpt.tiers._peers`): a restore gives a node that lost its copy the partner's, checked by
CRC-32, before falling back to the disk and durable tiers.

A memory save goes through the manager's one :class:`~torch_ckpt.save._checkpointer.AsyncCheckpointer`
(its request names this tier's layout) and never counts as a persistent save: the disk cadence,
``replicate_every_n_saves``, durable replication and disk retention never see it. A restore takes a
memory step only when every node holds an intact copy newer than every live disk and durable step
(the lineage rules of :mod:`torch_ckpt.policy._lineage`, over the manifests of all three tiers).
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from torch_ckpt._logging import get_logger
from torch_ckpt.config import CheckpointConfig
from torch_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ConfigError,
)
from torch_ckpt.handle import SaveHandle
from torch_ckpt.policy._lineage import Lineage, head_of, new_segment, successor
from torch_ckpt.policy._naming import MAX_STEP, Naming, check_step
from torch_ckpt.policy._retention import KeepLatest, apply_retention
from torch_ckpt.policy._schedule import Cadence
from torch_ckpt.restore._restore import DATA_SUFFIX
from torch_ckpt.restore._resume_nodes import local_inventory, restore_node_local
from torch_ckpt.root._layout import (
    check_root,
    clean_stale_temporaries,
    discard_step_dir,
    read_manifest,
    retire_step_dir,
    scan_committed,
    scan_manifests,
    write_durable,
)
from torch_ckpt.root._lock import RootLock
from torch_ckpt.root._nodes import NodeLayout, choose_layout
from torch_ckpt.save._checkpointer import AsyncCheckpointer
from torch_ckpt.save._persist import SaveRequest
from torch_ckpt.save._persist_nodes import persist_node_local
from torch_ckpt.storage._locations import DurableUnavailableError
from torch_ckpt.tiers._peers import PeerReplicator, repair, replica_inventory

__all__ = ["MemoryTier", "TIERS", "OWNER_NAME", "is_memory_save", "memory_health"]

log = get_logger(__name__)

#: A memory restore candidate: (step, run segment of the next saves, {node: holder} to rebuild, below the disk floor).
_Candidate = tuple[int, Lineage, Any, bool]
#: The directory of ``memory_root`` holding recycled data files (see :func:`_recycle`).
SPARE_DIR = ".spare"
#: Smaller data files are deleted, not recycled.
SPARE_MIN_BYTES = 1 << 20


class _Superseded(Exception):
    """A memory step was read, and the plan agreed with the durable steps starts with another one: the read is
    dropped before the live state is written."""

#: The values of ``CheckpointManager.save(..., tier=)``.
TIERS = ("disk", "memory")


def is_memory_save(tier: Any, memory: MemoryTier | None, *, path: Any, extra_dir: Any) -> bool:
    """True when ``save(..., tier=tier)`` is a memory save; False for a disk save.

    Raises:
        ConfigError: an unknown ``tier``; ``"memory"`` without ``memory_root``, or with ``path``/``extra_dir``.
    """
    if tier not in TIERS:
        raise ConfigError(f"tier must be one of {list(TIERS)}, got {tier!r}")
    if tier == "disk":
        return False
    if memory is None:
        raise ConfigError("save(..., tier='memory') needs CheckpointManager(..., memory_root='/dev/shm/<run>')")
    if path is not None or extra_dir is not None:
        raise ConfigError("save(..., tier='memory') takes no path or extra_dir: memory checkpoints are the step "
                          "directories of memory_root")
    return True


class MemoryTier:
    """The memory tier of one manager (see the module doc); built on every rank (collective).

    Args:
        root: ``memory_root``, absolute. config: the manager's settings. engine: its checkpointer.
        naming: its naming. runs: its ``RunLineage`` (the run segment memory saves record).

    The construction agrees on the node-local layout and checks the root on every node; a failure
    is kept in :attr:`error` (the manager reports it with its own, on every rank).
    """

    def __init__(self, root: Path, config: CheckpointConfig, engine: AsyncCheckpointer, naming: Naming,
                 runs: Any, disk_root: Path) -> None:
        self.root, self.naming, self.engine, self.runs = root, naming, engine, runs
        self.ctx = ctx = engine.ctx
        self.read_only, self.explicit_paths_only = config.read_only, config.explicit_paths_only
        self.keep_last = config.memory_keep_last
        policy = config.build_memory_policy()
        self.cadence = Cadence(policy) if policy is not None else None
        self.captured_at: dict[int, float] = {}  # step -> Unix time its state was captured (last 64)
        self.rolled_back_to: int | None = None  # a restore's step: newer memory steps go at the next save
        self.listed: dict[int, Lineage] = {}  # every node's memory steps at the last restore: {step: lineage}
        self.fallbacks: list[tuple[int, Lineage, Any]] = []  # the last restore's memory steps below the disk floor
        self.last_step: int | None = None  # the newest step seen by save() or due(), for health()
        self._owed = False  # rank 0: a due memory save was put off while another save was being written
        self.source = "memory"  # the last memory restore's source on this rank: "memory" or "memory-peer"
        self.error: CheckpointError | None = None
        self._lock: RootLock | None = None
        self.spare = root / SPARE_DIR  # the data files of retired steps, written over by the next saves
        # forced node-local (shared=False): each node keeps its own copy, even for one node
        self.layout: NodeLayout = choose_layout(ctx, False, persist=persist_node_local)  # type: ignore[assignment]
        leader = self.layout.is_leader
        if leader:
            try:
                check_root(root, create=not self.read_only, what="memory_root")
                self.error = _claim(root, disk_root, read_only=self.read_only)
                _warn_unless_in_ram(root)
            except CheckpointNotFoundError:
                pass  # read-only and missing: nothing to restore from memory
            except CheckpointError as exc:
                self.error = exc
        if not self.read_only:
            shared = self.layout.check(root, ctx, ok=self.error is None)
            if shared and "more than one node" in shared:
                self.error = ConfigError(f"memory_root {root} is seen by more than one node (a shared directory); "
                                         "the memory tier keeps one copy per node: give each node a directory of "
                                         "its own, e.g. on its /dev/shm")
            elif shared:
                self.error = self.error or ConfigError(f"memory_root: {shared}")
        if leader and not self.read_only and self.error is None:
            try:
                self._lock = RootLock(root, drain=engine.drain)
                self._lock.acquire()
                clean_stale_temporaries(root, keep_incarnation=engine.incarnation, naming=naming)
                _remove_spare(self.spare)  # an earlier process's: RAM it no longer needs
            except CheckpointError as exc:
                self.error = exc
        self.peers: PeerReplicator | None = None
        self._retention = threading.Lock()
        count, replicas = self.layout.node_count, config.memory_replicas
        if count == 1 and replicas and leader and not self.read_only:
            log.warning("memory tier: one node, so no partner holds a replica: a node loss loses the memory copies "
                        "(restore falls back to the disk and durable tiers)")
        elif count > 1 and replicas and not self.read_only:
            try:  # collective on every rank (the group); the same ConfigError everywhere
                self.peers = PeerReplicator(root, naming, self.layout, ctx, replicas=replicas,
                                            stride=config.memory_partner_stride,
                                            bytes_per_second=cast(Any, config.memory_replication_bytes_per_second),
                                            on_safe=lambda: _delete(self._retire()))
            except ConfigError as exc:
                self.error = self.error or exc

    def close(self) -> None:
        """Finish peer replication of the steps committed so far, release the memory root's lock (the
        checkpoints stay)."""
        if self.peers is not None:
            self.peers.close(self.ctx.timeout_seconds)
        if self._lock is not None:
            _remove_spare(self.spare)  # the saves are over: their RAM goes
            self._lock.release()

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: Any, state: Any, *, started_at: float) -> SaveHandle:
        """Collective: checkpoint ``state`` as ``step`` into ``memory_root`` (every node its own copy).

        Raises:
            ConfigError: a read-only manager or a bad step (every rank raises at the agreement).
            CheckpointError: as :meth:`CheckpointManager.save`.
        """
        refused: Exception | None = None
        waited = 0.0
        valid = not isinstance(step, bool) and isinstance(step, int) and 0 <= step <= MAX_STEP
        final = self.root / (self.naming.name(step) if valid else ".invalid_step")
        lineage = None
        try:
            if self.read_only:
                raise ConfigError(f"this CheckpointManager was opened with read_only=True: memory saves into "
                                  f"{self.root} are refused")
            if not valid:
                check_step(step)
            if self.error is not None:
                raise self.error
            waited = self.engine.wait_previous()
            lineage = self.runs.head() if self.runs.acts_on_root else None
            if lineage is not None and not self.explicit_paths_only:
                self.runs.set_aside_abandoned()  # a rollback: a restart that finds no memory copy must not resume them
            if self.layout.is_leader:
                self._drop(step, inclusive=True)  # a leftover of this step, or newer steps this run did not write
        except Exception as exc:  # noqa: BLE001 - every rank raises it at the engine's agreement
            refused = exc
        request = SaveRequest(final=final, step=step if valid else 0, lineage=lineage, nodes=self.layout,
                              after_commit=self._after_commit, spare_dir=self.spare)
        captured = time.time()
        handle = self.engine.submit(request, state, refused=refused, started_at=started_at, waited_s=waited)
        if valid:
            self._saw(step)
        self.captured_at[step] = captured
        while len(self.captured_at) > 64:
            self.captured_at.pop(next(iter(self.captured_at)))
        if self.cadence is not None:
            self.cadence.record_save_started(handle, time.monotonic())
        return handle

    def _saw(self, step: int) -> None:
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    def due(self, step: int) -> bool:
        """Collective: record that ``step`` finished; True when the memory cadence (rank 0 decides) says to save
        and no save (of either tier) is still being written (a due save is put off rather than making training wait)."""
        if self.cadence is None:
            return False
        self._saw(step)
        now = time.monotonic()
        busy = self.engine.in_flight is not None
        self.cadence.record_step(step, now, busy=busy)
        decision = False
        if self.ctx.is_coordinator:
            wanted = self.cadence.decide(step, now) or self._owed  # a save put off while another was written
            self._owed, decision = wanted and busy, wanted and not busy
        return bool(self.ctx.broadcast(decision, what="memory save decision"))

    def disk_saved(self, step: int) -> None:
        """A disk save of ``step`` begins (``step`` finished): the memory clock restarts (a newer checkpoint
        exists), with no memory cost sample; the disk save's stall is no memory step time."""
        self._saw(step)
        self._owed = False  # the disk checkpoint is newer than a memory save put off
        if self.cadence is not None:
            now = time.monotonic()
            self.cadence.record_step(step, now, busy=self.engine.in_flight is not None)
            self.cadence.other_saved(step, now)

    def before_disk_save(self, step: int) -> None:
        """A disk save of ``step`` was submitted: memory steps of an abandoned timeline go (see :meth:`_drop`)."""
        if isinstance(step, int):
            self._saw(step)
        if self.layout.is_leader and not self.read_only:
            self._drop(step, inclusive=False)

    def _drop(self, step: int, *, inclusive: bool) -> None:
        """Leader: delete memory steps newer than ``step`` (and ``step`` itself when ``inclusive``), and after
        a restore of step S every step newer than S: they belong to an abandoned timeline or an earlier run,
        and a restart must never resume them."""
        limit = step if self.rolled_back_to is None else min(step, self.rolled_back_to)
        self.rolled_back_to = None
        if self.peers is not None:
            self.peers.drop_newer(limit)
        if not self.root.is_dir():
            return
        doomed = []
        for entry in self.root.iterdir():
            s = self.naming.step_of(entry.name)
            if s is not None and (s > limit or (inclusive and s == step)) and entry.is_dir() \
                    and not entry.is_symlink():
                doomed.append((s, entry))
        newer = sorted(s for s, _ in doomed if s != step or not inclusive)
        if newer:
            log.warning("memory tier: deleting step(s) %s of %s, newer than step %d (an abandoned timeline or "
                        "an earlier run's); they are never resumed", newer, self.root, limit)
        for _, entry in doomed:
            discard_step_dir(entry)

    def _after_commit(self, final: Path) -> Callable[[], None] | None:
        """Writer thread, every rank: memory retention on each node's leader (``memory_keep_last`` newest)."""
        if not self.layout.is_leader:
            return None
        if self.peers is not None:
            self.peers.committed(cast(int, self.naming.step_of(final.name)))
        retired = self._retire()
        return functools.partial(_recycle, retired, self.spare, final) if retired else None

    def _retire(self) -> list[Path]:
        """Leader (writer or replication thread): retire the memory steps retention drops: all but the
        ``memory_keep_last`` newest, the step being sent to the partners and the newest node-loss-safe one."""
        with self._retention:
            keep = self.peers.keeps() if self.peers is not None else set()
            retired = []
            try:
                committed = scan_committed(self.root, self.naming)
                for s in apply_retention(KeepLatest(count=self.keep_last), list(committed), protected=sorted(keep)):
                    retired.append(retire_step_dir(committed[s]))
                    log.debug("memory retention removed step %d (%s)", s, committed[s])
            except (OSError, CheckpointError) as exc:
                log.warning("memory retention in %s failed: %s: %s", self.root, type(exc).__name__, exc)
            return retired

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, *, step: int | None, disk_root: Path, tier: Any, load: Callable[..., None],
                choose: bool = True, disk_per_node: bool = False) -> tuple[int, Lineage] | None:
        """Collective: load the memory step :meth:`CheckpointManager.restore` should take, if any.

        ``step`` None: the newest step every node holds intact in memory (or gets back from a partner), when
        it is newer than every live disk and durable step that can be assembled (a disk step counts only
        when every node holds it intact, with ``disk_per_node`` (node-local disk roots), or the durable tier
        holds it: a node that lost its disk copy of the newest step makes the memory step the newest
        usable one); ``step`` given: that step when only the memory tier holds it. A memory copy
        that is missing on some node or fails verification is passed over with a warning naming the step
        and the reason. Returns ``(step, run segment of the next saves)``, or None: take the disk/durable path.
        Either way :attr:`listed` then holds every node's memory steps, ``{step: lineage}``, for the disk
        path's lineage decision (a restore of an older step is a rollback); ``choose=False`` only lists.
        ``load(directory, verify=...)`` loads a step; ``verify`` (CRC-32) is False for a copy just rebuilt from a
        partner's replica, checked as it arrived.
        The coordinator lists the durable tier in the background: meanwhile the first candidate without the
        durable steps is rebuilt from the partners' replicas where a node lost its copy, and read; the plan with
        the durable steps is agreed before the live state is written. When its first candidate is another
        step, the read is dropped (the live state unchanged) and that plan is followed.

        Raises:
            StateMismatchError: the memory checkpoint does not fit the live state.
        """
        guess, listing, gathered = self._plan(step, disk_root, tier, choose=choose, disk_per_node=disk_per_node)
        early = None  # (step, repairs, problem): the rebuild streamed while the coordinator lists the durable tier
        if guess and guess[0][2] and not guess[0][3]:
            early = (guess[0][0], guess[0][2],
                     repair(self.layout, self.ctx, self.root, self.naming, guess[0][0], guess[0][2]))
        if not (choose and tier is not None):
            return self._follow(guess, load, early, gathered)
        agreed: list[list[_Candidate]] = []

        def agree(cand: int, repairs: Any) -> Lineage:
            """Collective the first time, before the live state is written: the plan with the durable steps; the
            run segment ``cand`` continues, or :class:`_Superseded`."""
            if not agreed:
                agreed.append(self._decide(step, gathered, listing, disk_per_node))
            first = next((entry for entry in agreed[0] if not entry[3]), None)
            if first is None or (first[0], first[2]) != (cand, repairs):
                raise _Superseded()
            return first[1]

        tried: set[int] = set()
        try:
            done = self._first([entry[:3] for entry in guess if not entry[3]], load, early, agree=agree, tried=tried,
                               gathered=gathered)
        except _Superseded:
            done = None
        if done is not None:
            self.fallbacks = [entry[:3] for entry in agreed[0] if entry[3]]
            return done
        if not agreed:  # every guessed candidate failed before the agreement
            agreed.append(self._decide(step, gathered, listing, disk_per_node))
        return self._follow([entry for entry in agreed[0] if entry[0] not in tried], load, early, gathered)

    def _follow(self, plan: list[_Candidate], load: Callable[..., None], early: tuple[int, Any, str | None] | None,
                gathered: list[tuple[Any, ...]]) -> tuple[int, Lineage] | None:
        """Collective: load the first candidate of the agreed ``plan`` that works; keep its fallbacks."""
        self.fallbacks = [entry[:3] for entry in plan if entry[3]]
        return self._first([entry[:3] for entry in plan if not entry[3]], load, early, gathered=gathered)

    def restore_newer(self, step: int, load: Callable[..., None]) -> tuple[int, Lineage] | None:
        """Collective: the disk/durable path restored ``step`` after the newest usable disk or durable step failed
        to load; load the newest memory step newer than ``step`` (older than that failed one, so :meth:`restore`
        passed it over), if any works. Returns as :meth:`restore`; None: ``step`` stands."""
        plan, self.fallbacks = [entry for entry in self.fallbacks if entry[0] > step], []
        if plan:
            log.warning("memory tier: the disk/durable path fell back to step %d; memory step(s) %s are newer",
                        step, [entry[0] for entry in plan])
        return self._first(plan, load, None) if plan else None

    def _first(self, plan: list[tuple[int, Lineage, Any]], load: Callable[..., None],
               early: tuple[int, Any, str | None] | None, *, agree: Callable[[int, Any], Lineage] | None = None,
               tried: set[int] | None = None, gathered: list[tuple[Any, ...]] | None = None
               ) -> tuple[int, Lineage] | None:
        """Collective: load the first memory candidate of ``plan`` that works (``early``: a rebuild already done).
        ``agree(step, repairs)``, when given, is called once a candidate is read, before the live state is
        written: it returns the candidate's run segment or raises :class:`_Superseded`; ``tried`` collects the
        steps that failed. A node whose own copy fails its checks while reading gets it rebuilt from a partner's
        replica listed in ``gathered`` (the inventories of :meth:`_plan`), and the step is read again, once."""
        for cand, lineage, planned in plan:
            if early is not None and early[:2] == (cand, planned):
                problem = early[2]
            else:
                problem = repair(self.layout, self.ctx, self.root, self.naming, cand, planned) if planned else None
            repairs, again = dict(planned), True
            while problem is None:
                checked = self.layout.node in repairs  # rebuilt: every file's CRC-32 was checked as it arrived
                before_write = None if agree is None else functools.partial(agree, cand, planned)
                try:
                    restore_node_local(self.layout, self.ctx, None, self.root, self.naming,
                                       functools.partial(load, verify=not checked, before_write=before_write),
                                       step=cand, read_only=True)
                    break
                except (CheckpointCorruptError, CheckpointNotFoundError, CheckpointReadError) as exc:
                    extra = self._replicas_for(cand, exc, repairs, gathered) if again else None
                    if not extra:
                        problem = f"{type(exc).__name__}: {exc}"
                        break
                    again = False
                    log.warning("memory tier: the copy of step %d on node(s) %s failed its checks (%s); rebuilding it "
                                "from the partners' replicas", cand, sorted(extra), exc)
                    repairs.update(extra)
                    problem = repair(self.layout, self.ctx, self.root, self.naming, cand, extra)
            if problem is not None:
                if tried is not None:
                    tried.add(cand)
                log.warning("memory tier: step %d could not be restored from %s (%s); falling back to %s", cand,
                            self.root, problem, "an older memory step" if cand != plan[-1][0] else
                            "the disk and durable tiers")
                continue
            log.info("[rank %d] restored step %d from the memory tier %s%s", self.ctx.rank, cand, self.root,
                     " (its copy rebuilt from a partner's replica)" if self.layout.node in repairs else "")
            self.source = "memory-peer" if self.layout.node in repairs else "memory"
            self.restored(cand)
            if self.peers is not None and self.layout.is_leader:
                self.peers.committed(cand)  # node-loss-safe again: the partners may lack it (a rebuilt copy, a kill)
            return cand, lineage if agree is None else agree(cand, planned)  # (agreed already: no collective)
        return None

    def _replicas_for(self, step: int, exc: BaseException, repairs: dict[int, int],
                      gathered: list[tuple[Any, ...]] | None) -> dict[int, int] | None:
        """Collective, after a read of ``step`` failed on some rank: ``{node: holder}`` for the nodes whose own copy
        failed (each rank says whether its own read raised ``exc``, not another rank's), each with a partner
        holding an intact replica of it; None when a node is not rebuilt yet and none holds one."""
        own = getattr(exc, "failed_ranks", None) is None
        bad = {n for n in self.ctx.all_gather(self.layout.node if own else None, what="memory copies that failed")
               if n is not None}
        if not bad or gathered is None or bad & set(repairs):
            return None
        holders = {source: node for node, _, _, _, reps, _ in gathered for source, steps in reps.items()
                   if step in steps and source in bad and node != source}
        return holders if set(holders) == bad else None

    def restored(self, step: int) -> None:
        """A restore (of any tier) loaded ``step``: memory steps newer than it go at the next save."""
        self.rolled_back_to = step

    def _plan(self, step: int | None, disk_root: Path, tier: Any, *, choose: bool, disk_per_node: bool,
              ) -> tuple[list[_Candidate], Future | None, list[tuple[Any, ...]]]:
        """Every rank: gather every node's memory, replica and disk steps (sets :attr:`listed`), the coordinator
        listing the durable tier in the background from then on; ``(guess, listing, gathered)``: ``guess`` the plan of
        :meth:`_choose` without the durable steps (rank 0 decides, every rank gets it; empty when not ``choose``),
        ``listing`` the coordinator's durable listing (:meth:`_decide` waits for it)."""
        mine: tuple[Any, ...] = (self.layout.node, None, {}, {}, {}, set())
        try:
            inv = local_inventory(self.root, self.naming, self.layout) \
                if self.layout.is_leader and self.root.is_dir() else None
            mem = {s: m.lineage for s, (_, m) in scan_manifests(self.root, self.naming).items()} \
                if inv is not None else {}
            lists_disk = self.runs.acts_on_root and disk_root.is_dir()
            disk = {s: m.lineage for s, (_, m) in scan_manifests(disk_root, self.naming).items()} if lists_disk else {}
            intact = set(local_inventory(disk_root, self.naming, self.layout)) if lists_disk else set()
            replicas = replica_inventory(self.root, self.naming, self.layout) \
                if inv is not None and not self.read_only else {}  # a rebuild writes into memory_root
            mine = (self.layout.node, inv, mem, disk, replicas, intact)
        except (CheckpointError, OSError) as exc:
            log.warning("memory tier: cannot list %s (%s: %s); not restoring from memory", self.root,
                        type(exc).__name__, exc)
        listing = None  # started after the local scans: its Python work would slow their many system calls
        if choose and tier is not None and self.ctx.is_coordinator:
            pool = ThreadPoolExecutor(1, thread_name_prefix="torch-ckpt-durable-listing")
            listing = pool.submit(_durable_steps, tier)
            pool.shutdown(wait=False)
        gathered = self.ctx.all_gather(mine, what="memory inventory")
        self.listed = {s: lin for _, _, mem, _, reps, _ in gathered
                       for s, lin in [*mem.items(), *(kv for r in reps.values() for kv in r.items())]}
        if not choose:
            return [], None, gathered
        guess: list[_Candidate] = []
        if self.ctx.is_coordinator:
            guess = self._choose(step, gathered, {}, disk_per_node,
                                 warn=log.warning if tier is None else lambda *_: None)
        return self.ctx.broadcast(guess, what="memory restore plan"), listing, gathered

    def _decide(self, step: int | None, gathered: list[tuple[Any, ...]], listing: Future | None,
                disk_per_node: bool) -> list[_Candidate]:
        """Every rank: the memory candidates, newest first, each with the run segment it continues and the nodes to
        rebuild from a partner's replica, ``{node: holder}``: rank 0 decides, with the durable steps once listed
        (without a durable tier, the guess of :meth:`_plan` is the plan)."""
        plan: list[_Candidate] = []
        if listing is not None:  # the coordinator's
            plan = self._choose(step, gathered, listing.result(), disk_per_node)
        return self.ctx.broadcast(plan, what="memory restore plan (durable steps listed)")

    def _choose(self, step: int | None, gathered: list[tuple[Any, ...]], durable: dict[int, Lineage],
                disk_per_node: bool, *, warn: Callable[..., None] = log.warning) -> list[_Candidate]:
        """Rank 0: the plan of :meth:`_decide` from the gathered inventories and the durable steps ``{step:
        lineage}`` (``disk_per_node``: see :meth:`restore`); ``warn`` logs the steps passed over."""
        held: dict[int, set[int]] = {}  # memory step -> nodes holding their own intact copy
        holders: dict[int, dict[int, int]] = {}  # memory step -> {node: a node holding its intact replica}
        mem_lineage: dict[int, Lineage] = {}
        disk: dict[int, Lineage] = {}
        seen: list[Lineage] = list(durable.values())
        on_disk: dict[int, set[int]] = {}  # node -> its intact disk steps (from the rank acting on its root)
        for node, inv, mem, dsk, reps, intact in gathered:
            seen += [*mem.values(), *dsk.values()]
            disk.update(dsk)
            if intact:
                on_disk.setdefault(node, set()).update(intact)
            mem_lineage.update(mem)  # a copy some node lists, intact or not
            for s, kind in (inv or {}).items():
                if kind == "node" and s in mem:
                    held.setdefault(s, set()).add(node)
            for source, steps in reps.items():
                for s, lin in steps.items():
                    holders.setdefault(s, {}).setdefault(source, node)
                    mem_lineage.setdefault(s, lin)
                    seen.append(lin)
        head = head_of(seen)
        persistent = [s for s, lin in [*disk.items(), *durable.items()] if head.holds(s, lin)]
        nodes = set(range(self.layout.node_count))
        everywhere = set.intersection(*(on_disk.get(n, set()) for n in nodes)) if disk_per_node else \
            set().union(*on_disk.values())
        usable = [s for s in persistent if s in durable or s in everywhere]  # a restore can assemble them
        live_mem = sorted((s for s in mem_lineage if head.holds(s, mem_lineage[s])), reverse=True)
        newest = max([*persistent, *live_mem], default=None)
        fork = new_segment(seen)

        def rebuilt(s: int) -> dict[int, int] | None:  # {node: holder} for the nodes lacking their copy; None: lost
            lacking = nodes - held.get(s, set())
            found = {n: h for n, h in holders.get(s, {}).items() if n in lacking}
            return found if set(found) == lacking else None

        if step is not None:
            repairs = rebuilt(step) if step in mem_lineage else None
            if step in disk or step in durable or repairs is None:
                return []  # the disk/durable path serves it, or says why not
            lin = mem_lineage[step]
            return [(step, successor(lin, step, newest=step == newest and lin.run == head.run, fork=fork), repairs,
                     False)]
        floor = max(usable, default=-1)
        if floor < max(persistent, default=-1):
            warn("memory tier: the newest disk step %d is not intact on every node (and the durable tier has no "
                 "copy); the newest usable disk step is %s", max(persistent), floor if floor >= 0 else "none")
        plan: list[tuple[int, Lineage, Any, bool]] = []  # (step, segment, repairs, below the disk floor)
        for s in live_mem:
            repairs = rebuilt(s)
            if s <= floor:  # only if that disk/durable step fails to load (restore_newer)
                if repairs is not None:
                    plan.append((s, successor(mem_lineage[s], s, newest=False, fork=fork), repairs, True))
                continue
            if repairs is None:
                if plan:  # older than a usable step: only a fallback, not worth a warning
                    continue
                warn("memory tier: step %d is missing or incomplete in memory on node(s) %s, and no partner holds "
                     "an intact replica; falling back to an older step (memory or the disk and durable tiers)", s,
                     sorted(nodes - held.get(s, set())))
                continue
            if repairs and not plan:  # the step the restore tries first; an older one is only a fallback
                warn("memory tier: node(s) %s lost their copy of step %d; taking it from the replica on node(s) %s",
                     sorted(repairs), s, sorted(set(repairs.values())))
            lin = mem_lineage[s]
            plan.append((s, successor(lin, s, newest=s == newest and lin.run == head.run, fork=fork), repairs, False))
        return plan

    # -- health ----------------------------------------------------------------------------------
    def newest(self) -> tuple[int | None, float | None]:
        """The newest memory step on this node and the age (seconds) of the state it holds."""
        committed = scan_committed(self.root, self.naming) if self.root.is_dir() else {}
        if not committed:
            return None, None
        step = max(committed)
        return step, self.age_of(step, committed[step])

    def age_of(self, step: int, directory: Path | None = None) -> float | None:
        """Seconds since the state of memory ``step`` was captured (an earlier process's: its commit time)."""
        captured = self.captured_at.get(step)
        if captured is None:
            try:
                captured = read_manifest(directory or self.root / self.naming.name(step)).wall_time
            except CheckpointError:
                return None
        return time.time() - captured


#: In ``memory_root``: the run root it belongs to (its absolute path), written by the first manager using it.
OWNER_NAME = ".torch-ckpt.run-root"


def _durable_steps(tier: Any) -> dict[int, Lineage]:
    """The durable tier's ``{step: lineage}``; none (logged) when it cannot be listed."""
    try:
        return {s: m.lineage for s, m in tier.listed().items()}
    except (DurableUnavailableError, CheckpointError, OSError) as exc:
        log.info("memory tier: the durable tier is not listed (%s); comparing with the disk tier only", exc)
        return {}


#: File systems that keep their files in RAM.
_IN_RAM = ("tmpfs", "ramfs", "hugetlbfs")


def _warn_unless_in_ram(root: Path) -> None:
    """Warn when ``root`` lies on a file system that is not held in RAM (a memory tier on disk is a second disk
    tier: its saves cost disk writes). Silent where the mounts cannot be read."""
    import psutil

    try:
        mounts = {Path(p.mountpoint): p.fstype for p in psutil.disk_partitions(all=True)}
    except (OSError, RuntimeError):
        return
    real = root.resolve()
    mount = max((m for m in mounts if m == real or m in real.parents), key=lambda m: len(m.parts), default=None)
    if mount is not None and mounts[mount] not in _IN_RAM:
        log.warning("memory tier: memory_root %s is on a %s file system (%s), not in RAM: its saves are disk writes; "
                    "use a directory on a tmpfs such as /dev/shm", root, mounts[mount] or "unknown", mount)


def _claim(root: Path, disk_root: Path, *, read_only: bool) -> ConfigError | None:
    """Bind ``root`` to the run root ``disk_root``: a memory root holding another run root's checkpoints is refused
    (another job's memory steps are never resumed, nor deleted); an error, or None."""
    marker, owner = root / OWNER_NAME, str(disk_root)
    try:
        claimed = marker.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        if not read_only:
            write_durable(marker, owner.encode("utf-8"))
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return ConfigError(f"memory_root {root}: cannot read {marker} ({exc}); remove it if the directory is yours")
    if claimed != owner:
        return ConfigError(f"memory_root {root} holds the memory checkpoints of the run root {claimed}, not of "
                           f"{owner}: give this run a memory_root of its own (e.g. /dev/shm/<run>; with a root per "
                           "node, as simulated nodes have, one per node too), or remove "
                           f"{root} if that run is over")
    return None


def memory_health(report: dict[str, Any], memory: MemoryTier | None, *, lost_with_node: bool = False) -> dict[str, Any]:
    """``report`` (:meth:`CheckpointManager.health`) with the memory tier's keys (see there); ``lost_with_node``:
    the disk root is node-local and no durable tier holds a copy, so a node loss takes its disk steps too."""
    step, age = memory.newest() if memory is not None else (None, None)
    ages = [a for a in (report.get("latest_age_s"), report.get("durable_age_s"), report.get("durable_newest_age_s"),
                        age) if a is not None]
    peers = memory.peers if memory is not None else None
    safe = peers.safe if peers is not None else None
    safe_age = memory.age_of(safe) if memory is not None and safe is not None else None
    durable, durable_age = (None, None) if lost_with_node else \
        (report.get("durable_step"), report.get("lost_work_if_failure_now_s"))
    node = [a for a in (safe_age, durable_age) if a is not None]
    last = memory.last_step if memory is not None else None

    def behind(*steps: int | None) -> int | None:
        known = [s for s in steps if s is not None]
        return None if last is None else last - max(known) if known else last

    return {**report, "memory_step": step, "memory_age_s": age,
            "lost_work_if_restart_now_s": min(ages) if ages else None,
            "memory_safe_step": safe, "lost_work_if_node_lost_s": min(node) if node else None,
            "lost_steps_if_node_lost": behind(safe, durable), "lost_work_if_job_lost_s": durable_age,
            "lost_steps_if_job_lost": behind(durable),
            "memory_replication": {**peers.stats, "partners": peers.partners, "sent_step": peers.sent}
            if peers is not None else {}}


def _delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _remove_spare(spare: Path) -> None:
    """Delete the spare directory (a symlink or file in its place: the link itself, never its target)."""
    try:
        if stat.S_ISDIR(os.lstat(spare).st_mode):
            shutil.rmtree(spare, ignore_errors=True)
        else:
            os.unlink(spare)
    except OSError:
        pass  # missing, or gone meanwhile


def _recycle(paths: list[Path], spare: Path, kept: Path) -> None:
    """Delete the retired step directories ``paths`` (hidden already), first moving their data files into
    ``spare``, up to the bytes of the step ``kept`` just committed (about what the next save writes): only
    files of at least :data:`SPARE_MIN_BYTES` with a single link (a hard link is another checkpoint's file too).
    On a tmpfs the next save then writes over their pages instead of freeing and allocating them again."""
    try:
        budget = sum(e.stat().st_size for e in os.scandir(kept) if e.is_file(follow_symlinks=False))
        if os.path.lexists(spare) and not stat.S_ISDIR(os.lstat(spare).st_mode):
            _remove_spare(spare)  # a symlink or a file put there: never followed
        spare.mkdir(exist_ok=True)
        held = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(spare))
        for path in paths:
            for entry in os.scandir(path):
                info = entry.stat(follow_symlinks=False)
                if entry.name.endswith(DATA_SUFFIX) and stat.S_ISREG(info.st_mode) and info.st_nlink == 1 \
                        and SPARE_MIN_BYTES <= info.st_size <= budget - held:
                    os.rename(entry.path, spare / secrets.token_hex(8))
                    held += info.st_size
    except OSError as exc:
        log.debug("memory tier: retired files not recycled: %s", exc)
    _delete(paths)

