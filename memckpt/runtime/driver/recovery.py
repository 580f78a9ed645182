"""Acting on a failure: end the generation, ask the stores which RAM copies survive, plan the
next generation (:mod:`memckpt.policy.recovery_plan`, falling back to the newest persisted
checkpoint when RAM copies were lost), roll the stores back past the chosen step, and keep
the record of each recovery and its phases."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from memckpt.errors import RecoveryError
from memckpt.policy.recovery_plan import (RecoveryPlan, ResizePlan, plan_from_persisted,
                                   plan_from_scratch, plan_recovery, plan_resize, source_label)
from memckpt.runtime.driver import actors
from memckpt.runtime.driver.actors import failure_domains
from memckpt.runtime.driver.control_plane import ControlPlane, eligible_nodes
from memckpt.policy.failure import Decision
from memckpt.runtime.chaos.faults import send_signal, send_signals
from memckpt.runtime.coordinator.messages import ElasticInfo, Resize
from memckpt.runtime.driver.pool import Generation, WorkerPool
from memckpt.runtime.worker.spec import RestoreInstruction

GRACE_S = 3.0  # how long survivors get to notice a failure and return before being killed
ROOM_POLL_S = 0.5  # how often a shrinking job looks for a node with room

Restore = dict[int, RestoreInstruction]


@dataclass(frozen=True)
class Failure:
    """A failure the driver's monitor decided on (or a planned resize: ``grow_to``), as
    :meth:`Recovery.detected` records it for :meth:`Recovery.recover`. Times are the
    driver's wall clock (``time.time()``)."""

    what: str  # the decision's words, in events and the recovery's record
    died: tuple[int, ...] = ()  # ranks whose worker died, sorted
    hung: tuple[int, ...] = ()  # ranks that stopped heart-beating, sorted
    silent_nodes: tuple[str, ...] = ()  # nodes whose store stopped reporting (frozen), sorted
    grow_to: Optional[int] = None  # elastic: every rank stopped to resize to this many
    detected_at: float = 0.0
    fault_at: Optional[float] = None  # when it began: the injected fault, or the last sign of life
    fault_from: Optional[str] = None  # which of the two ``fault_at`` is ("injected", ...)
    last_sign_of_life_at: Optional[float] = None  # a hang's ranks' and nodes' last heartbeat

    def __post_init__(self) -> None:
        if not self.what:
            raise ValueError("a Failure says what failed")
        for name in ("died", "hung", "silent_nodes"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or list(value) != sorted(value):
                raise ValueError(f"Failure.{name} must be a sorted tuple, got {value!r}")
        if self.grow_to is not None and self.grow_to < 1:
            raise ValueError(f"Failure.grow_to must be >= 1, got {self.grow_to}")
        if (self.fault_at is None) != (self.fault_from is None):
            raise ValueError("Failure.fault_at and fault_from come together")

    @property
    def detect_s(self) -> Optional[float]:
        """From the failure's start to its detection, when its start is known."""
        return self.detected_at - self.fault_at if self.fault_at else None


class DiedDuringRecovery(Exception):
    """Workers found dead while a recovery was under way (``phase``: one of
    :data:`memckpt.policy.failure.RECOVERY_PHASES`). Not a job failure: the driver hands
    them to :func:`memckpt.policy.failure.decide` with every death known so far and plans
    again. ``generation``: the generation being started when they were found (phase
    ``start``), which the next recovery ends."""

    def __init__(self, ranks: set[int], phase: str,
                 generation: Optional[Generation] = None) -> None:
        super().__init__(f"rank(s) {sorted(ranks)} died during the recovery's {phase} phase")
        self.ranks, self.phase, self.generation = tuple(sorted(ranks)), phase, generation


class Recovery:
    def __init__(self, plane: ControlPlane, pool: WorkerPool) -> None:
        self.plane, self.pool, self.ray, self.config = plane, pool, plane.ray, plane.config
        self.records: list[dict[str, Any]] = []  # one per recovery, for the run summary
        self._started = 0.0  # when the last recovery's plan was made
        self._unlabelled: set[str] = set()  # nodes said to lack the failure-domain label
        # nodes left out of the recovery under way although Ray lists them alive: their store
        # stopped reporting (frozen, cut off) or did not answer the roll-back
        self._silent: set[str] = set()
        self.left_out: set[str] = set()  # the silent nodes the last plan left out
        # called as a recovery enters a phase ("plan"), with the generation it ends: the
        # driver fires the faults scheduled for it (FaultInjector.during)
        self.on_phase: Optional[Callable[[str, Generation], None]] = None

    # -- the persisted tier ---------------------------------------------------------------------
    def persisted(self, why: str) -> Optional[tuple[int, Any]]:
        """The newest verified persisted checkpoint for this world size, events for the rest."""
        if not self.config.persistence:
            return None
        from memckpt.persist import CheckpointStore
        from memckpt.persist.uploader import persisted_restore
        stores = [CheckpointStore(t) for t in self.config.persistence]
        tier, manifest, reasons = persisted_restore(stores, self.config.workers.num_workers)
        for reason in reasons:
            self.plane.say(f"skipping persisted checkpoint: {reason}")
            self.plane.event("checkpoint_skipped", reason=reason, why=why)
        return None if tier is None or manifest is None else (tier, manifest)

    @staticmethod
    def persisted_instructions(found: tuple[int, Any], ranks) -> Restore:
        tier, manifest = found
        return {r: RestoreInstruction(manifest.step, ("persist",), tier, manifest.to_json())
                for r in ranks}

    def auto_resume(self, assignment: dict[int, str]) -> tuple[Optional[int], Restore]:
        """A new job on the roots of an earlier one resumes from its newest valid checkpoint."""
        found = self.persisted("auto-resume")
        if found is None:
            return None, {}
        tier, manifest = found
        uri, now = self.config.persistence[tier].uri, self.config.workers.num_workers
        resharded = "" if manifest.world_size == now else \
            f", resharded from {manifest.world_size} ranks to {now}"
        self.plane.say(f"auto-resume: step {manifest.step} from {uri}{resharded}")
        self.plane.event("auto_resume", step=manifest.step, tier=uri,
                         from_world_size=manifest.world_size, to_world_size=now)
        return manifest.step, self.persisted_instructions(found, assignment)

    # -- a failure --------------------------------------------------------------------------------
    def detected(self, g: Generation, decision: Decision) -> Failure:
        """Record a failure the monitor decided on; returns its description for :meth:`recover`."""
        t = time.time()
        since = self.records[-1]["detected_at"] if self.records else 0.0
        fault_time = self.plane.fault_time(since)
        fault_from = "injected" if fault_time is not None else None
        # a hang or a freeze began at the last sign of life of its ranks and nodes (on the
        # coordinator's clock): where a recovery nobody injected is counted from
        heard = self.ray.get(self.plane.coordinator.last_heard.remote(
            list(decision.hung), list(decision.silent_nodes))) if decision.hung else None
        if fault_time is None and heard is not None:
            fault_time, fault_from = heard, "last sign of life"
        self._silent |= set(decision.silent_nodes)  # until this recovery is over
        if decision.grow_to:  # a planned resize (growing back), never called a failure
            self.plane.say(f"every rank stopped at a committed step; resizing as planned: "
                           f"{decision.what}")
            self.plane.event("resize_started", what=decision.what, to_world_size=decision.grow_to,
                             gen=g.gen)
        else:
            self.plane.say(f"failure detected: {decision.what}")
            self.plane.event("failure_detected", what=decision.what,
                             ranks=sorted(decision.died), gen=g.gen,
                             **({"frozen_nodes": list(decision.silent_nodes)}
                                if decision.silent_nodes else {}))
        return Failure(decision.what, tuple(sorted(decision.died)), tuple(sorted(decision.hung)),
                       tuple(sorted(decision.silent_nodes)), decision.grow_to, detected_at=t,
                       fault_at=fault_time, fault_from=fault_from, last_sign_of_life_at=heard)

    def recover(self, g: Generation, failure: Failure, assignment: dict[int, str],
                holders: dict[int, tuple[str, ...]]
                ) -> tuple[RecoveryPlan | ResizePlan, Restore]:
        """End generation ``g``, plan the next; returns the plan and each rank's restore."""
        t0 = time.time()
        self._end_generation(g, failure)
        t_killed = time.time()
        if self.on_phase is not None:
            self.on_phase("plan", g)
        # a silent node is out at once: Ray may call it alive for a minute yet (its health
        # check), and its store would not answer the plan's calls
        alive = self.plane.alive_nodes(set(assignment.values()), silent=self._silent)
        self.pool.keep_nodes(alive)
        # the survivors the next generation reuses: a plan never counts on a dead one
        dead = self.pool.unresponsive(self.pool.workers)
        if dead:
            for rank in dead:
                self.ray.kill(self.pool.workers[rank], no_restart=True)
                self.pool.forget(rank)
            raise DiedDuringRecovery(dead, "plan")
        cap = {n: c for n, c in eligible_nodes(self.config).items() if n in alive}
        if failure.grow_to:
            plan = self.resize(g, assignment, cap, failure.what)
            self._record_resize(g, failure, plan, t0, t_killed, cap)
            return plan, self.resize_instructions(plan)
        if self.config.workers.elastic and self._room(cap) < len(assignment):
            cap = self._wait_for_room(cap, len(assignment))
            if self._room(cap) < len(assignment):
                plan = self.resize(g, assignment, cap, failure.what)
                self._record_resize(g, failure, plan, t0, t_killed, cap)
                return plan, self.resize_instructions(plan)
        planned, persisted = self._plan(assignment, holders, cap)
        self._record_plan(g, failure, planned, t0, t_killed, cap)
        if persisted:
            return planned, self.persisted_instructions(persisted, planned.assignment)
        return planned, {r: RestoreInstruction(planned.step, planned.sources[r],
                                               placed=r in planned.placed)
                         for r in planned.assignment if planned.sources[r]}

    # -- elastic ----------------------------------------------------------------------------------
    def _room(self, cap: dict[str, int]) -> int:
        per = self.config.workers.workers_per_node
        return sum(c // per for c in cap.values()) * per

    def _wait_for_room(self, cap: dict[str, int], needed: int) -> dict[str, int]:
        """Up to failure.replace_timeout_s for nodes with room for ``needed`` ranks (a
        replacement joining); the live nodes' capacity at the end."""
        deadline = time.time() + self.config.failure.replace_timeout_s
        while self._room(cap) < needed and time.time() < deadline:
            time.sleep(ROOM_POLL_S)
            cap = {n: c for n, c in eligible_nodes(self.config).items() if n not in self._silent}
        return cap

    def resize(self, g: Generation, assignment: dict[int, str], cap: dict[str, int],
               why: str) -> ResizePlan:
        """The plan to go on at the largest world size the live nodes place (pure:
        :func:`memckpt.policy.recovery_plan.plan_resize`), read from the RAM copies."""
        w = self.config.workers
        self.plane.ensure_stores(list(cap))
        inventory = self.plane.inventory(list(cap))
        committed = self.ray.get(self.plane.coordinator.committed.remote())
        return plan_resize(assignment, list(cap), cap, inventory, self.config.placement.replicas,
                           w.sizes(), w.workers_per_node, why, committed, self._domains(cap))

    def _domains(self, cap: dict[str, int]) -> Optional[dict[str, str]]:
        """The live nodes' failure domains (placement.failure_domain); a node that joined
        without the label is its own domain, said once: the job goes on."""
        domains = failure_domains(self.config, cap, strict=False)
        if domains is None:
            return None
        unlabelled = sorted(set(cap) - set(domains) - self._unlabelled)
        if unlabelled:
            self._unlabelled.update(unlabelled)
            self.plane.say(f"node(s) {[n[:12] for n in unlabelled]} have no "
                           f"{self.config.placement.failure_domain!r} label: each is its own "
                           "failure domain")
            self.plane.event("unlabelled_nodes", nodes=unlabelled,
                             label=self.config.placement.failure_domain)
        return domains

    @staticmethod
    def resize_instructions(plan: ResizePlan) -> Restore:
        return {r: RestoreInstruction(plan.step, (), reshard=dict(plan.sources),
                                      from_size=plan.from_size) for r in plan.assignment}

    def _record_resize(self, g: Generation, failure: Failure, plan: ResizePlan,
                       t0: float, t_killed: float, cap: dict[str, int]) -> None:
        self._roll_back(g, list(cap), plan.step)
        self.left_out = set(self._silent)
        lost = sorted(set(self.pool.worker_nodes.values()) - set(cap))
        # old rank -> the nodes its chunks are read from (RAM, no storage read)
        sources = {str(r): [f"ram:{n[:12]}" for n in ns] for r, ns in plan.sources.items()}
        record = {
            "what": failure.what, "died_ranks": list(failure.died), "dead_nodes": lost,
            "resumed_step": plan.step, "resized": {"from": plan.from_size, "to": plan.to_size},
            "why": plan.why, "moved_ranks": [], "in_place_ranks": [],
            "sources": sources,
            "notes": list(plan.notes), "gen": g.gen + 1, "fault_at": failure.fault_at,
            "detected_at": failure.detected_at,
            "phases_s": {"detect": failure.detect_s,
                         "stop": t_killed - t0, "plan": time.time() - t_killed},
        }
        self.records.append(record)
        self.plane.say(f"resized from {plan.from_size} to {plan.to_size} ranks ({plan.why}): "
                       f"resume at step {plan.step} from RAM; chunks from {record['sources']}"
                       + (f"; {'; '.join(plan.notes)}" if plan.notes else ""))
        self.plane.event("resized", from_world_size=plan.from_size, to_world_size=plan.to_size,
                         why=plan.why, step=plan.step, sources=record["sources"],
                         assignment=plan.assignment, lost_nodes=lost, gen=g.gen + 1)
        self.plane.coordinator.set_elastic.remote(ElasticInfo(
            world_size=plan.to_size, pending_growth=None,
            last_resize=Resize({"from": plan.from_size, "to": plan.to_size, "step": plan.step,
                                "why": plan.why, "sources": sources})))
        self._started = time.time()

    def _roll_back(self, g: Generation, nodes: list[str], step: int) -> None:
        """Every store of the plan drops what is newer than ``step`` and takes the next
        generation (its fence: an older generation's writes are refused from then on). A
        store that does not answer within :data:`actors.ROLL_BACK_S` (its node froze meanwhile)
        is left out and the recovery plans again without it."""
        failed = actors.roll_back(self.plane.stores, nodes, step, g.gen + 1)
        if failed:
            self._silent |= failed
            self.plane.say(f"node(s) {[n[:12] for n in sorted(failed)]} did not answer the "
                           "roll-back: planning again without them")
            raise DiedDuringRecovery({r for r, i in g.info.items() if i.node_id in failed}
                                     - g.killed, "plan")

    def _end_generation(self, g: Generation, failure: Failure) -> None:
        ray = self.ray
        silent = set(failure.silent_nodes) | self._silent  # also a replan's
        # a stopped process ignores polite kills; on a silent node the kill is sent but not
        # awaited (its raylet runs it if the node wakes: the stale worker dies then)
        frozen = [(g.info[r].node_id, g.info[r].pid) for r in failure.hung
                  if g.info[r].node_id in silent]
        if frozen:
            send_signals(frozen, "KILL", wait=False)
        for rank in failure.hung:
            if g.info[rank].node_id in silent:
                continue
            try:
                send_signal(g.info[rank].node_id, g.info[rank].pid, "KILL", timeout_s=5)
            except ray.exceptions.RayError:
                pass
        for rank in failure.died:
            ray.kill(g.workers[rank], no_restart=True)
        # Survivors end this generation at once: a rank waiting for a commit that can no
        # longer come is woken (abort); one in a collective sees it fail. One still stuck
        # after the grace period is killed.
        for rank, w in g.workers.items():
            if rank not in failure.died:
                w.abort.remote(g.gen)
        ready, stuck = ray.wait(list(g.refs), num_returns=len(g.refs), timeout=GRACE_S) \
            if g.refs else ([], [])
        also_died = set()
        for ref in g.refs:  # collect every outcome so none is reported as unhandled
            try:
                ray.get(ref, timeout=0 if ref in stuck else 5)
            except ray.exceptions.RayActorError:  # its process or node is gone too
                also_died.add(g.refs[ref])
            except Exception:  # noqa: BLE001 (every other outcome of a failed generation is moot)
                pass
        also_died -= set(failure.died) | g.killed  # not those killed here before
        dead = set(failure.died) | also_died | {g.refs[ref] for ref in stuck}
        for rank in dead:
            ray.kill(g.workers[rank], no_restart=True)
            self.pool.forget(rank)
        g.killed |= dead
        if also_died:
            raise DiedDuringRecovery(also_died, "stop")

    def _plan(self, assignment: dict[int, str], holders: dict[int, tuple[str, ...]],
              cap: dict[str, int]) -> tuple[RecoveryPlan, Optional[tuple[int, Any]]]:
        """The plan from the surviving RAM copies, else from the newest persisted checkpoint
        (returned too), else from scratch when nothing was ever snapshotted."""
        cfg = self.config
        self.plane.ensure_stores(list(cap))
        inventory = self.plane.inventory(list(cap))
        committed = self.ray.get(self.plane.coordinator.committed.remote())
        domains = self._domains(cap)
        try:
            return plan_recovery(assignment, holders, list(cap), cap, inventory,
                                 cfg.placement.replicas, committed, domains), None
        except RecoveryError as lost:
            persisted = self.persisted("RAM copies lost")
            if persisted is None and committed is None and not any(inventory.values()):
                # nothing was ever snapshotted: start over from scratch
                return plan_from_scratch(assignment, holders, list(cap), cap,
                                         cfg.placement.replicas, domains), None
            if persisted is None:
                raise
            plan = plan_from_persisted(assignment, holders, list(cap), cap, cfg.placement.replicas,
                                       persisted[1].step, str(lost), domains)
            self.plane.say(f"{lost}; falling back to persisted step {plan.step}")
            self.plane.event("fallback_to_persisted", step=plan.step, reason=str(lost),
                             tier=cfg.persistence[persisted[0]].uri)
            return plan, persisted

    def _record_plan(self, g: Generation, failure: Failure, plan: RecoveryPlan, t0: float,
                     t_killed: float, cap: dict[str, int]) -> None:
        self._roll_back(g, list(cap), plan.step)
        self.left_out = set(self._silent)
        t_plan = time.time()
        record = {
            "what": failure.what, "died_ranks": list(failure.died),
            "dead_nodes": sorted((set(self.pool.worker_nodes.values()) | g.holder_nodes)
                                 - set(cap) - self._silent),
            "resumed_step": plan.step, "moved_ranks": list(plan.moved),
            "in_place_ranks": sorted(plan.placed),  # copies already placed: no re-copy
            "sources": {str(r): source_label(s, plan.assignment[r])
                        for r, s in plan.sources.items()},
            "notes": list(plan.notes), "gen": g.gen + 1, "fault_at": failure.fault_at,
            "fault_from": failure.fault_from, "detected_at": failure.detected_at,
            "last_sign_of_life_at": failure.last_sign_of_life_at,
            "frozen_nodes": sorted(self._silent),
            "phases_s": {"detect": failure.detect_s,
                         "stop": t_killed - t0, "plan": t_plan - t_killed},
        }
        self.records.append(record)
        self.plane.say(f"recovery plan: resume at step {plan.step}; sources {record['sources']}"
                       + (f"; {'; '.join(plan.notes)}" if plan.notes else ""))
        self.plane.event("recovery_plan", **{k: v for k, v in record.items() if k != "phases_s"})
        self._started = time.time()

    # -- after it ---------------------------------------------------------------------------------
    def check_resumed(self, min_step: int, gen: int) -> bool:
        """True once, when every rank finished its first step after the restored one: the
        last recovery is over (its resume and total phases are recorded)."""
        if not self.records or "resume" in self.records[-1]["phases_s"] \
                or min_step <= self.records[-1]["resumed_step"]:
            return False
        now = time.time()
        self._silent.clear()  # a node that was silent and wakes may serve the next recovery
        last = self.records[-1]
        phases = last["phases_s"]
        phases["resume"] = now - self._started
        phases["total"] = now - (last.get("fault_at") or self._started)
        self.plane.event("recovery_finished", step=last["resumed_step"], gen=gen, phases_s=phases)
        return True
