"""The driver: start stores, coordinator and workers on Ray; watch; recover; summarise.

``memckpt.run(train_fn, config)`` is the whole lifecycle. The control loop is
an explicit sequence: START a generation of workers -> MONITOR until every rank
returns or a failure shows (an actor died, a node died, a rank stopped
heart-beating) -> RECOVER (kill the generation, ask the stores what RAM copies
survive, plan, roll back stores past the chosen step) -> START the next
generation, each rank restoring from its own node or a peer's store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from memckpt import placement
from memckpt.buffers import remove_path, resolve_ram_root
from memckpt.config import Config
from memckpt.control import STOP, Control
from memckpt.runtime.coordinator import COORDINATOR_NAMESPACE, Coordinator, coordinator_name
from memckpt.errors import ConfigError, MemckptError, PlacementError, RecoveryError
from memckpt.runtime.faults import Fault, FaultInjector, kill_node, send_signal
from memckpt.recovery_plan import (RecoveryPlan, plan_from_persisted, plan_from_scratch,
                              plan_recovery)
from memckpt.runtime.replica_store import ReplicaStore
from memckpt.runtime.worker import RestoreInstruction, Worker, WorkerSpec

log = logging.getLogger("memckpt")
POLL_S = 0.1
STOP_PERSIST_TIMEOUT_S = 300.0  # stop anyway if persisting for a stop takes longer
GRACE_S = 3.0  # how long survivors get to notice a failure and return before being killed
STARTUP_TIMEOUT_S = 120.0  # a rank silent this long before its first step is hung
LARGEST_SHARD_WAIT_S = 2.0  # stores answering what spares prepare for (see _largest_shard)


def _affinity(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def eligible_nodes(config: Config) -> dict[str, int]:
    """Live nodes that can run workers, with how many workers each can hold (by CPUs)."""
    import ray
    w = config.workers
    out = {}
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        res = n["Resources"]
        cpus, gpus = res.get("CPU", 0), res.get("GPU", 0)
        cap = int(cpus // w.cpus_per_worker) if w.cpus_per_worker else w.workers_per_node
        if w.gpus_per_worker:
            cap = min(cap, int(gpus // w.gpus_per_worker))
        if cap > 0:
            out[n["NodeID"]] = cap
    return out


@dataclass
class Generation:
    gen: int
    workers: dict[int, Any]
    refs: dict[Any, int]  # run ObjectRef -> rank
    info: dict[int, dict[str, Any]]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    holders: dict[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> replica holders

    @property
    def holder_nodes(self) -> set[str]:
        return {h for hs in self.holders.values() for h in hs}


class Runtime:
    def __init__(self, train_fn: Callable, config: Config, run_dir: Path,
                 injector: Optional[FaultInjector] = None, quiet: bool = False) -> None:
        import ray
        self.ray = ray
        self.train_fn, self.config, self.run_dir = train_fn, config, run_dir
        self.injector = injector or FaultInjector()
        self.injector.faults.extend(Fault.from_chaos(ev) for ev in config.chaos)
        self.quiet = quiet
        self.recoveries: list[dict[str, Any]] = []
        self.stores: dict[str, Any] = {}
        self.workers: dict[int, Any] = {}  # rank -> live worker actor (reused across generations)
        self.worker_nodes: dict[int, str] = {}
        self.spares: dict[str, Any] = {}  # node -> idle warm worker
        # node -> (spare, the stage asked of it: 0 state, 1 slot files, its prefault ref)
        self._prefaults: dict[str, tuple[Any, int, Any]] = {}
        self._standby = False  # every node's spare is up and has its memory in hand
        self._first_commit: Optional[int] = None  # the job's first committed step
        self._spare_nodes: set[str] = set()  # the live nodes that should have a spare
        self.events: list[dict[str, Any]] = []
        self._last_print = 0.0
        self.control = Control(config.stop_file)
        self._stop: Optional[tuple[int, str, float]] = None  # (step, action, requested at)

    # -- set-up ---------------------------------------------------------------------------------
    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[memckpt] {msg}", flush=True)

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append(dict(event=kind, time=time.time(), **fields))
        self.coordinator.log_event.remote(kind, fields)

    def _start_store(self, node: str) -> Any:
        ray, cfg = self.ray, self.config
        cls = ray.remote(ReplicaStore)
        return cls.options(
            name=f"memckpt-store-{cfg.job_name}-{node[:16]}", namespace=COORDINATOR_NAMESPACE,
            num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=16,
            scheduling_strategy=_affinity(node),
        ).remote(cfg.ram_root or "", cfg.job_name, node)

    def _ensure_stores(self, nodes: list[str]) -> None:
        new = {n: self._start_store(n) for n in nodes if n not in self.stores}
        if new:
            self.ray.get([s.ping.remote() for s in new.values()])
            self.stores.update(new)

    def _start_coordinator(self) -> None:
        ray, cfg = self.ray, self.config
        from ray.experimental import internal_kv
        if ray.util.list_named_actors(all_namespaces=True).count(coordinator_name(cfg.job_name)):
            raise ConfigError(f"job_name={cfg.job_name!r} is invalid: a job of that name is running "
                              "on this cluster; pick another job_name or stop it with memckpt kill")
        internal_kv._internal_kv_del(f"memckpt/{cfg.job_name}/coordinator".encode())
        here = ray.get_runtime_context().get_node_id()
        self.coordinator = ray.remote(Coordinator).options(
            name=coordinator_name(cfg.job_name), namespace=COORDINATOR_NAMESPACE, num_cpus=0,
            max_restarts=-1, max_task_retries=-1,
            scheduling_strategy=_affinity(here),
        ).remote(cfg.job_name, str(self.run_dir), cfg.workers.num_workers, cfg.persistence,
                  cfg.fingerprint())

    def initial_layout(self) -> tuple[dict[int, str], dict[int, tuple[str, ...]], dict[str, int]]:
        cfg = self.config
        w = cfg.workers
        nodes = eligible_nodes(cfg)
        usable = [n for n, cap in nodes.items() if cap >= w.workers_per_node]
        standbys = cfg.placement.standby_nodes
        if len(usable) < w.num_nodes + standbys:
            also = (f" plus placement.standby_nodes={standbys} standby node(s)" if standbys else "")
            raise PlacementError(
                f"the job needs {w.num_nodes} nodes{also} with room for {w.workers_per_node} "
                f"worker(s) of {w.cpus_per_worker} CPU each, but the cluster has {len(usable)}: "
                "start more nodes, or lower workers.num_workers / workers.cpus_per_worker"
                + (" / placement.standby_nodes" if standbys else ""))
        used = usable[: w.num_nodes]
        standby = usable[w.num_nodes: w.num_nodes + standbys]
        assignment = {r: used[r // w.workers_per_node] for r in range(w.num_workers)}
        holders: dict[int, tuple[str, ...]] = {r: () for r in assignment}
        if cfg.placement.replicas and len(used) + len(standby) > 1:
            plan = placement.standby_plan(used, standby, cfg.placement.strategy,
                                          cfg.placement.replicas, cfg.placement.group_size)
            holders = placement.rank_holders(assignment, plan)
            short = {n: n[:12] for n in used + standby}
            self._say("replica placement (node -> holders of its ranks' shards):\n" +
                      placement.format_plan({short[n]: tuple(short[h] for h in hs)
                                             for n, hs in plan.items()},
                                            {r: short[n] for r, n in assignment.items()})
                      + (f"\nstandby node(s), running no ranks until a node dies: "
                         f"{', '.join(short[n] for n in standby)}" if standby else ""))
        elif cfg.placement.replicas:
            fallback = ("the persistence tier is the copy that does" if cfg.persistence else
                        "add nodes, or configure a persistence tier")
            self._say(f"the job runs on one node: placement.replicas={cfg.placement.replicas} has "
                      "no peer node to hold copies, so snapshots stay in this node's RAM only; "
                      f"that survives a worker's death but not the node's ({fallback})")
            self._event("no_peer_replicas", replicas=cfg.placement.replicas,
                        persistence=bool(cfg.persistence))
        return assignment, holders, nodes

    # -- the control loop -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        self._start_coordinator()
        assignment, holders, capacity = self.initial_layout()
        self._ensure_stores(list(capacity))
        self.ray.get([s.clear.remote() for s in self.stores.values()])  # a fresh job
        self.ray.get([s.ping.remote() for s in self.stores.values()])
        gen, restarts = 0, 0
        self._event("job_started", world_size=cfg.workers.num_workers,
                    assignment=assignment, holders=holders, fingerprint=cfg.fingerprint())
        committed, restore = self._auto_resume(assignment)
        self._install_signal_handlers()
        try:
            while True:
                g = self._start_generation(gen, assignment, holders, restore, committed)
                try:
                    failure = self._monitor(g)
                except _Stopped as stop:
                    return self._finish(g, t_start, stopped_at=stop.step)
                if failure is None:
                    return self._finish(g, t_start)
                restarts += 1
                if restarts > cfg.failure.max_restarts:
                    raise RecoveryError(
                        f"gave up after {cfg.failure.max_restarts} recoveries (failure.max_restarts); "
                        f"last failure: {failure['what']}")
                plan, persisted = self._recover(g, failure, assignment, holders, capacity)
                assignment, holders, committed = plan.assignment, plan.holders, plan.step
                if persisted:
                    restore = self._persisted_instructions(persisted, assignment)
                else:
                    restore = {r: RestoreInstruction(plan.step, plan.sources[r],
                                                     placed=r in plan.placed)
                               for r in assignment if plan.sources[r]}
                gen += 1
        except BaseException as e:
            self._event("job_failed", error=str(e))
            raise
        finally:
            self._teardown()

    def _persisted(self, why: str) -> Optional[tuple[int, Any]]:
        """The newest verified persisted checkpoint for this world size, events for the rest."""
        if not self.config.persistence:
            return None
        from memckpt.persist import CheckpointStore
        from memckpt.persist.uploader import persisted_restore
        stores = [CheckpointStore(t) for t in self.config.persistence]
        tier, manifest, reasons = persisted_restore(stores, self.config.workers.num_workers)
        for reason in reasons:
            self._say(f"skipping persisted checkpoint: {reason}")
            self._event("checkpoint_skipped", reason=reason, why=why)
        return None if manifest is None else (tier, manifest)

    def _persisted_instructions(self, found: tuple[int, Any],
                                ranks) -> dict[int, RestoreInstruction]:
        tier, manifest = found
        return {r: RestoreInstruction(manifest.step, ("persist",), tier, manifest.to_json())
                for r in ranks}

    def _auto_resume(self, assignment: dict[int, str]
                     ) -> tuple[Optional[int], dict[int, RestoreInstruction]]:
        """A new job on the roots of an earlier one resumes from its newest valid checkpoint."""
        found = self._persisted("auto-resume")
        if found is None:
            return None, {}
        tier, manifest = found
        uri, now = self.config.persistence[tier].uri, self.config.workers.num_workers
        resharded = "" if manifest.world_size == now else \
            f", resharded from {manifest.world_size} ranks to {now}"
        self._say(f"auto-resume: step {manifest.step} from {uri}{resharded}")
        self._event("auto_resume", step=manifest.step, tier=uri,
                    from_world_size=manifest.world_size, to_world_size=now)
        return manifest.step, self._persisted_instructions(found, assignment)

    def _start_generation(self, gen: int, assignment: dict[int, str],
                          holders: dict[int, tuple[str, ...]],
                          restore: dict[int, RestoreInstruction],
                          committed: Optional[int]) -> Generation:
        ray, cfg = self.ray, self.config
        self.ray.get(self.coordinator.configure.remote(
            gen, assignment, {r: list(h) for r, h in holders.items()}, committed,
            {n: f"memckpt-store-{cfg.job_name}-{n[:16]}" for n in self.stores}))
        workers, how = {}, {}
        for rank, node in assignment.items():
            if rank in self.workers and self.worker_nodes[rank] == node:
                workers[rank], how[rank] = self.workers[rank], "reused"
            elif node in self.spares:
                workers[rank], how[rank] = self.spares.pop(node), "spare"
            else:
                workers[rank], how[rank] = self._new_worker(node), "new"
        self.workers, self.worker_nodes = dict(workers), dict(assignment)
        info = dict(zip(workers, ray.get([w.info.remote() for w in workers.values()])))
        master = ray.get(workers[0].address.remote())
        refs = {}
        for rank, w in workers.items():
            spec = WorkerSpec(rank, cfg.workers.num_workers, gen, cfg, tuple(holders.get(rank, ())),
                              dict(self.stores), self.coordinator, restore.get(rank),
                              tuple(self.injector.faults))
            refs[w.run.remote(self.train_fn, master, spec)] = rank
        self._event("generation_started", gen=gen, assignment=assignment, holders=holders,
                    workers=how, restore={r: i.step for r, i in restore.items()})
        if gen == 0:  # the first spares; after a recovery, once it is over (_progress_and_faults)
            self._top_up_spares()
        return Generation(gen, workers, refs, info, holders=dict(holders))

    def _new_worker(self, node: str, spare: bool = False) -> Any:
        cfg = self.config
        # A spare reserves no CPU while it idles; it takes over the CPU of the rank it
        # replaces, whose actor is gone by then.
        return self.ray.remote(Worker).options(
            num_cpus=0 if spare else cfg.workers.cpus_per_worker,
            num_gpus=0 if spare else cfg.workers.gpus_per_worker,
            max_restarts=0, max_concurrency=4, scheduling_strategy=_affinity(node),
        ).remote(cfg, self.coordinator)

    def _top_up_spares(self) -> None:
        """Keep one warm worker process per live node (torch imported) to replace a dead rank."""
        if self.config.failure.warm_spares:
            alive = {n["NodeID"] for n in self.ray.nodes() if n["Alive"]}
            self._spare_nodes = set(self.stores) & alive  # a lost node's store stays listed
            for node in self._spare_nodes - set(self.spares):
                self.spares[node] = self._new_worker(node, spare=True)

    def _monitor(self, g: Generation) -> Optional[dict[str, Any]]:
        """Block until every rank returned (None) or a failure is seen (its description)."""
        ray, cfg = self.ray, self.config
        pending = dict(g.refs)
        errors: dict[int, BaseException] = {}
        first_error_at: Optional[float] = None
        last_hung_check = 0.0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    g.results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    return self._failure(g, f"rank {rank}'s worker died", died={rank}, error=e)
                except ray.exceptions.RaySystemError as e:  # the arguments did not unpickle
                    raise MemckptError(
                        f"rank {rank}'s worker could not load the training function: "
                        f"{str(e).strip().splitlines()[-1]}. Make its module importable on every "
                        "node: submit with `ray job submit --working-dir .`, install it as a "
                        "package, or define it in the script that calls memckpt.run") from None
                except ray.exceptions.RayTaskError as e:
                    errors[rank] = e
                    first_error_at = first_error_at or time.time()
            now = time.time()
            self._progress_and_faults(g)
            if now - last_hung_check > cfg.failure.heartbeat_interval_s:
                last_hung_check = now
                hung = ray.get(self.coordinator.hung.remote(
                    cfg.failure.heartbeat_timeout_s,
                    max(STARTUP_TIMEOUT_S, cfg.failure.heartbeat_timeout_s)))
                hung = [r for r in hung if r not in g.results]
                if hung:
                    return self._failure(g, f"rank(s) {hung} stopped heart-beating (hung)",
                                         died=set(hung), hung=set(hung))
                lost = self._lost_holders(g)
                if lost:
                    return self._failure(
                        g, f"node(s) {[n[:12] for n in lost]} holding replicas (and running no "
                           "rank) died", died=set())
            # A raised error waits briefly for a peer's death to explain it (a collective
            # that failed because a peer died), unless no rank is left to wait for.
            if errors and (not pending or now - first_error_at > 0.5) \
                    and self._stopped_step(g) is None:
                dead = self._unresponsive(g, [r for r in pending.values()])
                if dead:
                    return self._failure(g, f"rank(s) {sorted(dead)} unreachable", died=dead)
                rank, err = sorted(errors.items())[0]
                cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
                if isinstance(cause, MemckptError) and not cause.retryable:
                    raise cause
                if _is_peer_failure(cause):
                    return self._failure(g, f"rank {rank} lost a peer: {cause}", died=set())
                raise cause
            if self._stopped_step(g) is not None and (pending or errors):
                # a rank stopped after persisting the requested step; the others follow
                # at their next step or fail in a collective with it: both are expected
                ray.wait(list(pending), num_returns=len(pending), timeout=GRACE_S)
                raise _Stopped(self._stopped_step(g))
        if self._stopped_step(g) is not None:
            raise _Stopped(self._stopped_step(g))
        return None

    @staticmethod
    def _stopped_step(g: Generation) -> Optional[int]:
        steps = [r["stopped"] for r in g.results.values() if r.get("stopped") is not None]
        return max(steps) if steps else None

    def _lost_holders(self, g: Generation) -> list[str]:
        """Replica holders that run no rank (standby nodes) and died: no worker's death
        reports them, and every rank would wait for its replica to them until it gave up."""
        idle = g.holder_nodes - set(self.worker_nodes.values())
        if not idle:
            return []
        alive = {n["NodeID"] for n in self.ray.nodes() if n["Alive"]}
        return sorted(idle - alive)

    def _unresponsive(self, g: Generation, ranks: list[int]) -> set[int]:
        ray = self.ray
        refs = {g.workers[r].info.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=2.0)
        dead = {refs[x] for x in refs if x not in ready}
        for x in ready:
            try:
                ray.get(x)
            except ray.exceptions.RayError:
                dead.add(refs[x])
        return dead

    def _failure(self, g: Generation, what: str, died: set[int], hung: frozenset = frozenset(),
                 error: Optional[BaseException] = None) -> dict[str, Any]:
        t = time.time()
        fired = self.ray.get(self.coordinator.status.remote()).get("fired_at", {})
        since = self.recoveries[-1]["detected_at"] if self.recoveries else 0.0
        fault_time = max((t for t in fired.values() if t > since), default=None)
        self._say(f"failure detected: {what}")
        self._event("failure_detected", what=what, ranks=sorted(died), gen=g.gen)
        return {"what": what, "died": sorted(died), "hung": sorted(hung), "detected_at": t,
                "fault_at": fault_time}

    def _check_stop(self, committed: Optional[int]) -> None:
        """Stop file / SIGTERM: every rank persists the same committed step (chosen by the
        coordinator at commit time), then the job stops (or, for -N, goes on)."""
        cfg = self.config
        if self._stop is None:
            request = self.control.requested()
            if request is None:
                return
            at, action = request
            at = max(at, (committed or 0) + 1) if action == STOP and at == 0 else at
            self._stop = (at, action, time.time())
            self._say(f"{'stop' if action == STOP else 'persist'} requested: persisting the "
                      f"first step committed at or after {at}")
            self.ray.get(self.coordinator.request_stop.remote(at, action))
        at, action, since = self._stop
        state = self.ray.get(self.coordinator.stop_state.remote())
        step = state["step"] if state else None
        if step is None:
            return
        persisted = self.ray.get(self.coordinator.persisted.remote())
        done = all(persisted.get(str(t), -1) >= step for t in range(len(cfg.persistence)))
        if not done and time.time() - since < STOP_PERSIST_TIMEOUT_S:
            return
        if not done:
            self._event("persist_timeout", step=step)
        self._stop = None
        self.ray.get(self.coordinator.clear_stop.remote())
        if action == STOP:
            raise _Stopped(step)
        self._say(f"persisted step {step}; training goes on")

    def _prefault_spares(self, committed: Optional[int]) -> None:
        """Once the job's snapshot slots exist (a second step committed), ask each spare in
        turn to prepare the memory a restore fills (:meth:`Worker.prefault`): one at a
        time, so populating gigabytes never takes more than one core from training. First
        every spare its state, then its slot files, emptiest node first (where a lost
        node's rank goes): where nodes share a machine's RAM, the first spare asked must
        not take what the others' state needs. Tells the coordinator when every node's
        spare is ready: the job is in standby, a failure now meets a ready replacement."""
        if committed is None:
            return
        if self._first_commit is None:
            self._first_commit = committed
        if committed <= self._first_commit:
            return
        asked = {n: (stage, ref) for n, (sp, stage, ref) in self._prefaults.items()
                 if self.spares.get(n) is sp}
        refs = [ref for _, ref in asked.values()]
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        todo = self._prefaults_due(asked)
        if not pending and todo:
            node, stage = todo[0]
            spare = self.spares[node]
            self._prefaults[node] = (spare, stage, spare.prefault.remote(
                self._largest_shard(), stage == 1))
        standby = not self.config.failure.warm_spares or (
            not pending and not todo and set(self.spares) >= self._spare_nodes)
        if standby != self._standby:
            self._standby = standby
            self.coordinator.set_standby.remote(standby)
            if standby:  # every prefault has returned: what each node's spare holds
                held = self._held({n: ref for n, (_, ref) in asked.items()})
                self._event("standby", held_bytes={n[:12]: b for n, b in held})

    def _prefaults_due(self, asked: dict[str, tuple[int, Any]]) -> list[tuple[str, int]]:
        """(node, stage) of the prefaults still to ask, in order (see _prefault_spares)."""
        fresh = [n for n in self.spares if n not in asked]
        if fresh:
            return [(n, 0) for n in fresh]
        ranks = Counter(self.worker_nodes.values())
        return [(n, 1) for n in sorted(self.spares, key=lambda n: ranks[n]) if asked[n][0] < 1]

    def _largest_shard(self) -> Optional[tuple[int, list, int]]:
        """The largest shard any live node's store holds (see ReplicaStore.largest_shard):
        what a spare prepares for, wherever it is, as any rank may move to its node."""
        refs = [self.stores[n].largest_shard.remote() for n in self._spare_nodes if n in self.stores]
        # This runs in the control loop: a store that is restarting (or on a node about to
        # be declared dead) must not hold up failure detection; the others answer in ms.
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=LARGEST_SHARD_WAIT_S) \
            if refs else ([], [])
        found = []
        for ref in ready:
            try:
                found.append(self.ray.get(ref))
            except self.ray.exceptions.RayError:
                pass  # a store that died meanwhile: the others answer
        found = [f for f in found if f is not None]
        return max(found, key=lambda f: f[0]) if found else None

    def _held(self, prefaults: dict[str, Any]) -> list[tuple[str, int]]:
        """(node, bytes its spare holds) for each finished prefault; a spare that died
        meanwhile holds nothing (the next recovery replaces it)."""
        out = []
        for node, ref in prefaults.items():
            try:
                out.append((node, int(self.ray.get(ref))))
            except self.ray.exceptions.RayError:
                out.append((node, 0))
        return out

    def _progress_and_faults(self, g: Generation) -> None:
        prog = self.ray.get(self.coordinator.progress.remote())
        self._check_stop(prog["committed"])
        self._prefault_spares(prog["committed"])
        step = prog["max_step"]
        now = time.time()
        if self.recoveries and "resume" not in self.recoveries[-1]["phases_s"] \
                and prog["min_step"] > self.recoveries[-1]["resumed_step"]:
            # every rank finished its first step after the restored one
            phases = self.recoveries[-1]["phases_s"]
            phases["resume"] = now - self._recovery_started
            fault_at = self.recoveries[-1].get("fault_at") or self._recovery_started
            phases["total"] = now - fault_at
            self._event("recovery_finished", step=self.recoveries[-1]["resumed_step"],
                        gen=g.gen, phases_s=phases)
            self._top_up_spares()
        if not self.quiet and now - self._last_print > 1.0 and step >= 0:
            self._last_print = now
            self._say(progress_line(g.gen, prog))
        pending = self.ray.get(self.coordinator.pending_faults.remote())
        for fault in self.injector.faults:
            if fault.key in pending:
                self._fire(fault, g)
                self.ray.get(self.coordinator.fault_done.remote(fault.key))

    def _fire(self, fault: Fault, g: Generation) -> None:
        rank = fault.rank if fault.rank is not None else random.randrange(len(g.workers))
        info = g.info[rank]
        node = info["node_id"]
        self._say(f"injecting fault: {fault.target} (rank {rank}, node {node[:8]}, {fault.signal})")
        self.injector.record(fault, node_id=node, pid=info["pid"])
        self._event("fault_injected", target=fault.target, rank=rank, node=node, signal=fault.signal)
        if fault.target in ("worker", "random"):
            send_signal(node, info["pid"], fault.signal)
        elif fault.target == "node":
            (self.injector.node_killer or kill_node)(node)
        elif fault.target == "store":
            pid = self.ray.get(self.stores[node].ping.remote())["pid"]
            send_signal(node, pid, fault.signal)
        elif fault.target == "coordinator":
            where = self.ray.get(self.coordinator.whereabouts.remote())
            send_signal(where["node_id"], where["pid"], fault.signal)

    # -- recovery -------------------------------------------------------------------------------
    def _recover(self, g: Generation, failure: dict[str, Any], assignment: dict[int, str],
                 holders: dict[int, tuple[str, ...]], capacity: dict[str, int]
                 ) -> tuple[RecoveryPlan, Optional[tuple[int, Any]]]:
        ray, cfg = self.ray, self.config
        t0 = time.time()
        for rank in failure["hung"]:  # a stopped process ignores polite kills
            try:
                send_signal(g.info[rank]["node_id"], g.info[rank]["pid"], "KILL", timeout_s=5)
            except ray.exceptions.RayError:
                pass
        for rank in failure["died"]:
            ray.kill(g.workers[rank], no_restart=True)
        # Survivors end this generation at once: a rank waiting for a commit that can no
        # longer come is woken (abort); one in a collective sees it fail. One still stuck
        # after the grace period is killed.
        for rank, w in g.workers.items():
            if rank not in failure["died"]:
                w.abort.remote(g.gen)
        ready, stuck = ray.wait(list(g.refs), num_returns=len(g.refs), timeout=GRACE_S)
        for ref in g.refs:  # collect every outcome so none is reported as unhandled
            try:
                ray.get(ref, timeout=0 if ref in stuck else 5)
            except Exception:  # noqa: BLE001 (every outcome of a failed generation is moot)
                pass
        dead = set(failure["died"]) | {g.refs[ref] for ref in stuck}
        for rank in dead:
            ray.kill(g.workers[rank], no_restart=True)
            self.workers.pop(rank, None)
        t_killed = time.time()
        alive = self._alive_nodes(set(assignment.values()))
        for rank, node in list(self.worker_nodes.items()):
            if node not in alive:
                self.workers.pop(rank, None)
        self.spares = {n: w for n, w in self.spares.items() if n in alive}
        cap = {n: c for n, c in eligible_nodes(cfg).items() if n in alive}
        self._ensure_stores(list(cap))
        inventory = self._inventory(list(cap))
        committed = ray.get(self.coordinator.committed.remote())
        persisted = None
        try:
            plan = plan_recovery(assignment, holders, list(cap), cap, inventory,
                                 cfg.placement.replicas, committed)
        except RecoveryError as lost:
            persisted = self._persisted("RAM copies lost")
            if persisted is None and committed is None and not any(inventory.values()):
                # nothing was ever snapshotted: start over from scratch
                plan = plan_from_scratch(assignment, holders, list(cap), cap,
                                         cfg.placement.replicas)
                return self._record_plan(g, failure, plan, t0, t_killed, cap), None
            if persisted is None:
                raise
            plan = plan_from_persisted(assignment, holders, list(cap), cap, cfg.placement.replicas,
                                       persisted[1].step, str(lost))
            self._say(f"{lost}; falling back to persisted step {plan.step}")
            self._event("fallback_to_persisted", step=plan.step, reason=str(lost),
                        tier=cfg.persistence[persisted[0]].uri)
        return self._record_plan(g, failure, plan, t0, t_killed, cap), persisted

    def _record_plan(self, g: Generation, failure: dict[str, Any], plan: RecoveryPlan, t0: float,
                     t_killed: float, cap: dict[str, int]) -> RecoveryPlan:
        ray = self.ray
        ray.get([self.stores[n].discard_after.remote(plan.step) for n in cap])
        ray.get([self.stores[n].set_generation.remote(g.gen + 1) for n in cap])
        t_plan = time.time()
        record = {
            "what": failure["what"], "died_ranks": failure["died"],
            "dead_nodes": sorted((set(self.worker_nodes.values()) | g.holder_nodes) - set(cap)),
            "resumed_step": plan.step, "moved_ranks": list(plan.moved),
            "in_place_ranks": sorted(plan.placed),  # copies already placed: no re-copy
            "sources": {str(r): _source_label(s, plan.assignment[r]) for r, s in plan.sources.items()},
            "notes": list(plan.notes), "gen": g.gen + 1, "fault_at": failure["fault_at"],
            "detected_at": failure["detected_at"],
            "phases_s": {"detect": (failure["detected_at"] - failure["fault_at"])
                         if failure["fault_at"] else None,
                         "stop": t_killed - t0, "plan": t_plan - t_killed},
        }
        self.recoveries.append(record)
        self._say(f"recovery plan: resume at step {plan.step}; sources {record['sources']}"
                  + (f"; {'; '.join(plan.notes)}" if plan.notes else ""))
        self._event("recovery_plan", **{k: v for k, v in record.items() if k != "phases_s"})
        self._recovery_started = time.time()
        return plan

    def _alive_nodes(self, suspects: set[str], timeout_s: float = 30.0) -> list[str]:
        """Nodes Ray reports alive whose store answers; waits for Ray's verdict on the rest."""
        ray = self.ray
        deadline = time.time() + timeout_s
        while True:
            alive_now = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            unsure = []
            for node in suspects & alive_now:
                store = self.stores.get(node)
                try:
                    ray.get(store.ping.remote(), timeout=1.0)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    unsure.append(node)
            if not unsure or time.time() > deadline:
                return [n for n in eligible_nodes(self.config) if n in alive_now and n not in unsure]
            time.sleep(0.2)

    def _inventory(self, nodes: list[str]) -> dict[str, dict[int, list[int]]]:
        refs = {n: self.stores[n].inventory.remote() for n in nodes}
        out = {}
        for n, ref in refs.items():
            try:
                out[n] = {int(r): s for r, s in self.ray.get(ref, timeout=30).items()}
            except self.ray.exceptions.RayError:
                out[n] = {}
        return out

    # -- the end --------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        try:
            self.control.install_signal_handlers()
        except ValueError:  # not the main thread: the caller handles signals
            pass

    def _finish(self, g: Generation, t_start: float,
                stopped_at: Optional[int] = None) -> dict[str, Any]:
        prog = self.ray.get(self.coordinator.progress.remote())
        results = [g.results[r] for r in sorted(g.results)]
        digest = None
        if stopped_at is None and len(results) == len(g.workers):
            digest = hashlib.sha256("".join(r["digest"] or "" for r in results).encode()).hexdigest()
        all_losses = self.ray.get(self.coordinator.all_losses.remote())
        by_step = sorted((int(k), v) for k, v in all_losses.items())
        losses = [v for _, v in by_step]
        for rec in self.recoveries:
            fetch = [r["restore"].get("fetch_and_load_s", 0.0) for r in results if r.get("restore")]
            rec["phases_s"]["fetch_and_load_max"] = max(fetch, default=0.0)
        if self.recoveries:  # which of the last generation's ranks sent their shard out again
            self.recoveries[-1]["recopied_ranks"] = [
                r["rank"] for r in results if "recopied" in (r.get("restore") or {})]
        summary = {
            "job": self.config.job_name, "world_size": self.config.workers.num_workers,
            "steps": len(losses), "first_step": by_step[0][0] if by_step else None,
            "losses": losses, "final_digest": digest,
            "rank_digests": [r["digest"] for r in results], "recoveries": self.recoveries,
            "faults": self.injector.fired, "results": [r["result"] for r in results],
            # the last generation's replica traffic: bytes sent, and bytes holders filled
            # from copies on their own node instead (DDP's identical parameters)
            "replication": {str(r["rank"]): r["replication"] for r in results
                            if "replication" in r},
            "committed": prog["committed"], "seconds": time.time() - t_start,
            "stopped_at": stopped_at,
            "persisted": self.ray.get(self.coordinator.persisted.remote()),
        }
        if stopped_at is not None or self.control.signalled.is_set():
            self._event("job_stopped", step=stopped_at)
            self._say(f"stopped cleanly after persisting step {stopped_at}")
            return summary
        self._event("job_finished", final_digest=digest, recoveries=len(self.recoveries))
        self._say(f"finished: {len(losses)} steps, {len(self.recoveries)} recoveries, "
                  f"final digest {digest[:16]}")
        return summary

    def _teardown(self) -> None:
        ray = self.ray
        # A dead node's RAM folder only exists on that node; where nodes share a machine
        # (a simulated cluster) free it here, since no store is left to do it.
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        job_root = resolve_ram_root(self.config.ram_root) / self.config.job_name
        for node in set(self.stores) - alive:
            remove_path(job_root / node)
        for w in list(self.workers.values()) + list(self.spares.values()):
            ray.kill(w, no_restart=True)
        for s in list(self.stores.values()):
            try:
                ray.get(s.clear.remote(), timeout=10)
            except Exception:  # a dead node's store: nothing to clear
                pass
            ray.kill(s, no_restart=True)
        try:
            ray.get(self.coordinator.finish.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(self.coordinator, no_restart=True)


class _Stopped(Exception):
    """The stop file or a signal asked the job to end after persisting ``step``."""

    def __init__(self, step: Optional[int]) -> None:
        super().__init__(step)
        self.step = step


def progress_line(gen: int, prog: dict[str, Any]) -> str:
    """The driver's once-a-second line, from ``Coordinator.progress()``."""
    def num(v: Optional[float], fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    return (f"gen {gen} step {prog['max_step']} loss {num(prog['last_loss'], '.4f')} "
            f"{num(prog.get('steps_per_s'), '.1f')} steps/s "
            f"committed {num(prog['committed'], 'd')} "
            f"stall {num(prog.get('stall_ms'), '.1f')} ms lag {num(prog.get('lag'), 'd')}")


def _source_label(sources: tuple[str, ...], node: str) -> str:
    if not sources:
        return "scratch"
    if sources == ("persist",):
        return "persisted"
    return "local" if sources and sources[0] == node else f"peer:{sources[0][:12]}"


def _is_peer_failure(err: BaseException) -> bool:
    """A collective failed because a peer went away (gloo/nccl), not a bug in user code."""
    text = f"{type(err).__name__}: {err}".lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe",
                                   "gloo", "nccl", "timed out", "peer", "socket"))


def default_run_dir(job: str) -> Path:
    """``./runs/<job>``, or under the temp directory when the working directory is not
    writable (a Ray job's unpacked working_dir may be read-only or already gone)."""
    try:
        cwd = Path.cwd()
        if os.access(cwd, os.W_OK):
            return cwd / "runs" / job
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "memckpt-runs" / job


def run(train_fn: Callable, config: Config, *, address: Optional[str] = None,
        summary: Optional[str | Path] = None, run_dir: Optional[str | Path] = None,
        injector: Optional[FaultInjector] = None, quiet: bool = False) -> dict[str, Any]:
    """Run ``train_fn(ctx)`` on ``config.workers.num_workers`` Ray workers with in-memory
    replicated snapshots and automatic recovery. Returns (and writes to ``summary``) the
    run summary: per-step ``losses``, ``final_digest``, ``recoveries``.

    With no ``address`` and no ``RAY_ADDRESS``, a local Ray instance is started.
    """
    import ray
    if not isinstance(config, Config):
        raise ConfigError(f"config must be a memckpt.Config, got {type(config).__name__}")
    if not ray.is_initialized():
        ray.init(address=address, namespace=COORDINATOR_NAMESPACE, log_to_driver=True)
    rd = Path(run_dir) if run_dir else default_run_dir(config.job_name)
    result = Runtime(train_fn, config, rd, injector, quiet).run()
    text = json.dumps(result, indent=1, default=str)
    (rd / "summary.json").write_text(text)
    if summary:
        Path(summary).parent.mkdir(parents=True, exist_ok=True)
        Path(summary).write_text(text)
    return result
