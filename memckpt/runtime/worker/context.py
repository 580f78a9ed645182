"""What a training function sees: :class:`WorkerContext`, one per rank and generation.

    def train(ctx: memckpt.WorkerContext):
        state = memckpt.TrainState(model, optimizer, scheduler, data=sampler)
        start = ctx.restore(state)              # 0 on a fresh start
        for step in range(start + 1, total + 1):
            loss = ...
            ctx.step(state, step, loss=loss)    # snapshot + replicate + report

The step pays only for the local copy into this node's RAM. A background
:class:`~memckpt.runtime.worker.replicator.Replicator` streams each sealed snapshot to the rank's
replica holders, reports it to the coordinator and learns when it is committed; committed
steps due for persisting go to the rank's :class:`~memckpt.persist.uploader.Persister`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, TypedDict

import numpy as np

from memckpt.format import shard as fmt
from memckpt.engine.buffers import resolve_ram_root
from memckpt.engine.stop import STOP
from memckpt.format.data import batch_plan
from memckpt.format.digest import state_digest
from memckpt.errors import ChecksumError, GenerationEnded, MemckptError, NoSnapshotError
from memckpt.persist.catalog import protect
from memckpt.persist.uploader import Persister
from memckpt.engine.populate import MIN_BYTES, POOL
from memckpt.runtime.chaos.faults import fire
from memckpt.runtime.worker.rank_checkpointer import RankCheckpointer
from memckpt.runtime.wire.ram_files import node_dir, own_dir, scan
from memckpt.runtime.worker.node_link import NodeLink
from memckpt.runtime.worker.replicator import Replicator
from memckpt.runtime.worker.result import RestoreReport
from memckpt.runtime.worker.spec import RestoreInstruction, WorkerSpec
from memckpt.runtime.wire.data_plane import StoreConnection
from memckpt.format.state import TrainState, restore_allocations
from memckpt.checkpointer import RestoreAndStep

if TYPE_CHECKING:
    import torch


class RankStats(TypedDict):
    """:meth:`WorkerContext.stats`: what a rank's snapshots and replication cost so far."""

    snapshots: int  # snapshots taken
    waited_s: float  # seconds the step waited on them
    slot_waited_s: float  # the engine's waits for a free slot
    slot_allocations: int  # its slot allocations
    replicate_s: float  # the last replication's seconds
    sent_bytes: int  # replica bytes sent to holders
    filled_bytes: int  # replica bytes holders filled on their own node instead


