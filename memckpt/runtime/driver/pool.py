"""The driver's worker actors: each rank's (reused across generations while its node lives),
the generation running, and a warm spare per node with the memory a restore fills; inside
:func:`memckpt.keep_workers`, taken from and handed back to the workers kept between jobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Optional

from memckpt.runtime.driver import kept
from memckpt.runtime.driver.control_plane import ControlPlane, affinity, alive_node_ids
from memckpt.runtime.worker.result import WorkerInfo, WorkerResult
from memckpt.runtime.worker.worker import Worker

LARGEST_SHARD_WAIT_S = 2.0  # stores answering what spares prepare for (see _largest_shard)
# a worker that does not answer its liveness ping in this long counts as dead: a dead one
# is reported by Ray at once, a live one answers in milliseconds even on a loaded machine
PING_S = 5.0
# how long a finished job inside keep_workers() waits for its workers to park: a spare made
# late in a short job may still be importing torch, and is worth the wait (a hung one is killed)
PARK_WAIT_S = 30.0


@dataclass
class Generation:
    gen: int
    workers: dict[int, Any]
    refs: dict[Any, int]  # run ObjectRef -> rank
    info: dict[int, WorkerInfo]  # rank -> its worker's process
    results: dict[int, WorkerResult] = field(default_factory=dict)  # the ranks that returned
    holders: dict[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> replica holders
    killed: set[int] = field(default_factory=set)  # ranks whose worker the recovery killed

    @property
    def holder_nodes(self) -> set[str]:
        return {h for hs in self.holders.values() for h in hs}


class WorkerPool:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane, self.ray, self.config = plane, plane.ray, plane.config
        self.workers: dict[int, Any] = {}  # rank -> live worker actor (reused across generations)
        self.worker_nodes: dict[int, str] = {}
        self.spares: dict[str, Any] = {}  # node -> idle warm worker
        # node -> (spare, its prefault ref)
        self._prefaults: dict[str, tuple[Any, Any]] = {}
        self._standby = False  # every node's spare is up and has its memory in hand
        self._first_commit: Optional[int] = None  # the job's first committed step
        self._spare_nodes: set[str] = set()  # the live nodes that should have a spare
        self._spare_shaped: set[Any] = set()  # workers made as spares (reserving no CPU)
        # keep_workers(): workers of an earlier job, ready for this one, by (node, spare?)
        self._adopted: dict[tuple[str, bool], list[Any]] = {}

    def assign(self, assignment: dict[int, str]) -> tuple[dict[int, Any], dict[int, str]]:
        """A worker for each rank: its own if it lives on the rank's node, else another
        idle one there (after a resize renumbered the ranks), else that node's spare, else
        a new one. Returns the workers and how each was found."""
        workers, how = {}, {}
        idle = {r: w for r, w in self.workers.items()
                if assignment.get(r) != self.worker_nodes.get(r)}
        for rank in assignment:
            if rank in self.workers and rank not in idle:
                workers[rank], how[rank] = self.workers[rank], "reused"
        for rank, node in assignment.items():
            if rank in workers:
                continue
            other = next((r for r in idle if self.worker_nodes.get(r) == node), None)
            if other is not None:
                workers[rank], how[rank] = idle.pop(other), "reused"
            elif node in self.spares:
                workers[rank], how[rank] = self.spares.pop(node), "spare"
            else:
                workers[rank], how[rank] = self._worker_for(node)
        for w in idle.values():  # a shrunk job's leftovers free their node's CPUs
            self.ray.kill(w, no_restart=True)
        self.workers, self.worker_nodes = dict(workers), dict(assignment)
        return workers, how

    def _worker_for(self, node: str, spare: bool = False) -> tuple[Any, str]:
        """A worker on ``node``: one kept from an earlier job ("kept"), else a new one."""
        found = self._adopted.get((node, spare))
        if found:
            return found.pop(), "kept"
        return self.new_worker(node, spare), "new"

    def new_worker(self, node: str, spare: bool = False) -> Any:
        cfg = self.config
        # A spare reserves no CPU while it idles; it takes over the CPU of the rank it
        # replaces, whose actor is gone by then.
        w = self.ray.remote(Worker).options(
            num_cpus=0 if spare else cfg.workers.cpus_per_worker,
            num_gpus=0 if spare else cfg.workers.gpus_per_worker,
            max_restarts=0, max_concurrency=4, scheduling_strategy=affinity(node),
        ).remote(cfg, self.plane.coordinator)
        if spare:
            self._spare_shaped.add(w)
        return w

    # -- workers kept between jobs (memckpt.keep_workers) ---------------------------------------
    def _shape(self, spare: bool) -> kept.Shape:
        w = self.config.workers
        return (0.0, 0.0) if spare else (float(w.cpus_per_worker), float(w.gpus_per_worker))

    def adopt_kept(self, assignment: dict[int, str], nodes: list[str]) -> int:
        """Before the first generation, inside :func:`memckpt.keep_workers`: take the kept
        workers this job can use (one per rank on its node, one spare per node of ``nodes``,
        each of the same shape), bind them to this job, and kill the rest, which would
        otherwise hold CPUs the new workers need. Returns how many were taken."""
        pool = kept.current()
        if pool is None or not len(pool):
            return 0
        wanted = [(n, False) for n in assignment.values()]
        if self.config.failure.warm_spares:
            wanted += [(n, True) for n in nodes]
        taken = {}
        for node, spare in wanted:
            w = pool.take(node, self._shape(spare))
            if w is not None:
                taken[w] = (node, spare)
        for w in pool.drain():
            self.ray.kill(w, no_restart=True)
        bound = self.answers({w.rebind.remote(self.config, self.plane.coordinator): w
                              for w in taken}, PING_S)  # each answers with its node
        for w, (node, spare) in taken.items():
            if bound.get(w) != node:
                self.ray.kill(w, no_restart=True)  # stuck, or gone with its node
                continue
            self._adopted.setdefault((node, spare), []).append(w)
            if spare:
                self._spare_shaped.add(w)
        return sum(len(ws) for ws in self._adopted.values())

    def release(self, finished: bool) -> list[Any]:
        """The job ended. Inside :func:`memckpt.keep_workers` and ``finished``: its live
        workers that park in time are kept for the next job. Returns those to kill."""
        leftover = [w for ws in self._adopted.values() for w in ws]
        self._adopted.clear()
        pool = kept.current() if finished else None
        if pool is None:
            return self.actors() + leftover
        where = {w: self.worker_nodes[r] for r, w in self.workers.items()}
        where.update({w: n for n, w in self.spares.items()})
        parked = self.answers({w.park.remote(): w for w in where}, PARK_WAIT_S)
        kill = leftover
        for w, node in where.items():
            if parked.get(w) is True:
                pool.put(node, self._shape(w in self._spare_shaped), w)
            else:
                kill.append(w)
        return kill

    def forget(self, rank: int) -> None:
        """``rank``'s worker was killed: the next generation needs another."""
        self.workers.pop(rank, None)

    def answers(self, calls: dict[Any, Any], timeout_s: float) -> dict[Any, Any]:
        """key -> result of each call (``calls``: its ObjectRef -> a key) answered within
        ``timeout_s``; a call that raised (its actor or node is gone) or is still pending
        has no entry. Never waits longer than ``timeout_s`` for all of them together."""
        ready, _ = self.ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        out = {}
        for ref in ready:
            try:
                out[calls[ref]] = self.ray.get(ref)
            except self.ray.exceptions.RayError:
                pass
        return out

    def unresponsive(self, workers: dict[int, Any], timeout_s: float = PING_S) -> set[int]:
        """The ranks of ``workers`` whose actor is dead (Ray says so: its process or node
        is gone) or does not answer a liveness ping within ``timeout_s``. A worker answers
        on a thread of its own while it trains, so a live one answers in milliseconds."""
        alive = self.answers({w.info.remote(): r for r, w in workers.items()}, timeout_s)
        return set(workers) - set(alive)

    def keep_nodes(self, alive: list[str]) -> None:
        """Forget the workers and spares of nodes that died."""
        for rank, node in list(self.worker_nodes.items()):
            if node not in alive:
                self.workers.pop(rank, None)
        self.spares = {n: w for n, w in self.spares.items() if n in alive}

    def actors(self) -> list[Any]:
        return list(self.workers.values()) + list(self.spares.values())

    # -- warm spares ------------------------------------------------------------------------------
    def top_up_spares(self, skip: Collection[str] = ()) -> None:
        """Keep one warm worker process per live node (torch imported) to replace a dead rank.
        ``skip``: the nodes the last recovery left out as silent (frozen or cut off, though
        Ray says they live) get none, and lose the one they had: it answers nothing, and a
        prefault pending there would hold up every other node's (:meth:`prefault_spares`)."""
        if self.config.failure.warm_spares:
            for node in set(skip) & set(self.spares):
                self.ray.kill(self.spares.pop(node), no_restart=True)  # carried out if it wakes
                self._prefaults.pop(node, None)
            # a lost node's store stays listed
            self._spare_nodes = (set(self.plane.stores) & alive_node_ids()) - set(skip)
            for node in self._spare_nodes - set(self.spares):
                self.spares[node] = self._worker_for(node, spare=True)[0]

    def prefault_spares(self, committed: Optional[int]) -> None:
        """Once the job's snapshot slots exist (a second step committed), ask each spare in
        turn to prepare the memory a restore fills (:meth:`Worker.prefault`, within the
        node's ``Config.ram_budget``): one at a time, so populating gigabytes never takes
        more than one core from training. Tells the coordinator when every node's spare is
        ready: the job is in standby, a failure now meets a ready replacement."""
        if committed is None:
            return
        if self._first_commit is None:
            self._first_commit = committed
        if committed <= self._first_commit:
            return
        asked = {n: ref for n, (sp, ref) in self._prefaults.items() if self.spares.get(n) is sp}
        refs = list(asked.values())
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        todo = [n for n in self.spares if n not in asked]
        if not pending and todo:
            spare = self.spares[todo[0]]
            self._prefaults[todo[0]] = (spare, spare.prefault.remote(self._largest_shard()))
        standby = not self.config.failure.warm_spares or (
            not pending and not todo and set(self.spares) >= self._spare_nodes)
        if standby != self._standby:
            self._standby = standby
            self.plane.coordinator.set_standby.remote(standby)
            if standby:  # every prefault has returned: what each node's spare holds
                held = self._held(asked)
                self.plane.event("standby", held_bytes={n[:12]: b for n, b in held})

    def _largest_shard(self) -> Optional[tuple[int, list[list[Any]], int]]:
        """The largest shard any live node's store holds (see ReplicaStore.largest_shard):
        what a spare prepares for, wherever it is, as any rank may move to its node."""
        stores = self.plane.stores
        calls = {stores[n].largest_shard.remote(): n for n in self._spare_nodes if n in stores}
        # This runs in the control loop: a store that is restarting (or on a node about to
        # be declared dead) must not hold up failure detection; the others answer in ms.
        found = [f for f in self.answers(calls, LARGEST_SHARD_WAIT_S).values() if f is not None]
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
