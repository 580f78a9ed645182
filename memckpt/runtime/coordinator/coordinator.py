"""The coordinator: one named actor per job, holding membership and the commit of steps.

It knows no tensor bytes. Each node's store sends it, per step, its ranks' readiness and
step metrics (``node_ready``; ``node_metrics`` for a step no rank snapshotted) and, per
interval, each rank's last sign of life (``node_heartbeat``; see
:mod:`memckpt.runtime.node.aggregator`; every few seconds its memckpt RAM and budget, a new
peak logged as ``node_ram``); a step every rank is ready for is committed. A
silent store is a frozen or cut-off node (``liveness``). The per-rank ``shard_ready``,
``report`` and ``heartbeat`` serve a worker with no store on its node. Also: fire-once
chaos claims, events (``events.jsonl``), rank 0's loss per step (``losses.jsonl``), each
complete step's min / median / max stall (``steps.jsonl``, what ``memckpt report``
draws), and the Ray metrics of ``memckpt.runtime.coordinator.metrics``.

Its parts, one module each: what the stores send it (:mod:`.messages`), the commit rule
counted per node (:mod:`.readiness`), who is alive (:mod:`.heartbeats`), the step log and
progress (:mod:`.steps`), the small state that survives a restart (:mod:`.job_state`, kept by
:mod:`.state_store`), and two sets of calls no training step makes: persisting to the
slower tiers (:mod:`.persistence`) and the chaos bookkeeping of drills (:mod:`.drills`).
Per step it does O(nodes) work: a node's batch and heartbeat are one record each whatever
its ranks, and the driver's polls read counters, not ranks.

It is no single point of failure: its small state ``s`` goes to a :class:`StateStore`
(default: Ray's GCS key-value store), so when its process is killed Ray restarts it
(``max_restarts=-1``), it reloads that state, rebuilds the committed step from what the
replica stores hold, and callers' retried calls carry on.

The state is written when membership changes, not per step (the whole of ``s`` is
O(ranks), so a write per rank per step was O(ranks^2) a step). Exactly these write it:

- ``configure`` (a generation starts: start, recovery, resize) and ``finish`` (which
  removes it);
- rare changes that must survive a restart at once: ``request_stop``, ``clear_stop``,
  the stop step being decided (in the call that commits it), ``started_over``,
  ``persist_ready``'s persisted step, a ``claim`` that fires, ``set_elastic``,
  ``set_standby``, ``request_fault``, ``fault_done``, a restart (the restart count) and
  a rebuild that raised the committed step;
- ``register`` only marks the workers' info dirty: it is written by the first call at
  least :data:`REGISTER_DEBOUNCE_S` after the last write (at most one write a second
  while dirty, none at all while a generation's ranks register within that time).

The per-step and per-interval calls never write it: the steps
committed since the last write are rebuilt after a restart (:meth:`Coordinator.rebuild`)
from the stores' inventories, once, by the first call that needs the committed step (again,
at most every :data:`REBUILD_RETRY_S`, only while a ``wait_commit`` times out and no step
has committed since the restart: a store that did not answer proves less, never more).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from memckpt.persist.catalog import protect
from memckpt.policy.step_metrics import StepSummary
from memckpt.runtime.coordinator.drills import DrillCalls
from memckpt.runtime.coordinator.heartbeats import Liveness
from memckpt.runtime.coordinator.messages import (CoordinatorStatus, ElasticInfo, EventFields,
                                                  Heartbeat, NodeRam, Progress, ReadyBatch)
from memckpt.runtime.coordinator.metrics import JobMetrics
from memckpt.runtime.coordinator.persistence import PersistCalls
from memckpt.runtime.coordinator.readiness import Membership, PlacementMismatch, Readiness
from memckpt.runtime.coordinator.job_state import JobState
from memckpt.runtime.coordinator.steps import StepLog
from memckpt.runtime.coordinator.state_store import (
    COORDINATOR_NAMESPACE, GcsStateStore, Inventory, InventorySource, MemoryStateStore,
    StateStore, proven_ready, ray_inventory)
from memckpt.runtime.ray_nodes import WorkerInfo, Whereabouts

__all__ = ["COORDINATOR_NAMESPACE", "Coordinator", "GcsStateStore", "Inventory", "MemoryStateStore",
           "STALE", "StateStore", "View", "coordinator_name", "proven_ready", "ray_inventory"]

def coordinator_name(job: str) -> str:
    return f"memckpt-coordinator-{job}"


def _at_least(committed: Optional[int], step: int) -> bool:
    """``step`` is committed (step 0 counts: a falsy 0 once made every job's start wait out
    the full commit timeout)."""
    return committed is not None and committed >= step


REGISTER_DEBOUNCE_S = 1.0  # registrations are written at most once per this many seconds
REBUILD_TIMEOUT_S = 5.0  # a store that has not answered its inventory by then is skipped
REBUILD_RETRY_S = 10.0  # a rebuild that proved too little is tried again after this long
WAKE_BUCKET_S = 0.05  # commit waiters' deadlines are kept to this grain (one timer each)

View = tuple[Optional[int], Optional[int], Optional[str]]  # see Coordinator._commit_view
STALE: View = (None, None, "stale")  # the answer to a call of an older generation


class Coordinator(PersistCalls, DrillCalls):
    """Run as an async Ray actor: ``ray.remote(Coordinator).options(name=..., ...)``.

    ``state``: where the small state survives a restart (default: Ray's GCS);
    ``inventory``: how a restarted coordinator asks the stores what they hold (default:
    :func:`ray_inventory`); ``clock``: wall time (tests)."""

    def __init__(self, job: str, run_dir: str, world_size: int,
                 tiers: tuple[Any, ...] = (), fingerprint: str = "", *,
                 state: Optional[StateStore] = None,
                 inventory: Optional[InventorySource] = None,
                 clock: Callable[[], float] = time.time) -> None:
        from memckpt.persist import CheckpointStore
        self.job = job
        self.fingerprint = fingerprint
        self.stores = [CheckpointStore(t) for t in tiers]  # persistence tiers, for manifests
        self._persist_shards: dict[tuple[int, int], dict[int, Any]] = {}  # (tier, step) -> entries
        self._folders: dict[tuple[int, int], str] = {}
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        self.state: StateStore = state if state is not None else GcsStateStore(job)
        self.inventory_source: InventorySource = inventory or ray_inventory
        self.clock = clock
        self._dirty = False  # registrations not yet written
        self._saved_at = float("-inf")
        self.ready = Readiness()  # the steps in flight: ranks ready, by node (not persisted)
        self._rebuild_due = False  # restarted: commits since the last write are unknown
        self._rebuild_task: Optional[asyncio.Future[Optional[int]]] = None
        self._rebuilt_at = float("-inf")
        # restarted, and no step committed since: a rank's shard_ready may have been lost
        self._stale_ready = False
        self._cond = asyncio.Condition()
        # commit waiters, by deadline bucket: a future woken by a commit or at its time
        self._wakers: dict[float, asyncio.Future[None]] = {}  # see _until_committed
        self.alive = Liveness(clock)  # nodes' heartbeats, ranks named late or heard alone
        self.node_ram: dict[str, NodeRam] = {}  # node -> its RAM held, budget, peak (B)
        self.received: Counter[str] = Counter()  # node messages taken, by method (tests, bench)
        self._refused_from: set[tuple[str, int]] = set()  # (node, its generation) refused
        self._relays: set[tuple[str, int]] = set()  # (leader, generation) heard from
        self.job_metrics = JobMetrics(job)
        self.steps = StepLog(self.run_dir, self.job_metrics)  # losses, stalls, progress
        self.s = JobState()
        saved = self.state.get()
        if saved:  # restarted after a crash: resume from the last saved view
            self.s = JobState.load(saved)
            self.s.restarts_of_coordinator += 1
            if self.s.assignment:  # an elastic job's size is its last generation's
                self.world_size = len(self.s.assignment)
            self._rebuild_due = self._stale_ready = True
            self.steps.reload_losses()
            self._index_nodes()
            protect(self.stores, self.s.protected)
            self.event("coordinator_restarted", committed=self.s.committed, gen=self.s.gen)
            self._save()

    def _index_nodes(self) -> None:
        """This generation's ranks by node and each node's placement digest (O(ranks),
        once per generation)."""
        self.ready.configure(Membership.of(self.s.assignment, self.s.holders))

    # -- persistence of the small state -------------------------------------------------------
    def _save(self) -> None:
        """The full write (see the module's docstring for when)."""
        self.state.put(self.s.dump())
        self._dirty = False
        self._saved_at = self.clock()

    def _save_if_due(self) -> None:
        """Write the registrations marked dirty, at most once per REGISTER_DEBOUNCE_S."""
        if self._dirty and self.clock() - self._saved_at >= REGISTER_DEBOUNCE_S:
            self._save()

    def event(self, kind: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": kind, **fields}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        self.job_metrics.event(kind, fields)

    # -- membership ---------------------------------------------------------------------------
    async def configure(self, gen: int, assignment: dict[int, str], holders: dict[int, list[str]],
                        committed: Optional[int], stores: dict[str, str]) -> None:
        """Start generation ``gen`` of the worker group (driver, at start and after recovery)."""
        async with self._cond:
            self.world_size = len(assignment)  # an elastic job changes it between generations
            s = self.s
            s.gen, s.committed, s.workers, s.stores = gen, committed, {}, dict(stores)
            s.assignment = {str(r): n for r, n in assignment.items()}
            s.holders = {str(r): list(h) for r, h in holders.items()}
            self._rebuild_due = self._stale_ready = False  # the driver's step is this gen's
            self.alive.reset()
            self._index_nodes()
            self.steps.reset()
            self._save()
            self._cond.notify_all()
            self._wake_commit_waiters()

    async def register(self, rank: int, gen: int, info: WorkerInfo) -> None:
        if gen != self.s.gen:
            return
        self.s.workers[str(rank)] = info
        self.alive.rank_heard(rank, -1, self.ready.members.rank_node.get(rank))
        self._dirty = True
        self._save_if_due()

    async def heartbeat(self, rank: int, gen: int, step: int) -> None:
        if gen == self.s.gen:
            self.alive.rank_heard(rank, step, self.ready.members.rank_node.get(rank))
        self._save_if_due()

    async def liveness(self, timeout_s: float,
                       startup_timeout_s: float) -> tuple[list[int], list[str]]:
        """(hung ranks, silent nodes): a node whose store's heartbeat is older than the
        timeout is frozen or cut off, with all its ranks; a hung rank on a live node is one
        its store names late past the timeout (``startup_timeout_s`` instead while a rank
        has not finished its first step: start-up imports, process-group rendezvous and
        restore may legitimately take longer). O(nodes + ranks named): see
        :mod:`memckpt.runtime.coordinator.heartbeats`."""
        return self.alive.judge(timeout_s, startup_timeout_s, self.ready.members.node_ranks)

    async def last_heard(self, ranks: list[int], nodes: list[str]) -> Optional[float]:
        """The last sign of life (wall time) of ``nodes``' stores and ``ranks``, the
        earliest among them: where a hang or a freeze began, as far as anyone can tell."""
        return self.alive.last_heard(ranks, nodes)

    # -- commit -------------------------------------------------------------------------------
    def _commit_view(self) -> View:
        """(committed step, the committed step every rank must persist now or None, and
        what follows it: "stop" or "persist")."""
        stop = self.s.stop
        return self.s.committed, stop.step if stop else None, stop.action if stop else None

    async def shard_ready(self, rank: int, gen: int, step: int, holders: list[str]) -> View:
        """``rank``'s shard of ``step`` is local and on ``holders`` (a worker with no store on
        its node; see node_ready); returns (committed step, step to persist now or None,
        "stop"/"persist"), or STALE for an older generation. O(1): no write, no scan of
        ranks."""
        await self._rebuilt()
        async with self._cond:
            if gen != self.s.gen:
                return STALE
            if not self.ready.rank(step, rank, holders):
                return self._commit_view()
            self._maybe_commit(step)
            self._save_if_due()
            return self._commit_view()

    def _maybe_commit(self, step: int) -> None:
        """Commit ``step`` if every rank is ready for it and it is newer (call under the lock)."""
        if self.ready.count(step) < self.world_size or _at_least(self.s.committed, step):
            return
        self.s.committed = step
        self._stale_ready = False  # whatever readiness the restart lost, a newer step is in
        stop = self.s.stop
        if stop and stop.step is None and step >= stop.at:
            stop.step = step  # every rank must persist this step, even after a restart
            self._save()
        self.ready.committed(step)
        self._cond.notify_all()
        self._wake_commit_waiters()

    def _wake_commit_waiters(self) -> None:
        """A step committed or a generation started: every commit waiter checks again."""
        wakers, self._wakers = self._wakers, {}
        for waker in wakers.values():
            if not waker.done():
                waker.set_result(None)

    def _waker(self, loop: asyncio.AbstractEventLoop, deadline: float) -> asyncio.Future[None]:
        """The future a waiter with ``deadline`` awaits: shared by every waiter whose
        deadline falls in the same WAKE_BUCKET_S, woken by the next commit or at the
        bucket's end (one timer a bucket, not one a waiter)."""
        at = math.ceil(deadline / WAKE_BUCKET_S) * WAKE_BUCKET_S
        waker = self._wakers.get(at)
        if waker is None:
            waker = self._wakers[at] = loop.create_future()
            loop.call_at(at, self._expire, at, waker)
        return waker

    def _expire(self, at: float, waker: asyncio.Future[None]) -> None:
        if self._wakers.get(at) is waker:
            del self._wakers[at]
        if not waker.done():
            waker.set_result(None)

    async def _until_committed(self, gen: int, step: int, timeout_s: float) -> bool:
        """Wait until ``step`` is committed or ``gen`` is over; False on timeout (up to
        WAKE_BUCKET_S late). Waiters share futures, woken at each commit, and take no lock:
        at 512 nodes' batches waiting, a commit answers them all in one pass of the loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.s.gen == gen and not _at_least(self.s.committed, step):
            if deadline <= loop.time():
                return False
            await self._waker(loop, deadline)
        return True

    async def wait_commit(self, gen: int, step: int, timeout_s: float) -> View:
        """Wait until ``step`` is committed (or the generation changes, or time runs out);
        STALE once ``gen`` is not the current generation."""
        await self._rebuilt()
        if not await self._until_committed(gen, step, timeout_s):
            self._rearm_rebuild()
        return STALE if gen != self.s.gen else self._commit_view()

    # -- node batches: one message per node per step (memckpt.runtime.node.aggregator) --------
    async def node_ready(self, node: str, batch: ReadyBatch, wait_s: float) -> View:
        """``node``'s ranks placed their shards of ``batch.step`` (checked against placement:
        see :mod:`memckpt.runtime.coordinator.readiness`), with the node's step summaries.
        Then waits up to ``wait_s`` for the commit: the answer the node's store hands its
        ranks. STALE for an older generation (nothing changes). O(1) unless the batch names
        ranks placed short."""
        gen, step = batch.gen, batch.step
        await self._rebuilt()
        async with self._cond:
            if gen != self.s.gen:
                self._refused(node, gen, batch.metrics)
                return STALE
            self.received["node_ready"] += 1
            self._take_batch(node, batch)
            self._maybe_commit(step)
            self._save_if_due()
        return await self.wait_commit(gen, step, wait_s)

    async def group_ready(self, leader: str, parts: tuple[tuple[str, ReadyBatch], ...],
                          wait_s: float) -> View:
        """Several nodes' batches of one step in one message, merged by their group's
        leader (:mod:`memckpt.runtime.node.relay`): each taken as ``node_ready`` takes it,
        one commit check and one wait for them all. O(the nodes in it), without the cost of
        a message each. A part that disagrees with the placement is logged and the others
        taken before the error is raised (each member then sends its own, and only that
        node's fails). A part that readies no rank carries the summaries of a step no rank
        snapshotted: taken as ``node_metrics`` takes them; a group of those alone is
        answered at once."""
        if not parts:
            return self._commit_view()
        gen, step = parts[0][1].gen, parts[0][1].step
        await self._rebuilt()
        mismatch: Optional[PlacementMismatch] = None
        readies = any(b.readies for _, b in parts)  # else step summaries alone
        async with self._cond:
            if gen != self.s.gen:
                for node, batch in parts:
                    self._refused(node, gen, batch.metrics)
                return STALE
            self.received["group_ready"] += 1
            if (leader, gen) not in self._relays:  # which relays a generation uses, once each
                self._relays.add((leader, gen))
                self.event("relay_group", leader=leader, gen=gen, step=step,
                           nodes=[node for node, _ in parts])
            for node, batch in parts:
                try:
                    self._take_batch(node, batch)
                except PlacementMismatch as e:
                    mismatch = e
            if readies:
                self._maybe_commit(step)
            self._save_if_due()
        if mismatch is not None:
            raise mismatch
        if not readies:  # no one waits on summaries: answered at once
            return self._commit_view()
        return await self.wait_commit(gen, step, wait_s)

    def _take_batch(self, node: str, batch: ReadyBatch) -> None:
        """One node's batch of this generation (under the lock): a sign of life, its step
        summaries, its ranks' readiness (checked against placement)."""
        self.alive.node_spoke(node, batch.step, self.ready.members.node_ranks.get(node, ()))
        self.steps.take(batch.gen, node, batch.metrics, self.world_size, self.s.committed)
        if not batch.readies:
            return  # a step's summaries alone (a step no rank snapshotted, relayed)
        try:
            self.ready.node(node, batch)
        except PlacementMismatch as e:
            self.event("placement_mismatch", node=node, gen=batch.gen, step=batch.step,
                       error=str(e))
            raise

    async def node_metrics(self, node: str, gen: int, metrics: tuple[StepSummary, ...]) -> None:
        if gen != self.s.gen:
            self._refused(node, gen, metrics)
            return
        self.received["node_metrics"] += 1
        self.alive.node_spoke(node, max((m.step for m in metrics), default=-1),
                              self.ready.members.node_ranks.get(node, ()))
        self.steps.take(gen, node, metrics, self.world_size, self.s.committed)

    async def ended_metrics(self, node: str, gen: int, metrics: tuple[StepSummary, ...]) -> None:
        """What a store held of ``gen`` as its ranks joined a newer one, or a report of
        ``gen`` it took after the recovery fenced it off (maybe before this coordinator
        starts the next generation): losses kept, for a step the next one resumes from."""
        if gen <= self.s.gen:
            self.steps.orphaned(gen, metrics)

    async def node_heartbeat(self, node: str, hb: Heartbeat) -> bool:
        """``node``'s sign of life (its ranks' newest step, the late ones by name; every
        few seconds its RAM). O(1) plus the ranks it names. False: refused, ``hb.gen`` is
        over (the store fences it off and stops beating for it)."""
        gen = hb.gen
        if gen != self.s.gen:
            self._refused(node, gen, hb.metrics)
            return gen > self.s.gen  # only an older generation is over
        self.received["node_heartbeat"] += 1
        if hb.ram is not None:  # every few seconds: (bytes its memckpt files hold, its budget)
            held, budget = hb.ram
            known = self.node_ram.get(node)
            peak = known["peak"] if known else 0
            if held > peak:  # a new peak (rare: slots are reused once made)
                self.event("node_ram", node=node, held_bytes=held, budget_bytes=budget)
            self.node_ram[node] = NodeRam(held=held, budget=budget, peak=max(peak, held))
        self.alive.node_beat(node, hb, self.ready.members.node_ranks.get(node, ()))
        self.steps.newest = max(self.steps.newest, hb.top)  # where the job was, between batches
        self.steps.take(gen, node, hb.metrics, self.world_size, self.s.committed)
        self._save_if_due()
        return True

    def _refused(self, node: str, gen: int, metrics: tuple[StepSummary, ...]) -> None:
        """A store of an older generation spoke (frozen, cut off, or fenced late): only its
        losses kept (orphaned); counted, the first per generation logged."""
        if gen < self.s.gen:
            self.steps.orphaned(gen, metrics)
        self.received["stale"] += 1
        key = (node, gen)
        if key not in self._refused_from:
            self._refused_from.add(key)
            self.event("stale_node_refused", node=node, its_gen=gen, gen=self.s.gen)

    def _rearm_rebuild(self) -> None:
        """A waiter timed out after a restart and nothing committed since: the first rebuild
        may have missed a store (and with it some ranks' readiness): ask again, at most once
        per REBUILD_RETRY_S."""
        task = self._rebuild_task
        if (self._stale_ready and task is not None and task.done()
                and self.clock() - self._rebuilt_at >= REBUILD_RETRY_S):
            self._rebuild_task = None
            self._rebuild_due = True

    async def committed(self) -> Optional[int]:
        await self._rebuilt()
        return self.s.committed

    async def _rebuilt(self) -> None:
        """After a restart, the first caller starts the rebuild and every caller waits for
        it (outside the lock); afterwards a no-op."""
        if not self._rebuild_due:
            return
        if self._rebuild_task is None:
            self._rebuild_task = asyncio.ensure_future(self.rebuild())
        await asyncio.shield(self._rebuild_task)

    async def rebuild(self) -> Optional[int]:
        """Ask every store what it holds (REBUILD_TIMEOUT_S; silent ones are skipped, which
        proves less, never more) and raise the committed step to what that proves."""
        gen = self.s.gen
        t0 = time.time()
        try:
            got = self.inventory_source(dict(self.s.stores), REBUILD_TIMEOUT_S)
            inventory = await got if inspect.isawaitable(got) else got
            if gen != self.s.gen:  # a new generation began meanwhile: the driver's step
                return self.s.committed
            best = await self.verify_committed(inventory)
        except Exception as e:  # noqa: BLE001 - proves nothing; the saved step stands
            self.event("committed_rebuild_failed", error=repr(e))
            return self.s.committed
        finally:
            self._rebuild_due = False
            self._rebuilt_at = self.clock()
        self.event("committed_rebuild_done", committed=best, stores=len(inventory),
                   of_stores=len(self.s.stores), seconds=time.time() - t0)
        return best

    async def verify_committed(self, inventory: Inventory) -> Optional[int]:
        """Raise the committed step to what the stores prove: every rank's shard on its own
        node and on all its holders (after a coordinator restart). Steps newer than that
        which some ranks' shards reached count those ranks as ready (their ``shard_ready``
        may have been lost with the old process). Never lowers the committed step."""
        async with self._cond:
            before = self.s.committed
            proven = proven_ready(inventory, self.s.assignment, self.s.holders)
            full = len(self.s.assignment) == self.world_size
            for step in sorted(proven):
                if _at_least(self.s.committed, step):
                    continue
                if full:
                    self.ready.proven(step, proven[step])
                    self._maybe_commit(step)
            best = self.s.committed
            if best != before:
                self.event("committed_rebuilt", committed=best, was=before)
                self._save()
                self._cond.notify_all()
            return best

    # -- progress, status ----------------------------------------------------------------------
    async def report(self, rank: int, gen: int, step: int, metrics: dict[str, float]) -> None:
        if gen != self.s.gen:
            return
        self.alive.rank_heard(rank, step, None)  # a rank with no store: heard alone
        self.steps.take(gen, f"rank {rank}", [self.steps.summarize(rank, step, metrics)],
                        self.world_size, self.s.committed)
        self._save_if_due()

    async def set_elastic(self, info: ElasticInfo) -> None:
        """The driver: an elastic job's size, last resize and pending growth (for status);
        each call updates the keys it names."""
        elastic = ElasticInfo(**self.s.elastic) if self.s.elastic else ElasticInfo()
        elastic.update(info)
        self.s.elastic = elastic
        self._save()

    async def log_event(self, kind: str, fields: EventFields) -> None:
        if kind == "failure_detected":  # where the job was: the start of what a resume redoes
            fields = dict(fields, reached_step=self.steps.newest, committed=self.s.committed)
        self.event(kind, **fields)

    async def progress(self) -> Progress:
        await self._rebuilt()
        return self.steps.progress(self.s.gen, self.world_size, self.s.committed)

    async def restored_loss(self, gen: int, step: int, loss: float) -> bool:
        """Rank 0 of recovery generation ``gen`` resumed from ``step``, whose loss its
        snapshot kept (:meth:`StepLog.restored`). False: another generation, or not this
        run's step."""
        if gen != self.s.gen or gen == 0:
            return False
        return self.steps.restored(gen, step, loss)

    async def all_losses(self) -> dict[str, float]:
        return self.steps.losses

    async def status(self) -> CoordinatorStatus:
        now = time.time()
        units = {u: p.status(now) for u, p in self.steps.units.items()}
        return {**self.s.as_dict(), "units": units, "snapshots": self.steps.snapshots,
                **self.alive.status(), "node_ram": self.node_ram,
                "refused_stale": self.received["stale"]}

    async def whereabouts(self) -> Whereabouts:
        import ray
        return Whereabouts(ray.get_runtime_context().get_node_id(), os.getpid())

    async def finish(self) -> None:
        self.steps.flush(self.s.committed)
        self.s.done = True
        self.state.delete()
