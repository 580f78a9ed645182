"""Elastic jobs without Ray: the config's sizes and checks, batch_plan, and the pure
resize decision (which size, which nodes, which copies, or fail)."""

from __future__ import annotations

import pytest

from memckpt import Config, FailureConfig, PlacementConfig, WorkersConfig
from memckpt.format.data import batch_plan
from memckpt.errors import ConfigError, RecoveryError, StateError
from memckpt.policy.recovery_plan import growth_size, plan_resize, served_ranks


def test_default_is_not_elastic():
    w = WorkersConfig(num_workers=4)
    assert w.min_workers == 4 and not w.elastic and w.sizes() == (4,) and w.grow


def test_sizes_step_by_whole_nodes_and_size_multiple():
    assert WorkersConfig(num_workers=3, min_workers=1).sizes() == (3, 2, 1)
    assert WorkersConfig(num_workers=8, min_workers=4, workers_per_node=2).sizes() == (8, 6, 4)
    assert WorkersConfig(num_workers=12, min_workers=4, workers_per_node=2,
                         size_multiple=4).sizes() == (12, 8, 4)


@pytest.mark.parametrize("kwargs, names", [
    (dict(num_workers=3, min_workers=0), "workers.min_workers=0"),
    (dict(num_workers=3, min_workers=4), "workers.min_workers=4"),
    (dict(num_workers=4, min_workers=3, workers_per_node=2), "workers.min_workers=3"),
    (dict(num_workers=4, min_workers=3, size_multiple=2), "multiple of 2"),
    (dict(num_workers=3, size_multiple=2), "workers.num_workers=3"),
    (dict(num_workers=3, min_workers=2, grow="yes"), "workers.grow"),
])
def test_invalid_worker_sizes_name_the_fix(kwargs, names):
    with pytest.raises(ConfigError) as e:
        WorkersConfig(**kwargs)
    assert names in str(e.value)


def test_replace_timeout_validated():
    assert FailureConfig(replace_timeout_s=0).replace_timeout_s == 0
    with pytest.raises(ConfigError, match="failure.replace_timeout_s"):
        FailureConfig(replace_timeout_s=-1)


def test_layouts_that_cannot_run_at_a_smaller_size():
    with pytest.raises(ConfigError, match="placement.standby_nodes"):
        Config(workers=WorkersConfig(num_workers=3, min_workers=2),
               placement=PlacementConfig(standby_nodes=1))
    # groups of 2 nodes cannot be formed from 3 nodes
    with pytest.raises(ConfigError, match="workers.min_workers=2: at 3 ranks"):
        Config(workers=WorkersConfig(num_workers=4, min_workers=2),
               placement=PlacementConfig(strategy="group", group_size=2))
    Config(workers=WorkersConfig(num_workers=3, min_workers=1))  # ring: any size


def test_batch_plan():
    assert batch_plan(24, 4, 3) == 2
    assert batch_plan(24, 4, 2) == 3
    assert batch_plan(24, 4, 1) == 6
    with pytest.raises(StateError) as e:
        batch_plan(24, 4, 4)
    assert "global batch 24" in str(e.value) and "4 ranks x micro batch 4 = 16" in str(e.value)
    with pytest.raises(StateError, match="micro_batch=0"):
        batch_plan(24, 0, 2)


# three one-rank nodes a, b, c; ring replicas: a->b, b->c, c->a
ASSIGN = {0: "a", 1: "b", 2: "c"}
INV = {"a": {0: [4, 5], 2: [4, 5]}, "b": {1: [4, 5], 0: [4, 5]}, "c": {2: [4, 5], 1: [4, 5]}}
CAP1 = {"a": 1, "b": 1, "c": 1, "d": 1}


def test_shrink_to_the_largest_size_the_live_nodes_place():
    plan = plan_resize(ASSIGN, ["a", "c"], CAP1, INV, 1, (3, 2), 1, "node b died", 5)
    assert (plan.step, plan.from_size, plan.to_size) == (5, 3, 2)
    assert plan.assignment == {0: "a", 1: "c"}
    # every old rank's shard, from the live nodes holding it; rank 1's from c (b died)
    assert plan.sources == {0: ("a",), 1: ("c",), 2: ("a", "c")}
    assert plan.holders == {0: ("c",), 1: ("a",)}
    assert not plan.notes


