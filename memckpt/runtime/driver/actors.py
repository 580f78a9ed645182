"""The job's long-lived actors, started and released the same way by both front doors
(``memckpt.run``'s driver and the Ray Train callback): one coordinator per job, one
replica store per node.

Lifetimes: neither is detached. Each is owned by the process that starts it (the
driver, or Ray Train's controller) and dies with it, so a killed driver leaves no
actor behind; both restart in place after their own process dies (``max_restarts=-1``)
as long as their owner lives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from memckpt.engine.buffers import remove_path, resolve_ram_root
from memckpt.config import Config
from memckpt.errors import ConfigError
from memckpt.policy.placement import node_domains
from memckpt.policy.relay_groups import relay_groups
from memckpt.policy.recovery_plan import served_ranks
from memckpt.runtime.ray_nodes import alive_node_ids, on_node
from memckpt.runtime.coordinator.coordinator import (COORDINATOR_NAMESPACE, Coordinator,
                                                     GcsStateStore, coordinator_name)
from memckpt.runtime.coordinator.messages import EventFields
from memckpt.runtime.node.replica_store import Freed, ReplicaStore
from memckpt.runtime.wire.calls import COMMIT_GROUP, COMMIT_WAITERS


def failure_domains(config: Config, nodes: Iterable[str],
                    strict: bool = True) -> Optional[dict[str, str]]:
    """``nodes`` -> their failure domain: the value of their Ray node label
    ``config.placement.failure_domain`` (``ray.nodes()`` lists a node's labels under
    ``"Labels"``); None when that is not set (every node its own domain).

    ``strict``: a node without the label raises :class:`PlacementError` naming it (a job's
    start); else it is left out, its own domain (a node that joined a running job)."""
    label = config.placement.failure_domain
    if label is None:
        return None
    import ray
    labels = {n["NodeID"]: n.get("Labels") or {} for n in ray.nodes()}
    own = {n: labels.get(n, {}) for n in nodes}
    return node_domains(own if strict else {n: ls for n, ls in own.items() if ls.get(label)},
                        label)


def relay_members(config: Config, nodes: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """node -> its relay group's members, leader first (``config.control``;
    :mod:`memckpt.policy.relay_groups`): a rack's nodes together where the job names failure
    domains. {} on a job too small for relays (no look at the cluster then)."""
    control, nodes = config.control, sorted(set(nodes))
    if control.relay_fanout < 2 or len(nodes) < control.relay_min_nodes:
        return {}
    groups = relay_groups(nodes, control.relay_fanout, control.relay_min_nodes,
                          failure_domains(config, nodes, strict=False))
    return {n: g.members for n, g in groups.items()}


def store_name(job: str, node: str) -> str:
    return f"memckpt-store-{job}-{node[:16]}"



def held_bytes(job: str) -> dict[str, int]:
    """node id -> bytes of shards (own slots and peers' replicas) ``job``'s replica store on
    that node holds now; live nodes with a store only."""
    import ray
    out = {}
    for node in (n["NodeID"] for n in ray.nodes() if n["Alive"]):
        try:
            store = ray.get_actor(store_name(job, node), namespace=COORDINATOR_NAMESPACE)
        except ValueError:  # no store of this job there (a head without workers)
            continue
        out[node] = int(ray.get(store.memory.remote())["held_bytes"])
    return out

def start_store(config: Config, node: str) -> Any:
    """The replica store of ``node`` (pinned there, no CPU reserved). Its ranks' waits for
    a commit answer run in their own threads (COMMIT_GROUP), never in the 16 that serve
    writes, reads and readiness."""
    import ray
    # concurrency groups are declared with the class (Ray refuses them in .options())
    return ray.remote(concurrency_groups={COMMIT_GROUP: COMMIT_WAITERS})(ReplicaStore).options(
        name=store_name(config.job_name, node), namespace=COORDINATOR_NAMESPACE,
        num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=16,
        scheduling_strategy=on_node(node),
    ).remote(config.ram_root or "", config.job_name, node, config.ram_budget)


def start_coordinator(config: Config, run_dir: Path) -> Any:
    """The job's coordinator, on this process's node; refuses a job name already running."""
    import ray
    if ray.util.list_named_actors(all_namespaces=True).count(coordinator_name(config.job_name)):
        raise ConfigError(f"job_name={config.job_name!r} is invalid: a job of that name is "
                          "running on this cluster; pick another job_name or stop it with "
                          "memckpt kill")
    GcsStateStore(config.job_name).delete()  # a former job's of that name
    here = ray.get_runtime_context().get_node_id()
    coordinator = ray.remote(Coordinator).options(
        name=coordinator_name(config.job_name), namespace=COORDINATOR_NAMESPACE, num_cpus=0,
        max_restarts=-1, max_task_retries=-1, scheduling_strategy=on_node(here),
    ).remote(config.job_name, str(run_dir), config.workers.num_workers, config.persistence,
             config.fingerprint())
    # Up before anything is sent to it: teardown gives a coordinator 10 s to finish, which a
    # process still starting on a loaded node can miss, losing the events sent before it
    # (a start that fails at once, e.g. too few nodes, would leave no "job_failed").
    ray.get(coordinator.committed.remote())
    return coordinator


def inventory(stores: Mapping[str, Any], nodes: Iterable[str],
              timeout_s: float = 30.0) -> dict[str, dict[int, list[int]]]:
    """node -> rank -> steps its store holds (own slots and replicas); {} for a store
    that does not answer."""
    import ray
    refs = {n: stores[n].inventory.remote() for n in nodes}
    out = {}
    for n, ref in refs.items():
        try:
            out[n] = {int(r): s for r, s in ray.get(ref, timeout=timeout_s).items()}
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            out[n] = {}
    return out


ROLL_BACK_S = 10.0  # a store that does not roll back in this long is taken as lost too


def roll_back(stores: Mapping[str, Any], nodes: Iterable[str], step: int, gen: int,
              timeout_s: float = ROLL_BACK_S) -> set[str]:
    """Every store of ``nodes`` drops what is newer than ``step`` and takes generation
    ``gen`` (its fence: an older generation's writes are refused from then on), all at
    once. Returns the nodes whose store did not answer within ``timeout_s`` (frozen) or
    died with the call: the caller leaves them out."""
    import ray
    refs = {}
    for n in nodes:
        refs[stores[n].discard_after.remote(step)] = n
        refs[stores[n].set_generation.remote(gen)] = n
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) \
        if refs else ([], [])
    failed = {refs[r] for r in late}
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError:  # its node died meanwhile
            failed.add(refs[ref])
    return failed


def free_unserved(stores: Mapping[str, Any], assignment: Mapping[int, str],
                  holders: Mapping[int, Sequence[str]], skip: Iterable[str] = ()
                  ) -> EventFields:
    """Every live node's store frees the shards of ranks the layout (``assignment``,
    ``holders``) does not give it: after a recovery moved ranks or resized the job, and
    once that layout committed a step past it, those are never read again. ``skip``: nodes
    not asked (left out of the layout as frozen: theirs go when the job ends). Returns the
    event fields: the bytes freed and the folders removed per node."""
    import ray
    alive = alive_node_ids() - set(skip)
    keep = served_ranks(assignment, holders, [n for n in stores if n in alive])
    refs = {n: stores[n].keep_only.remote(*keep[n]) for n in keep}
    freed: dict[str, Freed] = {}
    for n, ref in refs.items():
        try:
            freed[n[:12]] = ray.get(ref, timeout=30)
        except ray.exceptions.RayError:  # a node lost meanwhile: its RAM went with it
            pass
    return {"freed_bytes": sum(f.freed_bytes for f in freed.values()),
            "removed": {n: list(f.removed) for n, f in freed.items() if f.removed}}


def release(config: Config, stores: Mapping[str, Any], coordinator: Any) -> None:
    """The job ended: every store frees its node's RAM and goes, then the coordinator.
    A dead node's RAM folder only exists on that node; where nodes share a machine (a
    simulated cluster) it is freed here, since no store is left to do it."""
    import ray
    alive = alive_node_ids()
    job_root = resolve_ram_root(config.ram_root) / config.job_name
    for node in set(stores) - alive:
        remove_path(job_root / node)
    for s in list(stores.values()):
        try:
            ray.get(s.clear.remote(), timeout=10)
        except Exception:  # a dead node's store: nothing to clear
            pass
        ray.kill(s, no_restart=True)
    if coordinator is None:
        return
    try:
        ray.get(coordinator.finish.remote(), timeout=10)
    except Exception:
        pass
    ray.kill(coordinator, no_restart=True)
