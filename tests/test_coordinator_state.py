"""The coordinator's persisted state is written when membership changes, not per step, and a
restarted coordinator rebuilds the committed step from the stores' inventories (no Ray: the
real Coordinator in-process, an in-memory state store, a plain inventory function)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Optional

from memckpt.runtime.coordinator.job_state import JobState, StopRequest
from memckpt.runtime.coordinator.coordinator import (REBUILD_RETRY_S, REGISTER_DEBOUNCE_S,
                                                     Coordinator, Inventory, proven_ready)
from memckpt.runtime.coordinator.coordinator import MemoryStateStore as MemoryState
from memckpt.runtime.ray_nodes import WorkerInfo

PER_NODE = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def layout(ranks: int) -> tuple[dict[int, str], dict[int, list[str]], dict[str, str]]:
    nodes = [f"n{i}" for i in range(ranks // PER_NODE)]
    assignment = {r: nodes[r // PER_NODE] for r in range(ranks)}
    holders = {r: [nodes[(r // PER_NODE + 1) % len(nodes)]] for r in range(ranks)}
    return assignment, holders, {n: f"store-{n}" for n in nodes}


def inventory_of(assignment: dict[int, str], holders: dict[int, list[str]],
                 steps: dict[int, list[int]]) -> Inventory:
    """What the stores hold when rank r's shard of each of ``steps[r]`` is in place."""
    inv: Inventory = {n: {} for n in set(assignment.values())}
    for r, node in assignment.items():
        for n in (node, *holders[r]):
            inv[n][r] = list(steps.get(r, []))
    return inv


def start(tmp_path, state: MemoryState, ranks: int, clock: Clock, **kw) -> Coordinator:
    return Coordinator("job", str(tmp_path), ranks, state=state, clock=clock, **kw)


def fresh(tmp_path, ranks: int) -> tuple[MemoryState, Clock, Coordinator]:
    state, clock = MemoryState(), Clock()
    return state, clock, start(tmp_path, state, ranks, clock)


async def configure(c: Coordinator, ranks: int, gen: int = 0,
                    committed: Optional[int] = None) -> None:
    assignment, holders, stores = layout(ranks)
    await c.configure(gen, assignment, holders, committed, stores)


async def step(c: Coordinator, ranks: int, gen: int, s: int,
               only: Optional[range] = None) -> tuple:
    _, holders, _ = layout(ranks)
    view: tuple = ()
    for r in only if only is not None else range(ranks):
        metrics = {"stall_s": 0.001, **({"loss": 1.0 / (s + 1)} if r == 0 else {})}
        await c.report(r, gen, s, metrics)
        await c.heartbeat(r, gen, s)
        view = await c.shard_ready(r, gen, s, holders[r])
    return view


async def register_all(c: Coordinator, ranks: int, clock: Clock, every_s: float) -> None:
    for r in range(ranks):
        await c.register(r, 0, WorkerInfo(r, 100 + r, "x"))
        clock.now += every_s


def test_no_write_per_step_and_at_most_one_per_generation_start(tmp_path):
    ranks = 256
    state, clock, c = fresh(tmp_path, ranks)

    async def run() -> None:
        await configure(c, ranks)
        assert state.puts == 1  # the generation starts
        await register_all(c, ranks, clock, 0.0)
        assert state.puts == 1  # registrations within the debounce: none yet
        clock.now += REGISTER_DEBOUNCE_S
        for s in range(20):
            view = await step(c, ranks, 0, s)
            assert view[0] == s
            clock.now += 0.5
        assert state.puts == 2  # the registrations, once, from the first call found it due
        assert len(c.s.workers) == ranks
        before = state.puts
        for s in range(20, 40):
            await step(c, ranks, 0, s)
            clock.now += 5
        assert state.puts == before  # committed steps write nothing
        await configure(c, ranks, gen=1, committed=39)  # a recovery: one write
        assert state.puts == before + 1
        await c.finish()
        assert state.data is None

    asyncio.run(run())


def test_registrations_spread_out_write_at_most_once_a_second(tmp_path):
    ranks = 64
    state, clock, c = fresh(tmp_path, ranks)

    async def run() -> None:
        await configure(c, ranks)
        await register_all(c, ranks, clock, 0.1)  # 6.4 s of registrations
        assert state.puts <= 1 + 6.4 / REGISTER_DEBOUNCE_S + 1

    asyncio.run(run())


