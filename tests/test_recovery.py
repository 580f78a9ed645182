"""Unit tests for memckpt.policy.recovery_plan: pure recovery decisions (no Ray, no torch)."""

from __future__ import annotations

import copy

import pytest

from memckpt.errors import RecoveryError
from memckpt.policy.recovery_plan import (
    RecoveryPlan,
    choose_nodes,
    lost_ranks,
    newest_common_step,
    plan_recovery,
    repair_holders,
)

NODES = ["A", "B", "C"]
ASSIGN = {0: "A", 1: "B", 2: "C"}  # one rank per node
RING = {0: ("B",), 1: ("C",), 2: ("A",)}  # ring, 1 replica: rank r's copy on the next node


def ring_inventory(steps=(5, 6)) -> dict[str, dict[int, list[int]]]:
    """Every node holds its own rank's slots and the replica of the previous node's rank."""
    inv: dict[str, dict[int, list[int]]] = {n: {} for n in NODES}
    for rank, own in ASSIGN.items():
        inv[own][rank] = list(steps)
        for h in RING[rank]:
            inv[h][rank] = list(steps)
    return inv


def check_holders(plan: RecoveryPlan, alive, replicas: int) -> None:
    """Holders never sit on the rank's own node or a dead node, and fill up when they can."""
    for rank, hs in plan.holders.items():
        own = plan.assignment[rank]
        assert own not in hs, (rank, hs)
        assert all(h in alive for h in hs), (rank, hs)
        assert len(set(hs)) == len(hs), (rank, hs)
        if len(alive) >= replicas + 1:
            assert len(hs) == replicas, (rank, hs)


# ---- newest_common_step / lost_ranks ------------------------------------------------------

def test_newest_common_step_basics():
    inv = {"A": {0: [5, 6]}, "B": {1: [5]}}
    assert newest_common_step([0, 1], inv) == 5
    assert newest_common_step([0], inv) == 6
    assert newest_common_step([0], inv, at_most=5) == 5
    assert newest_common_step([0], inv, at_most=4) is None
    assert newest_common_step([0, 2], inv) is None  # rank 2 has nothing anywhere
    # copies of one rank spread over nodes combine
    assert newest_common_step([0, 1], {"A": {0: [6]}, "B": {0: [5], 1: [5, 6]}}) == 6


def test_lost_ranks():
    inv = {"A": {0: [5, 6]}, "C": {2: [6]}}
    assert lost_ranks([0, 1, 2], inv, 6) == [1]
    assert lost_ranks([0, 1, 2], inv, 5) == [1, 2]


# ---- process death: every node alive ------------------------------------------------------

def test_process_death_restores_locally_at_newest_step():
    inv = ring_inventory()
    cap = {n: 1 for n in NODES}
    plan = plan_recovery(ASSIGN, RING, NODES, cap, inv, replicas=1, committed=6)
    assert plan.step == 6
    assert plan.assignment == ASSIGN
    assert plan.moved == ()
    for rank, own in ASSIGN.items():
        assert plan.sources[rank][0] == own  # restore from the local store: no network
        assert set(plan.sources[rank]) == {own, *RING[rank]}
    assert plan.holders == RING  # nothing to repair
    assert plan.notes == ()
    check_holders(plan, NODES, 1)


def test_process_death_with_two_ranks_per_node():
    assign = {0: "A", 1: "A", 2: "B", 3: "B"}
    holders = {0: ("B",), 1: ("B",), 2: ("A",), 3: ("A",)}
    inv = {"A": {0: [5, 6], 1: [5, 6], 2: [5, 6], 3: [5, 6]},
           "B": {0: [5, 6], 1: [5, 6], 2: [5, 6], 3: [5, 6]}}
    plan = plan_recovery(assign, holders, ["A", "B"], {"A": 2, "B": 2}, inv, replicas=1)
    assert plan.step == 6 and plan.assignment == assign and plan.moved == ()
    assert all(plan.sources[r][0] == assign[r] for r in assign)
    assert plan.holders == holders


# ---- node death ---------------------------------------------------------------------------

def test_node_death_moves_rank_to_the_node_holding_its_shard():
    inv = ring_inventory()
    alive = ["A", "C"]
    plan = plan_recovery(ASSIGN, RING, alive, {"A": 2, "B": 2, "C": 2}, inv, replicas=1,
                         committed=6)
    assert plan.step == 6
    assert plan.assignment == {0: "A", 1: "C", 2: "C"}
    assert plan.moved == (1,)
    assert plan.sources[1] == ("C",)  # local restore on its new node
    assert plan.sources[0][0] == "A" and plan.sources[2][0] == "C"
    assert all("B" not in s for s in plan.sources.values())
    check_holders(plan, alive, 1)
    # rank 0 lost its holder B; rank 1 now runs on its old holder C: both get the other node
    assert plan.holders == {0: ("C",), 1: ("A",), 2: ("A",)}
    assert plan.notes == ()  # 2 nodes alive >= replicas + 1


