"""A training worker (one rank) and the context its training function sees.

The user's function receives a :class:`WorkerContext`::

    def train(ctx: memckpt.WorkerContext):
        state = memckpt.TrainState(model, optimizer, scheduler, data=sampler)
        start = ctx.restore(state)              # 0 on a fresh start
        for step in range(start + 1, total + 1):
            loss = ...
            ctx.step(state, step, loss=loss)    # snapshot + replicate + report

The step pays only for the local copy into this node's RAM. A background
replicator streams each sealed snapshot to the rank's replica holders over TCP
(:mod:`memckpt.runtime.transport`), reports it to the coordinator and learns when it is
committed.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import math
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import psutil

from memckpt import shard as fmt
from memckpt.buffers import resolve_ram_root
from memckpt.checkpointer import Checkpointer
from memckpt.config import Config
from memckpt.digest import state_digest
from memckpt.errors import ChecksumError, GenerationEnded, MemckptError, NoSnapshotError
from memckpt.control import STOP
from memckpt.runtime.faults import SIGNALS, STEADY_WAIT_S
from memckpt.netutil import free_port
from memckpt.persist.uploader import Persister
from memckpt.populate import MIN_BYTES, POOL, HostReserve, SlotReserve, spare_budget
from memckpt.snapshot import SLOT_NAMES
from memckpt.state import TrainState, restore_allocations
from memckpt.runtime.replica_store import node_dir, own_dir, scan
from memckpt.runtime.transport import StoreConnection

RETRIES = 5  # tries per replica holder before the replication fails


@dataclass(frozen=True)
class RestoreInstruction:
    step: int
    sources: tuple[str, ...]  # node ids holding the shard, best first; or ("persist",)
    tier: Optional[int] = None  # with ("persist",): the tier index and its manifest (JSON)
    manifest: Optional[str] = None
    placed: bool = False  # the step is already on this rank's node and all its holders


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    gen: int
    config: Config
    holders: tuple[str, ...]  # this rank's replica holder nodes
    stores: dict[str, Any]  # node id -> ReplicaStore actor handle
    coordinator: Any
    restore: Optional[RestoreInstruction]
    faults: tuple = ()  # memckpt.runtime.faults.Fault: fired from inside the step, exactly at at_step


class Replicator:
    """Background thread: sealed snapshot -> replica holders -> coordinator commit."""

    def __init__(self, spec: WorkerSpec, ckpt: Checkpointer) -> None:
        self.spec, self.ckpt = spec, ckpt
        self.queue: "queue.Queue[Optional[int]]" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.bytes_sent = 0
        self.bytes_filled = 0  # replica bytes holders copied from their own node instead
        self.last_seconds = 0.0
        self.cancelled = False
        self.on_committed: Optional[Callable[[int, Optional[str]], None]] = None
        self._senders: dict[str, StoreConnection] = {}  # node id -> connection to its store
        self._thread = threading.Thread(target=self._loop, name="memckpt-replicator", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import ray
        while True:
            step = self.queue.get()
            if step is None:
                return
            try:
                self._replicate(ray, step)
            except BaseException as e:  # surfaced on the training thread at the next step
                self.error = e
                return
            finally:
                self.queue.task_done()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued snapshot is replicated and committed."""
        deadline = time.time() + timeout_s
        while self.queue.unfinished_tasks and self.error is None:
            if time.time() > deadline:
                return False
            time.sleep(0.01)
        if self.error is not None:
            raise self.error
        return True

    def _replicate(self, ray, step: int) -> None:
        spec = self.spec
        t0 = time.perf_counter()
        with self.ckpt.engine.reading(step, verify=False) as shard:
            for node in spec.holders:
                self._send(ray, node, step, shard)
        self.last_seconds = time.perf_counter() - t0
        committed, persist, action = ray.get(spec.coordinator.shard_ready.remote(
            spec.rank, spec.gen, step, list(spec.holders)))
        while committed is None or committed < step:
            if self.cancelled:  # recovery ended this generation: no commit will come
                return
            committed, persist, action = ray.get(
                spec.coordinator.wait_commit.remote(spec.gen, step, 5.0))
        self.ckpt.engine.set_committed(step)
        if self.on_committed is not None:
            # Called before the next step can commit, so this step's slot is still in RAM.
            self.on_committed(step, action if persist == step else None)

    def _send(self, ray, node: str, step: int, shard: fmt.Shard) -> None:
        """Stream the shard to ``node``'s store over this rank's connection to it (but the
        chunks that store fills from its own node's copies)."""
        rank, store = self.spec.rank, self.spec.stores[node]
        for attempt in range(RETRIES):  # a restarting store comes back within seconds
            try:
                sender = self._senders.get(node)
                if sender is None:
                    sender = StoreConnection(ray.get(store.address.remote()))
                    self._senders[node] = sender
                sent = sender.send(rank, step, shard.raw, shard.header["data_xxh3"], self.spec.gen,
                                   lambda: self.cancelled, shard.chunks)
                self.bytes_sent += sent
                self.bytes_filled += (len(shard.raw) - sent) if sent else 0  # 0: already held
                return
            except (OSError, ray.exceptions.RayActorError) as e:
                self._drop(node)
                if self.cancelled:
                    return
                last = e
                time.sleep(0.5 * (attempt + 1))
            except ChecksumError as e:  # corrupted on the way: send it again
                last = e
        raise MemckptError(f"rank {rank}: replica holder {node[:12]} unreachable for step {step} "
                           f"after {RETRIES} tries: {last}")

    def _drop(self, node: str) -> None:
        sender = self._senders.pop(node, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        self.cancelled = True  # a stale generation must not keep writing to stores
        self.queue.put(None)
        for node in list(self._senders):
            self._drop(node)


class StopTraining(BaseException):
    """Raised from ``ctx.step`` once a requested stop step is persisted: the run ends
    cleanly. A BaseException, so a training loop's ``except Exception`` lets it pass."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class WorkerContext:
    """What a training function sees: its rank, restore, and the per-step call."""

    def __init__(self, spec: WorkerSpec, node_id: str) -> None:
        cfg = spec.config
        self.spec = spec
        self.rank, self.world_size, self.config = spec.rank, spec.world_size, cfg
        self.node_id = node_id
        self.generation = spec.gen
        self.device = "cpu"
        ram_root = resolve_ram_root(cfg.ram_root)
        self._ram_root = ram_root
        self.ckpt = Checkpointer(cfg, spec.rank, spec.world_size,
                                 directory=own_dir(ram_root, cfg.job_name, node_id),
                                 gated=True, on_sealed=self._sealed, persist=False)
        self.replicator = Replicator(spec, self.ckpt)
        self.persister: Optional[Persister] = None
        self.stop_after: Optional[int] = None  # set once a requested stop step is persisted
        if cfg.persistence:
            self.persister = self._make_persister()
        self.replicator.on_committed = self._committed
        self.last_step = -1
        self._state: Optional[TrainState] = None
        self.restore_seconds: dict[str, float] = {}

    def _sealed(self, step: int, _path: Path) -> None:
        self.replicator.queue.put(step)

    # -- persistence (committed steps -> disk / S3, in the background) -----------------------
    def _make_persister(self) -> Persister:
        import ray
        coord, rank = self.spec.coordinator, self.rank
        return Persister(
            self.config.persistence, rank,
            reader=lambda step: self.ckpt.engine.reading(step, verify=False),
            staging=self.ckpt.directory / "staging.bin",
            folder_for=lambda tier, step: ray.get(coord.persist_folder.remote(tier, step)),
            on_written=lambda tier, step, entry: ray.get(
                coord.persist_ready.remote(tier, step, rank, entry)),
            on_event=lambda kind, **f: coord.log_event.remote(kind, dict(f, rank=rank)),
            world_size=self.world_size)

    def _committed(self, step: int, request: Optional[str]) -> None:
        """A step committed; ``request`` is "stop"/"persist" when the driver asked every
        rank to persist exactly this step (stop file, SIGTERM)."""
        tiers = self.persister.due(step) if self.persister is not None else ()
        if request is not None and self.persister is not None:
            tiers = range(len(self.persister.tiers))
        if tiers:
            # Stage the copy here, while the step's slot is protected. If a healthy upload
            # still holds the staging buffer, a requested persist waits; a scheduled one
            # follows failure.on_fall_behind (wait: hold the next commit; skip: skip this
            # step). An upload retrying against a failing tier is superseded, never waited on.
            wait = request is not None or self.config.failure.on_fall_behind == "wait"
            self.persister.submit(step, tiers, stage_now=True, wait=wait)
        if request == STOP:
            if self.persister is not None:
                self.persister.flush(600.0)
            self.stop_after = step

    # -- restore ------------------------------------------------------------------------------
    def restore(self, state: TrainState) -> int:
        """Load this rank's shard of the step the runtime chose (0 on a fresh start), then
        snapshot it again so this rank's copies match the new placement."""
        self._state = state
        instr = self.spec.restore
        step = 0
        if instr is not None:
            t0 = time.perf_counter()
            try:
                step = self._load(state, instr)
            finally:
                POOL.clear()  # what the restore did not take
            self.restore_seconds["fetch_and_load_s"] = time.perf_counter() - t0
            # Where the state really came from: the plan's first source, unless that copy
            # failed its check and a later one served (see _load).
            self.spec.coordinator.log_event.remote("restored", {
                "rank": self.rank, "gen": self.generation, "step": step,
                "source": self.restore_source,
                # fetched into the slot file a warm spare held ready (no new memory)
                "spare_slot": self.ckpt.engine.stats.offered_taken > 0,
                "seconds": round(self.restore_seconds["fetch_and_load_s"], 4)})
            self.ckpt.engine.discard_newer(step)
            self.ckpt.engine.set_committed(step)
        if instr is not None and step in self.ckpt.engine.steps():
            # Its own slot holds the step (a process restarted on its node, or a peer's copy
            # fetched straight into the slot): no second copy. Holders placement moved are
            # sent it from there; those that have it skip it (the store compares checksums).
            if not instr.placed:
                self._sealed(step, self.ckpt.directory)
                self.restore_seconds["recopied"] = 1.0
        else:
            # Copy the restored state out again so this rank's copies match the placement.
            t0 = time.perf_counter()
            self._snapshot(state, step)
            if instr is not None:
                self.restore_seconds["resnapshot_s"] = time.perf_counter() - t0
                self.restore_seconds["recopied"] = 1.0
        self.ckpt.engine.drop_offered()  # the slots exist now; a spare's file is spare
        self.last_step = step
        return step

    def _load(self, state: TrainState, instr: RestoreInstruction) -> int:
        import ray
        errors = []
        if instr.sources == ("persist",):
            return self._load_persisted(state, instr)
        for node in instr.sources:
            try:
                if node == self.node_id:
                    # no new slot: a spare's slot file frees its pages for this restore
                    self.ckpt.engine.drop_offered()
                    if instr.step not in self.ckpt.engine.steps():
                        # the rank moved to a node holding its replica: the store's replica
                        # files become its own slots (renamed: nothing is copied, and the
                        # restored step needs no second copy here)
                        self.ckpt.engine.adopt(self._replica_files(instr.step))
                    # read through the engine's mapping, which the next snapshot reuses (a
                    # second mapping would fault every page again)
                    source = f"local:{self.ckpt.directory}"
                    with self.ckpt.engine.reading(instr.step, verify=False) as shard:
                        return self._load_verifying(
                            state, shard, source, lambda: self.ckpt.engine.discard_step(instr.step))
                # a peer's store streams it over TCP into this rank's own slot (verified)
                source = f"peer:{node}"
                t0 = time.perf_counter()
                conn = StoreConnection(ray.get(self.spec.stores[node].address.remote()))
                t1 = time.perf_counter()
                try:
                    shard = self.ckpt.engine.install(
                        instr.step, lambda into: self._fetch(conn, instr.step, into),
                        source)  # verified
                    # install = slot allocation + fetch (timed in _fetch) + verification
                    self.restore_seconds.update(connect_s=t1 - t0,
                                                install_s=time.perf_counter() - t1)
                finally:
                    conn.close()
                step = self.ckpt.load_shard(state, shard, source)
                self.restore_source = source
                return step
            except (MemckptError, OSError, ray.exceptions.RayError) as e:
                errors.append(f"{node[:12]}: {e}")
        raise NoSnapshotError(f"rank {self.rank}: no source could provide step {instr.step}: "
                              + "; ".join(errors))

    def _load_verifying(self, state: TrainState, shard: fmt.Shard, source: str,
                        discard: Callable[[], None]) -> int:
        """Load a local ``shard`` into ``state`` while a second thread checks its data
        checksum (xxh3 releases the GIL, so the two overlap). A mismatch calls ``discard``
        (the copy is never restored or sent on again) and raises :class:`ChecksumError`
        once the load is done: the caller then loads the next source over everything, and
        training never starts from the corrupt bytes."""
        check = cf.ThreadPoolExecutor(1, thread_name_prefix="memckpt-verify")
        verified = check.submit(fmt.verify_data, shard, source)
        try:
            step = self.ckpt.load_shard(state, shard, source)
        finally:
            check.shutdown(wait=True)
        try:
            verified.result()
        except ChecksumError:
            discard()
            raise
        self.restore_source = source
        return step

    def _fetch(self, conn: StoreConnection, step: int, into: Callable[[int], np.ndarray]
               ) -> np.ndarray:
        alloc = [0.0]

        def timed_into(nbytes: int) -> np.ndarray:
            t = time.perf_counter()
            try:
                return into(nbytes)
            finally:
                alloc[0] = time.perf_counter() - t

        t0 = time.perf_counter()
        raw = conn.fetch(self.rank, step, timed_into)
        # the transfer alone; allocating the new slot's memory is timed apart
        self.restore_seconds["fetch_s"] = time.perf_counter() - t0 - alloc[0]
        self.restore_seconds["slot_alloc_s"] = alloc[0]
        self.restore_seconds["fetch_bytes"] = float(len(raw))
        return raw

    def _load_persisted(self, state: TrainState, instr: RestoreInstruction) -> int:
        from memckpt.persist import CheckpointStore, Manifest
        store = CheckpointStore(self.config.persistence[instr.tier])
        manifest = Manifest.from_json(instr.manifest, store.describe())
        self.restore_source = f"{store.describe()}@{manifest.step}"
        step = self.ckpt.load_persisted(state, store, manifest)
        return 0 if step is None else step

    def _replica_files(self, step: int) -> list[Path]:
        """The complete replica files of this rank on this node; one must hold ``step``."""
        root = node_dir(self._ram_root, self.config.job_name, self.node_id)
        held = scan(root / "replicas").get(self.rank, {})
        if step not in held:
            raise NoSnapshotError(f"this node holds no shard of rank {self.rank} at step {step}")
        return list(held.values())

    def restore_allocations(self) -> list:
        """What a restore of this rank's newest snapshot creates (see :data:`POOL`); none
        when the state lives on GPUs."""
        if self.config.workers.gpus_per_worker:
            return []
        slots = [s for s in self.ckpt.engine.slots if s.complete and s.layout is not None]
        if not slots:
            return []
        return restore_allocations(max(slots, key=lambda s: s.step).layout, MIN_BYTES)

    # -- per step -----------------------------------------------------------------------------
    def step(self, state: TrainState, step: int, **metrics: float) -> None:
        """Call after finishing ``step``: snapshot when due and report ``metrics``."""
        if self.replicator.error is not None:
            raise self.replicator.error
        if self.stop_after is not None:
            raise StopTraining(self.stop_after)
        self._maybe_fault(step)
        t0 = time.perf_counter()
        self._snapshot(state, step)
        stall = time.perf_counter() - t0
        self.last_step = step
        report = {k: float(v) for k, v in metrics.items()}
        stats = self.ckpt.engine.stats
        report.update(stall_s=stall, replicate_s=self.replicator.last_seconds,
                      committed=float(self.ckpt.engine.committed or 0),
                      skipped=float(stats.skipped), waited_s=stats.waited_s,
                      replicated_bytes=float(self.replicator.bytes_sent),
                      replica_filled_bytes=float(self.replicator.bytes_filled))
        self.spec.coordinator.report.remote(self.rank, self.generation, step, report)

    def _maybe_fault(self, step: int) -> None:
        """Scheduled faults fire here, so they hit exactly the step they name (once per job)."""
        import ray
        for fault in self.spec.faults:
            mine = fault.rank == self.rank or (fault.rank is None and self.rank == 0)
            if fault.at_step != step or not mine:
                continue
            wait = STEADY_WAIT_S if fault.steady else 0.0
            if not ray.get(self.spec.coordinator.claim.remote(fault.key, wait)):
                continue
            if fault.target == "worker":
                os.kill(os.getpid(), SIGNALS[fault.signal])
            else:  # node, store, coordinator, random: the driver acts; this rank holds still
                ray.get(self.spec.coordinator.request_fault.remote(fault.key))
                ray.get(self.spec.coordinator.wait_fault.remote(fault.key, 60.0))

    def _snapshot(self, state: TrainState, step: int) -> None:
        self._state = state
        if step % self.config.snapshot_every == 0:
            self.ckpt.step(state, step)

    def digest(self) -> Optional[str]:
        return state_digest(self._state) if self._state is not None else None

    def finish(self, timeout_s: float = 600.0) -> None:
        """The function returned: commit the last snapshot everywhere and persist it if due."""
        self.ckpt.wait()
        self.replicator.drain(timeout_s)
        if self.persister is not None:
            self.persister.flush(timeout_s)

    def abort(self) -> None:
        """Recovery replaced this generation: make the training function return at its next
        ``ctx.step`` (or at once, if it waits there for a commit that cannot come)."""
        err = GenerationEnded(f"rank {self.rank}: generation {self.generation} was ended by "
                              "recovery")
        self.replicator.cancelled = True
        self.replicator.error = self.replicator.error or err
        self.ckpt.engine.abort(err)

    def close(self) -> None:
        self.replicator.close()
        if self.persister is not None:
            self.persister.flush(60.0)
            self.persister.close()
        self.ckpt.close()


def release_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames an exception's traceback holds (and
    those of the exceptions it chains): a generation ended by recovery unwinds through the
    training function, whose model and optimizer would otherwise stay alive as long as the
    exception does: through the ``gc.collect()`` that runs while it propagates, then for
    as long as Ray holds it. The traceback itself, file and line of every frame, is
    unchanged."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def warm_torch() -> None:
    """Pay torch's lazy first-use costs now (the optimizers import torch._dynamo, skip_init
    the meta registrations, DDP and ZeRO torch.distributed's modules: ~1 s here), so a
    spare that takes over a rank builds its model at once instead of after them."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    from torch.nn.utils import skip_init

    layer = skip_init(torch.nn.Linear, 2, 2)
    opt = torch.optim.AdamW(layer.parameters())
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()


def settle_imports() -> None:
    """Hide what is alive now from the cyclic garbage collector for good (``gc.freeze``): the
    ~300k import-time objects of torch, Ray and memckpt, which live as long as the process
    anyway. A full collection then walks only what training creates. The collection that
    frees a failed generation's state before the next restore (:meth:`Worker.run`) sits on
    the recovery's critical path: 0.17 s here with them, under 1 ms without; the
    interpreter's own full collections during training shrink the same way."""
    gc.collect()
    gc.freeze()


