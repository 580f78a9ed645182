"""A node's store line to the coordinator (memckpt.runtime.node.uplink), without Ray: the real
Uplink with its ranks as threads, the real Coordinator in an event loop on its own thread,
called as Ray calls an actor (``handle.method.remote(...)`` -> a reference, resolved by the
Uplink's ``get``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from memckpt.runtime.coordinator.coordinator import Coordinator, MemoryStateStore
from memckpt.runtime.node import uplink as uplink_module
from memckpt.runtime.node.uplink import Uplink

NODES = {"a": [0, 1, 2], "b": [3, 4, 5]}
HOLDERS = {r: ["b" if r < 3 else "a"] for r in range(6)}


class LoopHandle:
    """``coordinator`` run on ``loop``: ``handle.method.remote(*args)`` is a future."""

    def __init__(self, coordinator: Coordinator, loop: asyncio.AbstractEventLoop) -> None:
        self.c, self.loop = coordinator, loop

    def __getattr__(self, name: str) -> Any:
        c, loop = self.c, self.loop

        class Method:
            @staticmethod
            def remote(*args: Any) -> concurrent.futures.Future:
                return asyncio.run_coroutine_threadsafe(getattr(c, name)(*args), loop)
        return Method

    def call(self, name: str, *args: Any) -> Any:
        return getattr(self, name).remote(*args).result(10)


def get(ref: concurrent.futures.Future, timeout_s: float) -> Any:
    return ref.result(timeout_s)


@contextlib.contextmanager
def running_coordinator(run_dir: Path, nodes: dict[str, list[int]],
                        holders: dict[int, list[str]], links: list[Uplink]
                        ) -> Iterator[LoopHandle]:
    """A coordinator of generation 0 (``nodes``' ranks, ``holders``) on a loop of its own;
    ``links``' heartbeat threads end before the loop their calls run on."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    c = Coordinator("job", str(run_dir), sum(map(len, nodes.values())),
                    state=MemoryStateStore(), inventory=lambda names, t: {})
    handle = LoopHandle(c, loop)
    assignment = {r: n for n, rs in nodes.items() for r in rs}
    handle.call("configure", 0, assignment, holders, None, {n: n for n in nodes})
    try:
        yield handle
    finally:
        while links:
            links.pop().close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.fixture
def coordinator(tmp_path) -> Iterator[LoopHandle]:
    with running_coordinator(tmp_path, NODES, HOLDERS, OPEN) as handle:
        yield handle


OPEN: list[Uplink] = []


@pytest.fixture(autouse=True)
def _close_uplinks() -> Iterator[None]:
    yield
    while OPEN:  # their heartbeat threads end
        OPEN.pop().close()


def links(handle: LoopHandle, gen: int = 0, vouch: bool = True) -> dict[str, Uplink]:
    """Every node's uplink, its ranks joined (``vouch``: each with its spec's holders, so
    the store judges them and its batch names none; else the coordinator judges each)."""
    out = {n: Uplink(n, get=get) for n in NODES}
    for n, up in out.items():
        for r in NODES[n]:
            assert up.join(r, gen, NODES[n], handle, interval_s=60.0,
                           holders=HOLDERS[r] if vouch else None)
    OPEN.extend(out.values())
    return out


def rank(up: Uplink, r: int, gen: int, step: int) -> Any:
    """What a rank's NodeLink does: readiness, then wait for the answer."""
    assert up.rank_ready(r, gen, step, HOLDERS[r])
    for _ in range(50):
        view = up.wait_commit(gen, step, 1.0)
        if view is not None and (view[2] == "stale" or (view[0] or -1) >= step):
            return view
    raise AssertionError(f"rank {r} got no answer for step {step}")


def run_ranks(ups: dict[str, Uplink], gen: int, step: int) -> dict[int, Any]:
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = {r: pool.submit(rank, ups[n], r, gen, step) for n, rs in NODES.items() for r in rs}
        return {r: f.result(30) for r, f in futs.items()}