def test_node_death_without_room_on_holder_goes_to_least_loaded_node():
    inv = ring_inventory()
    alive = ["A", "C"]
    plan = plan_recovery(ASSIGN, RING, alive, {"A": 2, "B": 2, "C": 1}, inv, replicas=1)
    assert plan.assignment == {0: "A", 1: "A", 2: "C"}
    assert plan.moved == (1,)
    assert plan.sources[1] == ("C",)  # fetched from the peer holding it
    assert plan.sources[1][0] != plan.assignment[1]
    check_holders(plan, alive, 1)
    assert plan.holders[1] == ("C",)  # its existing replica stays where it is


def test_node_death_picks_least_loaded_among_several_with_room():
    # 4 nodes, D died; rank 3 (on D) has its only replica on B, which is full.
    assign = {0: "A", 1: "A", 2: "B", 3: "D", 4: "C"}
    holders = {0: ("B",), 1: ("B",), 2: ("C",), 3: ("B",), 4: ("A",)}
    inv = {"A": {0: [6], 1: [6], 4: [6]}, "B": {0: [6], 1: [6], 2: [6], 3: [6]},
           "C": {2: [6], 4: [6]}, "D": {3: [6]}}
    alive = ["A", "B", "C"]
    plan = plan_recovery(assign, holders, alive, {"A": 2, "B": 1, "C": 2}, inv, replicas=1)
    assert plan.assignment[3] == "C"  # A has 2 ranks already (full), C has 1 and room
    assert plan.sources[3] == ("B",)
    assert plan.moved == (3,)
    check_holders(plan, alive, 1)


def test_node_death_with_two_replicas_heals_holders():
    nodes = ["A", "B", "C", "D"]
    assign = {i: n for i, n in enumerate(nodes)}
    holders = {0: ("B", "C"), 1: ("C", "D"), 2: ("D", "A"), 3: ("A", "B")}
    inv: dict[str, dict[int, list[int]]] = {n: {} for n in nodes}
    for r, own in assign.items():
        for n in (own, *holders[r]):
            inv[n][r] = [7, 8]
    alive = ["A", "C", "D"]  # B died
    plan = plan_recovery(assign, holders, alive, {n: 2 for n in nodes}, inv, replicas=2)
    assert plan.step == 8
    assert plan.assignment[1] == "C"  # first live holder with room, least loaded, alive order
    assert plan.sources[1][0] == "C" and set(plan.sources[1]) == {"C", "D"}
    check_holders(plan, alive, 2)
    assert plan.notes == ()


def test_dead_nodes_inventory_is_ignored():
    inv = ring_inventory()
    inv["B"][0] = [5, 6, 7]  # B (dead) claims a newer step: it must not count
    inv["B"][1] = [5, 6, 7]
    plan = plan_recovery(ASSIGN, RING, ["A", "C"], {"A": 2, "C": 2}, inv, replicas=1)
    assert plan.step == 6
    assert all("B" not in s for s in plan.sources.values())


# ---- differing steps ----------------------------------------------------------------------

def test_mixed_steps_pick_newest_common_and_note_rollback():
    assign = {0: "A", 1: "B"}
    holders = {0: ("B",), 1: ("A",)}
    inv = {"A": {0: [5, 6], 1: [5]}, "B": {0: [5, 6], 1: [5]}}
    plan = plan_recovery(assign, holders, ["A", "B"], {"A": 1, "B": 1}, inv, replicas=1,
                         committed=6)
    assert plan.step == 5
    assert any("committed step 6" in n and "5" in n for n in plan.notes), plan.notes
    assert plan.sources == {0: ("A", "B"), 1: ("B", "A")}


def test_no_rollback_note_at_or_above_committed():
    assign = {0: "A", 1: "B"}
    holders = {0: ("B",), 1: ("A",)}
    inv = {"A": {0: [5, 6], 1: [5]}, "B": {0: [5, 6], 1: [5]}}
    for committed in (None, 5, 4):
        plan = plan_recovery(assign, holders, ["A", "B"], {"A": 1, "B": 1}, inv, replicas=1,
                             committed=committed)
        assert plan.step == 5
        assert not any("rolled back" in n for n in plan.notes), (committed, plan.notes)


