"""The controller side of the Ray Train front door.

:class:`MemckptCallback` runs inside Ray Train's controller, which lives as long as
the run: the job's coordinator and one replica store per node it starts there outlive
every restart of the worker group. At each worker-group start it places replicas over
the nodes Ray Train chose, decides from the stores' inventory where every rank's
newest commonly held step is (plan: :func:`memckpt.policy.recovery_plan.plan_in_place`) and
hands each worker its spec. A watchdog thread turns a rank that stopped heart-beating
into a worker death (SIGKILL), which Ray Train answers with a restart, and carries out the
chaos faults a rank cannot deliver to itself (several ranks at once, a node).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from memckpt.config import Config
from memckpt.errors import ConfigError, RecoveryError
from memckpt.ray_train import context as worker_side
from memckpt.runtime.node.janitor import start_janitor
from memckpt.ray_train.layout import holders_for, run_config, train_tier
from memckpt.policy.failure import hung_what
from memckpt.policy.recovery_plan import plan_in_place, source_label
from memckpt.runtime.driver import actors
from memckpt.runtime.driver.driver import STARTUP_TIMEOUT_S, default_run_dir
from memckpt.runtime.chaos.faults import Fault, aim, deliver, send_signals
from memckpt.runtime.worker.spec import copies_by_node, ranks_by_node
from memckpt.runtime.worker.worker import RestoreInstruction, WorkerSpec

logger = logging.getLogger(__name__)


class MemckptCallback(ControllerCallback, WorkerGroupCallback):
    """Per-step RAM snapshots with peer replicas for a Ray Train run::

        trainer = TorchTrainer(train_loop, scaling_config=...,
            run_config=RunConfig(callbacks=[MemckptCallback(config)], ...))

    ``config``: a :class:`memckpt.Config` (placement, snapshot interval, failure
    policy, extra persisted tiers); the worker count comes from the ``ScalingConfig``.
    ``checkpoint_every``: every that many steps memckpt persists a checkpoint into the
    run's storage folder and reports it to Ray Train (``Result.checkpoint``,
    ``get_checkpoint()``, ``CheckpointConfig`` retention); None: RAM only.
    ``run_dir``: where the coordinator writes ``events.jsonl`` and ``losses.jsonl``.
    """

    def __init__(self, config: Config, *, checkpoint_every: Optional[int] = 100,
                 run_dir: Optional[str | Path] = None) -> None:
        if not isinstance(config, Config):
            raise ConfigError(f"MemckptCallback(config) needs a memckpt.Config, got "
                              f"{type(config).__name__}")
        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or
                                             not isinstance(checkpoint_every, int)
                                             or checkpoint_every < 1):
            raise ConfigError(f"checkpoint_every={checkpoint_every!r} is invalid: use a whole "
                              "number of steps >= 1, or None for no Ray Train checkpoints")
        self.base = config
        self.checkpoint_every = checkpoint_every
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(config.job_name)
        self._reset()

    def _reset(self) -> None:
        self.config: Optional[Config] = None
        self.coordinator: Any = None
        self.janitor: Any = None
        self.stores: dict[str, Any] = {}
        self.gen = -1
        self.assignment: dict[int, str] = {}
        self.holders: dict[int, tuple[str, ...]] = {}
        self.processes: dict[int, tuple[str, int]] = {}  # rank -> (node, pid), this generation
        self.report: Optional[tuple[int, str]] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._killed: set[tuple[int, int]] = set()  # (gen, rank) killed as hung
        self._faults: tuple[Fault, ...] = ()  # the config's chaos schedule
        self._prune_after: Optional[int] = None  # after a restart: its step (_prune_old_layout)
        self._warned: set[type] = set()  # watchdog errors already logged

    def __getstate__(self) -> dict[str, Any]:  # sent to the controller before it starts
        return {"base": self.base, "checkpoint_every": self.checkpoint_every,
                "run_dir": self.run_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    # -- controller hooks -------------------------------------------------------------------
    def after_controller_start(self, train_run_context: Any) -> None:
        storage = train_run_context.run_config.storage_context
        tier = None
        if self.checkpoint_every is not None:
            tier = train_tier(storage.experiment_fs_path, storage.storage_filesystem.type_name,
                              self.checkpoint_every)
        cfg = run_config(self.base, train_run_context.scaling_config.num_workers, tier)
        self.config = cfg
        self._faults = tuple(Fault.from_chaos(ev) for ev in cfg.chaos)
        if tier is not None:
            self.report = (len(cfg.persistence) - 1, tier.uri)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator = actors.start_coordinator(cfg, self.run_dir)
        self.janitor = start_janitor(cfg, self.coordinator)
        self._event("job_started", world_size=cfg.workers.num_workers, run=str(storage
                    .experiment_fs_path), fingerprint=cfg.fingerprint())
        threading.Thread(target=self._watchdog, name="memckpt-watchdog", daemon=True).start()

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        self._unwatch()
        if self.coordinator is not None:
            self._event("failure_detected", gen=self.gen, decision=str(failure_decision))

    def before_worker_group_shutdown(self, worker_group: Any) -> None:
        self._unwatch()

    def _unwatch(self) -> None:
        """Ray Train is ending this generation: its ranks going silent is no hang."""
        with self._lock:
            self.processes = {}

    async def before_controller_shutdown(self) -> None:
        self._teardown("job_ended")

    def after_controller_finish(self, result: Any) -> None:
        self._teardown("job_ended")

    def before_controller_abort(self) -> None:
        self._teardown("job_aborted")

    # -- worker-group hooks -----------------------------------------------------------------
    def after_worker_group_start(self, worker_group: Any) -> None:
        import ray
        cfg = self.config
        assert cfg is not None, "after_controller_start runs first"
        workers = worker_group.get_workers()
        assignment = {w.distributed_context.world_rank: w.metadata.node_id for w in workers}
        with self._lock:
            self.gen += 1
            gen = self.gen
            self._ensure_stores(set(assignment.values()))
            if gen == 0:  # a fresh job: nothing an earlier job left in these nodes' RAM
                ray.get([s.clear.remote() for s in self.stores.values()])
            # placement.failure_domain: the first group is refused (PlacementError, the
            # run's error) where copies cannot sit outside each rank's domain; a restart
            # keeps going with copies inside it, as memckpt.run's recovery does
            domains = actors.failure_domains(cfg, dict.fromkeys(assignment.values()),
                                             strict=gen == 0)
            holders = holders_for(assignment, cfg, self.holders, domains, strict=gen == 0)
            restore = self._plan(gen, assignment, holders)
            self.assignment, self.holders = assignment, holders
            self.processes = {}
        committed = next(iter(restore.values())).step if restore else None
        ray.get(self.coordinator.configure.remote(
            gen, assignment, {r: list(h) for r, h in holders.items()}, committed,
            {n: actors.store_name(cfg.job_name, n) for n in self.stores}))
        # a restart: the layout before is freed once this one commits past its restored
        # step (set only now: before configure, the coordinator's committed step is the
        # last generation's, and the restore still reads the old copies)
        with self._lock:
            self._prune_after = None if gen == 0 else (-1 if committed is None else committed)
        refs = {}
        by_node, copies = ranks_by_node(assignment), copies_by_node(holders)
        relays = actors.relay_members(cfg, assignment.values())
        for i, w in enumerate(workers):
            rank = w.distributed_context.world_rank
            node = assignment[rank]
            spec = WorkerSpec(rank, cfg.workers.num_workers, gen, cfg, holders.get(rank, ()),
                              dict(self.stores), self.coordinator, restore.get(rank),
                              self._faults, node_ranks=by_node[node],
                              node_copies=copies.get(node, ()), relay=relays.get(node, ()))
            refs[rank] = worker_group.execute_single_async(i, worker_side.install, spec,
                                                           self.report)
        pids = {rank: ray.get(ref) for rank, ref in refs.items()}
        with self._lock:
            self.processes = {r: (assignment[r], pids[r]) for r in assignment}
        self._event("generation_started", gen=gen, assignment=assignment, holders=holders,
                    restore={r: i.step for r, i in restore.items()})

    # -- decisions and actions --------------------------------------------------------------
    def _ensure_stores(self, nodes: set[str]) -> None:
        import ray
        assert self.config is not None
        new = {n: actors.start_store(self.config, n) for n in nodes if n not in self.stores}
        if new:
            ray.get([s.ping.remote() for s in new.values()])
            self.stores.update(new)
            ray.get(self.janitor.add_nodes.remote(list(new)))

    def _roll_back(self, nodes: list[str], step: int, gen: int) -> None:
        """The stores' roll-back and fence (bounded: a frozen node's store is said, not
        waited for; its copies were not in the inventory either, so nothing reads them)."""
        silent = actors.roll_back(self.stores, nodes, step, gen)
        if silent:
            self._event("stores_not_rolled_back", gen=gen, nodes=sorted(silent))

    def _plan(self, gen: int, assignment: dict[int, str],
              holders: dict[int, tuple[str, ...]]) -> dict[int, RestoreInstruction]:
        """Where each rank restores from: the newest step every rank still holds in some
        live node's RAM; none (Ray Train's checkpoint, or a fresh start) when some rank's
        every copy is gone."""
        import ray
        if gen == 0:
            return {}
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        live_stores = [n for n in self.stores if n in alive]
        inventory = actors.inventory(self.stores, live_stores, timeout_s=10.0)
        committed = ray.get(self.coordinator.committed.remote())
        try:
            plan = plan_in_place(self.assignment, assignment, holders, alive, inventory,
                                 committed)
        except RecoveryError as lost:
            self._roll_back(live_stores, -1, gen)
            self._event("fallback_to_ray_checkpoint", gen=gen, reason=str(lost))
            return {}
        self._roll_back(live_stores, plan.step, gen)
        self._event("recovery_plan", gen=gen, resumed_step=plan.step,
                    moved_ranks=list(plan.moved), in_place_ranks=sorted(plan.placed),
                    sources={str(r): source_label(s, assignment[r]) for r, s in plan.sources.items()},
                    dead_nodes=sorted(set(self.assignment.values()) - set(alive)),
                    notes=list(plan.notes))
        return {r: RestoreInstruction(plan.step, plan.sources[r], placed=r in plan.placed)
                for r in assignment if plan.sources[r]}

    def _watchdog(self) -> None:
        """A rank silent for ``failure.heartbeat_timeout_s`` (a stopped or wedged process)
        is SIGKILLed: Ray Train sees a dead worker and restarts the group (alone it would
        wait for its poll or the collective timeout)."""
        cfg = self.config
        assert cfg is not None
        timeout = cfg.failure.heartbeat_timeout_s
        while not self._stop.wait(cfg.failure.heartbeat_interval_s):
            try:
                import ray
                hung, silent = ray.get(self.coordinator.liveness.remote(
                    timeout, max(STARTUP_TIMEOUT_S, timeout)), timeout=10)
                with self._lock:
                    gen, procs = self.gen, dict(self.processes)
                for rank in hung:
                    if rank not in procs or (gen, rank) in self._killed:
                        continue
                    self._killed.add((gen, rank))
                    node, pid = procs[rank]
                    frozen = node in silent  # its whole node stopped reporting
                    self._event("hung_rank_killed", gen=gen, rank=rank, node=node, pid=pid,
                                timeout_s=timeout, what=hung_what([rank], (node,) if frozen
                                                                  else ()))
                    # a frozen node's raylet runs the kill only if it wakes: not awaited
                    send_signals([(node, pid)], "KILL", timeout_s=10, wait=not frozen)
                self._carry_out_faults()
                self._prune_old_layout()
            except Exception as e:  # noqa: BLE001 (a restarting coordinator, a dead node: next round)
                import ray
                if not self._stop.is_set() and not isinstance(e, ray.exceptions.RayError) \
                        and type(e) not in self._warned:  # anything else is a bug: say it once
                    self._warned.add(type(e))
                    logger.warning("memckpt watchdog: %r (retrying every %s s)", e,
                                   cfg.failure.heartbeat_interval_s)
                time.sleep(cfg.failure.heartbeat_interval_s)

    def _carry_out_faults(self) -> None:
        """The chaos faults a rank reached and cannot deliver itself (several ranks in the
        same instant, its node): the rank holds at its step until they are done."""
        import ray
        pending = set(ray.get(self.coordinator.pending_faults.remote(), timeout=10))
        for fault in self._faults:
            if fault.key not in pending:
                continue
            with self._lock:
                gen, procs = self.gen, dict(self.processes)
            strike = aim(fault, procs)
            if strike is not None:
                self._event("fault_injected", gen=gen, **strike.details())
                deliver(strike, coordinator=self.coordinator,
                        store_pid=lambda node: ray.get(self.stores[node].ping.remote()).pid)
            ray.get(self.coordinator.fault_done.remote(fault.key), timeout=10)

    def _prune_old_layout(self) -> None:
        """After a restart moved ranks (Ray Train places the new group anew), free the
        shards the layout before left on nodes that no longer serve them, once this
        layout has committed past its restored step."""
        import ray
        with self._lock:
            after, gen = self._prune_after, self.gen
            assignment, holders = dict(self.assignment), dict(self.holders)
        if after is None:
            return
        committed = ray.get(self.coordinator.committed.remote(), timeout=10)
        if committed is None or committed <= after:
            return
        with self._lock:
            if self.gen != gen:  # restarted meanwhile: the next layout's turn
                return
            self._prune_after = None
        self._event("old_layout_freed", gen=gen, committed=committed,
                    **actors.free_unserved(self.stores, assignment, holders))

    def _event(self, kind: str, **fields: Any) -> None:
        self.coordinator.log_event.remote(kind, fields)

    def _teardown(self, kind: str) -> None:
        """Free every store's RAM and end the coordinator (once)."""
        if self.coordinator is None or self.config is None:
            return
        self._stop.set()
        try:
            import ray
            ray.get(self.coordinator.log_event.remote(kind, {"gen": self.gen}), timeout=10)
        except Exception:  # noqa: BLE001 (the coordinator is being torn down anyway)
            pass
        actors.release(self.config, self.stores, self.coordinator)
        import ray
        ray.kill(self.janitor, no_restart=True)
        self.coordinator, self.stores, self.janitor = None, {}, None