def test_every_rank_gets_the_commit_through_its_store_one_batch_per_node(coordinator):
    ups = links(coordinator)
    for step in (1, 2):
        views = run_ranks(ups, 0, step)
        assert all(v[0] == step for v in views.values()), views
    assert coordinator.c.received["node_ready"] == 4  # 2 nodes x 2 steps


def test_ranks_joined_without_their_holders_are_judged_by_the_coordinator(coordinator):
    ups = links(coordinator, vouch=False)
    views = run_ranks(ups, 0, 1)
    assert all(v[0] == 1 for v in views.values()), views


def test_a_rank_placed_short_of_its_holders_holds_the_step_back(coordinator, monkeypatch):
    """Node a's rank 0 says it placed step 1 nowhere: its store names it, the coordinator
    judges it short, and the step does not commit."""
    monkeypatch.setattr(uplink_module, "COMMIT_WAIT_S", 0.2)
    ups = links(coordinator)
    ups["a"].rank_ready(0, 0, 1, [])
    for r in (1, 2):
        ups["a"].rank_ready(r, 0, 1, HOLDERS[r])
    for r in NODES["b"]:
        ups["b"].rank_ready(r, 0, 1, HOLDERS[r])
    assert ups["b"].wait_commit(0, 1, 1.0) == (None, None, None)
    assert coordinator.c.s.committed is None


def test_a_coordinator_wait_that_runs_out_is_asked_again_once_for_the_step(coordinator,
                                                                           monkeypatch):
    monkeypatch.setattr(uplink_module, "COMMIT_WAIT_S", 0.05)
    ups = links(coordinator)
    done = threading.Event()
    answers: list = []

    def node_a() -> None:
        answers.extend(rank(ups["a"], r, 0, 1) for r in (0, 1))
        done.set()
    for r in (0, 1, 2):
        assert ups["a"].rank_ready(r, 0, 1, HOLDERS[r])
    # node a's batch is in; its wait at the coordinator runs out: the rank asks again
    assert ups["a"].wait_commit(0, 1, 1.0)[0] is None
    t = threading.Thread(target=node_a)
    t.start()
    run_ranks({"a": ups["a"], "b": ups["b"]}, 0, 1)
    t.join(30)
    assert done.is_set() and all(v[0] == 1 for v in answers)


def test_a_fenced_generation_refuses_and_its_waiters_go(coordinator):
    ups = links(coordinator)
    up = ups["a"]
    waiter = concurrent.futures.ThreadPoolExecutor(1).submit(up.wait_commit, 0, 1, 30.0)
    up.fence(1)  # the driver's set_generation: generation 0 is over on this node
    assert waiter.result(10) == (None, None, "stale")
    assert not up.rank_ready(0, 0, 1, HOLDERS[0])
    assert not up.join(0, 0, NODES["a"], coordinator, 60.0)
    assert not up.beat(0, 0, 3) and not up.report(0, 0, 1, {"stall_s": 0.1}, True)
    assert not up.heartbeat_once()  # nothing of generation 0 is sent any more


def test_a_thawed_nodes_batch_is_answered_stale_and_commits_nothing(coordinator):
    ups = links(coordinator, gen=0)  # the node froze in generation 0 ...
    assignment = {r: n for n, rs in NODES.items() for r in rs}
    coordinator.call("configure", 1, assignment, HOLDERS, None, {n: n for n in NODES})
    for r in (0, 1, 2):  # ... and thawed in 1
        assert ups["a"].rank_ready(r, 0, 1, HOLDERS[r])
    assert ups["a"].wait_commit(0, 1, 5.0) == (None, None, "stale")
    assert coordinator.c.s.committed is None and coordinator.c.received["node_ready"] == 0


def timed_link(handle: LoopHandle, now: list[float], interval_s: float) -> Uplink:
    """Node a's uplink on the clock ``now[0]``, its ranks joined with their holders (the
    job's heartbeat timeout 4 s: a rank is late after min(2 intervals, 2 s))."""
    up = Uplink("a", clock=lambda: now[0], get=get, sample=lambda pid: None)
    OPEN.append(up)
    for r in NODES["a"]:
        assert up.join(r, 0, NODES["a"], handle, interval_s=interval_s, timeout_s=4.0,
                       holders=HOLDERS[r])
    return up


