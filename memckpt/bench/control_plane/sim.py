"""A job's control plane in this process: the real node-side aggregator of every node and
the real coordinator, driven by simulated ranks (no Ray, no tensors, no network).

Each :class:`SimNode` does what a node's replica store does with its ranks' calls
(:mod:`memckpt.runtime.node.uplink`): it records their reports and readiness in its
:class:`~memckpt.runtime.node.aggregator.NodeAggregator` and sends the coordinator what
that returns, awaited as the coordinator's actor loop would run it; every message's
arguments are pickled to count its bytes, as Ray would serialise them.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, TypeVar

from memckpt.runtime.coordinator.coordinator import Coordinator
from memckpt.runtime.node.aggregator import NodeAggregator

View = tuple[Optional[int], Optional[int], Optional[str]]
LATE_S = 1.0  # a rank silent this long is named in its node's heartbeat (the default's)
T = TypeVar("T")


@dataclass
class Tally:
    """What reached the coordinator: messages by method, their pickled bytes, and the CPU
    seconds spent inside its calls (exact when the calls do not wait: ``wait_s`` 0)."""

    sent: Counter = field(default_factory=Counter)
    bytes: int = 0
    cpu_s: float = 0.0

    @property
    def messages(self) -> int:
        return sum(self.sent.values())

    def count(self, method: str, *args: Any) -> None:
        self.sent[method] += 1
        self.bytes += len(pickle.dumps(args, protocol=5))

    async def timed(self, call: Awaitable[T]) -> T:
        t0 = time.process_time()
        out = await call
        self.cpu_s += time.process_time() - t0
        return out


def rank_metrics(rank: int, step: int) -> dict[str, float]:
    """A worker's per-step report as its rank sends it (memckpt.runtime.worker.context,
    counters as the increase since the last: memckpt.policy.step_metrics.increments), rank
    0's with its loss; the stall differs by rank so that min / median / max differ."""
    out = {"stall_s": 0.001 + rank * 1e-6, "replicate_s": 0.01, "committed": float(step - 1),
           "skipped": 0.0, "landed": 1.0, "requested": 1.0, "waited_s": 0.0,
           "replicated_bytes": float(1 << 20), "replica_filled_bytes": 0.0}
    if rank == 0:
        out["loss"] = 1.0 / (step + 1)
    return out


class SimNode:
    """One node's store, as far as the control plane sees it."""

    def __init__(self, node: str, ranks: list[int], holders: dict[int, list[str]],
                 coordinator: Coordinator, clock: Callable[[], float], tally: Tally) -> None:
        self.node, self.ranks, self.holders = node, ranks, holders
        self.c, self.clock, self.tally = coordinator, clock, tally
        self.agg = NodeAggregator(node)

    def join(self, gen: int) -> None:
        self.agg.join(gen, self.ranks, self.clock())
        for r in self.ranks:
            self.agg.expect(r, gen, self.holders[r])

    async def reports(self, gen: int, step: int, snapshotted: bool = True) -> None:
        """Every local rank's report of ``step``."""
        for r in self.ranks:
            out = self.agg.report(r, gen, step, rank_metrics(r, step), snapshotted,
                                  self.clock())
            if out:
                self.tally.count("node_metrics", self.node, gen, tuple(out))
                await self.tally.timed(self.c.node_metrics(self.node, gen, tuple(out)))

    def ready(self, gen: int, step: int, ranks: Optional[list[int]] = None) -> Any:
        """Local ranks' readiness of ``step``; the node's batch once all are in, else None."""
        batch = None
        for r in self.ranks if ranks is None else ranks:
            batch = self.agg.ready(r, gen, step, self.holders[r], self.clock()) or batch
        return batch

    async def send_ready(self, batch: Any, wait_s: float) -> list[View]:
        """The batch to the coordinator; its answer handed to every local rank."""
        self.tally.count("node_ready", self.node, batch, wait_s)
        view = await self.tally.timed(self.c.node_ready(self.node, batch, wait_s))
        return [view for _ in self.ranks]

    async def heartbeat(self, gen: int, step: Optional[int] = None) -> None:
        """The node's heartbeat (with ``step``: every local rank beat at it first)."""
        if step is not None:
            for r in self.ranks:
                self.agg.beat(r, gen, step, self.clock())
        hb = self.agg.heartbeat(self.clock(), LATE_S)
        if hb is not None:
            self.tally.count("node_heartbeat", self.node, hb)
            await self.tally.timed(self.c.node_heartbeat(self.node, hb))


class SimJob:
    """Every node of a job around one coordinator."""

    def __init__(self, coordinator: Coordinator, assignment: dict[int, str],
                 holders: dict[int, list[str]], clock: Callable[[], float]) -> None:
        self.c, self.clock = coordinator, clock
        self.tally = Tally()
        by_node: dict[str, list[int]] = {}
        for r in sorted(assignment):
            by_node.setdefault(assignment[r], []).append(r)
        self.nodes = {n: SimNode(n, rs, holders, coordinator, clock, self.tally)
                      for n, rs in by_node.items()}

    def join(self, gen: int) -> None:
        for n in self.nodes.values():
            n.join(gen)

    async def step(self, gen: int, step: int, wait_s: float = 0.0) -> list[View]:
        """One step, node after node: reports, readiness, each node's batch sent and
        answered at once (``wait_s`` 0: the last node's commits it). Returns the answers."""
        views: list[View] = []
        for n in self.nodes.values():
            await n.reports(gen, step)
            batch = n.ready(gen, step)
            views += await n.send_ready(batch, wait_s)
        return views

    async def step_concurrently(self, gen: int, step: int,
                                wait_s: float = 5.0) -> tuple[list[View], float]:
        """One step with every node's batch waiting at the coordinator for the commit, as
        in a job. Returns the answers and the commit latency: from the last node's batch
        (its last rank ready) until every rank holds its answer."""
        batches = []
        for n in self.nodes.values():
            await n.reports(gen, step)
            batches.append((n, n.ready(gen, step)))
        waiting = [asyncio.ensure_future(n.send_ready(b, wait_s)) for n, b in batches[:-1]]
        await asyncio.sleep(0)  # every earlier node's batch is in and waiting
        n, b = batches[-1]
        t0 = time.perf_counter()
        last = await n.send_ready(b, wait_s)
        views = [v for got in await asyncio.gather(*waiting) for v in got] + last
        return views, time.perf_counter() - t0

    async def heartbeats(self, gen: int, step: Optional[int] = None,
                         skip: tuple[str, ...] = ()) -> None:
        """Every node's heartbeat but ``skip``'s (see SimNode.heartbeat)."""
        for name, n in self.nodes.items():
            if name not in skip:
                await n.heartbeat(gen, step)
