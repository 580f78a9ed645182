"""The real coordinator and every node's real aggregator at many ranks, in this process: no
Ray, no tensors.

Simulated ranks (``per_node`` a node, ring placement of :func:`plan.layout`) report to
their node's :class:`~memckpt.runtime.node.aggregator.NodeAggregator`, which sends the
:class:`~memckpt.runtime.coordinator.coordinator.Coordinator` what a node's store sends
(:mod:`memckpt.bench.control_plane.sim`): per step one ``node_ready`` per node (its ranks'
readiness and step summaries) and, a step taking one heartbeat interval, one
``node_heartbeat`` per node. After a generation starts (``configure``, every rank's
``register``), per size:

- the coordinator's CPU per step (``time.process_time`` inside its calls, each answered at
  once), the node side's CPU per node per step, the messages and their pickled bytes per
  step at the coordinator, and the bytes it writes to its state store per step;
- the commit latency p50 / p99: every node's batch waits at the coordinator for the
  commit, as in a job; from the last node's batch (its last rank ready) until every rank
  holds its answer (in-process: no network);
- the detection of a frozen node: one node's store stops beating; on the coordinator's
  clock (moved on one heartbeat interval at a time, the driver checking ``liveness`` each
  time), how long until it is named (``heartbeat_timeout_s`` + at most one interval);
- from :func:`plan.time_plan`, the recovery plan after a node is lost.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from statistics import median, quantiles
from typing import Any, Callable, Optional, Sequence

from memckpt.bench.control_plane.plan import layout, time_plan
from memckpt.config import FailureConfig
from memckpt.bench.control_plane.sim import SimJob
from memckpt.runtime.coordinator.coordinator import (REGISTER_DEBOUNCE_S, Coordinator,
                                                     MemoryStateStore)

# (ranks, run_dir, state store, clock) -> a coordinator: the default is today's
Factory = Callable[[int, str, MemoryStateStore, Callable[[], float]], Any]
HEARTBEAT_TIMEOUT_S = FailureConfig().heartbeat_timeout_s  # the defaults
HEARTBEAT_INTERVAL_S = FailureConfig().heartbeat_interval_s
LATENCY_STEPS = 20


class SimClock:
    """The coordinator's and the nodes' clock: it stands still unless the benchmark moves
    it (past the coordinator's debounce; a heartbeat interval at a time)."""

    def __init__(self) -> None:
        self.start = time.time()
        self.offset = 0.0

    def __call__(self) -> float:
        return self.start + self.offset


def current(ranks: int, run_dir: str, state: MemoryStateStore,
            clock: Callable[[], float]) -> Coordinator:
    return Coordinator("bench", run_dir, ranks, state=state, inventory=lambda names, t: {},
                       clock=clock)


async def _start(c: Any, job: SimJob, assignment: dict[int, str], holders: dict[int, list[str]],
                 stores: dict[str, str], clock: SimClock) -> None:
    await c.configure(0, assignment, holders, None, stores)
    for r in assignment:
        await c.register(r, 0, {"rank": r, "pid": 1000 + r, "node_id": assignment[r]})
    job.join(0)
    clock.offset += REGISTER_DEBOUNCE_S  # a second on: the next call writes what is due
    await job.heartbeats(0, -1)


async def _detect(c: Any, job: SimJob, clock: SimClock, step: int) -> tuple[float, float]:
    """(seconds on the coordinator's clock from a node's last heartbeat until ``liveness``
    names it, CPU seconds of one ``liveness`` check)."""
    frozen = next(iter(job.nodes))
    await job.heartbeats(0, step)
    last, cpu = clock(), 0.0
    while clock() - last < 10 * HEARTBEAT_TIMEOUT_S:
        clock.offset += HEARTBEAT_INTERVAL_S
        await job.heartbeats(0, step, skip=(frozen,))
        t0 = time.process_time()
        ranks, nodes = await c.liveness(HEARTBEAT_TIMEOUT_S, HEARTBEAT_TIMEOUT_S)
        cpu = time.process_time() - t0
        if nodes:
            if nodes != [frozen] or ranks != job.nodes[frozen].ranks:
                raise RuntimeError(f"liveness named {nodes} / ranks {ranks[:8]}..., not only "
                                   f"{frozen} and its ranks")
            return clock() - last, cpu
    raise RuntimeError(f"{frozen} stopped beating and was never named")


async def _run(c: Any, ranks: int, per_node: int, steps: int, state: MemoryStateStore,
               clock: SimClock) -> dict[str, Any]:
    lay = layout(ranks, per_node)
    holders = {r: list(h) for r, h in lay.holders.items()}
    stores = {n: f"memckpt-store-bench-{n}" for n in lay.nodes}
    job = SimJob(c, lay.assignment, holders, clock)
    puts0, bytes0 = state.puts, state.bytes_written
    t0 = time.process_time()
    await _start(c, job, lay.assignment, holders, stores, clock)
    start_cpu = time.process_time() - t0
    start_puts, start_bytes = state.puts - puts0, state.bytes_written - bytes0
    cpu, node_cpu, puts, written, msgs, sent = [], [], 0, 0, 0, 0
    for step in range(1, steps + 2):  # step 1 warms up
        p0, b0, m0, s0, c0 = (state.puts, state.bytes_written, job.tally.messages,
                              job.tally.bytes, job.tally.cpu_s)
        t0 = time.process_time()
        views = await job.step(0, step)
        await job.heartbeats(0, step)
        total = time.process_time() - t0
        if any(v[0] != step for v in views[-per_node:]):
            raise RuntimeError(f"step {step} did not commit at {ranks} ranks: {views[-1]}")
        if step > 1:
            spent = job.tally.cpu_s - c0
            cpu.append(spent)
            node_cpu.append((total - spent) / len(job.nodes))
            puts += state.puts - p0
            written += state.bytes_written - b0
            msgs += job.tally.messages - m0
            sent += job.tally.bytes - s0
    latency = []
    for step in range(steps + 2, steps + 2 + LATENCY_STEPS):
        views, took = await job.step_concurrently(0, step)
        if any(v[0] is None or v[0] < step for v in views) or len(views) != ranks:
            raise RuntimeError(f"step {step}: not every rank was answered with its commit")
        latency.append(took)
    detect_s, liveness_cpu = await _detect(c, job, clock, steps + 1 + LATENCY_STEPS)
    cuts = quantiles(latency, n=100)
    return {"ranks": ranks, "nodes": len(lay.nodes), "steps": steps,
            "cpu_per_step_s": median(cpu), "cpu_per_step_min_s": min(cpu),
            "node_cpu_per_step_s": median(node_cpu),
            "messages_per_step": msgs / steps, "bytes_per_step": sent / steps,
            "state_writes_per_step": puts / steps, "state_bytes_per_step": written / steps,
            "commit_latency_s": cuts[49], "commit_latency_p99_s": cuts[98],
            "frozen_node_detect_s": detect_s, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "heartbeat_interval_s": HEARTBEAT_INTERVAL_S, "liveness_cpu_s": liveness_cpu,
            "start_cpu_s": start_cpu, "start_state_writes": start_puts,
            "start_state_bytes": start_bytes}


def measure(ranks: int, per_node: int = 8, steps: int = 5, plan: bool = True,
            factory: Optional[Factory] = None) -> dict[str, Any]:
    """One row: ``ranks`` simulated ranks for ``steps`` steps (after one warm-up step)."""
    state, clock = MemoryStateStore(), SimClock()
    with tempfile.TemporaryDirectory(prefix="memckpt-bench-cp-") as run_dir:
        c = (factory or current)(ranks, run_dir, state, clock)
        row = asyncio.run(_run(c, ranks, per_node, steps, state, clock))
    row["per_node"] = per_node
    row["plan_after_node_loss_s"] = (time_plan(ranks, "node", per_node, rack_nodes=None,
                                                 repeat=1)["total"] / 1e3
                                     if plan else None)
    return row


def measure_all(sizes: Sequence[int], per_node: int = 8, steps: int = 5, plan: bool = True,
                factory: Optional[Factory] = None,
                progress: Optional[Callable[[dict[str, Any]], None]] = None) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        rows.append(measure(n, per_node, steps, plan, factory))
        if progress is not None:
            progress(rows[-1])
    return rows
