"""The coordinator's work per step is O(nodes), counted, not timed (issue #51): with no rank
late, a step's batches, the nodes' heartbeats and the driver's polls touch no per-rank
record at the coordinator, and what a node sends it is the same size at 8 ranks a node as
at 64. A late rank costs its own record, once per heartbeat, and no other."""

from __future__ import annotations

import asyncio
import pickle
from collections import Counter
from typing import Any

from memckpt.bench.control_plane.sim import LATE_S, SimJob
from memckpt.runtime.coordinator.coordinator import Coordinator, MemoryStateStore
from memckpt.runtime.coordinator.readiness import Membership
from memckpt.runtime.ray_nodes import WorkerInfo

TIMEOUT_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counted(dict):
    """A per-rank mapping that counts the records read from it: one a lookup, every one
    of them a walk."""

    reads: Counter = Counter()

    def __init__(self, name: str, *args: Any) -> None:
        super().__init__(*args)
        self.name = name

    def _read(self, records: int = 1) -> None:
        if records:
            Counted.reads[self.name] += records

    def __getitem__(self, k: Any) -> Any:
        self._read()
        return super().__getitem__(k)

    def get(self, k: Any, default: Any = None) -> Any:
        self._read()
        return super().get(k, default)

    def __contains__(self, k: Any) -> bool:
        self._read()
        return super().__contains__(k)


def _walk(name: str) -> Any:
    def walk(self: Counted) -> Any:
        self._read(len(self))  # a walk reads every record
        return getattr(dict, name)(self)
    return walk


for _name in ("__iter__", "items", "keys", "values"):
    setattr(Counted, _name, _walk(_name))


class CountedRanks(tuple):
    """A node's ranks (a tuple) that counts the ranks read from it by a walk or a lookup."""

    def __new__(cls, name: str, ranks: Any) -> "CountedRanks":
        out = super().__new__(cls, ranks)
        out.name = name
        return out

    def __iter__(self) -> Any:
        if len(self):
            Counted.reads[self.name] += len(self)
        return super().__iter__()

    def __contains__(self, rank: Any) -> bool:
        Counted.reads[self.name] += 1
        return super().__contains__(rank)


def job(tmp_path, nodes: int, per_node: int) -> tuple[Coordinator, SimJob, Clock]:
    clock = Clock()
    ranks = nodes * per_node
    names = [f"n{i}" for i in range(nodes)]
    assignment = {r: names[r // per_node] for r in range(ranks)}
    holders = {r: [names[(r // per_node + 1) % nodes]] for r in range(ranks)}
    c = Coordinator("job", str(tmp_path), ranks, state=MemoryStateStore(), clock=clock,
                    inventory=lambda names, t: {})
    sim = SimJob(c, assignment, holders, clock)

    async def start() -> None:
        await c.configure(0, assignment, holders, None, {n: f"store-{n}" for n in names})
        for r in range(ranks):
            await c.register(r, 0, WorkerInfo(r, 1000 + r, assignment[r]))
        sim.join(0)
        clock.now += 1.0
        await sim.heartbeats(0, -1)
        await sim.step_concurrently(0, 1)  # a generation's first step
    asyncio.run(start())
    return c, sim, clock


def count_per_rank_reads(c: Coordinator) -> None:
    """Every per-rank record the coordinator keeps, wrapped to count its reads."""
    for key in ("assignment", "holders", "workers"):
        setattr(c.s, key, Counted(key, getattr(c.s, key)))
    m = c.ready.members
    node_ranks = {n: CountedRanks(f"ranks of {n}", rs) for n, rs in m.node_ranks.items()}
    c.ready.members = Membership(Counted("members.holders", m.holders), node_ranks,
                                 Counted("members.rank_node", m.rank_node), m.digest)
    c.alive.ranks = Counted("alive.ranks", c.alive.ranks)
    for node in list(c.alive.late):
        c.alive.late[node] = Counted(f"late.{node}", c.alive.late[node])
    Counted.reads.clear()


async def a_second(c: Coordinator, sim: SimJob, clock: Clock, step: int) -> None:
    """One 1 s step as production runs it: reports and readiness, every batch waiting at the
    coordinator for the commit; two heartbeats a node; the driver's progress ten times and
    liveness twice."""
    views, _ = await sim.step_concurrently(0, step)
    assert all(v[0] == step for v in views)
    for _ in range(2):
        clock.now += 0.5
        await sim.heartbeats(0, step)
        for _ in range(5):
            prog = await c.progress()
        assert prog.committed == step and prog.min_step == step
        assert await c.liveness(TIMEOUT_S, TIMEOUT_S) == ([], [])


def test_a_step_touches_no_per_rank_record_when_no_rank_is_late(tmp_path):
    c, sim, clock = job(tmp_path, nodes=16, per_node=8)
    count_per_rank_reads(c)

    async def steps() -> None:
        for step in range(2, 7):
            await a_second(c, sim, clock, step)
    asyncio.run(steps())
    assert sum(Counted.reads.values()) == 0, dict(Counted.reads)
    assert c.s.committed == 6


def test_a_late_rank_costs_its_own_record_and_no_other(tmp_path):
    c, sim, clock = job(tmp_path, nodes=16, per_node=8)

    async def go() -> None:
        node = sim.nodes["n3"]
        quiet = node.ranks[0]
        for n in sim.nodes.values():  # every rank beats but one
            for r in n.ranks:
                if r != quiet:
                    n.agg.beat(r, 0, 1, clock() + LATE_S + 0.5)
        clock.now += LATE_S + 0.5
        await sim.heartbeats(0)
        assert set(c.alive.late["n3"]) == {quiet}
        count_per_rank_reads(c)
        assert await c.liveness(TIMEOUT_S, TIMEOUT_S) == ([], [])
        assert Counted.reads == Counter({"late.n3": 1})  # the late rank's record, once
    asyncio.run(go())


def test_what_a_node_sends_is_the_same_size_at_8_and_at_64_ranks_a_node(tmp_path):
    sizes = {}
    for per_node in (8, 64):
        c, sim, clock = job(tmp_path / str(per_node), nodes=4, per_node=per_node)
        node = sim.nodes["n1"]
        for r in node.ranks:
            node.agg.report(r, 0, 2, {"stall_s": 0.001 * (1 + r % 7), "landed": 1.0}, True,
                            clock())
        batch = node.ready(0, 2)
        clock.now += 0.1
        hb = node.agg.heartbeat(clock(), LATE_S)
        sizes[per_node] = (len(pickle.dumps(batch)), len(pickle.dumps(hb)))
        assert batch.placed == {} and batch.ready == per_node and hb.late == {}
    # the stall histogram may hold a few more buckets at 64 ranks; nothing grows per rank
    (b8, h8), (b64, h64) = sizes[8], sizes[64]
    assert h8 == h64 and b64 - b8 < 200, sizes