def test_restart_rebuilds_the_committed_step_from_the_stores(tmp_path):
    ranks = 64
    state, clock, c = fresh(tmp_path, ranks)
    assignment, holders, stores = layout(ranks)

    async def before_crash() -> None:
        await configure(c, ranks)
        for s in range(6):
            await step(c, ranks, 0, s)
        # step 6: half the ranks said ready before the crash
        await step(c, ranks, 0, 6, only=range(ranks // 2))
        assert await c.committed() == 5

    asyncio.run(before_crash())
    assert json_committed(state) is None  # the per-step commits were never written

    asked: list[dict[str, str]] = []

    def inventory(names, timeout_s):
        asked.append(dict(names))
        # every rank holds 4 and 5; the first half's shard of 6 is in place too
        return inventory_of(assignment, holders,
                            {r: [4, 5, 6] if r < ranks // 2 else [4, 5] for r in range(ranks)})

    c2 = start(tmp_path, state, ranks, clock, inventory=inventory)

    async def after_restart() -> None:
        assert await c2.committed() == 5
        assert asked == [stores]  # the stores by actor name, once
        assert await c2.committed() == 5
        assert len(asked) == 1
        # the second half's shard_ready for 6 commits it: the first half's came from the stores
        view = await step(c2, ranks, 0, 6, only=range(ranks // 2, ranks))
        assert view[0] == 6

    asyncio.run(after_restart())
    assert c2.s.restarts_of_coordinator == 1


def test_rebuild_never_lowers_and_silent_stores_prove_less(tmp_path):
    ranks = 16
    state, clock, c = fresh(tmp_path, ranks)
    assignment, holders, _ = layout(ranks)
    asyncio.run(configure(c, ranks, committed=7))
    full = inventory_of(assignment, holders, {r: [8, 9] for r in range(ranks)})
    silent = {n: held for n, held in full.items() if n != "n1"}  # one store did not answer
    c2 = start(tmp_path, state, ranks, clock, inventory=lambda names, t: silent)
    assert asyncio.run(c2.committed()) == 7
    c3 = start(tmp_path, state, ranks, clock,
               inventory=lambda names, t: inventory_of(assignment, holders, {}))
    assert asyncio.run(c3.committed()) == 7  # an empty inventory never lowers it

    async def broken(names, t):
        raise TimeoutError("stores gone")

    c4 = start(tmp_path, state, ranks, clock, inventory=broken)
    assert asyncio.run(c4.committed()) == 7
    c5 = start(tmp_path, state, ranks, clock, inventory=lambda names, t: full)
    assert asyncio.run(c5.committed()) == 9


def test_chaos_claim_and_stop_step_survive_a_restart(tmp_path):
    ranks = 16
    state, clock, c = fresh(tmp_path, ranks)

    async def run() -> None:
        await configure(c, ranks)
        assert await c.claim("fault-6") is True
        await c.request_stop(3, "stop")
        for s in range(5):
            await step(c, ranks, 0, s)

    asyncio.run(run())
    c2 = start(tmp_path, state, ranks, clock, inventory=lambda names, t: {})
    assert asyncio.run(c2.claim("fault-6")) is False  # fire-once across the restart
    assert asyncio.run(c2.stop_state()) == StopRequest(at=3, action="stop", step=3)


def test_a_state_an_older_version_wrote_loads_and_unknown_keys_are_dropped():
    old = json.dumps({"gen": 2, "assignment": {"0": "n"}, "holders": {"0": []},
                      "committed": 7, "ready": {"7": [0]}, "stop": {"at": 5, "action": "stop",
                                                                   "step": None}}).encode()
    s = JobState.load(old)
    assert (s.gen, s.committed, s.stop) == (2, 7, StopRequest(5, "stop"))
    assert s.fired == [] and s.fault_requests == {} and not s.standby
    assert JobState.load(s.dump()) == s


def test_workers_and_elastic_keep_their_json():
    """A saved state's workers are the plain dicts every version wrote (``memckpt kill`` reads
    them from the status): they load as WorkerInfo records and are written back the same; a
    malformed one is dropped (its rank registers again). ``elastic`` is JSON as it was."""
    saved = {"gen": 1, "workers": {"0": {"rank": 0, "pid": 11, "node_id": "n0"},
                                   "1": {"rank": 1}},
             "elastic": {"world_size": 2, "num_workers": 3, "min_workers": 2, "grow": True,
                         "last_resize": {"from": 3, "to": 2, "step": 5, "why": "node lost",
                                         "sources": {"2": ["ram:n1"]}}}}
    s = JobState.load(json.dumps(saved).encode())
    assert s.workers == {"0": WorkerInfo(0, 11, "n0")}
    assert json.loads(s.dump())["workers"] == {"0": {"rank": 0, "pid": 11, "node_id": "n0"}}
    assert json.loads(s.dump())["elastic"] == saved["elastic"]
    assert s.as_dict()["workers"]["0"]["pid"] == 11


def test_status_is_the_json_it_was(tmp_path):
    """``status()``: JobState's fields then the live ones, in the order they always came;
    ``register`` takes the typed record, ``set_elastic`` updates the keys it names."""
    from memckpt.runtime.coordinator.messages import ElasticInfo
    _, _, c = fresh(tmp_path, PER_NODE)

    async def run() -> dict:
        await configure(c, PER_NODE)
        await c.register(3, 0, WorkerInfo(3, 1234, "n0"))
        await c.set_elastic(ElasticInfo(world_size=8, num_workers=8, min_workers=4, grow=True))
        await c.set_elastic(ElasticInfo(pending_growth=8))
        return dict(await c.status())

    status = asyncio.run(run())
    assert list(status)[:17] == [f.name for f in dataclasses.fields(JobState)]
    assert list(status)[17:] == ["units", "snapshots", "node_beats", "heartbeats", "node_ram",
                                 "refused_stale"]
    assert status["workers"] == {"3": {"rank": 3, "pid": 1234, "node_id": "n0"}}
    assert status["elastic"] == {"world_size": 8, "num_workers": 8, "min_workers": 4,
                                 "grow": True, "pending_growth": 8}
    json.dumps(status)  # JSON-ready as it is


def test_proven_ready_needs_own_node_and_every_holder():
    assignment = {"0": "a", "1": "b"}
    holders = {"0": ["b"], "1": ["a"]}
    inv = {"a": {0: [3, 4], 1: [3]}, "b": {0: [3], 1: [3, 4]}}
    assert proven_ready(inv, assignment, holders) == {3: {0, 1}}


def json_committed(state: MemoryState):
    import json
    assert state.data is not None
    return json.loads(state.data)["committed"]


def test_concurrent_callers_after_a_restart_share_one_rebuild(tmp_path):
    ranks = 16
    state, clock, c = fresh(tmp_path, ranks)
    assignment, holders, _ = layout(ranks)
    asyncio.run(configure(c, ranks, committed=2))
    asked = []

    async def slow(names, t):
        asked.append(1)
        await asyncio.sleep(0.05)  # the lock is free meanwhile: a report goes through
        return inventory_of(assignment, holders, {r: [3] for r in range(ranks)})

    c2 = start(tmp_path, state, ranks, clock, inventory=slow)

    async def run() -> list:
        calls = [c2.committed() for _ in range(5)] + [c2.wait_commit(0, 3, 30.0)]
        return await asyncio.gather(*calls, c2.report(1, 0, 4, {"stall_s": 0.0}))

    got = asyncio.run(run())
    assert got[:5] == [3] * 5 and got[5][0] == 3
    assert asked == [1]


def test_a_rebuild_that_missed_a_store_is_retried_while_a_waiter_times_out(tmp_path):
    ranks = 16
    state, clock, c = fresh(tmp_path, ranks)
    assignment, holders, _ = layout(ranks)
    asyncio.run(configure(c, ranks, committed=2))
    full = inventory_of(assignment, holders, {r: [3] for r in range(ranks)})
    answers = [{n: held for n, held in full.items() if n != "n0"}, full]  # n0 silent at first
    c2 = start(tmp_path, state, ranks, clock, inventory=lambda names, t: answers.pop(0))

    async def run() -> None:
        assert (await c2.wait_commit(0, 3, 0.01))[0] == 2  # proved too little, timed out
        assert (await c2.wait_commit(0, 3, 0.01))[0] == 2  # too soon to ask again
        clock.now += REBUILD_RETRY_S
        await c2.wait_commit(0, 3, 0.01)  # times out, re-arms the rebuild
        assert (await c2.wait_commit(0, 3, 0.01))[0] == 3
        assert answers == []

    asyncio.run(run())
