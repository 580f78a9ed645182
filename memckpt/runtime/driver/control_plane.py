"""The job's coordinator and its replica store on each node, as the driver starts, asks and
tears them down; and the driver's log (console lines and the job's events)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Collection, Optional

from memckpt.config import Config
from memckpt.runtime.coordinator.messages import CoordinatorStatus
from memckpt.runtime.driver import actors
from memckpt.runtime.ray_nodes import alive_node_ids, on_node

LOGGING_CHECK = 64  # log_event calls kept before the done ones are dropped
LOGGING_WAIT_S = 10.0  # how long teardown waits for the events still being written

affinity = on_node  # the pool pins its workers the same way


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


class ControlPlane:
    """The coordinator (``coordinator``) and a replica store per node (``stores``)."""

    def __init__(self, config: Config, quiet: bool = False) -> None:
        import ray
        self.ray, self.config, self.quiet = ray, config, quiet
        self.coordinator: Any = None
        self.stores: dict[str, Any] = {}  # node -> its ReplicaStore actor (a dead node's stays)
        self.events: list[dict[str, Any]] = []
        # the coordinator's log_event calls not known to have run: teardown waits for them,
        # as an async actor may run a later call (finish) first, and the kill drops the rest
        self._logging: list[Any] = []

    # -- the driver's log -----------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[memckpt] {msg}", flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append(dict(event=kind, time=time.time(), **fields))
        if self.coordinator is not None:  # None: it never started (the error says why)
            self._logging.append(self.coordinator.log_event.remote(kind, fields))
            if len(self._logging) >= LOGGING_CHECK:
                _, self._logging = self.ray.wait(self._logging, num_returns=len(self._logging),
                                                 timeout=0)

    # -- start-up -------------------------------------------------------------------------------
    def start_coordinator(self, run_dir: Path) -> None:
        self.coordinator = actors.start_coordinator(self.config, run_dir)

    def ensure_stores(self, nodes: list[str]) -> None:
        new = {n: actors.start_store(self.config, n) for n in nodes if n not in self.stores}
        if new:
            self.ray.get([s.ping.remote() for s in new.values()])
            self.stores.update(new)

    def store_names(self) -> dict[str, str]:
        return {n: actors.store_name(self.config.job_name, n) for n in self.stores}

    # -- what the stores say ----------------------------------------------------------------------
    def alive_nodes(self, suspects: set[str], timeout_s: float = 30.0,
                    silent: Collection[str] = ()) -> list[str]:
        """Nodes Ray reports alive whose store answers; waits for Ray's verdict on the rest.
        ``silent``: nodes whose store stopped reporting (frozen, cut off), out at once."""
        ray = self.ray
        deadline = time.time() + timeout_s
        while True:
            alive_now = alive_node_ids() - set(silent)
            unsure = []
            for node in suspects & alive_now:
                store = self.stores[node]
                try:
                    ray.get(store.ping.remote(), timeout=1.0)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    unsure.append(node)
            if not unsure or time.time() > deadline:
                return [n for n in eligible_nodes(self.config) if n in alive_now and n not in unsure]
            time.sleep(0.2)

    def inventory(self, nodes: list[str]) -> dict[str, dict[int, list[int]]]:
        return actors.inventory(self.stores, nodes)

    # -- the end ----------------------------------------------------------------------------------
    def teardown(self, workers: list[Any]) -> None:
        """Kill ``workers``, then clear and kill the stores and the coordinator."""
        for w in workers:
            self.ray.kill(w, no_restart=True)
        if self._logging:  # the job's last events (job_failed, job_finished) written first
            self.ray.wait(self._logging, num_returns=len(self._logging), timeout=LOGGING_WAIT_S)
            self._logging = []
        actors.release(self.config, self.stores, self.coordinator)

    def fault_time(self, since: float) -> Optional[float]:
        """When the newest fault injected after ``since`` fired (None: none did)."""
        status: CoordinatorStatus = self.ray.get(self.coordinator.status.remote())
        return max((t for t in status["fired_at"].values() if t > since), default=None)
