"""The driver: start stores, coordinator and workers on Ray; watch; recover; summarise.

``memckpt.run(train_fn, config)`` is the whole lifecycle, an explicit state machine
(:class:`memckpt.policy.failure.State`): STARTING a generation of workers -> RUNNING,
watched until every rank returns or a failure shows (an actor died, a node died, a rank
stopped heart-beating), each observation judged by the pure
:func:`memckpt.policy.failure.decide` -> RECOVERING (:mod:`memckpt.runtime.driver.recovery`: kill
the generation, ask the stores what RAM copies survive, plan, roll back stores past the
chosen step) -> STARTING the next generation, each rank restoring from its own node or a
peer's store; until FINISHED or FAILED.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from memckpt.policy import placement
from memckpt.config import Config
from memckpt.engine.stop import STOP, Control
from memckpt.errors import ConfigError, PlacementError
from memckpt.policy.recovery_plan import growth_size
from memckpt.runtime.driver import actors
from memckpt.runtime.driver.control_plane import ControlPlane, alive_node_ids, eligible_nodes
from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE
from memckpt.runtime.coordinator.messages import ElasticInfo, Progress
from memckpt.policy.failure import Action, Decision, Observation, State, decide, next_state
from memckpt.policy.progress import ProgressKey, progress_due
from memckpt.runtime.chaos.faults import Fault, FaultInjector, aim, deliver
from memckpt.runtime.driver.pool import PING_S, Generation, WorkerPool
from memckpt.runtime.driver.recovery import (GRACE_S, DiedDuringRecovery, Failure, Recovery,
                                             Restore)
from memckpt.runtime.worker.result import WorkerInfo, WorkerResult
from memckpt.runtime.worker.spec import WorkerSpec, copies_by_node, ranks_by_node

if TYPE_CHECKING:
    from memckpt.runtime.worker.context import WorkerContext

__all__ = ["COORDINATOR_NAMESPACE", "Runtime", "default_run_dir", "progress_line", "run"]

POLL_S = 0.1
STOP_PERSIST_TIMEOUT_S = 300.0  # stop anyway if persisting for a stop takes longer
STARTUP_TIMEOUT_S = 120.0  # a rank silent this long before its first step is hung


class Runtime:
    def __init__(self, train_fn: Callable[[WorkerContext], Any], config: Config, run_dir: Path,
                 injector: Optional[FaultInjector] = None, quiet: bool = False) -> None:
        self.plane = ControlPlane(config, quiet)
        self.ray = self.plane.ray
        self.train_fn, self.config, self.run_dir = train_fn, config, run_dir
        self.injector = injector or FaultInjector()
        self.injector.faults.extend(Fault.from_chaos(ev) for ev in config.chaos)
        self.quiet = quiet
        self.pool = WorkerPool(self.plane)
        self.recovery = Recovery(self.plane, self.pool)
        self.recovery.on_phase = self._fire_during
        self._newest = -1  # the newest step any rank reported (arms the faults `during`)
        self.state = State.STARTING
        self._last_print = 0.0
        self._printed: Optional[ProgressKey] = None  # what the last progress line showed
        self.control = Control(config.stop_file)
        self._stop: Optional[tuple[int, str, float]] = None  # (step, action, requested at)
        self._failure: Optional[Failure] = None  # the one being recovered from (Recovery.detected)
        self._grow_to: Optional[int] = None  # elastic: growing to this size at a step boundary
        self._grow_checked = 0.0
        self._growths = 0  # resizes to more ranks (not failures: max_restarts ignores them)
        # after a recovery: its step, until the layout it set up commits past it
        self._prune_after: Optional[int] = None
        self._say, self._event = self.plane.say, self.plane.event

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.plane.events

    @property
    def coordinator(self) -> Any:
        return self.plane.coordinator

    # -- set-up ---------------------------------------------------------------------------------
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
            # placement.failure_domain: a node without the label, or a layout that cannot
            # keep copies outside the owner's domain, is refused here by name (the job's error)
            plan = placement.standby_plan(used, standby, cfg.placement.strategy,
                                          cfg.placement.replicas, cfg.placement.group_size,
                                          actors.failure_domains(cfg, used + standby),
                                          cfg.placement.failure_domain)
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

    # -- the state machine ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, plane = self.config, self.plane
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        gen, decision = 0, Decision(Action.WAIT)
        g: Optional[Generation] = None
        self.state = State.STARTING
        try:  # from the first actor on: a failed start (too few nodes) tears down too
            plane.start_coordinator(self.run_dir)
            assignment, holders, capacity = self.initial_layout()
            plane.ensure_stores(list(capacity))
            self.ray.get([s.clear.remote() for s in plane.stores.values()])  # a fresh job
            self.ray.get([s.ping.remote() for s in plane.stores.values()])
            reused = self.pool.adopt_kept(assignment, list(capacity))
            if reused:
                self._say(f"{reused} worker process(es) kept from this driver's last job "
                          "(memckpt.keep_workers): no new process to start for them")
            self._event("job_started", world_size=cfg.workers.num_workers,
                        assignment=assignment, holders=holders, fingerprint=cfg.fingerprint(),
                        kept_workers=reused)
            if cfg.workers.elastic:
                self.ray.get(self.coordinator.set_elastic.remote(ElasticInfo(
                    world_size=cfg.workers.num_workers, num_workers=cfg.workers.num_workers,
                    min_workers=cfg.workers.min_workers, grow=cfg.workers.grow)))
            committed, restore = self.recovery.auto_resume(assignment)
            self._install_signal_handlers()
            while not self.state.terminal:
                interrupted: Optional[Decision] = None  # a death while starting or recovering
                try:
                    if self.state is State.STARTING:
                        g = self._start_generation(gen, assignment, holders, restore, committed)
                        self._fire_during("restore", g)
                    elif self.state is State.RUNNING:
                        assert g is not None  # STARTING made it
                        decision = self._monitor(g, restarts=gen - self._growths)
                    else:  # RECOVERING
                        # a failure of a running generation, recorded as it was decided
                        assert g is not None and self._failure is not None
                        plan, restore = self.recovery.recover(
                            g, self._failure, assignment, holders)
                        assignment, holders, committed = plan.assignment, plan.holders, plan.step
                        self._prune_after = plan.step
                        if self._failure.grow_to:
                            self._grow_to, self._growths = None, self._growths + 1
                            self.ray.get(self.coordinator.clear_stop.remote())
                        gen += 1
                        self._fire_during("start", g)
                except DiedDuringRecovery as lost:
                    g = lost.generation or g
                    assert g is not None  # deaths are found in a generation that ran
                    interrupted = decision = self._died_during(g, lost, gen - self._growths)
                self.state = next_state(self.state, decision if self.state is State.RUNNING
                                        else interrupted)
            if self.state is State.FAILED:
                assert decision.error is not None  # FAILED follows a RAISE, which carries it
                if g is not None:  # the ranks' other outcomes (errors too) are collected:
                    # else Ray logs each as unhandled, from a thread of its own, once dropped
                    self.pool.answers(dict(g.refs), 1.0)
                raise decision.error
            assert g is not None
            return self._finish(g, t_start, decision.step if decision.action is Action.STOP
                                else None)
        except BaseException as e:
            self.state = State.FAILED
            self._event("job_failed", error=str(e))
            raise
        finally:
            self.plane.teardown(self.pool.release(finished=self.state is State.FINISHED))

    def _start_generation(self, gen: int, assignment: dict[int, str],
                          holders: dict[int, tuple[str, ...]], restore: Restore,
                          committed: Optional[int]) -> Generation:
        ray, cfg = self.ray, self.config
        ray.get(self.coordinator.configure.remote(
            gen, assignment, {r: list(h) for r, h in holders.items()}, committed,
            self.plane.store_names()))
        resized = bool(self.pool.worker_nodes) and len(assignment) != len(self.pool.worker_nodes)
        workers, how = self.pool.assign(assignment)
        info, master = self._reach_workers(gen, workers, holders)
        refs = {}
        by_node, copies = ranks_by_node(assignment), copies_by_node(holders)
        relays = actors.relay_members(cfg, assignment.values())
        for rank, w in workers.items():
            node = assignment[rank]
            spec = WorkerSpec(rank, len(assignment), gen, cfg, tuple(holders.get(rank, ())),
                              dict(self.plane.stores), self.coordinator, restore.get(rank),
                              self.injector.at_steps(), resized=resized,
                              node_ranks=by_node[node], node_copies=copies.get(node, ()),
                              relay=relays.get(node, ()))
            refs[w.run.remote(self.train_fn, master, spec)] = rank
        self._event("generation_started", gen=gen, world_size=len(assignment),
                    assignment=assignment, holders=holders,
                    workers=how, restore={r: i.step for r, i in restore.items()})
        if gen == 0:  # the first spares; after a recovery, once it is over (_progress_and_faults)
            self.pool.top_up_spares()
        return Generation(gen, workers, refs, info, holders=dict(holders))

    def _reach_workers(self, gen: int, workers: dict[int, Any],
                       holders: dict[int, tuple[str, ...]]
                       ) -> tuple[dict[int, WorkerInfo], tuple[str, int]]:
        """Each worker's pid and node, and rank 0's rendezvous address; a worker that died
        since the plan (a reused survivor, a spare) stops the start: the recovery plans
        again without it."""
        ray = self.ray
        refs = {r: w.info.remote() for r, w in workers.items()}
        info: dict[int, WorkerInfo] = {}
        dead: set[int] = set()
        master = ("", 0)
        for rank, ref in refs.items():
            try:
                info[rank] = ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.add(rank)
        if 0 not in dead:
            try:
                master = ray.get(workers[0].address.remote())
            except ray.exceptions.RayActorError:
                dead.add(0)
        if dead:
            raise DiedDuringRecovery(dead, "start", Generation(gen, workers, {}, info,
                                                               holders=dict(holders)))
        return info, master

    def _died_during(self, g: Generation, lost: DiedDuringRecovery, restarts: int) -> Decision:
        """Deaths found while starting or recovering go to :func:`decide` with every death
        known so far: those of the recovery under way while it still ends ``g`` (stop,
        plan), only the new ones once ``g`` is the next generation (start)."""
        known = set(lost.ranks)
        ending = self._failure if lost.phase != "start" else None  # the recovery under way's
        if ending is not None:
            known |= set(ending.died)
        obs = Observation(pending=(), died=tuple(sorted(known)), during=lost.phase,
                          hung=ending.hung if ending is not None else (), restarts=restarts,
                          max_restarts=self.config.failure.max_restarts)
        return self._decided(g, decide(obs))

    # -- watching a generation ------------------------------------------------------------------
    def _monitor(self, g: Generation, restarts: int) -> Decision:
        """Watch ``g`` until :func:`decide` says something other than wait; a failure it
        decided on is recorded (``self._failure``) for the recovery."""
        ray, cfg = self.ray, self.config
        pending = dict(g.refs)
        errors: dict[int, BaseException] = {}
        first_error_at: Optional[float] = None
        last_hung_check = 0.0
        base = Observation(pending=(), restarts=restarts, max_restarts=cfg.failure.max_restarts)
        while True:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            died: tuple[int, ...] = ()
            unloadable: Optional[tuple[int, str]] = None
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    g.results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    died = (rank,)
                except ray.exceptions.RaySystemError as e:  # the arguments did not unpickle
                    unloadable = (rank, str(e).strip().splitlines()[-1])
                except ray.exceptions.RayTaskError as e:
                    errors[rank] = e.cause
                    first_error_at = first_error_at or time.time()
            if died:  # the rest of the generation is swept before the plan is made
                died = tuple(sorted(set(died) | self._sweep(g, list(pending.values()))))
                # before the last recovery's first resumed step: a death during its restore
                base = dataclasses.replace(base, during="restore" if self.recovery.records and (
                    "resume" not in self.recovery.records[-1]["phases_s"]) else None)
            if died or unloadable:  # decided at once: nothing else is asked first
                obs = dataclasses.replace(base, pending=tuple(pending.values()), died=died,
                                          unloadable=unloadable)
                return self._decided(g, decide(obs))
            now = time.time()
            stop_step = self._progress_and_faults(g)
            hung: tuple[int, ...] = ()
            silent: tuple[str, ...] = ()
            lost: tuple[str, ...] = ()
            if now - last_hung_check > cfg.failure.heartbeat_interval_s:
                last_hung_check = now
                ranks, nodes = ray.get(self.coordinator.liveness.remote(
                    cfg.failure.heartbeat_timeout_s,
                    max(STARTUP_TIMEOUT_S, cfg.failure.heartbeat_timeout_s)))
                hung = tuple(r for r in ranks if r not in g.results)
                silent = tuple(nodes) if hung else ()
                lost = () if hung else tuple(self._lost_holders(g))
            obs = dataclasses.replace(
                base, pending=tuple(pending.values()), errors=tuple(sorted(errors.items())),
                error_age_s=now - first_error_at if first_error_at else 0.0, hung=hung,
                silent_nodes=silent, lost_holders=lost, stopped=self._stopped_step(g),
                stop_persisted=stop_step, grow_to=self._grow_to)
            decision = decide(obs)
            if decision.probe:
                decision = decide(dataclasses.replace(
                    obs, unreachable=tuple(sorted(self._unresponsive(g, list(pending.values()))))))
            if decision.action is Action.WAIT:
                continue
            if decision.grace and pending:
                ray.wait(list(pending), num_returns=len(pending), timeout=GRACE_S)
            return self._decided(g, decision)

    def _decided(self, g: Generation, decision: Decision) -> Decision:
        if decision.what:  # a failure (also one that gave up: max_restarts)
            self._failure = self.recovery.detected(g, decision)
        return decision

    @staticmethod
    def _stopped_step(g: Generation) -> Optional[int]:
        steps = [r.stopped for r in g.results.values() if r.stopped is not None]
        return max(steps) if steps else None

    def _lost_holders(self, g: Generation) -> list[str]:
        """Replica holders that run no rank (standby nodes) and died: no worker's death
        reports them, and every rank would wait for its replica to them until it gave up."""
        idle = g.holder_nodes - set(self.pool.worker_nodes.values())
        if not idle:
            return []
        return sorted(idle - alive_node_ids())

    def _unresponsive(self, g: Generation, ranks: list[int]) -> set[int]:
        """A dead worker's ping fails at once and a live one answers in milliseconds, but on
        a loaded machine a live one has taken over 2 s: :data:`PING_S` (5 s) only delays the
        verdict on a frozen rank, and the heartbeat finds those."""
        return self.pool.unresponsive({r: g.workers[r] for r in ranks}, PING_S)

    def _sweep(self, g: Generation, ranks: list[int]) -> set[int]:
        """One death found: which other running ``ranks`` are dead too (their node is
        gone, or their worker does not answer), so that deaths in the same instant are
        planned for together and no plan reuses a dead worker."""
        alive = alive_node_ids()
        gone = {r for r in ranks if g.info[r].node_id not in alive}
        return gone | self._unresponsive(g, [r for r in ranks if r not in gone])

    def _check_stop(self, committed: Optional[int]) -> Optional[int]:
        """Stop file / SIGTERM: every rank persists the same committed step (chosen by the
        coordinator at commit time), then the job stops (or, for -N, goes on). Returns the
        step to stop at once it is persisted."""
        cfg = self.config
        if self._stop is None:
            request = self.control.requested()
            if request is None:
                return None
            at, action = request
            at = max(at, (committed or 0) + 1) if action == STOP and at == 0 else at
            self._stop = (at, action, time.time())
            self._say(f"{'stop' if action == STOP else 'persist'} requested: persisting the "
                      f"first step committed at or after {at}")
            self.ray.get(self.coordinator.request_stop.remote(at, action))
        at, action, since = self._stop
        state = self.ray.get(self.coordinator.stop_state.remote())
        step = state.step if state else None
        if step is None:
            return None
        persisted = self.ray.get(self.coordinator.persisted.remote())
        done = all(persisted.get(str(t), -1) >= step for t in range(len(cfg.persistence)))
        if not done and time.time() - since < STOP_PERSIST_TIMEOUT_S:
            return None
        if not done:
            self._event("persist_timeout", step=step)
        self._stop = None
        self.ray.get(self.coordinator.clear_stop.remote())
        if action == STOP:
            return step
        self._say(f"persisted step {step}; training goes on")
        return None

    def _prune_old_layout(self, g: Generation, committed: Optional[int]) -> None:
        """Once ``g``, the layout a recovery set up, commits a step past it, free every
        node's shards of the layout before (a resize renumbers the ranks, a move leaves a
        rank's copies where it ran): up to a shard per old rank and copy, never read again."""
        if self._prune_after is None or committed is None or committed <= self._prune_after:
            return
        self._prune_after = None
        self._event("old_layout_freed", committed=committed,
                    **actors.free_unserved(self.plane.stores, self.pool.worker_nodes,
                                           g.holders, skip=self.recovery.left_out))

    def _progress_and_faults(self, g: Generation) -> Optional[int]:
        """Once per poll: the stop file, spares, the progress line and scheduled faults.
        Returns the step a requested stop persisted (see _check_stop)."""
        prog = self.ray.get(self.coordinator.progress.remote())
        self._newest = max(self._newest, prog.max_step)
        stop_step = self._check_stop(prog.committed)
        if stop_step is not None:
            return stop_step
        self._check_growth(g, prog.committed)
        self._prune_old_layout(g, prog.committed)
        self.pool.prefault_spares(prog.committed)
        if self.recovery.check_resumed(prog.min_step, g.gen):
            self.pool.top_up_spares(skip=self.recovery.left_out)
        now, key = time.time(), ProgressKey(g.gen, prog.max_step, prog.committed)
        if not self.quiet and progress_due(self._printed, key, now - self._last_print):
            self._last_print, self._printed = now, key
            self._say(progress_line(g.gen, prog))
        pending = self.ray.get(self.coordinator.pending_faults.remote())
        for fault in self.injector.faults:
            if fault.key in pending:
                self._fire(fault, g)
                self.ray.get(self.coordinator.fault_done.remote(fault.key))
        return None

    def _check_growth(self, g: Generation, committed: Optional[int]) -> None:
        """Elastic, below num_workers: once a second, look in Ray's node table for nodes
        with room; when a larger size fits, every rank stops after the next committed step
        and the job restarts at that size, resharded from RAM (see failure.decide)."""
        w = self.config.workers
        now = time.time()
        if (not (w.elastic and w.grow) or self._grow_to or self._stop or committed is None
                or len(g.workers) >= w.num_workers or now - self._grow_checked < 1.0):
            return
        self._grow_checked = now
        cap = eligible_nodes(self.config)
        size = growth_size(len(g.workers), w.sizes(), list(cap), cap, w.workers_per_node)
        if size is None:
            return
        self._grow_to = size
        self._say(f"nodes with room appeared: growing from {len(g.workers)} to {size} ranks "
                  "at the next committed step")
        self._event("growth_pending", from_world_size=len(g.workers), to_world_size=size,
                    after_step=committed)
        self.coordinator.set_elastic.remote(ElasticInfo(pending_growth=size))
        self.ray.get(self.coordinator.request_stop.remote(committed + 1, STOP))

    def _fire(self, fault: Fault, g: Generation) -> None:
        # not at a worker this recovery killed already (a survivor stuck past the grace)
        strike = aim(fault, {r: (i.node_id, i.pid) for r, i in g.info.items()
                             if r not in g.killed})
        if strike is None:
            return
        self._say(f"injecting fault: {fault.target} (rank(s) {list(strike.ranks)}, node(s) "
                  f"{[n[:8] for n in strike.nodes]}, {fault.signal})")
        details = strike.details()
        self.injector.record(fault, node_id=details["node"], pid=details["pid"],
                             ranks=details["ranks"])
        self._event("fault_injected", **{k: v for k, v in details.items() if k != "pid"})
        deliver(strike, coordinator=self.coordinator, node_killer=self.injector.node_killer,
                store_pid=lambda node: self.ray.get(self.plane.stores[node].ping.remote()).pid)

    def _fire_during(self, phase: str, g: Generation) -> None:
        """The faults scheduled for ``phase`` of a recovery (once training reached their
        step), against ``g``: the generation the recovery ends (plan, start) or starts
        (restore). The first generation never fires them: no step was reached before it."""
        for fault in self.injector.during(phase):
            if self._newest >= fault.at_step:
                self._fire(fault, g)

    # -- the end --------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        try:
            self.control.install_signal_handlers()
        except ValueError:  # not the main thread: the caller handles signals
            pass

    def _finish(self, g: Generation, t_start: float,
                stopped_at: Optional[int] = None) -> dict[str, Any]:
        prog = self.ray.get(self.coordinator.progress.remote())
        results: list[WorkerResult] = [g.results[r] for r in sorted(g.results)]
        digest = None
        if stopped_at is None and len(results) == len(g.workers):
            digest = hashlib.sha256("".join(r.digest or "" for r in results).encode()).hexdigest()
        all_losses = self.ray.get(self.coordinator.all_losses.remote())
        by_step = sorted((int(k), v) for k, v in all_losses.items())
        losses = [v for _, v in by_step]
        recoveries = self.recovery.records
        for rec in recoveries:
            fetch = [r.restore.fetch_and_load_s for r in results if r.restore is not None]
            rec["phases_s"]["fetch_and_load_max"] = max(fetch, default=0.0)
        if recoveries:  # which of the last generation's ranks sent their shard out again
            recoveries[-1]["recopied_ranks"] = [
                r.rank for r in results if r.restore is not None and r.restore.recopied]
        summary = {
            "job": self.config.job_name, "world_size": len(g.workers),
            "steps": len(losses), "first_step": by_step[0][0] if by_step else None,
            "losses": losses, "final_digest": digest,
            "rank_digests": [r.digest for r in results], "recoveries": recoveries,
            "faults": self.injector.fired, "results": [r.result for r in results],
            # the last generation's replica traffic: bytes sent, and bytes holders filled
            # from copies on their own node instead (DDP's identical parameters)
            "replication": {str(r.rank): dataclasses.asdict(r.replication) for r in results
                            if r.replication is not None},
            "committed": prog.committed, "seconds": time.time() - t_start,
            "stopped_at": stopped_at,
            "persisted": self.ray.get(self.coordinator.persisted.remote()),
        }
        if stopped_at is not None or self.control.signalled.is_set():
            self._event("job_stopped", step=stopped_at)
            self._say(f"stopped cleanly after persisting step {stopped_at}")
            return summary
        self._event("job_finished", final_digest=digest, recoveries=len(recoveries))
        self._say(f"finished: {len(losses)} steps, {len(recoveries)} recoveries, "
                  f"final digest {(digest or 'none')[:16]}")
        return summary


def progress_line(gen: int, prog: Progress) -> str:
    """The driver's progress line, from ``Coordinator.progress()`` (printed when the step,
    the committed step or the generation changes, at most once a second)."""
    def num(v: Optional[float], fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    return (f"gen {gen} step {prog.max_step} loss {num(prog.last_loss, '.4f')} "
            f"{num(prog.steps_per_s, '.1f')} steps/s "
            f"committed {num(prog.committed, 'd')} "
            f"stall {num(prog.stall_ms, '.1f')} ms lag {num(prog.lag, 'd')}")


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


def run(train_fn: Callable[[WorkerContext], Any], config: Config, *, address: Optional[str] = None,
        summary: Optional[str | os.PathLike[str]] = None, run_dir: Optional[str | os.PathLike[str]] = None,
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
