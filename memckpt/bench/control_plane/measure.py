"""The control plane of a job of many ranks, driven the way production drives it, on one
machine: no Ray, no tensors, no workers.

Real: the :class:`~memckpt.runtime.coordinator.coordinator.Coordinator`, in a process of
its own on an asyncio loop as its actor runs (:mod:`.transport`), every call to it pickled
and sent over an OS pipe and its reply pickled back; one
:class:`~memckpt.runtime.node.uplink.Uplink` per node (the replica store's line to the
coordinator, hosting the node's aggregator), ticked every interval as its heartbeat
thread ticks it; relay groups as a job of that many nodes has them (``control``:
``group_ready`` from each group's leader, ``node_ready`` from a node alone), held at the
coordinator until the step commits and its answer handed to every rank's
``wait_commit``; the driver's polls at their rates (``progress``
and ``pending_faults`` every :data:`~memckpt.runtime.driver.driver.POLL_S`, ``liveness``
every heartbeat interval) and the janitor's ``committed`` once a second.

Stood in for: Ray's actor RPC (gRPC, the raylet, the object store) by the pipe; the
ranks' calls to their store (a Ray call each in a job) by direct calls on its ``Uplink``
from one thread that plays every rank; each node's heartbeat thread by one
:class:`Ticker` for all (the same ticks, spread over the interval); a member's call to
its leader's store (a Ray call between stores) by a direct call; the workers themselves. Steps are paced at
``step_s`` (1 s) of wall time, every rank of every node reporting, beating and saying its
shard is placed each step.

Per size, over ``steps`` timed steps after :data:`WARMUP_STEPS`: the coordinator
process's CPU per step (and of it: inside its methods, and (de)serializing), the calls and
argument bytes it took per step by method, its state writes per step, the commit latency
(from the last node's batch going out until every node's answer is back, through the
pipe) p50 / p99, the node side's CPU per node per step (every ``Uplink`` call of its ranks
and its ticks), the achieved step time; then optionally a frozen node (one
``Uplink`` closed: its heartbeats stop) until the driver's ``liveness`` names it, in real
time; and the recovery plan's CPU after a node loss (:func:`plan.time_plan`).
"""

from __future__ import annotations

import inspect
import tempfile
import threading
import time
from statistics import median, quantiles
from typing import Any, Callable, Optional, Sequence

from memckpt.runtime.ray_nodes import WorkerInfo
from memckpt.bench.control_plane import transport
from memckpt.bench.control_plane.plan import layout, time_plan
from memckpt.bench.control_plane.sim import rank_metrics
from memckpt.config import ControlConfig, FailureConfig
from memckpt.policy.relay_groups import relay_groups

HEARTBEAT_TIMEOUT_S = FailureConfig().heartbeat_timeout_s  # the defaults
HEARTBEAT_INTERVAL_S = FailureConfig().heartbeat_interval_s
STEP_S = 1.0
WARMUP_STEPS = 2
JANITOR_POLL_S = 1.0  # memckpt.runtime.node.janitor.POLL_S
CALL_TIMEOUT_S = 60.0
DEFAULT_CONTROL = ControlConfig()  # the relays a job gets by default


def _driver_constants() -> tuple[float, float]:
    """The driver's poll interval and start-up timeout (imported when a run starts: the
    driver's module imports much more than the command line needs)."""
    from memckpt.runtime.driver.driver import POLL_S, STARTUP_TIMEOUT_S
    return POLL_S, STARTUP_TIMEOUT_S


