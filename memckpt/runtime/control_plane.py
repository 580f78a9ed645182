"""The job's coordinator and its replica store on each node, as the driver starts, asks and
tears them down; and the driver's log (console lines and the job's events)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from memckpt.buffers import remove_path, resolve_ram_root
from memckpt.config import Config
from memckpt.errors import ConfigError
from memckpt.runtime.coordinator import COORDINATOR_NAMESPACE, Coordinator, coordinator_name
from memckpt.runtime.replica_store import ReplicaStore


def affinity(node_id: str):
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


def alive_node_ids() -> set[str]:
    import ray
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def store_name(job: str, node: str) -> str:
    return f"memckpt-store-{job}-{node[:16]}"


class ControlPlane:
    """The coordinator (``coordinator``) and a replica store per node (``stores``)."""

    def __init__(self, config: Config, quiet: bool = False) -> None:
        import ray
        self.ray, self.config, self.quiet = ray, config, quiet
        self.coordinator: Any = None
        self.stores: dict[str, Any] = {}  # node -> its ReplicaStore actor (a dead node's stays)
        self.events: list[dict[str, Any]] = []

    # -- the driver's log -----------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[memckpt] {msg}", flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append(dict(event=kind, time=time.time(), **fields))
        self.coordinator.log_event.remote(kind, fields)

    # -- start-up -------------------------------------------------------------------------------
    def start_coordinator(self, run_dir: Path) -> None:
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
            scheduling_strategy=affinity(here),
        ).remote(cfg.job_name, str(run_dir), cfg.workers.num_workers, cfg.persistence,
                  cfg.fingerprint())

    def _start_store(self, node: str) -> Any:
        ray, cfg = self.ray, self.config
        cls = ray.remote(ReplicaStore)
        return cls.options(
            name=store_name(cfg.job_name, node), namespace=COORDINATOR_NAMESPACE,
            num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=16,
            scheduling_strategy=affinity(node),
        ).remote(cfg.ram_root or "", cfg.job_name, node)

    def ensure_stores(self, nodes: list[str]) -> None:
        new = {n: self._start_store(n) for n in nodes if n not in self.stores}
        if new:
            self.ray.get([s.ping.remote() for s in new.values()])
            self.stores.update(new)

    def store_names(self) -> dict[str, str]:
        return {n: store_name(self.config.job_name, n) for n in self.stores}

    # -- what the stores say ----------------------------------------------------------------------
    def alive_nodes(self, suspects: set[str], timeout_s: float = 30.0) -> list[str]:
        """Nodes Ray reports alive whose store answers; waits for Ray's verdict on the rest."""
        ray = self.ray
        deadline = time.time() + timeout_s
        while True:
            alive_now = alive_node_ids()
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

    def inventory(self, nodes: list[str]) -> dict[str, dict[int, list[int]]]:
        refs = {n: self.stores[n].inventory.remote() for n in nodes}
        out = {}
        for n, ref in refs.items():
            try:
                out[n] = {int(r): s for r, s in self.ray.get(ref, timeout=30).items()}
            except self.ray.exceptions.RayError:
                out[n] = {}
        return out

    # -- the end ----------------------------------------------------------------------------------
    def teardown(self, workers: list[Any]) -> None:
        """Kill ``workers``, then clear and kill the stores and the coordinator."""
        ray = self.ray
        # A dead node's RAM folder only exists on that node; where nodes share a machine
        # (a simulated cluster) free it here, since no store is left to do it.
        alive = alive_node_ids()
        job_root = resolve_ram_root(self.config.ram_root) / self.config.job_name
        for node in set(self.stores) - alive:
            remove_path(job_root / node)
        for w in workers:
            ray.kill(w, no_restart=True)
        for s in list(self.stores.values()):
            try:
                ray.get(s.clear.remote(), timeout=10)
            except Exception:  # a dead node's store: nothing to clear
                pass
            ray.kill(s, no_restart=True)
        if self.coordinator is None:
            return
        try:
            ray.get(self.coordinator.finish.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(self.coordinator, no_restart=True)

    def fault_time(self, since: float) -> Optional[float]:
        """When the newest fault injected after ``since`` fired (None: none did)."""
        fired = self.ray.get(self.coordinator.status.remote()).get("fired_at", {})
        return max((t for t in fired.values() if t > since), default=None)
