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
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from memckpt.persist.catalog import protect
from memckpt.policy.step_metrics import Summary
from memckpt.runtime.coordinator.metrics import JobMetrics
from memckpt.runtime.coordinator.steps import StepLog
from memckpt.runtime.coordinator.state_store import (
    COORDINATOR_NAMESPACE, GcsStateStore, Inventory, InventorySource, MemoryStateStore,
    StateStore, proven_ready, ray_inventory)

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

View = tuple[Optional[int], Optional[int], Optional[str]]  # see Coordinator._commit_view
STALE: View = (None, None, "stale")  # the answer to a call of an older generation


class Coordinator:
    """Run as an async Ray actor: ``ray.remote(Coordinator).options(name=..., ...)``.

    ``state``: where the small state survives a restart (default: Ray's GCS);
    ``inventory``: how a restarted coordinator asks the stores what they hold (default:
    :func:`ray_inventory`); ``clock``: wall time (tests)."""

    def __init__(self, job: str, run_dir: str, world_size: int,
                 tiers: tuple = (), fingerprint: str = "", *,
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
        self._ready: dict[int, set[int]] = {}  # step -> ranks ready (not persisted)
        self._rebuild_due = False  # restarted: commits since the last write are unknown
        self._rebuild_task: Optional[asyncio.Future] = None
        self._rebuilt_at = float("-inf")
        # restarted, and no step committed since: a rank's shard_ready may have been lost
        self._stale_ready = False
        self._cond = asyncio.Condition()
        self._moved: Optional[asyncio.Future] = None  # see _wake_commit_waiters
        self.heartbeats: dict[int, tuple[float, int]] = {}  # rank -> (last sign, its step)
        self.node_beats: dict[str, tuple[float, int]] = {}  # node -> (last beat, newest step)
        self.node_ram: dict[str, dict[str, int]] = {}  # node -> its RAM held, budget, peak (B)
        self._node_ranks: dict[str, list[int]] = {}  # this generation's ranks per node
        self._rank_node: dict[int, str] = {}  # and each rank's node
        self.received: Counter[str] = Counter()  # node messages taken, by method (tests, bench)
        self._refused_from: set[tuple[str, int]] = set()  # (node, its generation) refused
        self.job_metrics = JobMetrics(job)
        self.steps = StepLog(self.run_dir, self.job_metrics)  # losses, stalls, progress
        self.s: dict[str, Any] = {
            "gen": -1, "assignment": {}, "holders": {}, "committed": None,
            "workers": {}, "fired": [], "stores": {}, "stop": None, "persisted": {},
            "started_at": time.time(), "restarts_of_coordinator": 0, "done": False,
        }
        saved = self.state.get()
        if saved:  # restarted after a crash: resume from the last saved view
            self.s = json.loads(saved)
            self.s["restarts_of_coordinator"] += 1
            self.s.pop("ready", None)  # an older version's; readiness is rebuilt
            if self.s["assignment"]:  # an elastic job's size is its last generation's
                self.world_size = len(self.s["assignment"])
            self._rebuild_due = self._stale_ready = True
            self.steps.reload_losses()
            self._index_nodes()
            protect(self.stores, self.s.get("protected", {}))
            self.event("coordinator_restarted", committed=self.s["committed"], gen=self.s["gen"])
            self._save()

    def _index_nodes(self) -> None:
        self._node_ranks, self._rank_node = {}, {}
        for r, node in self.s["assignment"].items():
            self._node_ranks.setdefault(node, []).append(int(r))
            self._rank_node[int(r)] = node

    # -- persistence of the small state -------------------------------------------------------
    def _save(self) -> None:
        """The full write (see the module's docstring for when)."""
        self.state.put(json.dumps(self.s).encode())
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
            self.s.update(gen=gen, assignment={str(r): n for r, n in assignment.items()},
                          holders={str(r): list(h) for r, h in holders.items()},
                          committed=committed, workers={}, stores=stores)
            self._ready.clear()
            self._rebuild_due = self._stale_ready = False  # the driver's step is this gen's
            self.heartbeats.clear()
            self.node_beats.clear()
            self._index_nodes()
            self.steps.reset()
            self._save()
            self._cond.notify_all()
            self._wake_commit_waiters()

    async def register(self, rank: int, gen: int, info: dict[str, Any]) -> None:
        if gen != self.s["gen"]:
            return
        self.s["workers"][str(rank)] = info
        self.heartbeats[rank] = (self.clock(), -1)
        self._dirty = True
        self._save_if_due()

    async def heartbeat(self, rank: int, gen: int, step: int) -> None:
        if gen == self.s["gen"]:
            self.heartbeats[rank] = (self.clock(), step)
        self._save_if_due()

    # -- persistence ----------------------------------------------------------------------------
    async def request_stop(self, at_step: int, action: str) -> None:
        """Persist the first step committed at or after ``at_step`` to every tier; then the
        driver stops the job (action "stop") or goes on ("persist"). Decided at commit time,
        so every rank persists the same step while its snapshot is still in RAM."""
        self.s["stop"] = {"at": at_step, "action": action, "step": None}
        self.event("stop_requested", at=at_step, action=action)
        self._save()

    async def stop_state(self) -> Optional[dict[str, Any]]:
        return self.s.get("stop")

    async def clear_stop(self) -> None:
        self.s["stop"] = None
        self._save()

    async def persist_folder(self, tier: int, step: int) -> str:
        """The folder ``step`` goes into on ``tier``: decided once, the same for every rank."""
        key = (tier, step)
        if key not in self._folders:
            self._folders[key] = self.stores[tier].folder_for(step)
        return self._folders[key]

    async def persist_ready(self, tier: int, step: int, rank: int, entry: Any) -> bool:
        """``rank``'s shard of ``step`` is stored on ``tier``; the last one writes the manifest."""
        got = self._persist_shards.setdefault((tier, step), {})
        got[rank] = entry
        if len(got) < self.world_size:
            return False
        del self._persist_shards[(tier, step)]
        self._folders.pop((tier, step), None)
        store = self.stores[tier]
        t0 = time.time()
        store.commit(step, self.world_size, [got[r] for r in sorted(got)], self.fingerprint,
                     placement={"holders": self.s["holders"]}, job=self.job)
        self.s["persisted"][str(tier)] = step
        self._save()
        self.event("persisted", step=step, tier=store.describe(), manifest_s=time.time() - t0)
        return True

    async def started_over(self, gen: int, rank: int, step: int,
                           folders: dict[int, list[str]]) -> None:
        """``rank`` passed another model's persisted checkpoint over and starts at ``step``
        (load.on_incompatible="start_fresh"): the old model's step is no longer this job's
        committed one, and ``folders`` (per tier) are never written or removed.
        Every rank says so before it snapshots its start, so before this run commits."""
        async with self._cond:
            if gen != self.s["gen"]:
                return
            protect(self.stores, folders)
            saved = self.s.setdefault("protected", {})
            for tier, names in folders.items():
                saved[str(tier)] = sorted(set(saved.get(str(tier), [])) | set(names))
            if self.s["committed"] is not None:
                self.event("started_over", rank=rank, gen=gen, step=step,
                           old_committed=self.s["committed"])
                self.s["committed"] = None
            self._save()

    async def protected(self) -> dict[str, list[str]]:
        """The folders per tier no rank may write (see :meth:`started_over`)."""
        return dict(self.s.get("protected", {}))

    async def persisted(self) -> dict[str, int]:
        return dict(self.s["persisted"])

    async def liveness(self, timeout_s: float,
                       startup_timeout_s: float) -> tuple[list[int], list[str]]:
        """(hung ranks, silent nodes): a node whose store's heartbeat is older than the
        timeout is frozen or cut off, with all its ranks; a hung rank on a live node is
        found by the age its store reports for it (``startup_timeout_s`` instead while a
        rank has not finished its first step: start-up imports, process-group rendezvous
        and restore may legitimately take longer). One pass over ranks and nodes.

        A rank's age is judged at its store's last heartbeat, not now: a store that went
        silent says nothing of its ranks since, and its ranks' last signs precede its own,
        so judged now they would go stale first and a frozen node be taken for a hung rank."""
        now = self.clock()

        def stale(t: float, step: int, at: float) -> bool:
            return at - t > (timeout_s if step >= 0 else startup_timeout_s)

        silent = sorted(n for n, (t, step) in self.node_beats.items() if stale(t, step, now))
        ranks, beats = set(), self.node_beats
        for r, (t, step) in self.heartbeats.items():
            node = self._rank_node.get(r)
            if stale(t, step, beats[node][0] if node in beats else now):
                ranks.add(r)
        for node in silent:
            ranks.update(self._node_ranks.get(node, ()))
        return sorted(ranks), silent

    async def last_heard(self, ranks: list[int], nodes: list[str]) -> Optional[float]:
        """The last sign of life (wall time) of ``nodes``' stores and ``ranks``, the
        earliest among them: where a hang or a freeze began, as far as anyone can tell."""
        times = [self.node_beats[n][0] for n in nodes if n in self.node_beats]
        times += [self.heartbeats[r][0] for r in ranks if r in self.heartbeats]
        return min(times, default=None)

    # -- commit -------------------------------------------------------------------------------
    def _commit_view(self) -> View:
        """(committed step, the committed step every rank must persist now or None, and
        what follows it: "stop" or "persist")."""
        stop = self.s.get("stop") or {}
        return self.s["committed"], stop.get("step"), stop.get("action")

    async def shard_ready(self, rank: int, gen: int, step: int, holders: list[str]) -> View:
        """``rank``'s shard of ``step`` is local and on ``holders`` (a worker with no store on
        its node; see node_ready); returns (committed step, step to persist now or None,
        "stop"/"persist"), or STALE for an older generation. O(1): no write, no scan of
        ranks."""
        await self._rebuilt()
        async with self._cond:
            if gen != self.s["gen"]:
                return STALE
            need = self.s["holders"].get(str(rank), [])
            if not set(need) <= set(holders):
                return self._commit_view()
            self._ready.setdefault(step, set()).add(rank)
            self._maybe_commit(step)
            self._save_if_due()
            return self._commit_view()

    def _maybe_commit(self, step: int) -> None:
        """Commit ``step`` if every rank is ready for it and it is newer (call under the lock)."""
        if len(self._ready.get(step, ())) < self.world_size or _at_least(self.s["committed"], step):
            return
        self.s["committed"] = step
        self._stale_ready = False  # whatever readiness the restart lost, a newer step is in
        stop = self.s.get("stop")
        if stop and stop["step"] is None and step >= stop["at"]:
            stop["step"] = step  # every rank must persist this step, even after a restart
            self._save()
        for old in [k for k in self._ready if k <= step]:  # the steps in flight: a few
            del self._ready[old]
        self._cond.notify_all()
        self._wake_commit_waiters()

    def _wake_commit_waiters(self) -> None:
        """A step committed or a generation started: every commit waiter checks again."""
        moved, self._moved = self._moved, None
        if moved is not None and not moved.done():
            moved.set_result(None)

    async def _until_committed(self, gen: int, step: int, timeout_s: float) -> bool:
        """Wait until ``step`` is committed or ``gen`` is over; False on timeout. Waiters
        share one future, woken at each commit, and take no lock: at 512 nodes' batches
        waiting, a commit answers them all in one pass of the event loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.s["gen"] == gen and not _at_least(self.s["committed"], step):
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._moved is None:
                self._moved = loop.create_future()
            await asyncio.wait([self._moved], timeout=left)
        return True

    async def wait_commit(self, gen: int, step: int, timeout_s: float) -> View:
        """Wait until ``step`` is committed (or the generation changes, or time runs out);
        STALE once ``gen`` is not the current generation."""
        await self._rebuilt()
        if not await self._until_committed(gen, step, timeout_s):
            self._rearm_rebuild()
        return STALE if gen != self.s["gen"] else self._commit_view()

    # -- node batches: one message per node per step (memckpt.runtime.node.aggregator) --------
    async def node_ready(self, node: str, gen: int, step: int, ranks: Mapping[int, list[str]],
                         metrics: list[Summary], wait_s: float) -> View:
        """Every rank of ``node`` in ``ranks`` placed its shard of ``step`` on the holders
        given (each checked against placement), with the node's step summaries. Then waits
        up to ``wait_s`` for the commit: the answer the node's store hands its ranks. STALE
        for an older generation (nothing changes). O(ranks in the batch)."""
        await self._rebuilt()
        async with self._cond:
            if gen != self.s["gen"]:
                self._refused(node, gen, metrics)
                return STALE
            self.received["node_ready"] += 1
            self.steps.take(gen, metrics, self.world_size, self.s["committed"])
            need = self.s["holders"]
            got = self._ready.setdefault(step, set())
            for r, placed in ranks.items():
                if set(need.get(str(r), ())) <= set(placed):
                    got.add(int(r))
            self._maybe_commit(step)
            self._save_if_due()
        return await self.wait_commit(gen, step, wait_s)

    async def node_metrics(self, node: str, gen: int, metrics: list[Summary]) -> None:
        if gen != self.s["gen"]:
            self._refused(node, gen, metrics)
            return
        self.received["node_metrics"] += 1
        self.steps.take(gen, metrics, self.world_size, self.s["committed"])

    async def ended_metrics(self, node: str, gen: int, metrics: list[Summary]) -> None:
        """What a store held of ``gen`` as its ranks joined a newer one: losses kept."""
        if gen < self.s["gen"]:
            self.steps.orphaned(gen, metrics)

    async def node_heartbeat(self, node: str, gen: int, beats: Mapping[int, tuple[float, int]],
                             metrics: list[Summary], ram: Optional[tuple[int, int]] = None) -> bool:
        """``beats``: each of its ranks' (age of its last sign of life, on the node's clock;
        its step), placed on this clock. O(ranks of the node). False: refused, ``gen`` is
        over (the store fences it off and stops beating for it)."""
        if gen != self.s["gen"]:
            self._refused(node, gen, metrics)
            return gen > self.s["gen"]  # only an older generation is over
        self.received["node_heartbeat"] += 1
        if ram is not None:  # every few seconds: (bytes its memckpt files hold, its budget)
            peak = self.node_ram.get(node, {}).get("peak", 0)
            if ram[0] > peak:  # a new peak (rare: slots are reused once made)
                self.event("node_ram", node=node, held_bytes=ram[0], budget_bytes=ram[1])
            self.node_ram[node] = {"held": ram[0], "budget": ram[1], "peak": max(peak, ram[0])}
        now, top = self.clock(), -1
        for r, (age, step) in beats.items():
            self.heartbeats[int(r)] = (now - age, step)
            top = max(top, step)
        self.node_beats[node] = (now, top)
        self.steps.newest = max(self.steps.newest, top)  # where the job was, between batches
        self.steps.take(gen, metrics, self.world_size, self.s["committed"])
        self._save_if_due()
        return True

    def _refused(self, node: str, gen: int, metrics: list[Summary]) -> None:
        """A store of an older generation spoke (frozen, cut off, or fenced late): only its
        losses kept (orphaned); counted, the first per generation logged."""
        if gen < self.s["gen"]:
            self.steps.orphaned(gen, metrics)
        self.received["stale"] += 1
        key = (node, gen)
        if key not in self._refused_from:
            self._refused_from.add(key)
            self.event("stale_node_refused", node=node, its_gen=gen, gen=self.s["gen"])

    def _rearm_rebuild(self) -> None:
        """A waiter timed out after a restart and nothing committed since: the first rebuild
        may have missed a store (and with it some ranks' readiness): ask again, at most once
        per REBUILD_RETRY_S."""
        task = self._rebuild_task
        if (self._stale_ready and task is not None and task.done()
                and self.clock() - self._rebuilt_at >= REBUILD_RETRY_S):
            self._rebuild_task = None
            self._rebuild_due = True

    async def _until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds (checked at every notify); False on timeout."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(predicate), timeout_s)
                return True
            except asyncio.TimeoutError:
                return False

    async def committed(self) -> Optional[int]:
        await self._rebuilt()
        return self.s["committed"]

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
        gen = self.s["gen"]
        t0 = time.time()
        try:
            got = self.inventory_source(dict(self.s.get("stores", {})), REBUILD_TIMEOUT_S)
            inventory = await got if inspect.isawaitable(got) else got
            if gen != self.s["gen"]:  # a new generation began meanwhile: the driver's step
                return self.s["committed"]
            best = await self.verify_committed(inventory)
        except Exception as e:  # noqa: BLE001 - proves nothing; the saved step stands
            self.event("committed_rebuild_failed", error=repr(e))
            return self.s["committed"]
        finally:
            self._rebuild_due = False
            self._rebuilt_at = self.clock()
        self.event("committed_rebuild_done", committed=best, stores=len(inventory),
                   of_stores=len(self.s.get("stores", {})), seconds=time.time() - t0)
        return best

    async def verify_committed(self, inventory: Inventory) -> Optional[int]:
        """Raise the committed step to what the stores prove: every rank's shard on its own
        node and on all its holders (after a coordinator restart). Steps newer than that
        which some ranks' shards reached count those ranks as ready (their ``shard_ready``
        may have been lost with the old process). Never lowers the committed step."""
        async with self._cond:
            before = self.s["committed"]
            proven = proven_ready(inventory, self.s["assignment"], self.s["holders"])
            full = len(self.s["assignment"]) == self.world_size
            for step in sorted(proven):
                if _at_least(self.s["committed"], step):
                    continue
                if full:
                    self._ready.setdefault(step, set()).update(proven[step])
                    self._maybe_commit(step)
            best = self.s["committed"]
            if best != before:
                self.event("committed_rebuilt", committed=best, was=before)
                self._save()
                self._cond.notify_all()
            return best

    # -- progress, chaos, status --------------------------------------------------------------
    async def report(self, rank: int, gen: int, step: int, metrics: dict[str, float]) -> None:
        if gen != self.s["gen"]:
            return
        self.heartbeats[rank] = (self.clock(), step)
        self.steps.take(gen, [self.steps.summarize(rank, step, metrics)], self.world_size,
                        self.s["committed"])
        self._save_if_due()

    async def claim(self, key: str, standby_timeout_s: float = 0.0) -> bool:
        """Fire-once: True the first time ``key`` is claimed in this job. With a timeout, a
        steady fault: first wait (up to it) until the job is in standby (set_standby)."""
        if standby_timeout_s > 0 and key not in self.s["fired"]:
            # on timeout, fire anyway: a drill must not hang on a spare that never came
            await self._until(lambda: self.s.get("standby", False) or key in self.s["fired"],
                              standby_timeout_s)
        if key in self.s["fired"]:
            return False
        self.s["fired"].append(key)
        self.s.setdefault("fired_at", {})[key] = time.time()
        self._save()
        return True

    async def set_elastic(self, info: dict[str, Any]) -> None:
        """The driver: an elastic job's size, last resize and pending growth (for status)."""
        self.s["elastic"] = dict(self.s.get("elastic") or {}, **info)
        self._save()

    async def set_standby(self, ready: bool) -> None:
        """The driver: every node's warm spare is (or is no longer) ready to take over."""
        async with self._cond:
            self.s["standby"] = ready
            self._save()
            self._cond.notify_all()

    async def request_fault(self, key: str) -> None:
        """A rank reached a scheduled fault the driver must carry out (node, store, ...)."""
        async with self._cond:
            self.s.setdefault("fault_requests", {})[key] = "requested"
            self._save()

    async def pending_faults(self) -> list[str]:
        return [k for k, v in self.s.get("fault_requests", {}).items() if v == "requested"]

    async def fault_done(self, key: str) -> None:
        async with self._cond:
            self.s.setdefault("fault_requests", {})[key] = "done"
            self._save()
            self._cond.notify_all()

    async def wait_fault(self, key: str, timeout_s: float) -> None:
        await self._until(lambda: self.s.get("fault_requests", {}).get(key) == "done", timeout_s)

    async def log_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "failure_detected":  # where the job was: the start of what a resume redoes
            fields = dict(fields, reached_step=self.steps.newest, committed=self.s["committed"])
        self.event(kind, **fields)

    async def progress(self) -> dict[str, Any]:
        await self._rebuilt()
        return dict(self.steps.progress(self.world_size, self.s["committed"]),
                    gen=self.s["gen"], committed=self.s["committed"])

    async def restored_loss(self, gen: int, step: int, loss: float) -> bool:
        """Rank 0 of recovery generation ``gen`` resumed from ``step``, whose loss its
        snapshot kept (:meth:`StepLog.restored`). False: another generation, or not this
        run's step."""
        if gen != self.s["gen"] or gen == 0:
            return False
        return self.steps.restored(gen, step, loss)

    async def all_losses(self) -> dict[str, float]:
        return self.steps.losses

    async def status(self) -> dict[str, Any]:
        now = self.clock()
        return dict(self.s, metrics=self.steps.metrics, snapshots=self.steps.snapshots,
                    heartbeats={str(r): {"age_s": now - t, "step": s}
                                for r, (t, s) in self.heartbeats.items()},
                    node_beats={n: {"age_s": now - t, "step": s}
                                for n, (t, s) in self.node_beats.items()},
                    node_ram=self.node_ram,
                    refused_stale=self.received["stale"])

    async def whereabouts(self) -> dict[str, Any]:
        import ray
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def finish(self) -> None:
        self.s["done"] = True
        self.state.delete()