def test_shrink_to_one_node_keeps_no_replica_and_says_so():
    plan = plan_resize({0: "a", 1: "c"}, ["c"], CAP1, {"c": {0: [7], 1: [7]}}, 1,
                       (3, 2, 1), 1, "node a died")
    assert plan.to_size == 1 and plan.assignment == {0: "c"} and plan.holders == {0: ()}
    assert "fewer than 1 replicas" in plan.notes[0]


def test_below_min_workers_fails_naming_setting_and_node():
    with pytest.raises(RecoveryError) as e:
        plan_resize(ASSIGN, ["a"], CAP1, INV, 1, (3, 2), 1, "nodes b, c died")
    assert "workers.min_workers=2" in str(e.value) and "'b'" in str(e.value)


def test_every_copy_of_a_rank_gone_fails_naming_it():
    inv = {"a": {0: [5]}, "c": {2: [5]}}
    with pytest.raises(RecoveryError, match=r"rank\(s\) \[1\]"):
        plan_resize(ASSIGN, ["a", "c"], CAP1, inv, 1, (3, 2), 1, "node b died", 5)


def test_resize_takes_the_newest_step_every_rank_has():
    inv = {"a": {0: [4, 5], 2: [4]}, "c": {2: [4], 1: [4, 5]}}
    plan = plan_resize(ASSIGN, ["a", "c"], CAP1, inv, 1, (3, 2), 1, "node b died", 5)
    assert plan.step == 4 and "rolled back" in plan.notes[0]


def test_whole_nodes_only():
    # two ranks per node: a node with room for one rank is not used
    cap = {"a": 2, "b": 1, "c": 2}
    assign = {0: "a", 1: "a", 2: "x", 3: "x", 4: "c", 5: "c"}
    inv = {"a": {r: [3] for r in range(6)}}
    plan = plan_resize(assign, ["a", "b", "c"], cap, inv, 1, (6, 4, 2), 2, "node x died")
    assert plan.to_size == 4 and set(plan.assignment.values()) == {"a", "c"}


def test_growth_size():
    assert growth_size(2, (3, 2), ["a", "c", "d"], CAP1, 1) == 3
    assert growth_size(2, (3, 2), ["a", "c"], CAP1, 1) is None
    assert growth_size(3, (3, 2), ["a", "b", "c", "d"], CAP1, 1) is None


def test_ranks_stopped_for_growth_are_a_resize_not_a_finish_nor_a_restart():
    from memckpt.policy.failure import Action, Observation, decide
    stopped = Observation(pending=(), stopped=7, restarts=3, max_restarts=3)
    assert decide(stopped).action is Action.STOP
    grow = decide(Observation(pending=(), stopped=7, grow_to=3, restarts=3, max_restarts=3))
    assert grow.action is Action.RECOVER and grow.grow_to == 3 and "growing to 3" in grow.what
    # a rank still running when another stopped at the boundary: the resize too
    assert decide(Observation(pending=(1,), stopped=7, grow_to=3)).action is Action.RECOVER


def test_served_ranks_after_a_resize():
    """Each node keeps the own slots of the ranks it runs and the replicas it holds; a
    node the new layout does not use keeps nothing."""
    assignment = {0: "A", 1: "C"}
    holders = {0: ("C",), 1: ("A",)}
    assert served_ranks(assignment, holders, ["A", "C", "D"]) == {
        "A": ([0], [1]), "C": ([1], [0]), "D": ([], [])}
    two_per_node = {0: "A", 1: "A", 2: "B", 3: "B"}
    assert served_ranks(two_per_node, {0: ("B",), 1: ("B",), 2: ("A",), 3: ("A",)},
                        ["A", "B"]) == {"A": ([0, 1], [2, 3]), "B": ([2, 3], [0, 1])}
