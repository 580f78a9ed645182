"""The real coordinator at many ranks, in this process: no Ray, no tensors.

Simulated ranks (``per_node`` a node, ring placement of :func:`plan.layout`) drive
:class:`~memckpt.runtime.coordinator.coordinator.Coordinator` directly, each call awaited
in turn as its actor's event loop would run it. After a generation starts (``configure``,
every rank's ``register``), per step every rank sends what a worker sends today: its
``report`` (the metrics of ``RankContext``'s report, rank 0's loss), a ``heartbeat`` and its
``shard_ready``. Per size: the coordinator's CPU per step (``time.process_time`` around the
calls), the messages it takes per step, the bytes written to its state store per step (an
in-memory store that counts them; in a job, Ray's GCS), the commit latency (the last
rank's ``shard_ready``, the call that commits: in-process there is no network), and from
:func:`plan.time_plan` the recovery plan after a node is lost.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from statistics import median
from typing import Any, Callable, Optional, Sequence

from memckpt.bench.control_plane.plan import layout, time_plan
from memckpt.runtime.coordinator.coordinator import (REGISTER_DEBOUNCE_S, Coordinator,
                                                     MemoryStateStore)

# (ranks, run_dir, state store, clock) -> a coordinator: the default is today's; a
# comparison may pass another (an older version, writing its state through the same store)
Factory = Callable[[int, str, MemoryStateStore, Callable[[], float]], Any]
MESSAGES_PER_RANK = 3  # report, heartbeat, shard_ready


class SimClock:
    """Wall time that the benchmark can move on (past the coordinator's debounce)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def current(ranks: int, run_dir: str, state: MemoryStateStore,
            clock: Callable[[], float]) -> Coordinator:
    return Coordinator("bench", run_dir, ranks, state=state, inventory=lambda names, t: {},
                       clock=clock)


def _metrics(rank: int, step: int) -> dict[str, float]:
    """A worker's per-step report (memckpt.runtime.worker.context)."""
    out = {"stall_s": 0.0012, "replicate_s": 0.01, "committed": float(step - 1),
           "skipped": 0.0, "landed": float(step), "requested": float(step), "waited_s": 0.0,
           "replicated_bytes": float(step << 20), "replica_filled_bytes": 0.0}
    if rank == 0:
        out["loss"] = 1.0 / (step + 1)
    return out


async def _run(c: Any, ranks: int, per_node: int, steps: int, state: MemoryStateStore,
               clock: SimClock) -> dict[str, Any]:
    job = layout(ranks, per_node)
    holders = {r: list(h) for r, h in job.holders.items()}
    stores = {n: f"memckpt-store-bench-{n}" for n in job.nodes}
    puts0, bytes0 = state.puts, state.bytes_written
    t0 = time.process_time()
    await c.configure(0, job.assignment, holders, None, stores)
    for r in job.assignment:
        await c.register(r, 0, {"rank": r, "pid": 1000 + r, "node_id": job.assignment[r]})
    clock.offset += REGISTER_DEBOUNCE_S  # a second on: the next call writes what is due
    await c.heartbeat(0, 0, 0)
    start_cpu = time.process_time() - t0
    start_puts, start_bytes = state.puts - puts0, state.bytes_written - bytes0
    ranks_now = sorted(job.assignment)
    cpu, latency, puts, written = [], [], 0, 0
    for step in range(1, steps + 2):  # step 1 warms up
        p0, b0 = state.puts, state.bytes_written
        t0 = time.process_time()
        last = 0.0
        for r in ranks_now:
            await c.report(r, 0, step, _metrics(r, step))
            await c.heartbeat(r, 0, step)
            w0 = time.perf_counter()
            view = await c.shard_ready(r, 0, step, holders[r])
            last = time.perf_counter() - w0
        spent = time.process_time() - t0
        if view[0] != step:
            raise RuntimeError(f"step {step} did not commit at {ranks} ranks: {view}")
        if step > 1:
            cpu.append(spent)
            latency.append(last)
            puts += state.puts - p0
            written += state.bytes_written - b0
    return {"ranks": ranks, "nodes": len(job.nodes), "steps": steps,
            "cpu_per_step_s": median(cpu), "cpu_per_step_min_s": min(cpu),
            "messages_per_step": MESSAGES_PER_RANK * ranks,
            "state_writes_per_step": puts / steps, "state_bytes_per_step": written / steps,
            "commit_latency_s": median(latency),
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
