"""``CheckpointConfig``: every setting of a :class:`~torch_ckpt.CheckpointManager`, typed and validated once.

The manager and the Lightning and Accelerate adapters build from it, so every integration shares one set
of names and defaults; durations are stored as float seconds, byte sizes as int bytes, signals as a tuple.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_ckpt._values import DEFAULT, DefaultType, check_bool, check_int, parse_size, to_bytes, to_seconds
from torch_ckpt.errors import ConfigError
from torch_ckpt.policy._naming import Naming
from torch_ckpt.policy._preemption import parse_signals
from torch_ckpt.policy._retention import KeepAny, KeepEveryNSteps, KeepLatest, RetentionPolicy
from torch_ckpt.policy._schedule import FORMULAS, AnyOf, EveryNSeconds, EveryNSteps, SavePolicy, YoungDaly

#: fields that take Python objects: code only, never from a settings file
CODE_ONLY_FIELDS = frozenset({"retention", "save_policy", "process_group", "naming"})

__all__ = ["CheckpointConfig", "parse_size", "DEFAULT", "DefaultType", "ON_EXISTING_NEWER", "PERSIST_MODES",
           "DURABLE_VERIFY", "ON_WRITE_ERROR", "RANK_LOCAL_POLICIES"]

# the accepted values of persist, on_existing_newer, durable_verify, on_write_error, on_world_size_change
PERSIST_MODES = ("thread", "process")
ON_EXISTING_NEWER = ("error", "supersede")
DURABLE_VERIFY = ("checksum", "size")
ON_WRITE_ERROR = ("raise", "warn")
RANK_LOCAL_POLICIES = ("error", "keep_live")
#: Types an integration's own file keys may have (:meth:`CheckpointConfig.from_dict_with_extras`).
_EXTRA_TYPES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Every setting of a :class:`~torch_ckpt.CheckpointManager` (all keyword-only, all optional).

    Attributes:
        keep_last: Keep this many newest committed checkpoints (int >= 1; ``None`` keeps all).
        keep_every_n_steps: Also keep every step that is a multiple of this (int >= 1 or ``None``).
        retention: A custom :class:`~torch_ckpt.RetentionPolicy`; replaces the two above.
        async_save: Persist in the background (``save()`` returns once staged) or inside ``save()``.
        persist: Where background writes run: ``"thread"`` (lowest latency to durable) or ``"process"`` (a
            writer process per rank, off the trainer's GIL; not for DTensor/FSDP2 states).
        overlap_staging: Copy parameters and optimizer state (``optimizer_owned_keys``) in the background,
            overlapping the next forward/backward; the state's optimizers wait for it before their next
            ``step()``; other mutations of them must call ``wait_staged()`` first.
        writer_niceness: Nice increment of the writer on Linux (int 0-19; 0 = unchanged; on 2 cores, 19 cuts
            the writer's slowdown of training from about 2x to 1.2x).
        staging_budget_bytes: Host bytes for the reusable staging buffers (int or ``"4GB"``); ``None``: half
            the available memory (cgroup-aware) over the local ranks. A state that does not fit is saved
            synchronously from the live tensors (logged), never by over-allocating.
        thread_count: DCP writer threads (and files) per rank (int, 1-256); 2 overlaps checksumming with writing.
        incremental: Do not rewrite tensors unchanged since the last committed save into the same root (same
            CRC-32 of their staged bytes): hard-link the data file holding them (the durable tier copies it
            server-side). Each checkpoint stays self-contained; ``False`` writes every byte of every save.
        verify_on_load: Check every file's CRC-32 before loading (sizes are always checked).
        on_world_size_change: What ``restore()`` does with rank-local state (RNG, dataloader position)
            when the world size differs: ``"error"`` or ``"keep_live"``.
        timeout_seconds: Limit for checkpoint collectives between ranks (seconds or duration, > 0).
        process_group: Ranks taking part (default: all); checkpoint traffic uses private gloo groups from it.
        save_policy: When ``should_save()`` says yes (rank 0 decides for all): a :class:`~torch_ckpt.SavePolicy`
            such as ``YoungDaly(mtbf_seconds="8h")``; exclusive with the flat fields below, which build one.
        mtbf_seconds: Mean time between failures of the job (seconds or duration, > 0): ``YoungDaly``.
        save_every_n_steps: Save every this many steps (int >= 1).
        save_every_seconds: Save once this much time passed since the last save (seconds or duration, > 0).
        initial_cost_seconds: With ``mtbf_seconds``: the save cost assumed until one is measured (>= 0).
        formula: With ``mtbf_seconds`` (and ``memory_mtbf_seconds``): ``"daly"`` or ``"young"``.
        min_interval_steps: With ``mtbf_seconds``: never save more often than every this many steps.
        durable_url: fsspec URL of the durable tier (``s3://bucket/run``, ``file://``...), outside the local
            root; committed checkpoints are replicated there in the background.
        storage_options: fsspec options for ``durable_url`` (credentials, endpoint...).
        replicate_every_n_saves: Replicate every n-th save (int >= 1).
        durable_keep_last: Durable retention: keep this many newest durable checkpoints (``None``: all).
        durable_keep_every_n_steps: Durable retention: also keep multiples of this step.
        durable_verify: ``"checksum"`` (every upload checked: by the S3 ETag, else read back and
            CRC-32 compared) or ``"size"`` (sizes only, where no ETag vouches for the bytes).
        durable_flush_timeout_seconds: How long ``close()`` waits for pending replication (>= 0).
        preemption_signals: Signals requesting an emergency save at the next ``should_save()``/``save_if_due()``.
        preemption_timeout_seconds: How long the emergency save may take to commit before exiting (> 0).
        on_write_error: ``"raise"`` or ``"warn"`` (log failed background saves and continue).
        on_existing_newer: When the root holds newer committed steps this manager did not restore (an
            earlier run's): ``"error"`` in ``save()``, or ``"supersede"`` (moved aside, hidden, kept).
        read_only: Only read the root: no lock, nothing created or cleaned, ``save()`` refused.
        explicit_paths_only: Every save names its directory (``save(path=...)``); the root is only their
            folder: not locked, cleaned, pruned or moved aside from. Not with ``durable_url``.
        naming: How step directories are named (a :class:`~torch_ckpt.policy.Naming`; ``None``:
            ``StepNaming()``); listing, resume and retention only consider names it parses.
        local_root_shared: The root is one directory seen by every rank (``True``) or private to each
            node (``False``: each commits and uploads its own shards; a replaced node fetches only its
            own). ``None``: private when the ranks span several nodes.
        durable_upload_threads: Large files each node transfers to or from the durable tier at once (int,
            1-256): at most this many parts (64 MiB; 8 MiB chunks for downloads) in flight, small files beside.
        durable_timeout_seconds: Longest silence of the durable store waited out on the caller's thread
            (``restore()``; > 0; also botocore's connect/read timeouts unless ``storage_options`` sets them).
        durable_create: Create a missing durable bucket; by default it is an outage (``DurableUnavailableError``).
        memory_root: Local directory of the memory tier, typically under ``/dev/shm`` (tmpfs: it outlives the
            trainer process, not the node); ``None``: no memory tier. Each node keeps its own copy there (the
            node-local layout, even for one node); not the root nor inside it. A node loss loses that node's
            memory copies: ``restore()`` takes them from a partner's replica (``memory_replicas``), else
            falls back to the disk and durable tiers.
        memory_every_n_steps: Memory tier: ``save_if_due()`` saves into ``memory_root`` every this many steps
            when no disk save is due (int >= 1).
        memory_every_seconds: Memory tier: ``save_if_due()`` saves into ``memory_root`` once this much time
            passed since the last memory save, when no disk save is due (seconds or duration, > 0).
        memory_mtbf_seconds: Memory tier: the mean time between the failures it protects against (process
            and job restarts on the same nodes; seconds or duration, > 0): ``save_if_due()`` saves into
            ``memory_root`` at the ``YoungDaly`` interval of the memory saves' own measured cost (``formula``
            applies; no cost is assumed before the first memory save is measured). Combined with
            ``memory_every_n_steps``/``memory_every_seconds``, a memory save is due when any of them says so.
        memory_keep_last: Memory tier retention: keep this many newest steps in ``memory_root`` (int >= 1;
            each kept step holds about the node's share of the state in RAM).
        memory_replicas: Memory tier: partner nodes that hold a copy of each node's newest memory step in
            their ``memory_root`` (int >= 0; 0: none), sent in the background after each memory save and
            checked by CRC-32 on arrival, so a node loss resumes from a partner's RAM. Ignored on one node.
        memory_partner_stride: Memory tier: node ``k`` sends to nodes ``k + stride * i`` (mod the node count),
            ``i = 1..memory_replicas``; e.g. the nodes per rack, so that a copy leaves the rack (int >= 1).
        memory_replication_bytes_per_second: Memory tier: cap on the bytes per second each node sends to
            its partners (int or size such as ``"1GB"``); ``None``: no cap.

    Raises:
        ConfigError: A value is out of range or of the wrong type, or two fields conflict; the
            message names the field, the value and what is accepted.
    """

    keep_last: int | None = 3
    keep_every_n_steps: int | None = None
    retention: RetentionPolicy | None = None
    async_save: bool = True
    persist: str = "thread"
    overlap_staging: bool = False
    writer_niceness: int = 0
    staging_budget_bytes: int | str | None = None
    thread_count: int = 2
    incremental: bool = True
    verify_on_load: bool = True
    on_world_size_change: str = "error"
    timeout_seconds: float | str = 600.0
    process_group: Any = None
    save_policy: SavePolicy | None = None
    mtbf_seconds: float | str | None = None
    save_every_n_steps: int | None = None
    save_every_seconds: float | str | None = None
    initial_cost_seconds: float | str = 5.0
    formula: str = "daly"
    min_interval_steps: int = 1
    durable_url: str | None = None
    storage_options: Mapping[str, Any] | None = None
    replicate_every_n_saves: int = 1
    durable_keep_last: int | None = None
    durable_keep_every_n_steps: int | None = None
    durable_verify: str = "checksum"
    durable_flush_timeout_seconds: float | str = 300.0
    preemption_signals: tuple[str | int, ...] = ()
    preemption_timeout_seconds: float | str = 120.0
    on_write_error: str = "raise"
    on_existing_newer: str = "error"
    read_only: bool = False
    explicit_paths_only: bool = False
    naming: Naming | None = None
    local_root_shared: bool | None = None
    durable_upload_threads: int = 1
    durable_timeout_seconds: float | str = 30.0
    durable_create: bool = False
    memory_root: str | None = None
    memory_every_n_steps: int | None = None
    memory_every_seconds: float | str | None = None
    memory_mtbf_seconds: float | str | None = None
    memory_keep_last: int = 2
    memory_replicas: int = 1
    memory_partner_stride: int = 1
    memory_replication_bytes_per_second: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("async_save", "overlap_staging", "verify_on_load", "read_only", "durable_create",
                     "explicit_paths_only", "incremental"):
            check_bool(name, getattr(self, name))
        for name in ("keep_last", "keep_every_n_steps", "save_every_n_steps", "durable_keep_last",
                     "durable_keep_every_n_steps", "memory_every_n_steps"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.local_root_shared is not None and not isinstance(self.local_root_shared, bool):
            raise ConfigError(f"local_root_shared must be true, false or None, got {self.local_root_shared!r}")
        for name in ("min_interval_steps", "replicate_every_n_saves", "memory_keep_last", "memory_partner_stride"):
            check_int(name, getattr(self, name), 1)
        check_int("memory_replicas", self.memory_replicas, 0)
        for name in ("thread_count", "durable_upload_threads"):  # threads (and files) per rank
            check_int(name, getattr(self, name), 1, maximum=256)
        check_int("writer_niceness", self.writer_niceness, 0, maximum=19)
        for name, choices in (("persist", PERSIST_MODES), ("on_world_size_change", RANK_LOCAL_POLICIES),
                              ("formula", tuple(FORMULAS)), ("durable_verify", DURABLE_VERIFY),
                              ("on_write_error", ON_WRITE_ERROR), ("on_existing_newer", ON_EXISTING_NEWER)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {list(choices)}, got {getattr(self, name)!r}")
        for name, positive in (("timeout_seconds", True), ("initial_cost_seconds", False),
                               ("durable_flush_timeout_seconds", False), ("preemption_timeout_seconds", True),
                               ("mtbf_seconds", True), ("save_every_seconds", True),
                               ("durable_timeout_seconds", True), ("memory_every_seconds", True),
                               ("memory_mtbf_seconds", True)):
            if getattr(self, name) is not None or name not in ("mtbf_seconds", "save_every_seconds",
                                                               "memory_every_seconds", "memory_mtbf_seconds"):
                self._set(name, to_seconds(name, getattr(self, name), positive=positive))  # four are optional
        for name in ("staging_budget_bytes", "memory_replication_bytes_per_second"):
            if getattr(self, name) is not None:
                self._set(name, to_bytes(name, getattr(self, name)))
        for name, kind, what in (("retention", RetentionPolicy, "be a RetentionPolicy (keep(steps) -> set)"),
                                 ("save_policy", SavePolicy, "be a SavePolicy (YoungDaly, EveryNSteps, ...)"),
                                 ("naming", Naming, "provide name(step) and step_of(name) (torch_ckpt.policy.Naming)"),
                                 ("storage_options", Mapping, "be a mapping of fsspec options")):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} must {what}, got {getattr(self, name)!r}")
        flat = [n for n in ("mtbf_seconds", "save_every_n_steps", "save_every_seconds") if getattr(self, n) is not None]
        if self.save_policy is not None and flat:
            raise ConfigError(f"give either save_policy or {flat[0]}, not both (the flat fields build a policy)")
        self._check_durable()
        self._check_memory()
        if not isinstance(self.preemption_signals, (list, tuple)):
            raise ConfigError(f"preemption_signals must be a list of signal names or numbers, e.g. ['SIGTERM'], "
                              f"got {self.preemption_signals!r}")
        parse_signals(self.preemption_signals)  # raises ConfigError naming an unknown signal
        self._set("preemption_signals", tuple(self.preemption_signals))

    def _check_durable(self) -> None:
        if self.durable_url is not None and (not isinstance(self.durable_url, str) or not self.durable_url):
            raise ConfigError(f"durable_url must be a non-empty URL string, got {self.durable_url!r}")
        if self.storage_options is not None:
            self._set("storage_options", dict(self.storage_options))  # a copy: the caller's later edits stay out
        if self.durable_url is None and (self.durable_keep_last is not None
                                         or self.durable_keep_every_n_steps is not None):
            raise ConfigError("durable_keep_last/durable_keep_every_n_steps need durable_url")
        if self.explicit_paths_only and self.durable_url is not None:
            raise ConfigError("explicit_paths_only=True cannot be combined with durable_url: only checkpoints "
                              "under the root's own names are replicated")
        if self.read_only and self.durable_url is not None:
            raise ConfigError("read_only=True cannot be combined with durable_url: a durable checkpoint is "
                              "downloaded into the local root; open the durable copy's directory instead")

    def _check_memory(self) -> None:
        root = self.memory_root
        if root is None:
            if any(getattr(self, n) is not None for n in ("memory_every_n_steps", "memory_every_seconds",
                                                            "memory_mtbf_seconds")):
                raise ConfigError("memory_every_n_steps/memory_every_seconds/memory_mtbf_seconds need memory_root "
                                  "(the memory tier's directory, e.g. /dev/shm/<run>)")
            return
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str) or not root or "://" in root:
            raise ConfigError(f"memory_root must be a non-empty local directory path (e.g. /dev/shm/<run>), "
                              f"got {self.memory_root!r}")
        self._set("memory_root", root)

    def check_memory_root(self, root: str | os.PathLike[str]) -> Path | None:
        """``memory_root`` as an absolute path, checked against the run ``root``; None without a memory tier.

        Raises:
            ConfigError: ``memory_root`` is ``root``, inside it or contains it, also through a symbolic link
                (the message names the field).
        """
        if self.memory_root is None:
            return None
        memory, disk = Path(self.memory_root).expanduser().absolute(), Path(root).expanduser().absolute()
        real_memory, real_disk = memory.resolve(), disk.resolve()  # a symlink into the root is the root
        if {memory, real_memory} & {disk, real_disk} or disk in memory.parents or memory in disk.parents \
                or real_disk in real_memory.parents or real_memory in real_disk.parents:
            raise ConfigError(f"memory_root {memory} must not be the checkpoint root {disk}, lie inside it or "
                              "contain it: give the memory tier a directory of its own (e.g. /dev/shm/<run>)")
        if memory.exists() and not memory.is_dir():
            raise ConfigError(f"memory_root {memory} exists and is not a directory: name a directory "
                              "(e.g. /dev/shm/<run>)")
        return memory

    def build_memory_policy(self) -> SavePolicy | None:
        """The memory tier's save policy (``YoungDaly``/``EveryNSteps``/``EveryNSeconds``, ``AnyOf`` when
        several), or None. Its ``YoungDaly`` assumes no cost (0 s) until the first memory save is measured."""
        policies: list[SavePolicy] = []
        if self.memory_mtbf_seconds is not None:
            policies.append(YoungDaly(self.memory_mtbf_seconds, initial_cost_seconds=0.0, formula=self.formula))
        if self.memory_every_n_steps is not None:
            policies.append(EveryNSteps(self.memory_every_n_steps))
        if self.memory_every_seconds is not None:
            policies.append(EveryNSeconds(self.memory_every_seconds))
        return _any_of(policies)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalising in __post_init__ of a frozen dataclass

    # -- what the settings describe --------------------------------------------------------------
    def build_retention(self) -> RetentionPolicy | None:
        """The local retention policy: ``retention``, or one from ``keep_last``/``keep_every_n_steps``."""
        if self.retention is not None:
            return self.retention
        return _keep(self.keep_last, self.keep_every_n_steps)

    def build_durable_retention(self) -> RetentionPolicy | None:
        """The durable tier's retention (``durable_keep_last``/``durable_keep_every_n_steps``), or None."""
        return _keep(self.durable_keep_last, self.durable_keep_every_n_steps)

    def build_save_policy(self) -> SavePolicy | None:
        """``save_policy``, or a new policy the flat fields describe (``AnyOf`` when several), or None."""
        if self.save_policy is not None:
            return self.save_policy
        policies: list[SavePolicy] = []
        if self.mtbf_seconds is not None:
            policies.append(YoungDaly(self.mtbf_seconds, initial_cost_seconds=self.initial_cost_seconds,
                                      formula=self.formula, min_interval_steps=self.min_interval_steps))
        if self.save_every_n_steps is not None:
            policies.append(EveryNSteps(self.save_every_n_steps))
        if self.save_every_seconds is not None:
            policies.append(EveryNSeconds(self.save_every_seconds))
        return _any_of(policies)

    # -- sources ---------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of every setting, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str | None = None,
                  from_file: bool = False) -> CheckpointConfig:
        """Build from a mapping of field names to values (missing fields keep their defaults).

        ``source`` (a file path...) prefixes error messages; ``from_file`` makes an unknown-key error
        list and suggest only the fields a file may hold.

        Raises:
            ConfigError: ``values`` is not a mapping, has an unknown key (the message names it, the
                closest valid name and the valid ones), or has an invalid value.
        """
        return cls.from_dict_with_extras(values, {}, source=source, from_file=from_file)[0]

    @classmethod
    def from_dict_with_extras(cls, values: Mapping[str, Any], extras: Mapping[str, bool | int | float | str], *,
                              source: str | None = None, from_file: bool = False,
                              reserved: Iterable[str] = ()) -> tuple[CheckpointConfig, dict[str, Any]]:
        """Split ``values`` into this config and an integration's own keys (e.g. ``enabled``), validating both.

        Args:
            values: Field name or extra key -> value.
            extras: The integration's own keys and their defaults; a value must have its default's
                type (``bool``, ``int``, ``float`` or ``str``).
            source: Where ``values`` came from (a file path...), prefixed to error messages.
            from_file: ``values`` come from a settings file, which cannot hold the code-only fields.
            reserved: Fields the integration sets itself. ``from_file`` and ``reserved`` only narrow
                the names an unknown-key error suggests; refusing such keys is the caller's job
                (:meth:`read_yaml` does it for files).

        Returns:
            ``(config, extra_values)``: every key of ``extras`` with the given value or its default.

        Raises:
            ConfigError: ``values`` is not a mapping; a key is neither a field nor an extra (the message
                suggests the closest valid name); an extra or field value is invalid.
            TypeError: ``extras`` repeats a field or has a default of another type (a programming error).
        """
        prefix = f"{source}: " if source else ""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{prefix}expected a mapping of settings, got {type(values).__name__}")
        names = cls.field_names()
        if set(extras) & set(names):
            raise TypeError(f"extras must not repeat CheckpointConfig fields: {sorted(set(extras) & set(names))}")
        unknown = sorted(str(k) for k in values if k not in names and k not in extras)
        if unknown:
            hidden = {*reserved, *(CODE_ONLY_FIELDS if from_file else ())}
            valid = [n for n in (*names, *extras) if n not in hidden]
            close = difflib.get_close_matches(unknown[0], valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{prefix}unknown setting(s) {unknown}{hint}; rename or remove "
                              f"{'it' if len(unknown) == 1 else 'them'}. Valid settings: {valid}")
        extra_values = {**extras, **{k: v for k, v in values.items() if k in extras}}
        for key, value in extra_values.items():
            kind = type(extras[key])
            if kind not in _EXTRA_TYPES:
                raise TypeError(f"extras[{key!r}]: default must be a bool, int, float or str, got {kind.__name__}")
            if type(value) is not kind and not (kind is float and type(value) is int):
                raise ConfigError(f"{prefix}{key} must be {_EXTRA_TYPES[kind]}, got {value!r}")
        try:
            return cls(**{k: v for k, v in values.items() if k in names}), extra_values
        except ConfigError as exc:
            if not prefix:
                raise
            raise ConfigError(f"{prefix}{exc}") from None

    @staticmethod
    def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The mapping in a YAML settings file (``{}`` for an empty file), keys not yet validated.

        Plain data only (PyYAML's safe loader, never Python objects); ``~`` is expanded.

        Raises:
            ConfigError: The file cannot be read, is not UTF-8, not YAML, nested too deeply or not a
                mapping, gives a key twice (YAML would keep the last silently), or gives a setting only
                code can give (a Python object); every message names the file.
        """
        import yaml  # imported here so that `import torch_ckpt.config` stays fast

        path = Path(path).expanduser()

        class NoDuplicates(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no annotations
            def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    if isinstance(key, (str, int, float, bool)) and key in seen:
                        raise ConfigError(f"{path}: setting {key!r} is given twice (line "
                                          f"{key_node.start_mark.line + 1}); keep one")
                    seen.add(key)
                mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
                return mapping

        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read the configuration file {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}); save it as UTF-8 YAML") from exc
        try:
            data = yaml.load(text, Loader=NoDuplicates)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
        except RecursionError:  # PyYAML composes nested collections recursively
            raise ConfigError(f"{path}: nested too deeply to be a settings file (setting: value lines)") from None
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        data = dict(data or {})
        objects = sorted(str(k) for k in data if k in CODE_ONLY_FIELDS)
        if objects:
            them = "it" if len(objects) == 1 else "them"
            raise ConfigError(f"{path}: {objects} can only be given in code (they take Python objects); remove "
                              f"{them} from the file and pass {them} to the constructor")
        return data

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> CheckpointConfig:
        """Read a YAML file holding a mapping of field names to values (an empty file gives the defaults).

        Raises:
            ConfigError: The file cannot be read, is not valid YAML, is not a mapping, or has an
                unknown key or invalid value (the message names the file and the key).
        """
        return cls.from_dict(cls.read_yaml(path), source=str(Path(path).expanduser()), from_file=True)

    def replace(self, **changes: Any) -> CheckpointConfig:
        """A copy with ``changes`` applied and validated.

        Raises:
            ConfigError: An unknown field or an invalid value.
        """
        return self.from_dict({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value (normalised: seconds as float, bytes as int; objects as given)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _keep(count: int | None, every: int | None) -> RetentionPolicy | None:
    if count is None:
        return None
    latest = KeepLatest(count=count)
    return latest if every is None else KeepAny((latest, KeepEveryNSteps(every_steps=every)))



def _any_of(policies: list[SavePolicy]) -> SavePolicy | None:
    if not policies:
        return None
    return policies[0] if len(policies) == 1 else AnyOf(*policies)