def test_step_may_come_from_different_nodes_per_rank():
    # rank 0's step 6 only survives on C, step 5 only on A: 6 is still whole.
    assign = {0: "A", 1: "C"}
    inv = {"A": {0: [5]}, "C": {0: [6], 1: [5, 6]}}
    plan = plan_recovery(assign, {0: ("C",), 1: ("A",)}, ["A", "C"], {"A": 1, "C": 1}, inv,
                         replicas=1)
    assert plan.step == 6
    assert plan.sources[0] == ("C",)
    assert plan.assignment == assign


# ---- impossible recoveries ----------------------------------------------------------------

def test_every_copy_of_a_rank_lost_names_it():
    inv = ring_inventory()
    inv["C"].pop(1)  # rank 1 lived on B with its replica on C: both gone
    with pytest.raises(RecoveryError) as e:
        plan_recovery(ASSIGN, RING, ["A", "C"], {"A": 2, "C": 2}, inv, replicas=1, committed=6)
    msg = str(e.value)
    assert "[1]" in msg
    assert "placement.replicas" in msg or "persistence" in msg


def test_two_nodes_dead_loses_the_rank_they_both_held():
    # A and B dead: rank 0 lived on A with its only replica on B; rank 1's replica is on C.
    with pytest.raises(RecoveryError, match=r"rank\(s\) \[0\]"):
        plan_recovery(ASSIGN, RING, ["C"], {"C": 3}, ring_inventory(), replicas=1)


def test_no_common_step_is_an_error():
    inv = {"A": {0: [6]}, "B": {1: [5]}}
    with pytest.raises(RecoveryError, match="no step is held in RAM for every rank"):
        plan_recovery({0: "A", 1: "B"}, {0: ("B",), 1: ("A",)}, ["A", "B"], {"A": 1, "B": 1},
                      inv, replicas=1)


def test_no_node_with_room_says_add_a_node():
    inv = ring_inventory()
    with pytest.raises(RecoveryError) as e:
        plan_recovery(ASSIGN, RING, ["A", "C"], {"A": 1, "B": 1, "C": 1}, inv, replicas=1)
    assert "add a node" in str(e.value)
    assert "rank 1" in str(e.value)


# ---- reduced redundancy -------------------------------------------------------------------

def test_reduced_redundancy_note_when_too_few_nodes():
    inv = ring_inventory()
    holders = {0: ("B", "C"), 1: ("C", "A"), 2: ("A", "B")}
    for r, hs in holders.items():
        for h in hs:
            inv[h][r] = [5, 6]
    alive = ["A", "C"]  # 2 alive < replicas + 1 = 3
    plan = plan_recovery(ASSIGN, holders, alive, {"A": 2, "C": 2}, inv, replicas=2)
    assert plan.step == 6
    assert any("only 2 nodes alive" in n for n in plan.notes), plan.notes
    check_holders(plan, alive, 2)
    for rank, hs in plan.holders.items():
        assert len(hs) == 1  # the one other live node


def test_single_survivor_keeps_no_replicas():
    inv = {"A": {0: [3], 1: [3]}}
    plan = plan_recovery({0: "A", 1: "B"}, {0: ("B",), 1: ("A",)}, ["A"], {"A": 2}, inv,
                         replicas=1)
    assert plan.assignment == {0: "A", 1: "A"}
    assert plan.holders == {0: (), 1: ()}
    assert any("only 1 nodes alive" in n for n in plan.notes)


# ---- building blocks ----------------------------------------------------------------------

def test_choose_nodes_keeps_live_ranks_and_prefers_local_copy():
    new = choose_nodes(ASSIGN, ["A", "C"], {"A": 3, "C": 3}, ring_inventory(), 6)
    assert new == {0: "A", 1: "C", 2: "C"}
    # no local copy at that step: least loaded wins
    new = choose_nodes(ASSIGN, ["A", "C"], {"A": 3, "C": 3}, ring_inventory(), 9)
    assert new == {0: "A", 1: "A", 2: "C"}


def test_repair_holders_drops_dead_and_own_and_trims():
    out = repair_holders({0: ("B", "C", "A"), 1: ("A",)}, {0: "A", 1: "C"}, ["A", "C", "D"], 1)
    assert out == {0: ("C",), 1: ("A",)}
    out = repair_holders({}, {0: "A", 1: "A"}, ["A", "B", "C"], 2)
    assert all(set(hs) == {"B", "C"} for hs in out.values())