def test_the_heartbeat_names_only_late_ranks_and_the_store_keeps_every_age(coordinator):
    now = [100.0]
    up = timed_link(coordinator, now, interval_s=60.0)
    for r in NODES["a"]:
        up.beat(r, 0, 7)
    assert up.heartbeat_once()
    status = coordinator.call("status")
    assert status["node_beats"]["a"]["step"] == 7 and status["heartbeats"] == {}
    now[0] += 3.0  # rank 1 goes quiet past late_s (timeout / 2 here); the others beat
    for r in (0, 2):
        up.beat(r, 0, 8)
    assert up.heartbeat_once()
    beats = coordinator.call("status")["heartbeats"]
    assert beats.keys() == {"1"} and beats["1"]["step"] == 7
    assert coordinator.call("liveness", 4.0, 4.0) == ([], [])  # late, not yet hung
    assert up.detail() == {0: (0.0, 8), 1: (3.0, 7), 2: (0.0, 8)}  # every rank, on the node
    now[0] += 2.0
    for r in (0, 2):
        up.beat(r, 0, 9)
    assert up.heartbeat_once()
    assert coordinator.call("liveness", 4.0, 4.0) == ([1], [])


def test_a_flush_delivers_what_the_store_holds_before_a_rank_returns(coordinator):
    """Every rank of node a snapshotted step 2, so the step's summary (rank 0's loss) waits
    in the store for the node's batch; a rank whose run ended flushes it to the coordinator
    (the driver reads the losses next), and a fenced generation flushes nothing."""
    ups = links(coordinator)
    for step in (1, 2):  # a generation's first step goes at once; the next is held
        for r in (0, 1, 2):
            m = {"stall_s": 0.01 * (r + 1), **({"loss": 2.5 + step} if r == 0 else {})}
            assert ups["a"].report(r, 0, step, m, True)
    losses = coordinator.call("all_losses")
    assert losses.get("1") == 3.5 and "2" not in losses  # held for a batch that never came
    assert ups["a"].flush(0, 5.0)
    assert coordinator.call("all_losses")["2"] == 4.5
    ups["b"].fence(1)
    assert not ups["b"].flush(0, 5.0)


def test_a_thawed_node_beats_once_then_fences_its_generation_off_itself(coordinator):
    """A node frozen through the recovery wakes in generation 0: its first heartbeat is
    refused, and the store, seeing that answer at its next tick, stops beating for the
    generation and refuses its old ranks' calls; a store of the new generation beats on."""
    ups = links(coordinator, gen=0)
    assignment = {r: n for n, rs in NODES.items() for r in rs}
    coordinator.call("configure", 1, assignment, HOLDERS, None, {n: n for n in NODES})
    for r in NODES["b"]:  # node b's ranks joined the new generation
        assert ups["b"].join(r, 1, NODES["b"], coordinator, 60.0)
    thawed = ups["a"]
    assert thawed.heartbeat_once() and ups["b"].heartbeat_once()
    assert coordinator.call("status")["refused_stale"] == 1  # answered (same loop, in order)
    assert not thawed.heartbeat_once()  # the refusal seen: fenced, nothing sent
    assert not thawed.heartbeat_once()
    assert not thawed.rank_ready(0, 0, 3, HOLDERS[0]) and not thawed.report(
        0, 0, 3, {"stall_s": 0.1}, True)
    assert ups["b"].heartbeat_once() and ups["b"].heartbeat_once()
    assert coordinator.call("status")["refused_stale"] == 1  # (after node b's beats)
    assert coordinator.c.received["node_heartbeat"] == 3  # node b's, all taken
    # the fence is the generation's, not the store's: a rank of the new one joins and beats
    assert thawed.join(0, 1, NODES["a"], coordinator, 60.0) and thawed.heartbeat_once()
    coordinator.call("status")
    assert thawed.heartbeat_once()
    coordinator.call("status")
    assert coordinator.c.received["node_heartbeat"] == 5


