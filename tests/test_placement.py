"""Unit tests for memckpt.policy.placement (pure, no Ray)."""

from __future__ import annotations

from collections import Counter

import pytest

from memckpt.errors import MemckptError, PlacementError
from memckpt.policy.placement import (
    STRATEGIES,
    check_feasible,
    format_plan,
    lost_nodes,
    rank_holders,
    repair_plan,
    replica_plan,
    standby_plan,
    validate_plan,
)


def names(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def load(plan) -> Counter:
    return Counter(h for holders in plan.values() for h in holders)


# ---- exact layouts written by hand -------------------------------------------------------

def test_ring_exact():
    assert replica_plan(["a", "b", "c"], "ring", 1) == {"a": ("b",), "b": ("c",), "c": ("a",)}
    assert replica_plan(["a", "b", "c", "d"], "ring", 2) == {
        "a": ("b", "c"), "b": ("c", "d"), "c": ("d", "a"), "d": ("a", "b")}
    assert replica_plan(["a", "b"], "ring", 1) == {"a": ("b",), "b": ("a",)}


def test_group_exact():
    assert replica_plan(["a", "b", "c", "d"], "group", 1, 2) == {
        "a": ("b",), "b": ("a",), "c": ("d",), "d": ("c",)}
    assert replica_plan(list("abcdef"), "group", 2, 3) == {
        "a": ("b", "c"), "b": ("c", "a"), "c": ("a", "b"),
        "d": ("e", "f"), "e": ("f", "d"), "f": ("d", "e")}


def test_mixed_exact():
    # groups (a,b),(c,d); leftover e uses ring over all nodes
    assert replica_plan(list("abcde"), "mixed", 1, 2) == {
        "a": ("b",), "b": ("a",), "c": ("d",), "d": ("c",), "e": ("a",)}
    # group (a,b,c); leftovers d,e ring over all nodes
    assert replica_plan(list("abcde"), "mixed", 2, 3) == {
        "a": ("b", "c"), "b": ("c", "a"), "c": ("a", "b"), "d": ("e", "a"), "e": ("a", "b")}


def test_mixed_equals_group_when_divisible():
    assert replica_plan(names(6), "mixed", 1, 3) == replica_plan(names(6), "group", 1, 3)


def test_mixed_group_larger_than_nodes_is_ring():
    assert replica_plan(names(3), "mixed", 1, 4) == replica_plan(names(3), "ring", 1)


def test_order_of_nodes_is_ring_order_and_deterministic():
    plan = replica_plan(["z", "y", "x"], "ring", 1)
    assert list(plan) == ["z", "y", "x"] and plan["z"] == ("y",)
    assert replica_plan(names(7), "mixed", 2, 3) == replica_plan(names(7), "mixed", 2, 3)


# ---- properties over many sizes ----------------------------------------------------------

def layouts():
    for n in range(2, 9):
        for k in (1, 2):
            if k > n - 1:
                continue
            yield n, "ring", k, 2
            for g in range(max(2, k + 1), n + 1):
                yield n, "mixed", k, g
                if n % g == 0:
                    yield n, "group", k, g


@pytest.mark.parametrize("n,strategy,k,g", list(layouts()))
def test_plan_properties(n, strategy, k, g):
    nodes = names(n)
    plan = replica_plan(nodes, strategy, k, g)
    assert list(plan) == nodes
    for owner, holders in plan.items():
        assert isinstance(holders, tuple) and len(holders) == k
        assert owner not in holders
        assert len(set(holders)) == k
        assert set(holders) <= set(nodes)
    if strategy in ("ring", "group"):
        assert load(plan) == {node: k for node in nodes}  # perfectly balanced
    if strategy == "group":  # holders stay within the owner's group
        for i, owner in enumerate(nodes):
            group = set(nodes[i - i % g:i - i % g + g])
            assert set(plan[owner]) <= group
    validate_plan(plan, k)


# ---- infeasible layouts ------------------------------------------------------------------

@pytest.mark.parametrize("args,parts", [
    ((3, "star", 1, 2), ["placement.strategy='star'", "ring", "group", "mixed"]),
    ((1, "ring", 1, 2), ["at least 2 nodes", "single node", "replicas=1", "add nodes"]),
    ((0, "ring", 1, 2), ["at least 2 nodes", "add nodes"]),
    ((3, "ring", 0, 2), ["placement.replicas=0", ">= 1"]),
    ((3, "ring", 3, 2), ["placement.replicas=3 needs at least 4 nodes", "there are 3",
                         "lower placement.replicas to <= 2", "add nodes"]),
    ((4, "group", 1, 1), ["placement.group_size=1", ">= 2"]),
    ((6, "group", 2, 2), ["placement.group_size=2", "placement.replicas=2",
                          "raise placement.group_size to >= 3", "lower placement.replicas to <= 1"]),
    ((4, "group", 1, 6), ["placement.group_size=6", "larger than the 4 nodes", "strategy='ring'"]),
    ((5, "group", 1, 2), ["placement.group_size=2", "does not divide the 5 nodes",
                          "strategy='mixed'", "[5]"]),
    ((6, "group", 1, 4), ["placement.group_size=4", "strategy='mixed'", "[2, 3, 6]"]),
    ((5, "mixed", 2, 2), ["placement.group_size=2", "raise placement.group_size to >= 3"]),
    ((5, "mixed", 1, 1), ["placement.group_size=1", ">= 2"]),
    ((2, "mixed", 2, 3), ["placement.replicas=2", "lower placement.replicas to <= 1"]),
    ((3, "ring", 1.5, 2), ["placement.replicas=1.5", "integer"]),
])
def test_infeasible_messages(args, parts):
    with pytest.raises(PlacementError) as info:
        check_feasible(*args)
    for part in parts:
        assert part in str(info.value)
    assert isinstance(info.value, MemckptError)


def test_feasible_cases_pass():
    check_feasible(2, "ring", 1, 99)  # group_size ignored for ring
    check_feasible(5, "mixed", 2, 3)
    check_feasible(6, "group", 2, 3)
    assert STRATEGIES == ("ring", "group", "mixed")


def test_replica_plan_checks_feasibility_and_duplicates():
    with pytest.raises(PlacementError, match="placement.replicas=2"):
        replica_plan(["a", "b"], "ring", 2)
    with pytest.raises(PlacementError, match="unique"):
        replica_plan(["a", "b", "a"], "ring", 1)


# ---- validate_plan -----------------------------------------------------------------------

@pytest.mark.parametrize("plan,k,part", [
    ({"a": ("a",), "b": ("a",)}, 1, "own replica"),
    ({"a": ("b", "b"), "b": ("a", "c"), "c": ("a", "b")}, 2, "twice"),
    ({"a": ("x",), "b": ("a",)}, 1, "not nodes of the plan"),
    ({"a": ("b",), "b": ("a",)}, 2, "1 holders but placement.replicas=2"),
])
def test_validate_plan_rejects(plan, k, part):
    with pytest.raises(PlacementError, match=part):
        validate_plan(plan, k)


# ---- rank_holders / format_plan ----------------------------------------------------------

def test_rank_holders():
    plan = replica_plan(["a", "b", "c"], "ring", 1)
    assert rank_holders({1: "a", 0: "a", 2: "c"}, plan) == {0: ("b",), 1: ("b",), 2: ("a",)}
    assert list(rank_holders({3: "b", 0: "a"}, plan)) == [0, 3]
    with pytest.raises(PlacementError, match="rank 4 runs on node 'z'"):
        rank_holders({4: "z"}, plan)


def test_format_plan():
    plan = replica_plan(["node-a", "node-b", "node-c"], "ring", 2)
    text = format_plan(plan, {0: "node-a", 1: "node-a", 2: "node-b"})
    lines = text.splitlines()
    assert lines[0] == "node-a (ranks 0,1) -> node-b, node-c"
    assert lines[1] == "node-b (ranks 2) -> node-c, node-a"
    assert lines[2] == "node-c (no ranks) -> node-a, node-b"
    assert format_plan(plan).splitlines()[0] == "node-a -> node-b, node-c"
    assert format_plan({"a": ()}) == "a -> (none)"


# ---- repair_plan -------------------------------------------------------------------------

def check_repaired(old, new, alive, k):
    assert set(new) == set(alive)
    for owner, holders in new.items():
        assert owner not in holders and len(set(holders)) == len(holders) == k
        assert set(holders) <= set(alive)
        for i, h in enumerate(old.get(owner, ())):  # survivors stay at their position
            if h in alive:
                assert holders[i] == h


@pytest.mark.parametrize("n,strategy,k,g", [(5, "ring", 1, 2), (6, "ring", 2, 2), (6, "group", 1, 2),
                                            (6, "group", 2, 3), (7, "mixed", 2, 3), (8, "ring", 2, 2)])
def test_repair_one_and_two_deaths(n, strategy, k, g):
    nodes = names(n)
    plan = replica_plan(nodes, strategy, k, g)
    for dead in ([nodes[1]], [nodes[0], nodes[3]], [nodes[-1], nodes[-2]]):
        alive = [x for x in nodes if x not in dead]
        new = repair_plan(plan, alive, k)
        check_repaired(plan, new, alive, k)
        # untouched owners keep their plan exactly
        for owner in alive:
            if not set(plan[owner]) & set(dead):
                assert new[owner] == plan[owner]


def test_repair_ring_exact_picks_least_loaded():
    plan = replica_plan(list("abcd"), "ring", 1)  # a->b b->c c->d d->a
    # c dies: b lost its holder; loads: b=1 (a), d=0 (c gone), a=1 (d) -> d is least loaded
    assert repair_plan(plan, ["a", "b", "d"], 1) == {"a": ("b",), "b": ("d",), "d": ("a",)}


def test_repair_tie_broken_by_alive_order():
    plan = {"a": ("b",), "b": ("c",), "c": ("a",), "d": ("c",)}
    # c dies: b and d need a holder; loads a=0 (c gone), b=1, d=0
    # b: a and d tie at 0 -> a (first in alive); d: a and b tie at 1 -> a
    assert repair_plan(plan, ["a", "b", "d"], 1) == {"a": ("b",), "b": ("a",), "d": ("a",)}
    # the same with another alive order picks d first
    assert repair_plan(plan, ["d", "b", "a"], 1) == {"a": ("b",), "b": ("d",), "d": ("a",)}


def test_repair_balances_load():
    nodes = names(8)
    plan = replica_plan(nodes, "ring", 2)
    alive = nodes[:2] + nodes[4:]  # n2, n3 dead
    new = repair_plan(plan, alive, 2)
    counts = load(new)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_repair_with_too_few_alive_reduces_redundancy():
    plan = replica_plan(list("abcd"), "ring", 2)
    new = repair_plan(plan, ["a", "c"], 2)
    assert new == {"a": ("c",), "c": ("a",)}  # a kept c in place, c kept a
    assert repair_plan(plan, ["b"], 2) == {"b": ()}
    assert repair_plan(plan, [], 2) == {}


def test_repair_refills_and_adopts_new_nodes():
    reduced = {"a": ("c",), "c": ("a",)}
    new = repair_plan(reduced, ["a", "c", "e"], 2)
    assert new["a"][0] == "c" and new["c"][0] == "a" and set(new) == {"a", "c", "e"}
    check_repaired(reduced, new, ["a", "c", "e"], 2)
    with pytest.raises(PlacementError, match="unique"):
        repair_plan(reduced, ["a", "a"], 1)


def test_repair_with_lowered_replicas_keeps_first_survivors():
    plan = replica_plan(list("abcd"), "ring", 2)
    assert repair_plan(plan, list("abcd"), 1) == {"a": ("b",), "b": ("c",), "c": ("d",), "d": ("a",)}


# ---- lost_nodes --------------------------------------------------------------------------

def test_lost_nodes():
    ring1 = replica_plan(list("abcd"), "ring", 1)  # a->b b->c c->d d->a
    assert lost_nodes(ring1, ["b"]) == []
    assert lost_nodes(ring1, ["a", "c"]) == []
    assert lost_nodes(ring1, {"a", "b"}) == ["a"]  # a and its only holder b dead
    assert lost_nodes(ring1, ["c", "b", "a"]) == ["a", "b"]
    ring2 = replica_plan(list("abcd"), "ring", 2)
    assert lost_nodes(ring2, ["a", "b"]) == []
    assert lost_nodes(ring2, ["a", "b", "c"]) == ["a"]
    group = replica_plan(list("abcd"), "group", 1, 2)
    assert lost_nodes(group, ["a", "c"]) == []
    assert lost_nodes(group, ["c", "d"]) == ["c", "d"]
    assert lost_nodes({"a": (), "b": ()}, ["a"]) == ["a"]  # no holder at all


# ---- standby nodes ----------------------------------------------------------------------------
def test_standby_nodes_hold_every_first_copy_round_robin():
    assert standby_plan(["a", "b", "c"], ["s"], "ring", 1) == {"a": ("s",), "b": ("s",), "c": ("s",)}
    assert standby_plan(["a", "b", "c", "d"], ["s", "t"], "ring", 1) == {
        "a": ("s",), "b": ("t",), "c": ("s",), "d": ("t",)}
    # the other k-1 copies follow the strategy over the active nodes
    assert standby_plan(["a", "b", "c"], ["s"], "ring", 2) == {
        "a": ("s", "b"), "b": ("s", "c"), "c": ("s", "a")}
    assert standby_plan(["a", "b", "c", "d"], ["s"], "group", 2, group_size=2) == {
        "a": ("s", "b"), "b": ("s", "a"), "c": ("s", "d"), "d": ("s", "c")}
    # one active node is enough when the standby holds its only copy
    assert standby_plan(["a"], ["s"], "ring", 1) == {"a": ("s",)}


def test_no_standby_is_the_plain_plan():
    assert standby_plan(names(4), [], "ring", 2) == replica_plan(names(4), "ring", 2)


@pytest.mark.parametrize("args, part", [
    ((["a", "b"], ["s"], "ring", 0), "placement.replicas >= 1"),
    ((["a", "b"], ["b"], "ring", 1), "both active and standby"),
    ((["a"], ["s"], "ring", 2), "at least 2 nodes"),  # the second copy needs another active node
])
def test_standby_plan_errors_name_the_fix(args, part):
    with pytest.raises(PlacementError, match=part):
        standby_plan(*args)


def test_a_standby_holder_is_valid_though_it_owns_nothing():
    plan = {"a": ("s",), "b": ("s",)}
    with pytest.raises(PlacementError, match="not nodes of the plan"):
        validate_plan(plan, 1)
    validate_plan(plan, 1, extra_holders=["s"])