class Driver(threading.Thread):
    """The driver's and the janitor's calls to the coordinator at their rates, each
    answer waited for (``Runtime._monitor``: ``progress`` and ``pending_faults`` each
    poll, ``liveness`` each heartbeat interval). Records when ``liveness`` first named
    ``watch`` (a node made to freeze)."""

    def __init__(self, link: transport.Link, poll_s: float, startup_s: float,
                 timeout_s: float) -> None:
        super().__init__(daemon=True, name="bench-cp-driver")
        self.link, self.poll_s, self.startup_s = link, poll_s, startup_s
        self.timeout_s = timeout_s
        self.stop = threading.Event()
        self.watch: Optional[str] = None
        self.named: Optional[tuple[float, list[int], list[str]]] = None  # (when, ranks, nodes)
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        c, get = self.link.handle, self.link.get
        checked = janitor = time.monotonic()
        try:
            while not self.stop.wait(self.poll_s):
                get(c.progress.remote(), CALL_TIMEOUT_S)
                get(c.pending_faults.remote(), CALL_TIMEOUT_S)
                now = time.monotonic()
                if now - checked > HEARTBEAT_INTERVAL_S:
                    checked = now
                    ranks, nodes = get(c.liveness.remote(
                        self.timeout_s, max(self.startup_s, self.timeout_s)), CALL_TIMEOUT_S)
                    if self.watch is not None and self.named is None and nodes:
                        self.named = (time.perf_counter(), list(ranks), list(nodes))
                if now - janitor >= JANITOR_POLL_S:
                    janitor = now
                    get(c.committed.remote(), CALL_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - reported by the run
            self.error = e


TICK_SLICES = 16  # the ticker spreads each interval's node ticks over this many slices


class Ticker(threading.Thread):
    """Every node's interval tick (``Uplink.tick``: a relay's overdue batches, the
    heartbeat if due) from one thread, the nodes spread over the interval as their own
    threads' phases would be. In a job each store ticks on its own node; here one thread
    stands in for thousands (one per node would spend the bench's CPU switching between
    them under the GIL, not in the work a node does)."""

    def __init__(self, uplinks: list[Any], interval_s: float) -> None:
        super().__init__(daemon=True, name="memckpt-node-heartbeat")
        self.uplinks, self.interval_s = uplinks, interval_s
        self.stop = threading.Event()

    def run(self) -> None:
        n = len(self.uplinks)
        gap, i = self.interval_s / TICK_SLICES, 0
        while not self.stop.wait(gap):
            start = i * n // TICK_SLICES
            for up in self.uplinks[start:(i + 1) * n // TICK_SLICES]:
                up.tick()
            i = (i + 1) % TICK_SLICES


class LeaderStore:
    """A relay group's leader store as its members call it (``relay_ready``): the leader
    ``Uplink``'s merge point in this process, its future handed back at once. In a job it is
    a Ray call from store to store (stood in for: it never reaches the coordinator)."""

    def __init__(self, leader: Any) -> None:
        self.leader = leader

    @property
    def relay_ready(self) -> "LeaderStore":
        return self

    def options(self, **_: Any) -> "LeaderStore":
        return self

    def remote(self, node: str, batch: Any, timeout_s: float) -> Any:
        return self.leader.relay.take(node, batch)


def _join(uplink: Any, rank: int, ranks: list[int], holders: list[str], handle: Any,
          timeout_s: float, relay: Optional[tuple[Sequence[str], Any]] = None) -> None:
    """``Uplink.join`` as a rank calls it (with its holders and relay group where the store
    takes them)."""
    kwargs: dict[str, Any] = {"pid": None, "timeout_s": timeout_s}
    takes = inspect.signature(uplink.join).parameters
    if "holders" in takes:
        kwargs["holders"] = holders
    if relay is not None and "relay" in takes:
        kwargs["relay"] = relay
    if not uplink.join(rank, 0, ranks, handle, HEARTBEAT_INTERVAL_S, **kwargs):
        raise RuntimeError(f"{uplink.node} refused rank {rank}'s join")


def _wait(uplink: Any, rank: int, step: int) -> Any:
    """A rank's wait for ``step``'s commit, asked again while unsettled (as
    ``memckpt.runtime.worker.node_link`` does), for at most :data:`CALL_TIMEOUT_S`."""
    from memckpt.runtime.node.uplink import COMMIT_WAIT_S
    deadline = time.monotonic() + CALL_TIMEOUT_S
    view = None
    while time.monotonic() < deadline:
        view = uplink.wait_commit(0, step, COMMIT_WAIT_S)
        if view is not None and (view[2] == "stale" or (view[0] is not None
                                                        and view[0] >= step)):
            break
    if view is None or view[0] is None or view[0] < step:
        raise RuntimeError(f"step {step}: rank {rank} on {uplink.node} was answered {view}")
    return view


class Job:
    """A job's nodes, each with its ``Uplink``, around the coordinator's process."""

    def __init__(self, link: transport.Link, ranks: int, per_node: int,
                 timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 control: ControlConfig = DEFAULT_CONTROL) -> None:
        from memckpt.runtime.node.uplink import Uplink
        lay = layout(ranks, per_node)
        self.link, self.layout, self.timeout_s = link, lay, timeout_s
        self.holders = {r: list(h) for r, h in lay.holders.items()}
        self.nodes: dict[str, list[int]] = {}
        for r in sorted(lay.assignment):
            self.nodes.setdefault(lay.assignment[r], []).append(r)
        own_thread = "beat_thread" not in inspect.signature(Uplink).parameters  # older
        ticked: dict[str, Any] = {} if own_thread else {"beat_thread": False}
        self.uplinks = {n: Uplink(n, get=link.get, sample=lambda pid: None, **ticked)
                        for n in self.nodes}
        self.ticker = None if own_thread else Ticker(list(self.uplinks.values()),
                                                     HEARTBEAT_INTERVAL_S)
        self.groups = relay_groups(list(self.nodes), control.relay_fanout,
                                   control.relay_min_nodes)
        if self.groups and not hasattr(next(iter(self.uplinks.values())), "relay"):
            self.groups = {}  # an older version (--plot-against): no relays
        self.leaders = {g.leader: LeaderStore(self.uplinks[g.leader])
                        for g in self.groups.values()}
        # the step batches the coordinator takes a step: one a group, one a node alone
        self.batches = (len(self.leaders) + sum(1 for n in self.nodes if n not in self.groups))
        self.steps_late = 0

    def start(self) -> None:
        """A generation starts: ``configure``, every rank's ``register`` (as workers send
        them, not waited on one by one), then every rank joins its store; the nodes' first
        joins spread over one heartbeat interval (nodes start at different times: their
        heartbeats do not all go at once)."""
        c, get = self.link.handle, self.link.get
        stores = {n: f"memckpt-store-bench-{n}" for n in self.nodes}
        get(c.configure.remote(0, dict(self.layout.assignment), self.holders, None, stores),
            CALL_TIMEOUT_S)
        refs = [c.register.remote(r, 0, WorkerInfo(rank=r, pid=1000 + r, node_id=n))
                for n, rs in self.nodes.items() for r in rs]
        for ref in refs:
            get(ref, CALL_TIMEOUT_S)

    def join(self) -> None:
        gap = HEARTBEAT_INTERVAL_S / len(self.nodes)
        t0 = time.monotonic()
        for i, (n, rs) in enumerate(self.nodes.items()):
            time.sleep(max(0.0, t0 + i * gap - time.monotonic()))
            group = self.groups.get(n)
            relay = (group.members, self.leaders[group.leader]) if group else None
            for r in rs:
                _join(self.uplinks[n], r, rs, self.holders[r], self.link.handle,
                      self.timeout_s, relay)
        if self.ticker is not None:
            self.ticker.start()

    def step(self, step: int) -> tuple[float, float, float]:
        """Every rank's step: report, beat, shard placed; then every rank's wait for the
        commit's answer. Returns (this thread's CPU in the ``Uplink`` calls, the commit
        latency: the last node's batch going out -> every node's answer back here, and its
        part in the coordinator's process: the last batch read -> the last answer sent)."""
        metrics = {r: rank_metrics(r, step) for rs in self.nodes.values() for r in rs}
        first = len(self.link.log)
        t0 = time.thread_time()
        for n, rs in self.nodes.items():
            up = self.uplinks[n]
            for r in rs:
                if not (up.report(r, 0, step, metrics[r], True) and up.beat(r, 0, step)
                        and up.rank_ready(r, 0, step, self.holders[r])):
                    raise RuntimeError(f"{n} does not know rank {r}")
        for n, rs in self.nodes.items():
            up = self.uplinks[n]
            for r in rs:
                _wait(up, r, step)
        cpu = time.thread_time() - t0
        batches = self.link.log[first:]
        if len(batches) < self.batches or (len(batches) > self.batches and not self.leaders):
            # a leader sends its group's batches in parts when a member comes more than its
            # wait late (this thread plays every rank in turn: on a busy machine it can)
            raise RuntimeError(f"step {step}: {len(batches)} batches for {len(self.nodes)} "
                               f"nodes in {len(self.leaders)} relay groups")
        return (cpu, max(b.got_at for b in batches) - max(b.sent_at for b in batches),
                max(b.answered_at for b in batches) - max(b.taken_at for b in batches))

    def beat_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "memckpt-node-heartbeat"]

    def close(self) -> None:
        if self.ticker is not None:
            self.ticker.stop.set()
        for up in self.uplinks.values():
            up.close()


def _p99(values: list[float]) -> float:
    return quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def _delta(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, float]:
    return {k: v - a[key].get(k, 0) for k, v in b[key].items() if v - a[key].get(k, 0)}


def _detect_frozen(job: Job, driver: Driver, limit_s: float) -> tuple[float, list[int],
                                                                       list[str]]:
    """One node's store goes silent (its ``Uplink`` closed), the other ranks keep
    beating: (seconds from its last word, a heartbeat or a batch, until ``liveness`` named
    a node, the ranks and nodes named)."""
    frozen = next(iter(job.nodes))
    driver.watch = frozen
    job.uplinks[frozen].close()
    t_end = time.monotonic() + limit_s
    while driver.named is None and driver.error is None and time.monotonic() < t_end:
        for n, rs in job.nodes.items():
            if n != frozen:
                for r in rs:
                    job.uplinks[n].beat(r, 0, -2)
        time.sleep(HEARTBEAT_INTERVAL_S / 2)
    if driver.error is not None:
        raise RuntimeError(f"the driver's polls failed: {driver.error!r}")
    if driver.named is None:
        beats = job.link.get(job.link.handle.status.remote(), CALL_TIMEOUT_S)["node_beats"]
        raise RuntimeError(f"{frozen} stopped beating and was not named in {limit_s:g} s: "
                           f"the coordinator has {beats.get(frozen)}; errors "
                           f"{job.link.stats()['last_error']!r}")
    at, ranks, nodes = driver.named
    if nodes != [frozen] or sorted(ranks) != job.nodes[frozen]:
        raise RuntimeError(f"liveness named {nodes} / ranks {ranks[:8]}..., not only {frozen} "
                           "and its ranks")
    return at - job.link.last_sent[frozen], ranks, nodes


def measure(ranks: int, per_node: int = 8, steps: int = 10, plan: bool = True,
            frozen: bool = True, step_s: float = STEP_S,
            timeout_s: float = HEARTBEAT_TIMEOUT_S,
            control: ControlConfig = DEFAULT_CONTROL) -> dict[str, Any]:
    """One row: ``ranks`` simulated ranks, ``per_node`` a node, for ``steps`` timed steps
    of ``step_s`` after :data:`WARMUP_STEPS`; ``frozen``: then time a frozen node's
    detection (``timeout_s``, the heartbeat timeout, and more); ``plan``: the recovery
    plan; ``control``: the relays (``relay_fanout=0``: every node sends its own)."""
    poll_s, startup_s = _driver_constants()
    with tempfile.TemporaryDirectory(prefix="memckpt-bench-cp-") as run_dir:
        link = transport.start(ranks, run_dir)
        job: Optional[Job] = None
        driver = Driver(link, poll_s, startup_s, timeout_s)
        try:
            job = Job(link, ranks, per_node, timeout_s, control)
            s0 = link.stats()
            job.start()
            s1 = link.stats()
            job.join()
            driver.start()
            row = _run(job, driver, steps, step_s, s0, s1)
            if frozen:
                detect_s, _, _ = _detect_frozen(job, driver, 4 * timeout_s)
                row["frozen_node_detect_s"] = detect_s
            if driver.error is not None:
                raise RuntimeError(f"the driver's polls failed: {driver.error!r}")
        finally:
            driver.stop.set()
            if job is not None:
                job.close()
            if driver.is_alive():
                driver.join(CALL_TIMEOUT_S)
            link.close()
    row.update(per_node=per_node, heartbeat_timeout_s=timeout_s,
               relay_fanout=control.relay_fanout, relay_min_nodes=control.relay_min_nodes,
               heartbeat_interval_s=HEARTBEAT_INTERVAL_S, poll_s=poll_s)
    row.setdefault("frozen_node_detect_s", None)
    row["plan_after_node_loss_s"] = (time_plan(ranks, "node", per_node, rack_nodes=None,
                                                 repeat=1)["total"] / 1e3
                                     if plan else None)
    return row


def _run(job: Job, driver: Driver, steps: int, step_s: float, s0: dict[str, Any],
         s1: dict[str, Any]) -> dict[str, Any]:
    link, n_nodes = job.link, len(job.nodes)
    t_start = time.monotonic()
    node_cpu, latency, inner, late = 0.0, [], [], 0
    total = WARMUP_STEPS + steps
    a: dict[str, Any] = {}
    for i in range(total + 1):
        due = t_start + i * step_s
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        elif i > WARMUP_STEPS:
            late += 1  # the step before took longer than step_s
        if i == WARMUP_STEPS:  # the timed window opens
            beats = job.beat_threads()
            a = dict(link.stats(), threads=sum(map(transport.thread_cpu, beats)),
                     link=transport.thread_cpu(link.reader) + transport.thread_cpu(link.writer),
                     driver=transport.thread_cpu(driver), parent=time.process_time(),
                     t=time.monotonic())
        if i == total:
            break
        cpu, took, at_coordinator = job.step(i + 1)
        if i >= WARMUP_STEPS:
            node_cpu += cpu
            latency.append(took)
            inner.append(at_coordinator)
    b = dict(link.stats(), threads=sum(map(transport.thread_cpu, beats)),
             link=transport.thread_cpu(link.reader) + transport.thread_cpu(link.writer),
             driver=transport.thread_cpu(driver), parent=time.process_time(),
                     t=time.monotonic())
    calls, sent = _delta(a, b, "calls"), _delta(a, b, "bytes_in")
    inside = _delta(a, b, "inside_s")
    wall = b["t"] - a["t"]
    return {
        "ranks": len(job.layout.assignment), "nodes": n_nodes, "steps": steps,
        "step_s": step_s, "wall_per_step_s": wall / steps, "steps_late": late,
        "cpu_per_step_s": (b["process_cpu_s"] - a["process_cpu_s"]) / steps,
        "inside_per_step_s": sum(inside.values()) / steps,
        "serial_per_step_s": (b["serial_s"] - a["serial_s"]) / steps,
        "system_per_step_s": (b["system_s"] - a["system_s"]) / steps,
        "inside_by_method_s": {k: v / steps for k, v in sorted(inside.items())},
        "messages_per_step": sum(calls.values()) / steps,
        "node_messages_per_step": sum(v for k, v in calls.items()
                                      if k.startswith("node_") or k == "group_ready") / steps,
        "relay_groups": len(job.leaders),
        "calls_by_method": {k: v / steps for k, v in sorted(calls.items())},
        "errors": b["errors"], "last_error": b["last_error"] or None,
        "bytes_per_step": sum(sent.values()) / steps,
        "bytes_by_method": {k: v / steps for k, v in sorted(sent.items())},
        "reply_bytes_per_step": (b["bytes_out"] - a["bytes_out"]) / steps,
        "state_writes_per_step": (b["state_puts"] - a["state_puts"]) / steps,
        "state_bytes_per_step": (b["state_bytes"] - a["state_bytes"]) / steps,
        "commit_latency_s": median(latency), "commit_latency_p99_s": _p99(latency),
        "commit_latency_max_s": max(latency),
        "commit_at_coordinator_s": median(inner), "commit_at_coordinator_p99_s": _p99(inner),
        "node_cpu_per_step_s": (node_cpu + b["threads"] - a["threads"]) / steps / n_nodes,
        "link_cpu_per_step_s": (b["link"] - a["link"]) / steps,
        "driver_cpu_per_step_s": (b["driver"] - a["driver"]) / steps,
        "callers_cpu_per_step_s": (b["parent"] - a["parent"]) / steps,
        "start_cpu_s": s1["process_cpu_s"] - s0["process_cpu_s"],
        "start_state_writes": a["state_puts"] - s0["state_puts"],
        "start_state_bytes": a["state_bytes"] - s0["state_bytes"],
    }


def measure_all(sizes: Sequence[int], per_node: int = 8, steps: int = 10, plan: bool = True,
                frozen: bool = True,
                progress: Optional[Callable[[dict[str, Any]], None]] = None,
                shapes: Sequence[tuple[int, int]] = (),
                step_s: float = STEP_S,
                control: ControlConfig = DEFAULT_CONTROL) -> list[dict[str, Any]]:
    """A row per size of ``sizes`` (``per_node`` a node), then per (ranks, per node) of
    ``shapes``."""
    rows = []
    for n, k in [*((n, per_node) for n in sizes), *shapes]:
        rows.append(measure(n, k, steps, plan, frozen, step_s, control=control))
        if progress is not None:
            progress(rows[-1])
    return rows
