"""The measurements of ``memckpt bench recovery`` (see :mod:`memckpt.bench.recovery`) on one
local multi-node Ray cluster: memckpt's recovery after a killed worker or a lost node, the
restart + torch.load alternative after the same failures, raw TCP transfers and memckpt's
own transfer paths between two nodes, and the step time of a training job. Each returns a
sample (a dict); :mod:`memckpt.bench.recovery.rows` turns the samples into rows."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

from memckpt.bench.foreign_load import ForeignLoad, wait_quiet
from memckpt.bench.recovery.bench_actors import ColdWorker, PathClient, RawReceiver, RawSender
from memckpt.bench.recovery.workload import RecoveryJob, StepTimedJob, layout, state_nbytes
from memckpt.engine.buffers import PeakFootprint
from memckpt.runtime.ray_nodes import on_node

WORLD_SIZE = 2
NODES = 3
CPUS_PER_NODE = 2
GPT_WARMUP_STEPS = 3  # step intervals left out of the step-time median
PATH_ROUNDS = 4  # replications per direction in the transfer-path measurement
PATH_STEADY_FROM = 3  # from this round on both of a holder's slot files exist, as in a job
PATH_JOB = "bench-transfer-path"
BUSY_THRESHOLD = 0.10  # foreign CPU share above which a figure is flagged (log and report)


def connect_driver(cluster: Any) -> None:
    """Reconnect this driver to ``cluster`` without forwarding every worker's and raylet's log
    lines: the removed nodes' death notices would bury the table."""
    import ray
    ray.shutdown()
    ray.init(address=cluster.cluster.address, namespace="memckpt", log_to_driver=False,
             logging_level="ERROR")


def _worker_nodes() -> list[str]:
    import ray
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]


