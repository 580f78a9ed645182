"""Node-level aggregation (no Ray): every node's real aggregator and the real coordinator in
this process. Per step the coordinator takes one message per node, writes no state,
ignores an older generation, names a node that stopped beating, and sums the ranks' step
metrics into one line per step."""

from __future__ import annotations

import asyncio
import json

import pytest

from memckpt.bench.control_plane.sim import SimJob, rank_metrics
from memckpt.policy.failure import Action, Observation, decide
from memckpt.policy.step_metrics import (StallTally, Stalls, StepSummary, increments, summarize,
                                         without_counters)
from memckpt.runtime.coordinator.coordinator import STALE, Coordinator, MemoryStateStore
from memckpt.runtime.coordinator.messages import Heartbeat, ReadyBatch
from memckpt.runtime.coordinator.metrics import failure_target
from memckpt.runtime.coordinator.readiness import PlacementMismatch
from memckpt.policy.placement import holders_digest
from memckpt.runtime.node.aggregator import NodeAggregator

RANKS, PER_NODE = 64, 8
TIMEOUT_S, INTERVAL_S = 5.0, 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def layout(ranks: int = RANKS) -> tuple[dict[int, str], dict[int, list[str]], dict[str, str]]:
    nodes = [f"n{i}" for i in range(ranks // PER_NODE)]
    assignment = {r: nodes[r // PER_NODE] for r in range(ranks)}
    holders = {r: [nodes[(r // PER_NODE + 1) % len(nodes)]] for r in range(ranks)}
    return assignment, holders, {n: f"store-{n}" for n in nodes}


def job(tmp_path, gen: int = 0) -> tuple[Coordinator, SimJob, MemoryStateStore, Clock]:
    state, clock = MemoryStateStore(), Clock()
    c = Coordinator("job", str(tmp_path), RANKS, state=state, clock=clock,
                    inventory=lambda names, t: {})
    assignment, holders, stores = layout()
    asyncio.run(c.configure(gen, assignment, holders, None, stores))
    sim = SimJob(c, assignment, holders, clock)
    sim.join(gen)
    return c, sim, state, clock


# -- the aggregator alone ------------------------------------------------------------------
def test_one_batch_once_every_local_rank_is_ready():
    agg = NodeAggregator("n0")
    assert agg.join(3, [4, 5, 6], now=0.0)
    for r, holders in ((4, ["n1"]), (5, ["n1"]), (6, ["n2"])):
        agg.expect(r, 3, holders)
    assert agg.ready(4, 3, 10, ["n1"], 0.0) is None
    assert agg.ready(5, 3, 10, ["n1"], 0.0) is None
    assert agg.ready(9, 3, 10, ["n1"], 0.0) is None  # not a rank of this node
    batch = agg.ready(6, 3, 10, ["n2"], 0.0)
    assert batch is not None and (batch.gen, batch.step) == (3, 10)
    # every rank placed where its spec says: a count and a digest, no rank named
    assert batch.ready == 3 and batch.placed == {}
    assert batch.expected == holders_digest({4: ["n1"], 5: ["n1"], 6: ["n2"]})
    assert agg.ready(6, 3, 10, ["n2"], 0.0) is None  # said again (a retry): sent once


def test_a_batch_names_only_the_ranks_placed_short_or_never_vouched_for():
    agg = NodeAggregator("n0")
    agg.join(0, [0, 1, 2], now=0.0)
    agg.expect(0, 0, ["n1", "n2"])
    agg.expect(1, 0, ["n1"])  # rank 2 joined without its holders (an older worker)
    agg.ready(0, 0, 1, ["n1"], 0.0)  # short of n2
    agg.ready(1, 0, 1, ["n1", "n3"], 0.0)  # more than asked is fine
    batch = agg.ready(2, 0, 1, ["n1"], 0.0)
    assert batch is not None and batch.ready == 1
    assert batch.placed == {0: ("n1",), 2: ("n1",)}
    assert batch.expected == holders_digest({1: ["n1"]})


def test_a_heartbeat_names_only_the_late_ranks_and_the_node_keeps_every_age():
    agg = NodeAggregator("n0")
    agg.join(0, list(range(8)), now=0.0)
    for r in range(8):
        agg.beat(r, 0, 5 if r != 3 else 4, now=10.0 if r != 3 else 7.0)
    hb = agg.heartbeat(now=10.5, late_s=1.0)
    assert hb is not None and hb.top == 5 and hb.oldest_s == 3.5
    assert hb.late == {3: (3.5, 4)}  # the one rank silent past late_s, alone
    assert agg.detail(10.5)[3] == (3.5, 4) and agg.detail(10.5)[0] == (0.5, 5)


def test_an_older_generation_changes_nothing_on_the_node():
    agg = NodeAggregator("n0")
    agg.join(2, [0, 1], now=0.0)
    assert not agg.join(1, [0, 1], now=0.0)
    assert agg.ready(0, 1, 5, [], 0.0) is None and agg.ready(1, 1, 5, [], 0.0) is None
    assert agg.report(0, 1, 5, {"stall_s": 0.1}, True, 0.0) == []
    agg.beat(0, 1, 99, 1.0)
    hb = agg.heartbeat(now=2.0, late_s=1.0)
    assert hb is not None and hb.gen == 2 and hb.top == -1
    assert hb.late == {0: (2.0, -1), 1: (2.0, -1)}


def test_metrics_ride_on_the_batch_except_a_generations_first_step_and_unsnapshotted_ones():
    agg = NodeAggregator("n0")
    agg.join(0, [0, 1], now=0.0)
    # the first step goes at once (the driver times a recovery's resume by it)
    assert agg.report(0, 0, 1, {"stall_s": 0.1, "loss": 2.0}, True, 0.0) == []
    (first,) = agg.report(1, 0, 1, {"stall_s": 0.3}, True, 0.0)
    assert first.step == 1 and first.loss == 2.0 and first.has_rank0 and first.ranks == 2
    assert (first.stalls.n, first.stalls.lo, first.stalls.hi) == (2, 0.1, 0.3)
    # a snapshotted step: held for its batch
    for r in (0, 1):
        assert agg.report(r, 0, 2, {"stall_s": 0.2}, True, 0.0) == []
    agg.ready(0, 0, 2, [], 0.0)
    batch = agg.ready(1, 0, 2, [], 0.0)
    assert batch is not None and [m.step for m in batch.metrics] == [2]
    # a step no rank snapshotted: at once
    assert agg.report(0, 0, 3, {"stall_s": 0.0}, False, 0.0) == []
    assert [m.step for m in agg.report(1, 0, 3, {"stall_s": 0.0}, False, 0.0)] == [3]
    # one rank skipped its snapshot: the batch never completes; the heartbeat takes them
    assert agg.report(0, 0, 4, {"stall_s": 0.0}, True, 0.0) == []
    assert agg.report(1, 0, 4, {"stall_s": 0.0}, True, 0.0) == []
    hb = agg.heartbeat(now=1.0, late_s=1.0)
    assert hb is not None and [m.step for m in hb.metrics] == [4]
    assert hb.top == 4 and hb.late == {}


def test_a_rank_sends_increases_and_a_summary_sums_them():
    last: dict = {}
    assert increments({"stall_s": 0.1, "landed": 3.0, "replicated_bytes": 100.0}, last) == \
        {"stall_s": 0.1, "landed": 3.0, "replicated_bytes": 100.0}
    assert increments({"landed": 5.0, "replicated_bytes": 300.0}, last) == \
        {"landed": 2.0, "replicated_bytes": 200.0}
    assert increments({"landed": 1.0}, last) == {"landed": 1.0}  # a worker counting from 0
    one = summarize(1, {0: {"stall_s": 0.1, "landed": 1.0, "replicated_bytes": 100.0},
                        1: {"stall_s": 0.2, "landed": 3.0}})
    assert one.counter("landed") == 4.0 and one.counter("replicated_bytes") == 100.0
    assert "skipped" not in dict(one.counters) and one.loss is None


def test_a_store_restarted_mid_generation_counts_no_rank_twice():
    """The rank's increases, not its totals, reach the store: a new aggregator (the store
    restarted) adds only what is new, and reports sent again add nothing."""
    last: dict = {}
    sent = [increments({"stall_s": 0.1, "landed": float(s)}, last) for s in (1, 2, 3)]
    old = NodeAggregator("n0")
    assert old.join(0, [0], 0.0)
    counted = sum(m.counter("landed") for s, rep in enumerate(sent[:2], 1)
                  for m in old.report(0, 0, s, rep, False, 0.0))
    new = NodeAggregator("n0")  # the store restarted; step 2 was not committed: sent again
    assert new.join(0, [0], 0.0)
    again = new.report(0, 0, 2, without_counters(sent[1]), False, 0.0)
    fresh = new.report(0, 0, 3, sent[2], False, 0.0)
    counted += sum(m.counter("landed") for m in again + fresh)
    assert counted == 3.0  # three snapshots landed, each counted once


def test_stalls_merge_node_by_node_into_the_jobs_min_median_and_max():
    values = [0.001 * (1 + i / 100) for i in range(1000)] + [0.0, 5.0]
    tally = StallTally()
    for i in range(0, len(values), 8):  # node by node, 8 ranks each
        tally.add(Stalls.of(values[i:i + 8]))
    stats = tally.stats()
    ordered = sorted(values)
    true_median = (ordered[500] + ordered[501]) / 2
    assert stats["min"] == 0.0 and stats["max"] == 5.0  # exact
    assert stats["median"] == pytest.approx(true_median, rel=0.025)  # a bucket's width
    one, two = StallTally(), StallTally()
    one.add(Stalls.of([0.3]))
    two.add(Stalls.of([0.1, 0.4]))
    assert one.stats() == {"min": 0.3, "median": 0.3, "max": 0.3}
    assert two.stats()["median"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="no rank"):
        StallTally().stats()


# -- the coordinator, driven by every node --------------------------------------------------
def test_one_message_per_node_per_committed_step_and_no_state_write(tmp_path):
    c, sim, state, clock = job(tmp_path)
    nodes = RANKS // PER_NODE
    written = state.puts

    async def steps() -> None:
        for step in range(1, 6):
            before = sum(c.received.values())
            views, _ = await sim.step_concurrently(0, step)  # each batch waits for the commit
            assert c.s.committed == step and all(v[0] == step for v in views)
            assert len(views) == RANKS  # every rank has its answer
            got = sum(c.received.values()) - before
            # a generation's first step: its metrics go at once, then its batch
            assert got == (2 * nodes if step == 1 else nodes), (step, dict(c.received))

    asyncio.run(steps())
    assert c.received["node_ready"] == 5 * nodes == sim.tally.sent["node_ready"]
    assert state.puts == written  # no write per step; configure wrote once
    assert asyncio.run(c.committed()) == 5


def test_the_state_is_written_once_per_membership_change(tmp_path):
    c, sim, state, clock = job(tmp_path)
    assert state.puts == 1  # configure
    asyncio.run(sim.step(0, 1))
    asyncio.run(sim.heartbeats(0, 1))
    assert state.puts == 1
    assignment, holders, stores = layout()
    asyncio.run(c.configure(1, assignment, holders, 1, stores))  # a recovery
    assert state.puts == 2


def test_a_commit_waits_for_every_node_and_answers_them_all(tmp_path):
    c, sim, _, _ = job(tmp_path)
    views, latency = asyncio.run(sim.step_concurrently(0, 1, wait_s=5.0))
    assert len(views) == RANKS and all(v[0] == 1 for v in views) and latency >= 0


def test_a_batch_from_an_older_generation_changes_nothing(tmp_path):
    c, sim, state, clock = job(tmp_path, gen=0)
    asyncio.run(sim.step(0, 1))
    assignment, holders, stores = layout()
    asyncio.run(c.configure(1, assignment, holders, 1, stores))  # the driver recovered
    received, puts = dict(c.received), state.puts
    steps_file = tmp_path / "steps.jsonl"
    lines = steps_file.read_text()
    # the thawed node's store still sends generation 0's batches, metrics and heartbeats
    node = next(iter(sim.nodes.values()))
    for r in node.ranks:
        node.agg.report(r, 0, 2, {"stall_s": 0.1}, True, clock())
    batch = node.ready(0, 2)
    view = asyncio.run(c.node_ready(node.node, batch, 1.0))
    assert view == STALE
    asyncio.run(c.node_metrics(node.node, 0, (StepSummary(2, 8, Stalls.of([9.0])),)))
    asyncio.run(node.heartbeat(0, 2))
    assert asyncio.run(c.wait_commit(0, 2, 0.01)) == STALE
    assert asyncio.run(c.shard_ready(0, 0, 2, holders[0])) == STALE
    assert c.s.committed == 1 and c.ready.in_flight() == [] and c.alive.node_beats == {}
    # refused, counted, and said once: which node spoke for which generation
    refused = dict(c.received)
    assert refused.pop("stale") == 3 and refused == received and state.puts == puts
    said = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["node"], e["its_gen"], e["gen"]) for e in said
            if e["event"] == "stale_node_refused"] == [(node.node, 0, 1)]
    assert asyncio.run(c.status())["refused_stale"] == 3
    assert steps_file.read_text() == lines and "2" not in c.steps.losses


def test_a_node_that_stops_beating_is_named_after_the_timeout(tmp_path):
    c, sim, _, clock = job(tmp_path)
    asyncio.run(sim.step(0, 1))
    asyncio.run(sim.heartbeats(0, 1))
    frozen = "n3"
    last = clock.now
    named_at = None
    while named_at is None:
        clock.now += INTERVAL_S
        asyncio.run(sim.heartbeats(0, 1, skip=(frozen,)))
        ranks, nodes = asyncio.run(c.liveness(TIMEOUT_S, TIMEOUT_S))
        if clock.now - last <= TIMEOUT_S:
            assert (ranks, nodes) == ([], [])
        elif nodes:
            named_at = clock.now
            assert nodes == [frozen] and ranks == list(range(24, 32))
            # where the recovery is counted from when nobody injected the fault
            assert asyncio.run(c.last_heard(ranks, nodes)) == last
    assert TIMEOUT_S < named_at - last <= TIMEOUT_S + INTERVAL_S


def test_a_frozen_nodes_ranks_are_never_named_hung_before_their_node(tmp_path):
    """A frozen node's ranks last lived a little before their store's last heartbeat (it
    reports their age). Judged against the clock they went stale first, and a check in that
    window named "rank(s) hung" (a drill on a loaded machine saw it); judged at the store's
    last heartbeat they go with their node."""
    c, sim, _, clock = job(tmp_path)
    asyncio.run(sim.step(0, 1))
    frozen = "n3"
    ranks = sorted(sim.nodes[frozen].ranks)
    asyncio.run(c.node_heartbeat(frozen, Heartbeat(0, 1, 0.4, {})))
    last = clock.now
    hung: list = []
    nodes: list = []
    while clock.now - last <= TIMEOUT_S + INTERVAL_S:
        clock.now += INTERVAL_S / 5
        asyncio.run(sim.heartbeats(0, 1, skip=(frozen,)))
        hung, nodes = asyncio.run(c.liveness(TIMEOUT_S, TIMEOUT_S))
        assert not hung or nodes == [frozen], (clock.now - last, hung, nodes)
    assert nodes == [frozen] and hung == ranks


def test_a_hung_rank_on_a_live_node_is_found_by_the_age_its_store_reports(tmp_path):
    c, sim, _, clock = job(tmp_path)
    asyncio.run(sim.step(0, 1))
    node = sim.nodes["n1"]
    start = clock.now
    while clock.now - start <= TIMEOUT_S + INTERVAL_S:
        clock.now += INTERVAL_S
        for n in sim.nodes.values():
            for r in n.ranks:
                if r != 10:  # rank 10 (on n1) stopped; its store goes on
                    n.agg.beat(r, 0, 1, clock())
        asyncio.run(sim.heartbeats(0))
    assert node.node not in asyncio.run(c.liveness(TIMEOUT_S, TIMEOUT_S))[1]
    assert asyncio.run(c.liveness(TIMEOUT_S, TIMEOUT_S)) == ([10], [])


def test_step_metrics_are_aggregated_over_the_ranks(tmp_path):
    c, sim, _, _ = job(tmp_path)
    for step in (1, 2):
        asyncio.run(sim.step(0, step))
    rows = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["ranks"] == RANKS for r in rows)
    # the simulated rank r stalls 1 ms + r us
    stats = rows[-1]["stall_s"]
    assert stats["min"] == pytest.approx(0.001) and stats["max"] == pytest.approx(0.001063)
    assert stats["median"] == pytest.approx(0.0010315, rel=0.025)  # within a bucket
    losses = [json.loads(x) for x in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert [(x["step"], x["loss"]) for x in losses] == [(1, 0.5), (2, 1 / 3)]
    # each simulated rank's cumulative counts say it landed every due snapshot
    assert c.steps.snapshots == {"requested": 2.0 * RANKS, "landed": 2.0 * RANKS, "skipped": 0.0}
    prog = asyncio.run(c.progress())
    assert prog.min_step == prog.max_step == 2 and prog.last_loss == 1 / 3


# -- the driver's words ----------------------------------------------------------------------
def test_a_silent_node_is_named_frozen_or_cut_off():
    node = "a1b2c3d4e5f6a7b8c9d0"
    d = decide(Observation(pending=(0, 1, 2, 3), hung=(2, 3), silent_nodes=(node,),
                           max_restarts=3))
    assert d.action is Action.RECOVER and d.died == d.hung == (2, 3)
    assert d.silent_nodes == (node,)
    assert d.what == "node a1b2c3d4e5f6 stopped reporting (frozen or cut off): rank(s) [2, 3] lost"
    assert failure_target(d.what) == "node"
    plain = decide(Observation(pending=(0, 1), hung=(1,), max_restarts=3))
    assert plain.what == "rank(s) [1] stopped heart-beating (hung)"
    assert failure_target(plain.what) == "hung"


def test_commit_waiters_are_released_by_the_commit_or_a_new_generation(tmp_path):
    """Step 0 commits like any other (its waiters go at once, not after their 600 s), and
    a new generation releases an older one's waiters, answered stale."""
    async def go() -> None:
        c = Coordinator("job", str(tmp_path), 1, state=MemoryStateStore(),
                        inventory=lambda names, t: {})
        await c.configure(0, {0: "n"}, {0: []}, None, {"n": "store-n"})
        waiting = asyncio.ensure_future(c.wait_commit(0, 0, 600.0))
        later = asyncio.ensure_future(c.wait_commit(0, 1, 600.0))
        await asyncio.sleep(0)
        ready = ReadyBatch(0, 0, 1, holders_digest({0: []}))
        assert (await c.node_ready("n", ready, 600.0))[0] == 0
        assert (await asyncio.wait_for(waiting, 5))[0] == 0
        assert not later.done()  # step 1 has not committed
        await c.configure(1, {0: "n"}, {0: []}, 0, {"n": "store-n"})
        assert await asyncio.wait_for(later, 5) == STALE
    asyncio.run(go())


def test_a_resumed_steps_loss_lost_with_its_generation_comes_back_from_the_snapshot(tmp_path):
    """Rank 0's summary of step 2 is held on its store for the step's batch; a failure ends
    the generation before the batch goes (every copy of step 2 is in RAM all the same, so
    the recovery resumes from it and no rank redoes it). The summary is gone with generation
    0; the loss rank 0's snapshot kept is taken back once, for the current generation only."""
    c, sim, state, clock = job(tmp_path, gen=0)
    one, two = rank_metrics(0, 1)["loss"], rank_metrics(0, 2)["loss"]
    asyncio.run(sim.step(0, 1))
    assert c.steps.losses == {"1": one}
    node0 = sim.nodes["n0"]
    asyncio.run(node0.reports(0, 2))  # every rank snapshotted step 2: held for the batch
    assert "2" not in c.steps.losses
    assignment, holders, stores = layout()
    asyncio.run(c.configure(1, assignment, holders, 1, stores))  # the recovery
    sim.join(1)  # the stores join generation 1: what they held of generation 0 is dropped
    assert node0.agg.take_held() == []
    assert not asyncio.run(c.restored_loss(0, 2, two))  # the generation the failure ended
    assert asyncio.run(c.restored_loss(1, 2, two))
    assert asyncio.run(c.restored_loss(1, 2, two))  # said again: one line, the same loss
    assert c.steps.losses == {"1": one, "2": two}
    lines = [json.loads(x) for x in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert [(x["step"], x["gen"], x.get("restored", False)) for x in lines] == \
        [(1, 0, False), (2, 1, True)]
    # a step before the first one this run reported was another run's (an auto-resume's)
    assert not asyncio.run(c.restored_loss(1, 0, 9.0)) and "0" not in c.steps.losses
    # a restarted coordinator reads the restored line back like any other
    again = Coordinator("job", str(tmp_path), RANKS, state=state, clock=clock,
                        inventory=lambda names, t: {})
    assert again.steps.losses == {"1": one, "2": two}


def test_the_loss_before_the_resumed_step_refused_with_its_generation_is_taken_back(tmp_path):
    """A step's summary rides the next step's batch: the failure that ends generation 0
    can take step 2's loss (in step 3's batch, refused as stale) as well as step 3's (held).
    The recovery resumes from step 3: its loss comes back from the snapshot, step 2's from
    the refused batch. A refused loss of a step after the resumed one (redone) is not taken,
    nor one of a generation older than the one just ended."""
    c, sim, state, clock = job(tmp_path, gen=0)
    loss = {s: rank_metrics(0, s)["loss"] for s in (1, 2, 3, 4)}
    asyncio.run(sim.step(0, 1))
    assignment, holders, stores = layout()
    asyncio.run(c.configure(1, assignment, holders, 1, stores))  # the failure, the recovery
    # generation 0's batches that arrive after it ended: refused, nothing committed
    batch = (summarize(2, {0: rank_metrics(0, 2)}),)
    assert asyncio.run(c.node_ready("n0", ReadyBatch(0, 3, 0, "", {}, batch), 0.0)) == STALE
    late = (summarize(4, {0: rank_metrics(0, 4)}),)
    assert asyncio.run(c.node_heartbeat("n0", Heartbeat(0, 4, 0.0, {}, late))) is False
    assert c.steps.losses == {"1": loss[1]}  # nothing taken before the resumed step is known
    assert asyncio.run(c.restored_loss(1, 3, loss[3]))
    assert c.steps.losses == {"1": loss[1], "2": loss[2], "3": loss[3]}
    lines = [json.loads(x) for x in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert [(x["step"], x.get("restored", False)) for x in lines] == \
        [(1, False), (3, True), (2, True)]
    # generation 2 resumed from step 3 again: a generation-0 batch is two generations old
    asyncio.run(c.configure(2, assignment, holders, 3, stores))
    del c.steps.losses["2"]
    asyncio.run(c.node_metrics("n0", 0, batch))
    assert asyncio.run(c.restored_loss(2, 3, loss[3]))
    assert "2" not in c.steps.losses
    # a batch of the generation just ended, arriving after the restore, is taken at once
    asyncio.run(c.node_metrics("n0", 1, batch))
    assert c.steps.losses["2"] == loss[2]


def test_a_node_that_only_ever_sent_batches_is_named_once_it_stops(tmp_path):
    """Steps faster than the heartbeat interval: a store's batches stand in for its
    heartbeats, so it may never send one. Its batches alone keep it alive, and when they
    stop it is named frozen after the timeout like any node (not after the start-up one)."""
    c, sim, _, clock = job(tmp_path)
    asyncio.run(sim.step(0, 1))
    assert asyncio.run(c.liveness(TIMEOUT_S, 100 * TIMEOUT_S)) == ([], [])
    assert c.alive.ranks == {}  # every node spoke: none of its ranks is watched alone
    last, frozen = clock.now, "n3"
    for step in range(2, 100):
        clock.now += INTERVAL_S / 5
        for name, node in sim.nodes.items():
            if name != frozen:
                asyncio.run(node.reports(0, step))
                asyncio.run(node.send_ready(node.ready(0, step), 0.0))
        ranks, nodes = asyncio.run(c.liveness(TIMEOUT_S, 100 * TIMEOUT_S))
        if nodes:
            break
    assert nodes == [frozen] and ranks == sim.nodes[frozen].ranks
    assert TIMEOUT_S < clock.now - last <= TIMEOUT_S + INTERVAL_S


def test_a_batch_judged_against_other_holders_is_refused_loudly(tmp_path):
    """A store that judged its ranks against holders other than the placement's (a spec
    and the coordinator disagree: a bug) commits nothing and says so; the right digest, or
    a short rank named, is taken."""
    c, sim, _, clock = job(tmp_path)
    node = sim.nodes["n1"]
    wrong = ReadyBatch(0, 1, len(node.ranks), holders_digest({r: ["n9"] for r in node.ranks}))
    with pytest.raises(PlacementMismatch, match="n1's ranks placed step 1 on holders other"):
        asyncio.run(c.node_ready("n1", wrong, 0.0))
    said = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["node"] for e in said if e["event"] == "placement_mismatch"] == ["n1"]
    assert c.ready.count(1) == 0
    # one rank placed short by name: the others counted, it is not
    holders = {r: sim.nodes["n1"].holders[r] for r in node.ranks}
    short = node.ranks[0]
    rest = {r: h for r, h in holders.items() if r != short}
    named = ReadyBatch(0, 1, len(rest), holders_digest(rest), {short: ()})
    asyncio.run(c.node_ready("n1", named, 0.0))
    assert c.ready.count(1) == len(node.ranks) - 1
