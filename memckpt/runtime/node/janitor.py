"""Frees a Ray Train job's RAM when its controller dies without cleaning up.

It lives here, not in memckpt.ray_train, so that its process imports neither torch nor Ray
Train (importing that package does: ~5 CPU-s for an actor that only removes folders).

The coordinator and stores are owned by Ray Train's controller, which is owned by the
driver: killing the driver kills them all (no actor leaks), but a killed store frees
nothing, and its shared-memory files would stay. The janitor is the one *detached*
actor of a job: it outlives the driver, watches the coordinator, and once Ray reports
the coordinator dead for good, removes the job's folder on every node that had a
store, then ends itself. On a normal end the callback cleans up and kills it.
"""

from __future__ import annotations

import threading
from typing import Any

from memckpt.engine.buffers import remove_path, resolve_ram_root
from memckpt.config import Config
from memckpt.runtime.ray_nodes import on_node
from memckpt.runtime.coordinator.state_store import COORDINATOR_NAMESPACE

POLL_S = 1.0


def janitor_name(job: str) -> str:
    return f"memckpt-janitor-{job}"


def _remove_node_folder(ram_root: str, job: str, node: str) -> None:
    job_root = resolve_ram_root(ram_root or None) / job
    remove_path(job_root / node)
    try:
        job_root.rmdir()  # once no other node on this machine still uses it
    except OSError:
        pass


class Janitor:
    def __init__(self, ram_root: str, job: str, coordinator: Any) -> None:
        self.ram_root, self.job, self.coordinator = ram_root, job, coordinator
        self.nodes: set[str] = set()
        threading.Thread(target=self._watch, name="memckpt-janitor", daemon=True).start()

    def add_nodes(self, nodes: list[str]) -> None:
        self.nodes.update(nodes)

    def _watch(self) -> None:
        import ray
        while True:
            try:
                ray.get(self.coordinator.committed.remote(), timeout=60)
            except ray.exceptions.ActorDiedError:
                break  # its owner (the controller, the driver) is gone
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass  # restarting
            threading.Event().wait(POLL_S)
        task = ray.remote(num_cpus=0, max_retries=0)(_remove_node_folder)
        refs = [task.options(scheduling_strategy=on_node(n)).remote(self.ram_root, self.job, n)
                for n in self.nodes]
        for ref in refs:
            try:
                ray.get(ref, timeout=60)
            except ray.exceptions.RayError:
                pass  # a dead node: its RAM went with it
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def start_janitor(config: Config, coordinator: Any) -> Any:
    """The job's janitor (detached, on this node, no CPU); an earlier job's is replaced."""
    import ray
    name = janitor_name(config.job_name)
    try:
        ray.kill(ray.get_actor(name, namespace=COORDINATOR_NAMESPACE), no_restart=True)
    except ValueError:
        pass
    here = ray.get_runtime_context().get_node_id()
    return ray.remote(Janitor).options(
        name=name, namespace=COORDINATOR_NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=2, scheduling_strategy=on_node(here),
    ).remote(config.ram_root or "", config.job_name, coordinator)