@pytest.mark.parametrize("how", ["held", "fenced", "late", "partial"])
def test_a_stores_held_losses_of_an_ended_generation_reach_the_coordinator_for_the_resume(
        coordinator, how):
    """Step 2's summary waits in node a's store for the node's batch when the failure ends
    generation 0. Its ranks joining generation 1 send it on, tagged with generation 0: the
    coordinator takes nothing of an ended generation but keeps the loss, and takes it once
    generation 1 resumed from a step at or after 2. ``fenced``: the driver fenced generation
    0 on the store as the recovery started, and its heartbeat thread ticked on until the
    ranks joined (seconds: they restore first): those ticks send nothing and keep it.
    ``late``: rank 0's report of step 2 reached the store only after the fence (a report is
    fire and forget; a busy store takes it late): refused, its loss still goes on.
    ``partial``: rank 2 never reported step 2: rank 0's loss goes on from what the node has."""
    ups = links(coordinator)
    for step in (1, 2):
        for r in (0, 1, 2):
            if step == 2 and (how == "late" and r == 0 or how == "partial" and r == 2):
                continue
            m = {"stall_s": 0.01, **({"loss": 2.5 + step} if r == 0 else {})}
            assert ups["a"].report(r, 0, step, m, True)
    if how in ("fenced", "late"):
        ups["a"].fence(1)  # before the coordinator starts generation 1 (the driver's order)
        for _ in range(3):
            assert not ups["a"].heartbeat_once()
    if how == "late":
        assert not ups["a"].report(0, 0, 2, {"stall_s": 0.01, "loss": 4.5}, True)
    assignment = {r: n for n, rs in NODES.items() for r in rs}
    coordinator.call("configure", 1, assignment, HOLDERS, 1, {n: n for n in NODES})
    for r in NODES["a"]:
        assert ups["a"].join(r, 1, NODES["a"], coordinator, 60.0)
    # not a stale node speaking: nothing refused or logged, nothing taken yet
    assert coordinator.call("status")["refused_stale"] == 0
    assert "2" not in coordinator.call("all_losses")
    assert coordinator.call("restored_loss", 1, 3, 5.5)  # the recovery resumed from step 3
    assert coordinator.call("all_losses") == {"1": 3.5, "2": 4.5, "3": 5.5}


def test_a_batch_stands_in_for_the_heartbeat_that_would_say_nothing_more(coordinator):
    """A node that sent its step's batch within its quiet time (a quarter of the timeout,
    1 s here) skips the heartbeat (one message a step, not three), and the coordinator
    counts the batch as its sign of life; a late rank, or that long with nothing sent,
    brings the heartbeat back."""
    now = [100.0]
    up = timed_link(coordinator, now, interval_s=0.5)
    assert up.heartbeat_once()  # nothing sent yet: it beats
    coordinator.call("status")  # (taken: one loop, in order)
    beat_at = coordinator.c.alive.node_beats["a"][0]
    for step in range(1, 10):
        now[0] += 0.9
        for r in NODES["a"]:
            up.beat(r, 0, step)
            assert up.rank_ready(r, 0, step, HOLDERS[r])
        assert not up.heartbeat_once()  # the batch just went: nothing more to say
    coordinator.call("status")  # every call before it was taken (one loop, in order)
    assert coordinator.c.received["node_heartbeat"] == 1
    assert coordinator.c.received["node_ready"] == 9
    assert coordinator.c.alive.node_beats["a"][0] > beat_at  # the batches kept it alive
    assert up.quiet_s == 1.0
    now[0] += 0.9  # not quite quiet long enough
    assert not up.heartbeat_once()
    now[0] += 0.1
    assert up.heartbeat_once()
    now[0] += 2.1
    for r in (0, 2):  # rank 1 went quiet: its store names it although a batch goes
        up.beat(r, 0, 10)
        up.rank_ready(r, 0, 10, HOLDERS[r])
    assert up.heartbeat_once()
    assert coordinator.call("status")["heartbeats"].keys() == {"1"}