class StopTraining(BaseException):
    """Raised from ``ctx.step`` once a requested stop step is persisted: the run ends
    cleanly. A BaseException, so a training loop's ``except Exception`` lets it pass."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class WorkerContext(RestoreAndStep):
    """What a training function sees: its rank, restore, and the per-step call."""

    def __init__(self, spec: WorkerSpec, node_id: str, link: Optional[NodeLink] = None) -> None:
        cfg = spec.config
        self.spec = spec
        self.rank, self.world_size, self.config = spec.rank, spec.world_size, cfg
        self.restore_source: Optional[str] = None  # where restore() took the state from
        self.resized = spec.resized  # this generation runs at another world size than the last
        self.node_id = node_id
        self.generation = spec.gen
        self.device = "cpu"
        ram_root = resolve_ram_root(cfg.ram_root)
        self._ram_root = ram_root
        self.ckpt = RankCheckpointer(cfg, spec.rank, spec.world_size,
                                     own_dir(ram_root, cfg.job_name, node_id), self._sealed,
                                     node_ranks=spec.node_ranks,
                                     node_copies=spec.node_copies)
        # readiness, reports, heartbeats: through the node's store
        self.link = link if link is not None else NodeLink(spec, node_id).start()
        self.replicator = Replicator(spec, self.ckpt, self.link)
        self.persister: Optional[Persister] = None
        self.stop_after: Optional[int] = None  # set once a requested stop step is persisted
        if cfg.persistence:
            self.persister = self._make_persister()
        self.replicator.on_committed = self._committed
        self.last_step = -1
        self._state: Optional[TrainState] = None
        # what this generation's restore took (None: a fresh start), in the worker's result
        self.restore_report: Optional[RestoreReport] = None

    def _sealed(self, step: int, _path: Path) -> None:
        self.replicator.queue.put(step)

    # -- persistence (committed steps -> disk / S3, in the background) -----------------------
    def _make_persister(self) -> Persister:
        import ray
        coord, rank = self.spec.coordinator, self.rank
        persister = Persister(
            self.config.persistence, rank,
            reader=self.ckpt.read,
            staging=self.ckpt.directory / "staging.bin",
            folder_for=lambda tier, step: ray.get(coord.persist_folder.remote(tier, step)),
            on_written=lambda tier, step, entry: ray.get(
                coord.persist_ready.remote(tier, step, rank, entry)),
            on_event=lambda kind, **f: coord.log_event.remote(kind, dict(f, rank=rank)),
            world_size=self.world_size)
        # another model's folders this job started beside, in every generation after the first
        protect(persister.stores, ray.get(coord.protected.remote()))
        return persister

    def _committed(self, step: int, request: Optional[str]) -> None:
        """A step committed; ``request`` is "stop"/"persist" when the driver asked every
        rank to persist exactly this step (stop file, SIGTERM)."""
        if self.persister is None:
            tiers: tuple[int, ...] = ()
        elif request is not None:
            tiers = tuple(range(len(self.persister.tiers)))
        else:
            tiers = self.persister.due(step)
        if tiers and self.persister is not None:
            # Stage the copy here, while the step's slot is protected. Every rank must write
            # the same steps, or no step gets a complete checkpoint (each rank superseding
            # its own pending step at its own pace left only step 0 complete on a slow S3):
            # so while a healthy upload still holds the staging buffer, a scheduled persist
            # follows failure.on_fall_behind (wait: hold the next commit) like a requested
            # one. An upload retrying against a failing tier is superseded, never waited on.
            wait = request is not None or self.config.failure.on_fall_behind == "wait"
            self.persister.submit(step, tiers, stage_now=True, wait=wait)
        if request == STOP:
            if self.persister is not None:
                self.persister.drain()  # bounded: a dead tier is given up on (close_timeout_s)
            self.stop_after = step

    # -- restore ------------------------------------------------------------------------------
    def restore(self, state: TrainState) -> int:
        """Load this rank's shard of the step the runtime chose (0 on a fresh start), then
        snapshot it again so this rank's copies match the new placement."""
        self._state = state
        instr = self.spec.restore
        step = 0
        report = None  # the restored step's metrics, from its shard's header
        if instr is not None:
            t0 = time.perf_counter()
            self.ckpt.restored_report = None
            self.restore_report = RestoreReport()
            try:
                step = self._load(state, instr)
            finally:
                POOL.clear()  # what the restore did not take
            restored = self._timings(fetch_and_load_s=time.perf_counter() - t0)
            report = self.ckpt.restored_report
            if self.rank == 0 and report is not None and "loss" in report:
                # The step's own summary may have gone with the generation the failure
                # ended (held on a store until the step's readiness, which never went
                # out), and no rank redoes the step: its loss comes back from the shard.
                self.spec.coordinator.restored_loss.remote(self.generation, step,
                                                           report["loss"])
            # Where the state really came from: the plan's first source, unless that copy
            # failed its check and a later one served (see _load).
            self.spec.coordinator.log_event.remote("restored", {
                "rank": self.rank, "gen": self.generation, "step": step,
                "source": self.restore_source,
                "seconds": round(restored.fetch_and_load_s, 4)})
            self.ckpt.resume_at(step)
        # every rank, before this generation maps a slot: the node's RAM budget is checked
        # against the real sizes of the ranks it runs and keeps copies of (a collective)
        self.ckpt.plan(state, step)
        if instr is not None and instr.reshard is None and self.ckpt.holds(step):
            # Its own slot holds the step (a process restarted on its node, or a peer's copy
            # fetched straight into the slot): no second copy. Holders placement moved are
            # sent it from there; those that have it skip it (the store compares checksums).
            if not instr.placed:
                self._sealed(step, self.ckpt.directory)
                self._timings(recopied=True)
        else:
            # Copy the restored state out again so this rank's copies match the placement.
            t0 = time.perf_counter()
            self._snapshot(state, step, report)
            if instr is not None:
                self._timings(resnapshot_s=time.perf_counter() - t0, recopied=True)
        self.last_step = step
        return step

    def _timings(self, **measured: Any) -> RestoreReport:
        """Set ``measured`` (fields of :class:`RestoreReport`) on the restore under way's
        report; returns it."""
        self.restore_report = dataclasses.replace(self.restore_report or RestoreReport(),
                                                  **measured)
        return self.restore_report

    def _load(self, state: TrainState, instr: RestoreInstruction) -> int:
        import ray
        errors = []
        if instr.sources == ("persist",):
            return self._load_persisted(state, instr)
        if instr.reshard is not None:
            return self._load_resharded(state, instr)
        for node in instr.sources:
            try:
                if node == self.node_id:
                    if not self.ckpt.holds(instr.step):
                        # the rank moved to a node holding its replica: the store's replica
                        # files become its own slots (renamed: nothing is copied, and the
                        # restored step needs no second copy here)
                        self.ckpt.adopt(self._replica_files(instr.step))
                    # read through the engine's mapping, which the next snapshot reuses (a
                    # second mapping would fault every page again)
                    source = f"local:{self.ckpt.directory}"
                    with self.ckpt.read(instr.step) as shard:
                        return self._load_verifying(
                            state, shard, source, lambda: self.ckpt.discard(instr.step))
                # a peer's store streams it over TCP into this rank's own slot (verified)
                source = f"peer:{node}"
                t0 = time.perf_counter()
                conn = StoreConnection(ray.get(self.spec.stores[node].address.remote()))
                t1 = time.perf_counter()
                try:
                    shard = self.ckpt.install(instr.step, partial(self._fetch, conn, instr.step),
                                              source)  # verified
                    # install = slot allocation + fetch (timed in _fetch) + verification
                    self._timings(connect_s=t1 - t0, install_s=time.perf_counter() - t1)
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
        self._timings(fetch_s=max(0.0, time.perf_counter() - t0 - alloc[0]),
                      slot_alloc_s=alloc[0], fetch_bytes=len(raw))
        return raw

    def _load_persisted(self, state: TrainState, instr: RestoreInstruction) -> int:
        import ray
        from memckpt.persist import CheckpointStore, Manifest
        assert instr.tier is not None and instr.manifest is not None  # a persisted instruction
        stores = [CheckpointStore(t) for t in self.config.persistence]
        manifest = Manifest.from_json(instr.manifest, stores[instr.tier].describe())
        step, folders = self.ckpt.resume_persisted(state, stores, (instr.tier, manifest))
        if folders:
            # load.on_incompatible="start_fresh" passed another model's checkpoint over: this
            # rank's uploads and the coordinator's manifests and retention leave those
            # folders alone, and the driver's committed step (the old model's) is void.
            # Said before this rank snapshots its start, so before any commit of this run.
            if self.persister is not None:
                protect(self.persister.stores, folders)
            ray.get(self.spec.coordinator.started_over.remote(
                self.generation, self.rank, 0 if step is None else step,
                {tier: sorted(f) for tier, f in folders.items()}))
        self.restore_source = (f"{stores[instr.tier].describe()}@{manifest.step}" if not folders
                               else "fresh start" if step is None else f"persisted@{step}")
        return 0 if step is None else step

    def _load_resharded(self, state: TrainState, instr: RestoreInstruction) -> int:
        """A resize: read the chunks of every old rank's shard this rank's layout needs from
        the stores holding them (RAM, over TCP; no storage read), through DCP's planner."""
        import ray
        import torch.distributed as dist
        from memckpt.format.dcp_reader import MemckptReader
        from memckpt.runtime.worker.ram_source import ReplicaSource
        assert instr.reshard is not None and instr.from_size is not None
        nodes = sorted({n for ns in instr.reshard.values() for n in ns})
        where = dict(zip(nodes, ray.get([self.spec.stores[n].address.remote() for n in nodes])))
        source = ReplicaSource({r: [where[n] for n in ns] for r, ns in instr.reshard.items()},
                               instr.from_size, instr.step)
        reader = MemckptReader(source)
        try:
            step = self.ckpt.load_resharded(state, reader)
        finally:
            source.close()
        self.restore_source = (f"ram:{instr.from_size}->{self.world_size} ranks, "
                               f"{source.bytes_read} bytes from "
                               + ", ".join(n[:12] for n in nodes))
        self._timings(fetch_bytes=int(source.bytes_read))
        if dist.is_initialized():
            # every rank has read the old shards before any overwrites them with the new layout
            dist.barrier()
        return step

    def _replica_files(self, step: int) -> list[Path]:
        """The complete replica files of this rank on this node; one must hold ``step``."""
        root = node_dir(self._ram_root, self.config.job_name, self.node_id)
        held = scan(root / "replicas").get(self.rank, {})
        if step not in held:
            raise NoSnapshotError(f"this node holds no shard of rank {self.rank} at step {step}")
        return list(held.values())

    def restore_allocations(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """What a restore of this rank's newest snapshot creates (see :data:`POOL`); none
        when the state lives on GPUs."""
        if self.config.workers.gpus_per_worker:
            return []
        layout = self.ckpt.newest_layout()
        return [] if layout is None else restore_allocations(layout, MIN_BYTES)

    # -- per step -----------------------------------------------------------------------------
    def step(self, state: TrainState, step: int, **metrics: float) -> None:
        """Call after finishing ``step``: snapshot when due and report ``metrics``."""
        if self.replicator.error is not None:
            raise self.replicator.error
        if self.stop_after is not None:
            raise StopTraining(self.stop_after)
        self._maybe_fault(step)
        report = {k: float(v) for k, v in metrics.items()}
        t0 = time.perf_counter()
        snapshotted = self._snapshot(state, step, report)
        stall = time.perf_counter() - t0
        self.last_step = step
        stats = self.ckpt.stats
        report.update(stall_s=stall, replicate_s=self.replicator.last_seconds,
                      committed=float(self.ckpt.committed or 0),
                      skipped=float(stats.skipped), landed=float(stats.landed),
                      requested=float(stats.requested), waited_s=stats.waited_s,
                      replicated_bytes=float(self.replicator.bytes_sent),
                      replica_filled_bytes=float(self.replicator.bytes_filled))
        self.link.report(step, report, snapshotted)

    def _maybe_fault(self, step: int) -> None:
        """Scheduled faults fire here, so they hit exactly the step they name (once per job);
        one aimed at a byte of a transfer fires in the replicator, mid-send."""
        for fault in self.spec.faults:
            if (fault.during is None and fault.at_byte is None and fault.at_step == step
                    and fault.claimer == self.rank):
                fire(fault, self.spec.coordinator)

    def _snapshot(self, state: TrainState, step: int,
                  report: Optional[Mapping[str, float]] = None) -> bool:
        self._state = state
        return self.ckpt.step(state, step, **(report or {}))

    def batch_plan(self, global_batch: int, micro_batch: int) -> int:
        """Gradient-accumulation steps that keep ``global_batch`` samples per optimizer step
        at the current world size (see :func:`memckpt.format.data.batch_plan`)."""
        return batch_plan(global_batch, micro_batch, self.world_size)

    def digest(self) -> Optional[str]:
        return state_digest(self._state) if self._state is not None else None

    def stats(self) -> RankStats:
        """What this rank's snapshots and replication have cost so far: snapshots taken and
        the seconds the step waited on them; the engine's waits for a free slot, its slot
        allocations; the last replication's
        seconds, and the replica bytes sent to holders and filled by holders on their own."""
        snap, engine, repl = self.ckpt.stats, self.ckpt.engine.stats, self.replicator
        return {"snapshots": snap.snapshots, "waited_s": snap.waited_s,
                "slot_waited_s": engine.waited_s, "slot_allocations": engine.allocations,
                "replicate_s": repl.last_seconds, "sent_bytes": repl.bytes_sent,
                "filled_bytes": repl.bytes_filled}

    def finish(self, timeout_s: float = 600.0) -> None:
        """The function returned: commit the last snapshot everywhere and persist it if due."""
        self.ckpt.wait()
        self.replicator.drain(timeout_s)
        if self.persister is not None:
            self.persister.drain(timeout_s)  # a dead or hung tier: its close_timeout_s
        self.link.flush()  # the last steps' reports reach the coordinator before the return

    def abort(self) -> None:
        """Recovery replaced this generation: make the training function return at its next
        ``ctx.step`` (or at once, if it waits there for a commit that cannot come)."""
        err = GenerationEnded(f"rank {self.rank}: generation {self.generation} was ended by "
                              "recovery")
        self.replicator.cancelled = True
        self.replicator.error = self.replicator.error or err
        self.ckpt.abort(err)

    def close(self) -> None:
        self.replicator.close()
        if self.persister is not None:
            self.persister.close()  # bounded; logs and reports what it left unpersisted
        self.ckpt.close()