class Worker:
    """One rank's process, as a long-lived Ray actor.

    ``run`` executes one generation of the user's function; after a peer failed,
    a surviving worker is reused for the next generation (warm: no new process,
    no re-import of torch), restoring from its own node's RAM. A fresh actor made
    ahead of time with no generation yet is a warm *spare* for a node.
    """

    def __init__(self, config: Config, coordinator: Any) -> None:
        import ray
        warm_torch()  # a spare must be ready to train at once
        settle_imports()
        self.config, self.coordinator = config, coordinator
        self.spec: Optional[WorkerSpec] = None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.ctx: Optional[WorkerContext] = None
        self.reserve = HostReserve()  # held while a spare idles (see prefault)
        folder = node_dir(resolve_ram_root(config.ram_root), config.job_name, self.node_id)
        self.slot_reserves = [SlotReserve(folder, i) for i in range(len(SLOT_NAMES))]
        self._takeover = threading.Lock()  # prefault against run: who owns the pool
        self._running = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, daemon=True)
        self._hb.start()

    def _heartbeat(self) -> None:
        interval = self.config.failure.heartbeat_interval_s
        while True:
            time.sleep(interval)
            spec, ctx = self.spec, self.ctx
            if self._running.is_set() and spec is not None:
                step = ctx.last_step if ctx is not None else -1
                self.coordinator.heartbeat.remote(spec.rank, spec.gen, step)

    def address(self) -> tuple[str, int]:
        return self.ip, free_port()

    def abort(self, gen: int) -> None:
        """End generation ``gen``'s training function (recovery: a peer is gone)."""
        ctx, spec = self.ctx, self.spec
        if ctx is not None and spec is not None and spec.gen == gen:
            ctx.abort()

    def prefault(self, shard: Optional[tuple[int, list, int]], slots: bool = False) -> int:
        """A spare, once the job's shards exist: prepare the memory a restore of ``shard``
        fills (file bytes, tensor table, data bytes: the job's largest shard, from
        :meth:`memckpt.runtime.replica_store.ReplicaStore.largest_shard`; the spare may take over any rank,
        a lost node's too). The optimizer state it creates is made ahead in
        :data:`POOL`; for the rest (the parameters), a :class:`HostReserve` is faulted in
        and unmapped at takeover. Either way the restore fills memory the kernel already
        has. With ``slots`` (asked once every node's spare holds its state): up to two more
        shards' worth, the snapshot slots a rank restored from a peer's replica needs on
        this node, as files (:class:`SlotReserve`). Never more than :func:`spare_budget`
        allows; skipped when the state lives on GPUs (the restore fills device memory) and
        once this worker runs a rank. Returns the bytes the spare holds in all."""
        if self.config.workers.gpus_per_worker or shard is None:
            return 0
        nbytes, table, data_len = shard
        vm = psutil.virtual_memory()
        if slots:
            budget = spare_budget(len(self.slot_reserves) * nbytes, nbytes, vm.available,
                                  vm.total)
            for reserve in self.slot_reserves:  # a no-op once a takeover released them
                budget -= reserve.hold(min(nbytes, budget))
            return self._held()
        layout = fmt.Layout.from_json(table, data_len, "the job's largest shard")
        budget = spare_budget(nbytes, nbytes, vm.available, vm.total)
        specs, room = [], budget
        for shape, dtype in restore_allocations(layout, MIN_BYTES):
            size = math.prod(shape) * dtype.itemsize
            if size <= room:
                specs.append((shape, dtype))
                room -= size
        with self._takeover:  # a rank's restore owns the pool once run() has begun
            if self.spec is not None:
                return 0
            POOL.fill(specs)
        POOL.wait()
        self.reserve.hold(max(0, budget - POOL.nbytes))
        return self._held()

    def _held(self) -> int:
        if self.spec is not None:  # took over a rank meanwhile: holds nothing for later
            return 0
        return POOL.nbytes + self.reserve.nbytes + sum(r.nbytes for r in self.slot_reserves)

    def info(self) -> dict[str, Any]:
        return {"rank": self.spec.rank if self.spec else None, "pid": os.getpid(),
                "node_id": self.node_id}

    def run(self, train_fn: Callable[[WorkerContext], Any], master: tuple[str, int],
            spec: WorkerSpec) -> dict[str, Any]:
        import datetime

        import torch
        import torch.distributed as dist

        with self._takeover:
            if self.spec is None:  # a spare taking over: its pool stays as far as it got
                POOL.stop()
            self.spec, self.ctx = spec, None
        ahead: list = []  # what the next generation's restore will create
        self.reserve.release()  # a spare's reserve: its pages serve the restore below
        # a spare's: the snapshot slots of a rank this node holds no shard of
        slot_files = [f for f in (r.release() for r in self.slot_reserves) if f is not None]
        self.coordinator.register.remote(spec.rank, spec.gen, self.info())
        self._running.set()
        torch.set_num_threads(max(1, int(spec.config.workers.cpus_per_worker)))
        backend = spec.config.workers.backend
        if backend == "auto":
            gpu = torch.cuda.is_available() and spec.config.workers.gpus_per_worker
            backend = "nccl" if gpu else "gloo"
        try:
            if spec.world_size > 1:
                dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                        rank=spec.rank, world_size=spec.world_size,
                                        timeout=datetime.timedelta(
                                            seconds=spec.config.failure.collective_timeout_s))
            self.ctx = WorkerContext(spec, self.node_id)
            if slot_files:
                self.ctx.ckpt.engine.offer_files(slot_files)
            try:
                result = train_fn(self.ctx)
            except StopTraining as stop:
                return {"rank": spec.rank, "digest": None, "result": None, "stopped": stop.step,
                        "restore": self.ctx.restore_seconds, "source": None}
            except BaseException as e:
                release_frames(e)
                # a failed generation: the next one restores this rank (see POOL)
                ahead = self.ctx.restore_allocations()
                raise
            self.ctx.finish()
            return {"rank": spec.rank, "digest": self.ctx.digest(), "result": result,
                    "restore": self.ctx.restore_seconds,
                    "source": getattr(self.ctx, "restore_source", None),
                    "replication": {"sent_bytes": self.ctx.replicator.bytes_sent,
                                    "filled_bytes": self.ctx.replicator.bytes_filled}}
        finally:
            self._running.clear()
            if self.ctx is not None:
                self.ctx.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            # Free this generation's training state now: it sits in reference cycles (the
            # context's callbacks, DDP's hooks), and a survivor reused for the next
            # generation would otherwise restore into fresh memory while still holding it.
            # Freed now, its pages are what the pool below gets back (see POOL).
            self.ctx = None
            gc.collect()
            if ahead:  # in the background while the runtime stops and plans
                POOL.fill(ahead)
