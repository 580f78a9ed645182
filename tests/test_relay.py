"""Relays: one store per group of nodes merges their step batches into one message to the
coordinator (memckpt.policy.relay_groups, memckpt.runtime.node.relay, the Uplink's member side),
without Ray: the real Uplinks, the real Coordinator on an event loop of its own (as in
test_uplink), and the leader's store reached through a stand-in for its actor handle that
runs the leader Uplink's ``relay_ready`` on a thread, as Ray would. The stand-in can play a
leader that died (its call fails), one frozen (its call never answers), one that does not
know the group yet, and one whose answer dies with it."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Iterator, Optional

import pytest

from memckpt.config import ConfigError, ControlConfig
from memckpt.policy.relay_groups import RelayGroup, relay_groups
from memckpt.runtime.coordinator.messages import ReadyBatch
from memckpt.runtime.coordinator.readiness import PlacementMismatch
from memckpt.runtime.node.uplink import Uplink
from test_uplink import LoopHandle, get, running_coordinator

NODES = {"a": [0, 1], "b": [2, 3], "c": [4, 5], "d": [6, 7]}
HOLDERS = {r: ["b" if r < 2 else "a"] for r in range(8)}
GROUP = ("a", "b", "c", "d")
INTERVAL_S = 0.1  # the heartbeat thread's tick: a relay's partial send, a member's patience


# -- who relays for whom (pure) ------------------------------------------------------------
def test_groups_are_even_within_a_rack_and_none_on_a_small_job():
    nodes = [f"n{i:02d}" for i in range(40)]
    racks = {n: ("r1" if i < 17 else "r2") for i, n in enumerate(nodes)}
    groups = relay_groups(nodes, fanout=16, min_nodes=8, domains=racks)
    sizes = sorted(len(g.members) for g in set(groups.values()))
    assert sizes == [8, 9, 11, 12], sizes  # r1: 17 -> 9 + 8; r2: 23 -> 12 + 11
    for n, g in groups.items():
        assert n in g.members and len({racks[m] for m in g.members}) == 1
        assert g.leader == g.members[0] == min(g.members)
    assert relay_groups(list(reversed(nodes)), 16, 8, racks) == groups  # order-free
    assert relay_groups(nodes, 16, min_nodes=41) == {}  # too small a job
    assert relay_groups(nodes, 0, 2) == {}  # turned off
    alone = relay_groups(["x", "y", "z"], 16, 2, {"x": "r1", "y": "r1", "z": "r2"})
    assert set(alone) == {"x", "y"}  # a node alone in its rack sends its own


def test_group_sizes_are_even_across_a_rack():
    nodes = [f"n{i:03d}" for i in range(23)]
    groups = relay_groups(nodes, fanout=16, min_nodes=2)
    assert sorted(len(g.members) for g in set(groups.values())) == [11, 12]
    assert set(groups) == set(nodes)


def test_relay_settings_are_checked_at_construction():
    with pytest.raises(ConfigError, match="relay_fanout"):
        ControlConfig(relay_fanout=1)
    with pytest.raises(ConfigError, match="relay_min_nodes"):
        ControlConfig(relay_min_nodes=1)
    with pytest.raises(ValueError, match="distinct"):
        RelayGroup(("a", "a"))


# -- the runtime --------------------------------------------------------------------------
@pytest.fixture
def coordinator(tmp_path) -> Iterator[LoopHandle]:
    with running_coordinator(tmp_path, NODES, HOLDERS, OPEN) as handle:
        yield handle


class LeaderStore:
    """The leader's store as its members' Uplinks call it (``relay_ready``): ``mode`` plays
    "live", "dead" (the call fails), "frozen" (never answers), "unaware" (does not lead the
    generation: answers None) or "lost" (answers, but the answer's reference dies with it)."""

    def __init__(self, leader: Uplink) -> None:
        self.leader = leader
        self.mode = "live"
        self.calls = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(8)

    def options(self, **_: Any) -> "LeaderStore":
        return self

    @property
    def relay_ready(self) -> "LeaderStore":
        return self

    def remote(self, node: str, batch: ReadyBatch, timeout_s: float) -> concurrent.futures.Future:
        self.calls += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.mode == "dead":
            fut.set_exception(RuntimeError("the actor died (ActorDiedError)"))
        elif self.mode == "unaware":
            fut.set_result(None)
        elif self.mode == "lost":
            answer: concurrent.futures.Future = concurrent.futures.Future()
            answer.set_exception(RuntimeError("the reference's owner died (OwnerDiedError)"))
            fut.set_result(answer)
        elif self.mode == "live":
            return self.pool.submit(self.leader.relay_ready, node, batch, timeout_s)
        return fut  # frozen: never answered


OPEN: list[Uplink] = []


@pytest.fixture(autouse=True)
def _close_uplinks() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def group_links(handle: LoopHandle) -> tuple[dict[str, Uplink], LeaderStore]:
    ups = {n: Uplink(n, get=get) for n in NODES}
    store = LeaderStore(ups["a"])
    for n, up in ups.items():
        for r in NODES[n]:
            assert up.join(r, 0, NODES[n], handle, interval_s=INTERVAL_S, holders=HOLDERS[r],
                           relay=(GROUP, store))
    OPEN.extend(ups.values())
    return ups, store


def rank(up: Uplink, r: int, step: int) -> Any:
    assert up.rank_ready(r, 0, step, HOLDERS[r])
    for _ in range(100):
        view = up.wait_commit(0, step, 1.0)
        if view is not None and (view[0] or -1) >= step:
            return view
    raise AssertionError(f"rank {r} got no answer for step {step}")


def run_ranks(ups: dict[str, Uplink], step: int, nodes: Optional[list[str]] = None
              ) -> dict[int, Any]:
    nodes = nodes or list(NODES)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = {r: pool.submit(rank, ups[n], r, step) for n in nodes for r in NODES[n]}
        return {r: f.result(30) for r, f in futs.items()}


def events(handle: LoopHandle, kind: str) -> list[dict[str, Any]]:
    import json
    path = handle.c.run_dir / "events.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in lines if e.get("kind", e.get("event")) == kind]


def test_a_groups_batches_reach_the_coordinator_as_one_message_a_step(coordinator):
    ups, store = group_links(coordinator)
    for step in (1, 2, 3):
        views = run_ranks(ups, step)
        assert all(v[0] == step for v in views.values()), views
    received = coordinator.c.received
    assert received["group_ready"] == 3 and received["node_ready"] == 0, received
    assert store.calls == 3 * 3  # b, c and d each step; a hands its own in-process
    assert set(coordinator.c.alive.node_beats) == set(NODES)  # every node heard through it


def test_a_missing_member_does_not_hold_back_the_others_signs_of_life(coordinator):
    ups, _ = group_links(coordinator)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        early = {r: pool.submit(rank, ups[n], r, 1) for n in "abc" for r in NODES[n]}
        # d is late: a, b and c's batches go after the leader's wait, without d's (in one
        # message, or more where a's own ranks come later than the wait: a loaded machine)
        c = coordinator.c

        def counted() -> int:  # read beside the coordinator's loop: a dict may change size
            try:
                return c.ready.count(1)
            except RuntimeError:
                return -1
        until(lambda: counted() == 6, 30.0)  # a, b and c's ranks, not d's
        sent = c.received["group_ready"]
        assert sent >= 1 and set(c.alive.node_beats) >= {"a", "b", "c"}
        assert c.s.committed is None  # d's ranks are not ready: no commit
        late = run_ranks(ups, 1, ["d"])  # d's batch then goes alone, and the step commits
        views = {r: f.result(30) for r, f in early.items()} | late
    assert all(v[0] == 1 for v in views.values()), views
    assert c.received["group_ready"] == sent + 1
    assert c.received["node_ready"] == 0  # all through the leader


@pytest.mark.parametrize("mode", ["dead", "frozen"])
def test_a_failed_leader_costs_one_resend_then_members_go_direct(coordinator, mode):
    ups, store = group_links(coordinator)
    store.mode = mode
    for step in (1, 2):
        views = run_ranks(ups, step)
        assert all(v[0] == step for v in views.values()), views
    received = coordinator.c.received
    # step 1: the leader's own batch is merged alone, b, c and d resend theirs; step 2: direct
    assert received["node_ready"] == 2 * 3 and received["group_ready"] == 2, received
    assert store.calls == 3  # the failed leader is asked once a generation
    bypassed = events(coordinator, "relay_bypassed")
    assert sorted(e["node"] for e in bypassed) == ["b", "c", "d"]


def summaries_only(ups: dict[str, Uplink], step: int) -> None:
    """Every rank reports ``step`` without a snapshot of it (``snapshot_every`` > 1)."""
    for n, up in ups.items():
        for r in NODES[n]:
            assert up.report(r, 0, step, {"loss": 1.0 / step, "stall_s": 0.0}, False)


def until(what: Any, timeout_s: float = 10.0) -> None:
    stop = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if what():
            return
        stop.wait(0.05)
    raise AssertionError(f"not within {timeout_s} s")


def test_a_step_no_rank_snapshotted_sends_its_summaries_through_the_relay(coordinator):
    ups, _ = group_links(coordinator)
    c = coordinator.c
    for step in (1, 2, 3):  # the first goes at once; none has a readiness batch
        summaries_only(ups, step)
    until(lambda: c.steps.progress(0, 8, None).min_step == 3)
    assert c.received["group_ready"] == 3 and not c.received["node_metrics"], c.received
    assert c.ready.in_flight() == []  # summaries ready no rank
    assert c.steps.losses["3"] == 1.0 / 3  # rank 0's


@pytest.mark.parametrize("mode", ["dead", "unaware", "lost"])
def test_summaries_a_failed_leader_did_not_send_go_direct(coordinator, mode):
    """"lost": the leader answered, and its message died with it before the coordinator
    took it (a node lost just then): the members see the answer's reference die and send
    their summaries themselves, else a step's loss would be lost (CI saw one so)."""
    ups, store = group_links(coordinator)
    c = coordinator.c
    store.mode = mode
    for step in (1, 2):
        summaries_only(ups, step)
    until(lambda: c.steps.progress(0, 8, None).min_step == 2)
    assert c.received["node_metrics"] == 3 * 2 and c.received["group_ready"] == 2  # a's own
    assert c.steps.losses == {"1": 1.0, "2": 0.5}
    bypassed = {e["node"] for e in events(coordinator, "relay_bypassed")}
    assert bypassed == (set() if mode == "unaware" else {"b", "c", "d"})


def test_a_flush_returns_once_the_coordinator_took_the_summaries_handed_to_the_leader(
        coordinator):
    """A rank's run ends (flush) with its last step's summaries at the leader, which waits
    for the other members' (they have none): the flush waits until the coordinator took
    them, so the driver, which reads the losses next, has them all."""
    ups, _ = group_links(coordinator)
    for r in NODES["b"]:  # b alone: the leader holds its part for a wait
        assert ups["b"].report(r, 0, 1, {"loss": 0.25, "stall_s": 0.0}, False)
    assert ups["b"].flush(0, 10.0)
    assert coordinator.c.steps.units["b"].step == 1


def test_a_leader_that_does_not_lead_the_generation_yet_is_bypassed_for_that_step(coordinator):
    ups, store = group_links(coordinator)
    store.mode = "unaware"
    assert all(v[0] == 1 for v in run_ranks(ups, 1).values())
    store.mode = "live"
    assert all(v[0] == 2 for v in run_ranks(ups, 2).values())
    received = coordinator.c.received
    assert received["node_ready"] == 3 and received["group_ready"] == 2, received
    assert not events(coordinator, "relay_bypassed")  # not a failure: no event, relay kept


def test_an_answer_lost_with_its_leader_is_resent_direct(coordinator):
    ups, store = group_links(coordinator)
    store.mode = "lost"
    assert all(v[0] == 1 for v in run_ranks(ups, 1).values())
    assert coordinator.c.received["node_ready"] == 3


def test_a_group_of_an_ended_generation_is_refused_and_a_mismatched_part_fails_alone(
        coordinator):
    c = coordinator.c
    ok = ReadyBatch(0, 1, 2, c.ready.members.digest["b"])
    stale = ((n, ReadyBatch(-1, 1, 2, "x")) for n in "ab")
    assert coordinator.call("group_ready", "a", tuple(stale), 0.01)[2] == "stale"
    assert c.received["stale"] == 2
    with pytest.raises(PlacementMismatch):
        coordinator.call("group_ready", "a", (("a", ReadyBatch(0, 1, 2, "wrong")), ("b", ok)),
                         0.01)
    assert c.ready.count(1) == 2  # b's part was taken
    assert events(coordinator, "placement_mismatch")[0]["node"] == "a"