class RecoveryBench:
    def __init__(self, cluster: Any, state_bytes: int, layers: int, kill_at: int, steps_after: int,
                 compute_iters: int, disk: Path, ram_root: Path, run_root: Path,
                 log: Callable[[str], None]) -> None:
        import ray
        self.ray = ray
        self.cluster, self.log = cluster, log
        self.state_bytes_target = state_bytes
        self.layers, self.kill_at, self.steps_after = layers, kill_at, steps_after
        self.compute_iters = compute_iters
        self.d, self.n = layout(state_bytes, layers)
        self.state_bytes = state_nbytes(self.d, self.n)
        self.disk, self.ram_root, self.run_root = disk, ram_root, run_root
        self.wait_quiet_s = 0.0
        self.retries = 0
        self._runs = 0

    def measure(self, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        """Run one measurement (after waiting for a quiet machine if asked) and note how much
        CPU other processes took meanwhile. A measurement that fails is run once more (a shared
        machine can run short of memory); the retry is logged and counted."""
        for attempt in range(2):
            wait_quiet(self.wait_quiet_s, self.log)
            load = ForeignLoad().start()
            try:
                out = fn(*args)
                break
            except Exception as e:  # noqa: BLE001
                if attempt:
                    raise
                self.log(f"measurement failed ({type(e).__name__}: {str(e)[:200]}); once more")
                self.retries += 1
                self.restore_nodes()
        out["foreign_cpu"] = load.stop()
        if (out["foreign_cpu"] or 0) > BUSY_THRESHOLD:
            self.log(f"  (other processes used {100 * out['foreign_cpu']:.0f}% of the CPU meanwhile)")
        return out

    # -- memckpt recovery ---------------------------------------------------------------------
    def config(self, name: str, **kw: Any):
        import memckpt
        return memckpt.Config(
            job_name=name,
            # One rank per node and 2 CPUs per rank: a node is full with its rank, so the rank
            # of a dead node must move to the spare node and pull its shard from a peer.
            workers=memckpt.WorkersConfig(num_workers=WORLD_SIZE, workers_per_node=1,
                                          cpus_per_worker=kw.pop("cpus_per_worker", CPUS_PER_NODE)),
            placement=kw.pop("placement", memckpt.PlacementConfig("ring", 1)),
            ram_root=str(self.ram_root),
            failure=memckpt.FailureConfig(max_restarts=1, collective_timeout_s=120.0,
                                          warm_spares=kw.pop("warm_spares", True)),
            **kw)

    def _cleanup(self, name: str) -> None:
        # A removed node's store never clears its shm files: free them here.
        shutil.rmtree(self.ram_root / name, ignore_errors=True)

    def _name(self, base: str) -> str:
        self._runs += 1  # a retried run gets a fresh job name
        return f"{base}-{self._runs}"

    def _kill_node(self, name: str, node: str) -> None:
        """Remove a node, and with it (in the background) its RAM: on one machine its shm
        files would otherwise hold ~4x the state until the job ends."""
        import threading
        self.cluster.remove_node(node)
        threading.Thread(target=shutil.rmtree, args=(self.ram_root / name / node,),
                         kwargs={"ignore_errors": True}, daemon=True).start()

    def restore_nodes(self) -> None:
        while len(self.cluster.nodes) < NODES:
            self.cluster.add_node()
        self.cluster.cluster.wait_for_nodes()
        deadline = time.time() + 60
        while len(_worker_nodes()) < NODES and time.time() < deadline:
            time.sleep(0.2)

    def memckpt_recovery(self, kind: str, rep: int) -> dict[str, Any]:
        import memckpt
        from memckpt.runtime.chaos.faults import FaultInjector

        name = self._name(f"bench-recovery-{kind}-{rep}")
        job = RecoveryJob(steps=self.kill_at + self.steps_after, state_bytes=self.state_bytes_target,
                          layers=self.layers, compute_iters=self.compute_iters)
        inj = FaultInjector(node_killer=lambda node: self._kill_node(name, node))
        # steady: the fault waits until every node's warm spare is ready, as in a job that
        # has trained for a while, instead of hitting spares that are still starting
        if kind == "worker":
            inj.kill_worker(rank=1, at_step=self.kill_at, steady=True)
        else:
            inj.kill_node(rank=1, at_step=self.kill_at, steady=True)
        extra: dict[str, Any] = {}
        if kind == "node-standby":  # the third node runs nothing and holds both replicas
            extra["placement"] = memckpt.PlacementConfig("ring", 1, standby_nodes=1)
        try:
            # memckpt's host RAM over the whole run (training, the fault, the recovery): the
            # job's folder under ram_root, every node's files (a removed node's until freed)
            with PeakFootprint(self.ram_root / name) as ram:
                summary = memckpt.run(job, self.config(name, **extra), run_dir=self.run_root / name,
                                      injector=inj, quiet=True)
        finally:
            self._cleanup(name)
        recs = summary["recoveries"]
        if len(recs) != 1:
            raise RuntimeError(f"{name}: expected one recovery, the runtime recorded {len(recs)}")
        rec = recs[0]
        results = summary["results"]
        ph = dict(rec["phases_s"])
        slow = max(results, key=lambda r: r["first_step_done_at"])
        started = rec["detected_at"] + (ph.get("stop") or 0) + (ph.get("plan") or 0)
        sample = {
            "total_s": slow["first_step_done_at"] - rec["fault_at"],
            "phases_s": ph, "resume_split_s": _resume_split(results, started),
            "critical_rank": max(results, key=lambda r: r["first_step"]["t_all_reduce"])["rank"],
            "rank_splits_s": {str(r["rank"]): _resume_split([r], started) for r in results},
            "sources": rec["sources"],
            **_footprint(ram, results),
            "resumed_step": rec["resumed_step"], "what": rec["what"],
            "fault_at": rec["fault_at"], "results": results,
        }
        peer = [r for r in results if (r.get("source") or "").startswith("peer:")]
        if peer:
            p = peer[0]
            sample["peer_fetch"] = {"bytes": p["fetch_bytes"], "seconds": p["fetch_s"],
                                    "src": p["source"][len("peer:"):], "dst": p["node_id"]}
        sample["replication"] = _replication_samples(results)
        # How the recovered generation got its workers: "reused" (a survivor returned in
        # time), "spare" (a warm process replaced a dead or stuck one) or "new".
        sample["workers"] = _generation_workers(self.run_root / name, rec["gen"])
        self.log(f"memckpt {kind} recovery: total {sample['total_s']:.2f} s "
                 f"(runtime: {_fmt_phases(ph)}; sources {rec['sources']}); host RAM peak "
                 f"{sample['peak_footprint_x'] or 0:.2f}x the state, {sample['peak_footprint_parts']}")
        return sample

    # -- raw transfer -------------------------------------------------------------------------
    def raw_transfer(self, src: str, dst: str, nbytes: int) -> dict[str, Any]:
        """One raw TCP transfer of ``nbytes`` from node ``src`` to node ``dst``: the limit of
        a peer fetch (the holder's store streams the shard to the restoring worker)."""
        (t,) = self.raw_tcp([(src, dst)], nbytes)
        self.log(f"raw TCP transfer {nbytes / 2**20:.0f} MiB {src[:8]} -> {dst[:8]}: {t:.2f} s")
        return {"bytes": nbytes, "total_s": t}

    def raw_transfer_2way(self, a: str, b: str, nbytes: int) -> dict[str, Any]:
        """Two raw TCP transfers at once, a -> b and b -> a: what the two ranks' replications
        do in steady state (each streams its shard to the other's node)."""
        sent = self.raw_tcp([(a, b), (b, a)], nbytes)
        self.log(f"raw TCP transfers {nbytes / 2**20:.0f} MiB both ways at once: "
                 + ", ".join(f"{t:.2f} s" for t in sent))
        return {"bytes": nbytes, "total_s": median(sent), "each": sent}

    def raw_tcp(self, pairs: list[tuple[str, str]], nbytes: int) -> list[float]:
        """Raw TCP transfers, all at once, between actors pinned to (src, dst) nodes:
        sendall of a preallocated array into recv_into a preallocated buffer, timed from
        connect to the receiver's ack; seconds per transfer."""
        ray = self.ray
        actors, runs = [], []
        try:
            for src, dst in pairs:
                sender = ray.remote(RawSender).options(
                    num_cpus=0, scheduling_strategy=on_node(src)).remote(nbytes)
                receiver = ray.remote(RawReceiver).options(
                    num_cpus=0, scheduling_strategy=on_node(dst)).remote()
                actors += [sender, receiver]
                runs.append((sender, receiver, receiver.listen.remote(nbytes)))
            ray.get([s.ready.remote() for s, _, _ in runs])
            addrs = ray.get([addr for _, _, addr in runs], timeout=600)
            recv = [r.receive_tcp.remote() for _, r, _ in runs]
            sent = ray.get([s.send_tcp.remote(addr) for (s, _, _), addr in zip(runs, addrs)],
                           timeout=600)
            ray.get(recv, timeout=600)
        finally:
            for x in actors:
                ray.kill(x, no_restart=True)
        return sent

    def transfer_paths(self, a: str, b: str, nbytes: int) -> dict[str, Any]:
        """memckpt's replication and fetch paths between nodes ``a`` and ``b`` with no job
        running, and raw TCP between the same nodes in the same call. A client per node
        streams a sealed shard into a
        :class:`~memckpt.runtime.node.replica_store.ReplicaStore` on the other node,
        both at once, :data:`PATH_ROUNDS` times (a new step each round; the store verifies
        before it acks); then ``b``'s client fetches its shard back from ``a``'s store."""
        ray = self.ray
        from memckpt.runtime.node.replica_store import ReplicaStore
        raw_2way = self.raw_tcp([(a, b), (b, a)], nbytes)
        (raw_1way,) = self.raw_tcp([(a, b)], nbytes)
        actors = []
        try:
            stores, clients = {}, {}
            for rank, node in enumerate((a, b)):
                stores[node] = ray.remote(ReplicaStore).options(
                    num_cpus=0, max_concurrency=16, scheduling_strategy=on_node(node)
                ).remote(str(self.ram_root), PATH_JOB, node)
                clients[node] = ray.remote(PathClient).options(
                    num_cpus=0, scheduling_strategy=on_node(node)).remote(nbytes, rank)
                actors += [stores[node], clients[node]]
            addr = {n: ray.get(s.address.remote(), timeout=120) for n, s in stores.items()}
            ray.get([c.ready.remote() for c in clients.values()], timeout=600)
            rounds = []
            for step in range(1, PATH_ROUNDS + 1):
                rounds.append(ray.get([clients[a].send.remote(addr[b], step),
                                       clients[b].send.remote(addr[a], step)], timeout=600))
            fetch = ray.get(clients[b].fetch.remote(addr[a], 1, PATH_ROUNDS), timeout=600)
            ray.get([s.clear.remote() for s in stores.values()], timeout=120)
        finally:
            for x in actors:
                ray.kill(x, no_restart=True)
            shutil.rmtree(self.ram_root / PATH_JOB, ignore_errors=True)
        steady = [t for r in rounds[PATH_STEADY_FROM - 1:] for t in r]
        self.log(f"transfer paths {nbytes / 2**20:.0f} MiB, nothing else running: replication "
                 f"both ways {', '.join(f'{t:.2f}' for r in rounds for t in r)} s (raw "
                 f"{', '.join(f'{t:.2f}' for t in raw_2way)} s); fetch {fetch:.2f} s (raw "
                 f"{raw_1way:.2f} s)")
        return {"bytes": nbytes, "replicate_s": steady, "first_rounds_s": rounds[:PATH_STEADY_FROM - 1],
                "raw_2way_s": raw_2way, "fetch_s": [fetch], "raw_1way_s": [raw_1way]}

    # -- the alternative ----------------------------------------------------------------------
    def restart_baseline(self, rep: int, worker: type = ColdWorker,
                         node_loss: bool = False) -> dict[str, Any]:
        """``worker``: the actor class of a rank, ColdWorker or one with its interface (the
        DCP alternative in memckpt.bench.compare.alternatives). ``node_loss``: the failure memckpt's
        node rows recover from, for this alternative too: at the fault step rank 1's whole
        node is removed, Ray must declare it dead (its health checks) before rank 1's death
        is seen, and rank 1 restarts on the third node. Its torch.save file is read from this
        machine's disk, which on a real cluster would have died with the node: the
        alternative is given the benefit of the doubt."""
        ray = self.ray
        nodes = _worker_nodes()[:WORLD_SIZE]
        cls = ray.remote(worker)

        def start(where: list[str]) -> list:
            return [cls.options(num_cpus=CPUS_PER_NODE, max_restarts=0, max_concurrency=2,
                                scheduling_strategy=on_node(node)).remote(CPUS_PER_NODE)
                    for node in where]

        paths = [str(self.disk / f"rank{r}.pt") for r in range(WORLD_SIZE)]
        marker = self.disk / f"fault-{rep}"
        marker.unlink(missing_ok=True)
        old = start(nodes)
        sizes = ray.get([w.save_checkpoint.remote(p, self.d, self.n, r)
                         for r, (w, p) in enumerate(zip(old, paths))])
        master = ray.get(old[0].address.remote())
        refs = [w.train.remote(master, r, WORLD_SIZE, self.kill_at if r == 1 else None,
                               str(marker), self.compute_iters, hold=node_loss)
                for r, w in enumerate(old)]
        if node_loss:  # rank 1 holds still at the fault step: take its node away
            deadline = time.time() + 600
            while not marker.exists() or not marker.read_text():
                if time.time() > deadline:
                    raise RuntimeError("the baseline's rank 1 never reached the fault step")
                time.sleep(0.01)
            self.cluster.remove_node(nodes[1])
        ray.wait([refs[1]], timeout=600)
        try:
            ray.get(refs[1])
            raise RuntimeError("the baseline's rank 1 returned instead of dying")
        except ray.exceptions.RayActorError:  # ActorDiedError: the SIGKILLed actor
            t_detect = time.time()
        t_fault = float(marker.read_text())
        for w in old:
            ray.kill(w, no_restart=True)
        t_killed = time.time()
        if node_loss:  # rank 1 moves to the node that is left
            spare = [n for n in _worker_nodes() if n not in nodes]
            if not spare:
                raise RuntimeError("no third node to restart the lost node's rank on")
            nodes = [nodes[0], spare[0]]
        new = start(nodes)
        master = ray.get(new[0].address.remote())
        ray.get([w.address.remote() for w in new[1:]])
        t_started = time.time()
        outs = ray.get([w.restore_and_step.remote(p, master, r, WORLD_SIZE, self.d, self.n,
                                                  self.compute_iters)
                        for r, (w, p) in enumerate(zip(new, paths))])
        t_done = time.time()
        for ref in refs:
            try:
                ray.get(ref, timeout=10)
            except Exception:  # noqa: BLE001 (the old generation's outcome is moot)
                pass
        for w in new:
            ray.kill(w, no_restart=True)
        for p in paths:
            Path(p).unlink(missing_ok=True)
        crit = max(outs, key=lambda o: o["t_all_reduce"])  # the rank the others waited for
        phases = {
            "detect": t_detect - t_fault, "stop": t_killed - t_detect,
            "start_actors": t_started - t_killed,
            "process_group": crit["process_group"], "build": crit["build"],
            "torch_load": crit["torch_load"], "compute": crit["compute"],
            "all_reduce": max(o["t_done"] for o in outs) - crit["t_all_reduce"],
            "first_step": t_done - crit["t_all_reduce"] + crit["compute"],
            "total": t_done - t_fault,
        }
        self.log(f"restart+torch.load{' after a node loss' if node_loss else ''}: total "
                 f"{phases['total']:.2f} s ({_fmt_phases(phases)})")
        return {"total_s": phases["total"], "phases_s": phases, "file_bytes": max(sizes),
                "restart_s": t_done - t_killed}

    # -- step time ----------------------------------------------------------------------------
    def step_time(self, mode: str, rep: int, size: str, steps: int) -> dict[str, Any]:
        """``mode``: "on" (snapshot + 1 replica every step), "persist" (the same plus a local
        disk tier every 10 steps), "local" (snapshot every step, no replica: what the local
        copy and seal alone cost) or "off" (no snapshots)."""
        import memckpt
        from memckpt.demo.job import GPTJob

        name = self._name(f"bench-steptime-{mode}-{rep}")
        job = StepTimedJob(GPTJob(steps=steps, size=size, seed=0))
        # No failure here: warm spares would only add start-up work.
        extra: dict[str, Any] = {}
        if mode == "local":
            extra["placement"] = memckpt.PlacementConfig("ring", 0)
        elif mode == "persist":  # what a disk tier every 10 steps costs the step
            extra["persistence"] = (memckpt.PersistTier(str(self.disk / name), every=10,
                                                        keep_last=1),)
        cfg = self.config(name, cpus_per_worker=1, warm_spares=False,
                          snapshot_every=steps + 1 if mode == "off" else 1, **extra)
        try:
            summary = memckpt.run(job, cfg, run_dir=self.run_root / name, quiet=True)
        finally:
            self._cleanup(name)
        r0 = next(r for r in summary["results"] if r["rank"] == 0)
        intervals = [dt for s, dt in r0["intervals"] if s > GPT_WARMUP_STEPS + 1]
        # ctx.step(s) ends interval s+1: the part of it spent snapshotting / waiting
        inside = [dt for s, dt in r0["inside"] if s > GPT_WARMUP_STEPS and s < steps]
        self.log(f"GPT {size} step time, snapshots {mode}: median "
                 f"{1e3 * median(intervals):.1f} ms over {len(intervals)} steps (in ctx.step "
                 f"{1e3 * median(inside):.1f} ms)")
        return {"intervals": intervals, "inside": inside, "state_bytes": r0["state_bytes"],
                "waited_s": r0["waited_s"], "replicate_s": r0["replicate_s"],
                "sent_bytes": r0["sent_bytes"], "filled_bytes": r0["filled_bytes"]}


def _resume_split(results: list[dict[str, Any]], started: float) -> dict[str, float]:
    """Where the resume went, from the recovery start (the runtime's detect + stop + plan)
    to every rank's first step done: the restore path of the rank that reached the first
    step's all-reduce last (the critical one), then the first step's all-reduce and the
    slowest first snapshot."""
    crit = max(results, key=lambda r: r["first_step"]["t_all_reduce"])
    last = max(results, key=lambda r: r["first_step_done_at"])
    fs = crit["first_step"]
    fal = crit["fetch_and_load_s"] or 0.0
    if crit.get("install_s") is not None:  # a peer restore times its install apart
        verify = crit["install_s"] - crit["slot_alloc_s"] - crit["fetch_s"]
    else:  # a local restore: what is neither loading nor fetching is verifying
        verify = fal - crit["slot_alloc_s"] - crit["fetch_s"] - crit["load_s"]
    return {
        "start": crit["t_enter"] - started,  # generation start, worker, process group
        "build": crit["t_built"] - crit["t_enter"],
        "connect": crit.get("connect_s", 0.0),  # to the holder's store (a peer restore)
        "slot_alloc": crit["slot_alloc_s"],
        "fetch": crit["fetch_s"],
        "verify": max(0.0, verify),
        "load": crit["load_s"],
        "other": max(0.0, fal - crit.get("connect_s", 0.0) - crit["slot_alloc_s"]
                     - crit["fetch_s"] - verify - crit["load_s"]),
        "resnapshot": (crit["t_restored"] - crit["t_built"]) - fal,
        "compute": fs["t_all_reduce"] - crit["t_restored"],
        "all_reduce": max(r["first_step"]["t_snapshot"] for r in results) - fs["t_all_reduce"],
        "first_snapshot": last["first_step_done_at"] - max(r["first_step"]["t_snapshot"]
                                                           for r in results),
    }


def _footprint(ram: PeakFootprint, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's host-RAM peak: bytes, against the training state, and where they were.

    The state is one copy of every rank's shard: the sum of the ranks' own slot file sizes
    (one slot each, header included), exact where the shard sizes the workload computes
    leave the header out. The peak counts allocated pages, so a file's last partial page
    makes it at most 4 KiB more per file than those sizes."""
    state = sum(r["slot_bytes"] for r in results)
    # "<node>/own/rank1" with the node's id cut short, as the log and the rows show it
    parts = {"/".join([k.split("/")[0][:8], *k.split("/")[1:]]): v
             for k, v in sorted(ram.at_peak.items())}
    return {"peak_footprint_bytes": ram.peak, "state_slot_bytes": state,
            "peak_footprint_x": ram.peak / state if state else None,
            "peak_footprint_parts": parts}


def _generation_workers(run_dir: Path, gen: int) -> dict[str, str]:
    try:
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "generation_started" and ev.get("gen") == gen:
                return {str(k): v for k, v in ev.get("workers", {}).items()}
    except (OSError, ValueError):
        pass
    return {}


def _replication_samples(results: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(bytes, seconds) of single replications a rank reported after its restore: between two
    steps its byte count grew by exactly one shard and its ``replicate_s`` changed."""
    out = []
    for r in results:
        seq = r["replication"]
        deltas = [b1 - b0 for (b0, _), (b1, _) in zip(seq, seq[1:]) if b1 > b0]
        if not deltas:
            continue
        unit = min(deltas)  # one shard to its holder(s)
        for (b0, s0), (b1, s1) in zip(seq, seq[1:]):
            if b1 - b0 == unit and s1 > 0 and s1 != s0:
                out.append((unit, s1))
    return out


def _fmt_phases(ph: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in ph.items() if isinstance(v, (int, float)))