def test_repair_holders_balances_new_holders():
    out = repair_holders({}, {0: "A", 1: "A", 2: "A", 3: "A"}, ["A", "B", "C"], 1)
    loads = [sum(n in hs for hs in out.values()) for n in ("B", "C")]
    assert loads == [2, 2]


# ---- determinism --------------------------------------------------------------------------

def test_plan_is_deterministic_and_leaves_inputs_alone():
    inv = ring_inventory()
    args = (ASSIGN, RING, ["A", "C"], {"A": 2, "B": 2, "C": 1}, inv)
    before = copy.deepcopy(args)
    plans = [plan_recovery(*copy.deepcopy(args), replicas=1, committed=6) for _ in range(5)]
    assert all(p == plans[0] for p in plans)
    assert plan_recovery(*args, replicas=1, committed=6) == plans[0]
    assert args == before
    # dict insertion order of the inputs does not matter
    shuffled_inv = {n: dict(reversed(list(inv[n].items()))) for n in reversed(list(inv))}
    shuffled_assign = dict(reversed(list(ASSIGN.items())))
    again = plan_recovery(shuffled_assign, RING, ["A", "C"], {"C": 1, "B": 2, "A": 2},
                          shuffled_inv, replicas=1, committed=6)
    assert again == plans[0]


# ---- which ranks need no re-copy after the restore ---------------------------------------

def test_process_death_needs_no_recopy():
    """A dead worker process (every node alive): every copy is where placement wants it."""
    plan = plan_recovery(ASSIGN, RING, NODES, {n: 1 for n in NODES}, ring_inventory(), 1)
    assert plan.step == 6 and plan.placed == frozenset({0, 1, 2})


def test_node_death_recopies_only_what_moved_or_lost_a_holder():
    """Node B dies: rank 1 moves to C (its holder) and needs a new holder; rank 0 lost its
    holder B. Only rank 2 (on C, holder A) keeps both copies in place."""
    inv = ring_inventory()
    del inv["B"]
    alive = ["A", "C"]
    plan = plan_recovery(ASSIGN, RING, alive, {"A": 2, "C": 2}, inv, 1)
    assert plan.assignment[1] == "C"
    assert plan.placed == frozenset({2})


def test_a_copy_of_only_an_older_step_is_not_placed():
    inv = ring_inventory()
    inv["B"][0] = [5]  # rank 0's holder B missed step 6 ...
    inv["A"][0] = [5, 6]
    inv["C"][0] = [6]  # ... which survives elsewhere
    plan = plan_recovery(ASSIGN, RING, NODES, {n: 1 for n in NODES}, inv, 1)
    assert plan.step == 6
    assert 0 not in plan.placed and {1, 2} <= plan.placed


# ---- several deaths at once (issue 26) ------------------------------------------------------

def test_every_worker_dead_with_the_stores_alive_restores_each_rank_on_its_own_node():
    plan = plan_recovery(ASSIGN, RING, NODES, {n: 1 for n in NODES}, ring_inventory(),
                         replicas=1, committed=6)
    assert plan.step == 6 and plan.assignment == ASSIGN and plan.moved == ()
    assert {r: s[0] for r, s in plan.sources.items()} == ASSIGN  # local, no network
    assert plan.placed == frozenset(ASSIGN)  # nothing to copy again


def test_a_node_and_a_process_on_another_node_dead_at_once_moves_only_the_nodes_rank():
    # B died (rank 1 and its copy of rank 0 with it); rank 2's process died on C: its
    # store on C lives, so rank 2 restores there and rank 1 goes to C, its holder
    plan = plan_recovery(ASSIGN, RING, ["A", "C"], {"A": 2, "C": 2}, ring_inventory(),
                         replicas=1, committed=6)
    assert plan.step == 6 and plan.assignment == {0: "A", 1: "C", 2: "C"}
    assert plan.sources[1] == ("C",) and plan.sources[2][0] == "C"  # its own node first


def test_two_ring_adjacent_nodes_lost_names_the_ranks_the_copies_and_the_settings():
    # B and C died: rank 1's own copy (B) and its only replica (C) with them
    with pytest.raises(RecoveryError) as e:
        plan_recovery(ASSIGN, RING, ["A"], {"A": 3}, ring_inventory(), replicas=1, committed=6)
    msg = str(e.value)
    assert "rank(s) [1]" in msg and "last committed step 6" in msg
    assert "rank 1: own copy on B, replicas on C" in msg  # the copies that were lost
    for setting in ("placement.replicas (now 1)", "placement.standby_nodes", "persistence tier"):
        assert setting in msg
