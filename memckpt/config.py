"""Configuration: frozen dataclasses, validated at construction.

A user writes a Python file that defines ``config = Config(...)`` and passes its
path to ``memckpt run --config``; :func:`load_config` reads it. Every invalid
value raises :class:`~memckpt.errors.ConfigError` naming the field, the value
and the fix. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import runpy
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from memckpt.policy import placement
from memckpt.policy.footprint import RamBudget, check_ram_budget
from memckpt.errors import ConfigError, PlacementError

CONTENT_KINDS = ("model", "optimizer", "scheduler", "scaler", "data", "rng", "extras")
FALL_BEHIND_POLICIES = ("wait", "skip")
SEALING_POLICIES = ("wait", "skip")
SKIP_UNCHANGED = ("verify", "trust", "off")  # EngineConfig.skip_unchanged
SNAPSHOT_MODES = ("sync", "overlap")
CHAOS_TARGETS = ("worker", "node", "random", "store", "coordinator")
SIGNALS = ("KILL", "STOP", "TERM")
CHAOS_PHASES = ("plan", "start", "restore")  # ChaosEvent.during: the phases of a recovery
BACKENDS = ("auto", "gloo", "nccl")

# S3 bucket naming rules (the common subset every region accepts).
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def _fail(field_name: str, value: Any, fix: str) -> None:
    raise ConfigError(f"{field_name}={value!r} is invalid: {fix}")


def _positive_int(field_name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(field_name, value, f"use a whole number >= {minimum}")


def _positive_float(field_name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        _fail(field_name, value, f"use a finite number {bound} (seconds or units, not a string)")


def _bool(field_name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(field_name, value, "use True or False")


def _choice(field_name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field_name, value, f"choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class WorkersConfig:
    """How many training workers, how they sit on nodes, what each needs."""

    num_workers: int = 1
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    backend: str = "auto"  # torch.distributed backend: gloo on CPU, nccl on GPU
    # Elastic: when a lost node cannot be replaced, go on with fewer ranks (down to
    # min_workers; None: num_workers, no shrinking); grow back when nodes with room appear.
    min_workers: Optional[int] = None
    grow: bool = True
    # every world size the job runs at is a multiple of this (a TP degree, a pipeline depth)
    size_multiple: int = 1

    def __post_init__(self) -> None:
        _positive_int("workers.num_workers", self.num_workers)
        _positive_int("workers.workers_per_node", self.workers_per_node)
        if self.min_workers is None:
            object.__setattr__(self, "min_workers", self.num_workers)
        _positive_int("workers.min_workers", self.min_workers)
        _bool("workers.grow", self.grow)
        _positive_int("workers.size_multiple", self.size_multiple)
        if self.floor > self.num_workers:
            _fail("workers.min_workers", self.min_workers,
                  f"it must be <= workers.num_workers={self.num_workers} (the job never runs "
                  "more ranks than num_workers)")
        _positive_float("workers.cpus_per_worker", self.cpus_per_worker, allow_zero=True)
        _positive_float("workers.gpus_per_worker", self.gpus_per_worker, allow_zero=True)
        _choice("workers.backend", self.backend, BACKENDS)
        if self.num_workers % self.workers_per_node:
            _fail("workers.workers_per_node", self.workers_per_node,
                  f"it must divide workers.num_workers={self.num_workers} so every node runs "
                  "the same number of ranks")
        step = self.size_step
        for name, value in (("workers.num_workers", self.num_workers),
                            ("workers.min_workers", self.floor)):
            if value % step:
                _fail(name, value,
                      f"every world size must be a multiple of {step} (whole nodes of "
                      f"workers_per_node={self.workers_per_node}, and "
                      f"size_multiple={self.size_multiple}): use a multiple of {step}")

    @property
    def num_nodes(self) -> int:
        return self.num_workers // self.workers_per_node

    @property
    def size_step(self) -> int:
        """World sizes the job may run at differ by multiples of this."""
        return math.lcm(self.workers_per_node, self.size_multiple)

    @property
    def floor(self) -> int:
        """``min_workers`` once set (construction fills None with ``num_workers``)."""
        assert self.min_workers is not None
        return self.min_workers

    @property
    def elastic(self) -> bool:
        return self.floor < self.num_workers

    def sizes(self) -> tuple[int, ...]:
        """Every world size the job may run at, largest first (num_workers alone unless elastic)."""
        return tuple(range(self.num_workers, self.floor - 1, -self.size_step))


@dataclass(frozen=True)
class PlacementConfig:
    """Which peer nodes keep a copy of each node's shards (never the owner's node).

    ``failure_domain``: the name of a Ray node label (``"rack"``, ``"zone"``, set with
    ``ray start --labels rack=r1``); every copy then sits on a node whose label differs
    from its owner's, so the loss of a whole rack or zone leaves a copy of each shard.
    None: every node is its own failure domain.
    """

    strategy: str = "ring"  # ring | group | mixed
    replicas: int = 1  # k copies on k distinct peer nodes
    group_size: int = 2  # nodes per group for group / mixed
    # Extra nodes that run no ranks at the start but hold each node's first replica, so a
    # dead node's ranks restart where their shards already are (a local restore).
    standby_nodes: int = 0
    failure_domain: Optional[str] = None  # a Ray node label: copies go outside the owner's

    def __post_init__(self) -> None:
        _choice("placement.strategy", self.strategy, placement.STRATEGIES)
        _positive_int("placement.replicas", self.replicas, minimum=0)
        _positive_int("placement.group_size", self.group_size, minimum=2)
        _positive_int("placement.standby_nodes", self.standby_nodes, minimum=0)
        if self.standby_nodes and not self.replicas:
            _fail("placement.standby_nodes", self.standby_nodes,
                  "a standby restores a dead node's ranks from the replicas it holds: set "
                  "placement.replicas >= 1, or placement.standby_nodes=0")
        domain = self.failure_domain
        if domain is not None and (not isinstance(domain, str) or not domain.strip()
                                   or domain != domain.strip() or " " in domain):
            _fail("placement.failure_domain", domain,
                  "name a Ray node label such as 'rack' or 'zone' (a non-empty string without "
                  "spaces), or None for every node its own failure domain")


# PersistTier's timeouts: how long storage may keep a job waiting (not in the fingerprint).
TIER_TIMEOUTS = ("request_timeout_s", "discover_timeout_s", "close_timeout_s")


@dataclass(frozen=True)
class PersistTier:
    """A slower tier under RAM: a local directory or an ``s3://bucket/prefix`` URI.

    The timeouts bound what a storage that refuses, hangs or answers slowly can cost:
    one S3 request (connect, and each wait for an answer); the auto-resume's listing of
    the tier at start-up (it then fails naming the tier); and ``close()`` / the job's end
    waiting for a persist that makes no progress (its RAM snapshots are then kept).
    """

    uri: str
    every: int = 100  # persist every K steps
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    two_slot: bool = False  # alternate between two fixed locations (constant space)
    request_timeout_s: float = 20.0
    discover_timeout_s: float = 30.0
    close_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.strip():
            _fail("persistence.uri", self.uri, "give a local directory path or s3://bucket/prefix")
        if self.uri.startswith("s3:"):
            m = re.match(r"^s3://([^/]+)(/.*)?$", self.uri)
            if not m or not _S3_BUCKET.match(m.group(1)) or ".." in m.group(1):
                _fail("persistence.uri", self.uri,
                      "write it as s3://bucket/prefix with a bucket name of 3-63 lowercase "
                      "letters, digits, dots or hyphens")
        elif "://" in self.uri:
            _fail("persistence.uri", self.uri, "only local paths and s3:// URIs are supported")
        _positive_int("persistence.every", self.every)
        _positive_int("persistence.keep_last", self.keep_last)
        for name in TIER_TIMEOUTS:
            _positive_float(f"persistence.{name}", getattr(self, name))

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")


@dataclass(frozen=True)
class FailureConfig:
    """How failures are detected and how hard the runtime tries to recover (Ray Train's name
    for the same settings; ``FailurePolicy`` is its deprecated alias)."""

    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0  # a worker silent this long is declared hung
    max_restarts: int = 3
    on_fall_behind: str = "wait"  # background copies behind: wait for them, or skip the snapshot
    collective_timeout_s: float = 300.0  # a torch.distributed call stuck this long fails the step
    warm_spares: bool = True  # keep one idle worker process per node to replace a dead rank
    # A dead node's ranks wait this long for a node with room (a replacement joining) before
    # an elastic job (workers.min_workers < num_workers) goes on with fewer ranks.
    replace_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _positive_float("failure.heartbeat_interval_s", self.heartbeat_interval_s)
        _positive_float("failure.heartbeat_timeout_s", self.heartbeat_timeout_s)
        _positive_int("failure.max_restarts", self.max_restarts, minimum=0)
        _choice("failure.on_fall_behind", self.on_fall_behind, FALL_BEHIND_POLICIES)
        _positive_float("failure.collective_timeout_s", self.collective_timeout_s)
        _bool("failure.warm_spares", self.warm_spares)
        _positive_float("failure.replace_timeout_s", self.replace_timeout_s, allow_zero=True)
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            _fail("failure.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"it must exceed twice failure.heartbeat_interval_s={self.heartbeat_interval_s} "
                  "or a single late heartbeat would look like a hung worker")


@dataclass(frozen=True)
class EngineConfig:
    """The snapshot engine's speed settings: none of them changes what a snapshot holds.

    ``seal_threads``: threads that hash a snapshot's chunks (its seal) and verify them on
    restore; 0 takes the cores this process may use (``os.sched_getaffinity``), split
    evenly among the ranks on the node (``LOCAL_WORLD_SIZE``), at most 16.
    ``on_sealing``: a snapshot due while the previous one is still being copied in the
    background or sealed is waited for (``"wait"``, the default: every due snapshot lands,
    so a crash loses at most ``snapshot_every`` steps, but a seal slower than the step
    makes the step longer) or skipped (``"skip"``: the step never waits for a seal; fewer
    snapshots land, counted in ``Checkpointer.stats`` and logged). Single-process only:
    the ranks of a multi-node job must snapshot the same steps, so there waiting follows
    ``failure.on_fall_behind``.
    ``prepare_slots``: map, populate (and pin, on CUDA) both snapshot slots in the
    background at ``restore()`` instead of on the first snapshot's step.
    ``skip_unchanged``: a tensor unchanged since its slot last took it (a frozen base model,
    buffers nothing wrote) is not copied again, its chunks are not hashed again, and its
    holders are not sent them again. ``"verify"`` (the default): the tensor's version
    counter, storage and shape must be as then, and its bytes are compared with the slot's
    (reads both, writes and hashes nothing): a write through ``p.data`` is caught too. Of a
    frozen CPU tensor of 64 KiB or more only the pages the kernel saw written since are
    compared, where Linux (6.7 or newer, userfaultfd allowed) offers it
    (:mod:`memckpt.engine.write_watch`); elsewhere the whole tensor. GPU tensors are always
    copied under it. ``"trust"``: a frozen parameter (``requires_grad``
    False) with the same storage and version counter is taken as unchanged without the
    compare, on CPU and GPU alike; everything else as under ``"verify"``. A write to a frozen
    parameter that bypasses autograd's version counter (``p.data.copy_(...)``) is then
    missed: only for jobs that never write their frozen parameters that way. ``"off"``:
    copy everything.
    ``share_unchanged``: where a data chunk of the snapshot being written is the same as the
    committed one's (what ``skip_unchanged`` did not copy), the two slots share one copy of
    its pages instead of holding it twice (:mod:`memckpt.engine.shared_pages`): a job whose
    state is mostly frozen holds about one copy of it per place, not two. Off with
    ``skip_unchanged="off"`` and on CUDA hosts (pinned slots are registered page by page).
    """

    seal_threads: int = 0
    on_sealing: str = "wait"
    prepare_slots: bool = True
    skip_unchanged: str = "verify"
    share_unchanged: bool = True

    def __post_init__(self) -> None:
        _positive_int("engine.seal_threads", self.seal_threads, minimum=0)
        _choice("engine.on_sealing", self.on_sealing, SEALING_POLICIES)
        _bool("engine.prepare_slots", self.prepare_slots)
        _choice("engine.skip_unchanged", self.skip_unchanged, SKIP_UNCHANGED)
        _bool("engine.share_unchanged", self.share_unchanged)


@dataclass(frozen=True)
class ControlConfig:
    """How the nodes' messages reach the coordinator: none of it changes what a snapshot
    holds (left out of the fingerprint).

    On a job of at least ``relay_min_nodes`` nodes, one store per group of at most
    ``relay_fanout`` nodes (a failure domain's nodes together, where
    ``placement.failure_domain`` names one) merges its group's step batches into one
    message to the coordinator, which then takes about one message a group a step instead
    of one a node (``docs/architecture.md``, "What grows with the job"). A member whose relay
    does not answer sends its own batch from then on. ``relay_fanout=0`` turns relays off.
    """

    relay_fanout: int = 16
    relay_min_nodes: int = 64

    def __post_init__(self) -> None:
        _positive_int("control.relay_fanout", self.relay_fanout, minimum=0)
        if self.relay_fanout == 1:
            _fail("control.relay_fanout", 1, "a relay merges at least 2 nodes' batches: use "
                  ">= 2, or 0 for no relays")
        _positive_int("control.relay_min_nodes", self.relay_min_nodes, minimum=2)


ON_INCOMPATIBLE = ("error", "start_fresh")


@dataclass(frozen=True)
class LoadSpec:
    """What a restore loads (InternEvo's ``content`` list)."""

    content: tuple[str, ...] = ("all",)
    ignore_data_position: bool = False  # the dataset changed: start the data from the beginning
    # A persisted checkpoint of another model (keys or shapes differ): "error" stops the job
    # naming the tensor; "start_fresh" starts from step 0 and leaves the old checkpoints alone.
    on_incompatible: str = "error"

    def __post_init__(self) -> None:
        content = tuple(self.content) if not isinstance(self.content, str) else (self.content,)
        object.__setattr__(self, "content", content)
        if not content:
            _fail("load.content", self.content, 'name at least one of "all", ' + ", ".join(CONTENT_KINDS))
        for kind in content:
            _choice("load.content", kind, ("all",) + CONTENT_KINDS)
        _choice("load.on_incompatible", self.on_incompatible, ON_INCOMPATIBLE)

    def kinds(self) -> frozenset[str]:
        kinds = set(CONTENT_KINDS) if "all" in self.content else set(self.content)
        if self.ignore_data_position:
            kinds.discard("data")
        return frozenset(kinds)


@dataclass(frozen=True)
class ChaosEvent:
    """A scheduled fault for unattended drills: at ``step`` kill ``target``. ``steady``: hold
    the fault until the job is in standby (every node's warm spare ready), to time the
    recovery a long-running job gets. ``ranks``: several ranks' workers (or nodes) killed in
    the same instant, instead of ``rank``. ``during``: not at a step but while a recovery is
    in that phase (``plan``: its survivors stopped, before the plan; ``start``: planned,
    before the next generation starts; ``restore``: started, before the first step after
    the restored one), the first recovery once training reached ``step``. ``at_byte``: not
    as ``rank`` finishes ``step`` but while its shard of that step is sent to its first
    replica holder, once that many bytes of the transfer crossed (the header first, then
    the chunks the holder does not hold already): the holder is left half way through
    receiving it, at the byte aimed at."""

    step: int
    target: str = "worker"  # worker | node | random | store | coordinator
    rank: Optional[int] = None  # which rank (worker, store: the rank's node); None with random
    signal: str = "KILL"
    steady: bool = False
    ranks: tuple[int, ...] = ()  # worker, node: these ranks at once (instead of rank)
    during: Optional[str] = None  # plan | start | restore: in that phase of a recovery
    # worker, node: while rank's shard of step is sent to its first replica holder, once
    # this many bytes of it crossed (the holder is left half way through receiving it)
    at_byte: Optional[int] = None
    # the targets that name the rank (or ranks) they hit; "random" picks one itself
    NEEDS_RANK: ClassVar[tuple[str, ...]] = ("worker", "node", "store")

    def __post_init__(self) -> None:
        _positive_int("chaos.step", self.step)
        _bool("chaos.steady", self.steady)
        _choice("chaos.target", self.target, CHAOS_TARGETS)
        _choice("chaos.signal", self.signal, SIGNALS)
        if isinstance(self.ranks, list):
            object.__setattr__(self, "ranks", tuple(self.ranks))
        if not isinstance(self.ranks, tuple):
            _fail("chaos.ranks", self.ranks, "give a tuple of ranks, e.g. ranks=(0, 1)")
        for r in self.ranks:
            _positive_int("chaos.ranks", r, minimum=0)
        if len(set(self.ranks)) != len(self.ranks):
            _fail("chaos.ranks", self.ranks, "name each rank once")
        if self.ranks and (self.rank is not None or self.target not in ("worker", "node")):
            _fail("chaos.ranks", self.ranks, "give either rank or ranks, with target "
                  "'worker' or 'node'")
        if self.during is not None:
            _choice("chaos.during", self.during, CHAOS_PHASES)
            if self.target not in ("worker", "node"):
                _fail("chaos.during", self.during, "a fault during a recovery needs target "
                      "'worker' or 'node'")
        if self.at_byte is not None:
            _positive_int("chaos.at_byte", self.at_byte, minimum=0)
            if self.target not in ("worker", "node") or self.rank is None or self.during:
                _fail("chaos.at_byte", self.at_byte, "a fault half way through a replica's "
                      "transfer needs target 'worker' or 'node' and the rank whose shard is "
                      "sent (rank=...), not ranks or during")
        if self.rank is not None:
            _positive_int("chaos.rank", self.rank, minimum=0)
        elif self.target in self.NEEDS_RANK and not self.ranks:
            _fail("chaos.rank", None, f"target={self.target!r} needs the rank it aims at")


@dataclass(frozen=True)
class Config:
    """Everything a memckpt job needs. Frozen; validated at construction."""

    job_name: str = "memckpt"
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    snapshot_every: int = 1  # take an in-RAM snapshot every N steps
    snapshot_mode: str = "sync"  # sync: the step waits for the local copy; overlap: not even that
    ram_root: Optional[str] = None  # where snapshot buffers live; None: /dev/shm/memckpt
    # the host RAM memckpt may hold per node: a fraction of its RAM (float) or bytes (int);
    # a job whose slots would need more stops before its first snapshot (docs/configuration.md)
    ram_budget: RamBudget = 0.5
    persistence: tuple[PersistTier, ...] = ()
    failure: FailureConfig = field(default_factory=FailureConfig)
    load: LoadSpec = field(default_factory=LoadSpec)
    chaos: tuple[ChaosEvent, ...] = ()
    # InternEvo's stop file: a positive step N in it means persist at step N and stop
    # cleanly; a negative -N, persist at step N and go on.
    stop_file: Optional[str] = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.job_name, str) or not _JOB_NAME.match(self.job_name):
            _fail("job_name", self.job_name, "use 1-64 letters, digits, '.', '_' or '-'")
        for name, kind in (("workers", WorkersConfig), ("placement", PlacementConfig),
                           ("failure", FailureConfig), ("load", LoadSpec),
                           ("engine", EngineConfig), ("control", ControlConfig)):
            if not isinstance(getattr(self, name), kind):
                _fail(name, getattr(self, name), f"pass a memckpt.{kind.__name__}(...)")
        _positive_int("snapshot_every", self.snapshot_every)
        _choice("snapshot_mode", self.snapshot_mode, SNAPSHOT_MODES)
        if problem := check_ram_budget(self.ram_budget):
            _fail("ram_budget", self.ram_budget, problem)
        object.__setattr__(self, "persistence", self._tuple_of("persistence", PersistTier))
        object.__setattr__(self, "chaos", self._tuple_of("chaos", ChaosEvent))
        uris = [t.uri for t in self.persistence]
        if len(set(uris)) != len(uris):
            _fail("persistence", uris, "give each tier its own uri")
        n, standby = self.workers.num_nodes, self.placement.standby_nodes
        peers = self.placement.replicas - (1 if standby else 0)  # copies among the active nodes
        if self.workers.elastic and standby:
            _fail("placement.standby_nodes", standby,
                  "an elastic job (workers.min_workers < num_workers) uses every node with room "
                  "for ranks: set placement.standby_nodes=0, or workers.min_workers=num_workers")
        if self.workers.elastic and self.placement.strategy != "ring" and peers > 0:
            for size in self.workers.sizes():
                nodes = size // self.workers.workers_per_node
                try:
                    placement.check_feasible(nodes, self.placement.strategy, min(peers, nodes - 1),
                                             self.placement.group_size)
                except PlacementError as e:
                    if nodes > 1:
                        raise ConfigError(f"workers.min_workers={self.workers.min_workers}: at "
                                          f"{size} ranks ({nodes} nodes) {e.message}; use "
                                          "placement.strategy='ring' or raise "
                                          "workers.min_workers") from None
        if peers > 0 and (n > 1 or standby):
            try:
                placement.check_feasible(n, self.placement.strategy, peers,
                                         self.placement.group_size)
            except PlacementError as e:
                on_standby = (f"; the standby node(s) hold 1 of the {self.placement.replicas}"
                              if standby else "")
                raise ConfigError(f"{e.message} (workers span {n} nodes: "
                                  f"num_workers={self.workers.num_workers}, "
                                  f"workers_per_node={self.workers.workers_per_node}"
                                  f"{on_standby})") from None
        for ev in self.chaos:
            for r in (ev.rank, *ev.ranks):
                if r is not None and r >= self.workers.num_workers:
                    _fail("chaos.rank", r, f"ranks run from 0 to {self.workers.num_workers - 1}")

    def _tuple_of(self, name: str, kind: type) -> tuple:
        value = getattr(self, name)
        if isinstance(value, kind):
            value = (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
            _fail(name, value, f"pass a list of memckpt.{kind.__name__}(...)")
        return tuple(value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A stable hash of what decides a snapshot's contents and layout.

        Chaos drills, the job name and where RAM buffers live do not change what a
        snapshot holds, so they are left out: a drill can resume a normal run.
        """
        d = self.to_dict()
        for volatile in ("chaos", "job_name", "ram_root", "ram_budget", "stop_file", "engine",
                         "control"):
            d.pop(volatile)
        d["placement"].pop("failure_domain")  # where copies sit, not what a snapshot holds
        for tier in d["persistence"]:
            for name in TIER_TIMEOUTS:
                tier.pop(name)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_config(path: str | Path) -> Config:
    """Run a user's ``config.py`` and return the ``config = Config(...)`` it defines."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist: pass the path of a .py file "
                          "that defines `config = memckpt.Config(...)`")
    try:
        namespace = runpy.run_path(str(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e.message}") from None
    cfg = namespace.get("config")
    if not isinstance(cfg, Config):
        raise ConfigError(f"{p} must define `config = memckpt.Config(...)`; "
                          f"found config={type(cfg).__name__}")
    return cfg


# Old names kept for one version: old -> new.
RENAMED = {"FailurePolicy": "FailureConfig"}


def renamed(name: str, stacklevel: int = 3) -> Any:
    """The class an old name in :data:`RENAMED` now goes by, with a FutureWarning that names
    the new one (shown to users by default, unlike a DeprecationWarning)."""
    new = RENAMED[name]
    warnings.warn(f"memckpt.{name} is renamed memckpt.{new} (Ray Train's name for a config of "
                  f"failure settings); use {new}: the old name goes in the next version",
                  FutureWarning, stacklevel=stacklevel)
    return globals()[new]


def __getattr__(name: str) -> Any:
    if name in RENAMED:
        return renamed(name)
    raise AttributeError(f"module 'memckpt.config' has no attribute {name!r}")
