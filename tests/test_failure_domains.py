"""Failure domains (placement.failure_domain): every copy outside its owner's rack, the
layouts that cannot do it refused by name, and the recovery after a whole rack is lost.
Pure: no Ray, no torch."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from memckpt import Config, PlacementConfig, WorkersConfig
from memckpt.bench.control_plane.plan import STEPS, layout
from memckpt.errors import ConfigError, PlacementError
from memckpt.policy.loads import LeastLoaded
from memckpt.policy.placement import (node_domains, repair_plan, replica_plan, standby_plan,
                                      validate_plan)
from memckpt.ray_train.layout import holders_for
from memckpt.policy.recovery_plan import plan_recovery, repair_holders


def racks(nodes: list[str], per_rack: int) -> dict[str, str]:
    return {n: f"r{i // per_rack}" for i, n in enumerate(nodes)}


def names(n: int) -> list[str]:
    return [f"n{i:02d}" for i in range(n)]


def outside(plan, domains) -> bool:
    return all(domains[h] != domains[o] for o, hs in plan.items() for h in hs)


# ---- placement ----------------------------------------------------------------------------

def test_ring_alternates_equal_racks():
    nodes = names(6)  # racks r0 = n00,n01,n02 and r1 = n03,n04,n05
    plan = replica_plan(nodes, "ring", 1, domains=racks(nodes, 3), label="rack")
    # the ring is n00 n03 n01 n04 n02 n05: each node's copy on the next one, in the other rack
    assert plan == {"n00": ("n03",), "n03": ("n01",), "n01": ("n04",), "n04": ("n02",),
                    "n02": ("n05",), "n05": ("n00",)}
    assert list(plan) == nodes


@pytest.mark.parametrize("strategy,k,g", [("ring", 1, 2), ("ring", 2, 2), ("ring", 3, 2),
                                          ("group", 1, 4), ("group", 2, 4), ("mixed", 1, 3)])
def test_equal_racks_place_outside_and_balanced(strategy, k, g):
    nodes = names(24)
    domains = racks(nodes, 6)  # 4 racks of 6
    plan = replica_plan(nodes, strategy, k, g, domains=domains, label="rack")
    assert outside(plan, domains)
    validate_plan(plan, k, domains=domains)
    if strategy != "mixed":
        assert Counter(h for hs in plan.values() for h in hs) == {n: k for n in nodes}


@pytest.mark.parametrize("strategy,k,g", [("ring", 1, 2), ("ring", 2, 2), ("group", 1, 2),
                                          ("group", 2, 3), ("mixed", 1, 3), ("mixed", 2, 4)])
def test_every_node_its_own_domain_changes_nothing(strategy, k, g):
    nodes = names(12)
    plain = replica_plan(nodes, strategy, k, g)
    assert replica_plan(nodes, strategy, k, g, domains={n: n for n in nodes}) == plain
    assert replica_plan(nodes, strategy, k, g, domains=None) == plain


@pytest.mark.parametrize("seed", range(40))
def test_uneven_racks_ring_is_outside_whenever_it_can_be(seed):
    rnd = random.Random(seed)
    nodes = names(rnd.randint(2, 30))
    domains = {n: f"r{rnd.randint(0, rnd.randint(1, 5))}" for n in nodes}
    k = rnd.randint(1, 3)
    biggest = max(Counter(domains.values()).values())
    if k > len(nodes) - 1 or len(nodes) - biggest < k:
        with pytest.raises(PlacementError):
            replica_plan(nodes, "ring", k, domains=domains)
        return
    plan = replica_plan(nodes, "ring", k, domains=domains)
    assert outside(plan, domains) and all(len(hs) == k for hs in plan.values())


def test_one_rack_is_refused_by_name():
    nodes = names(4)
    with pytest.raises(PlacementError) as e:
        replica_plan(nodes, "ring", 1, domains={n: "r1" for n in nodes}, label="rack")
    assert str(e.value) == ("placement.failure_domain='rack': every node is in rack 'r1'; copies "
                            "need a second rack: add nodes with another 'rack' label or set "
                            "failure_domain=None")


def test_a_rack_too_big_for_the_replicas_is_refused():
    nodes = names(5)
    domains = {**{n: "r1" for n in nodes[:4]}, nodes[4]: "r2"}
    replica_plan(nodes, "ring", 1, domains=domains, label="rack")  # every r1 copy on n04
    with pytest.raises(PlacementError) as e:
        replica_plan(nodes, "ring", 2, domains=domains, label="rack")
    for part in ("placement.failure_domain='rack'", "rack 'r1' has 4 of the 5 nodes",
                 "placement.replicas=2", "{'r1': 4, 'r2': 1}", "failure_domain=None"):
        assert part in str(e.value)


def test_a_group_inside_one_rack_is_refused():
    nodes = names(6)
    domains = {**{n: "r1" for n in nodes[:5]}, nodes[5]: "r2"}
    with pytest.raises(PlacementError) as e:
        replica_plan(nodes, "group", 1, 2, domains=domains, label="zone")
    for part in ("placement.failure_domain='zone'", "strategy='group'", "group of 2",
                 "placement.strategy='ring'"):
        assert part in str(e.value)


def test_a_node_without_a_domain_is_refused():
    with pytest.raises(PlacementError) as e:
        replica_plan(names(3), "ring", 1, domains={"n00": "r1", "n01": "r2"}, label="rack")
    assert "['n02']" in str(e.value) and "rack" in str(e.value)


def test_node_domains_from_ray_labels():
    labels = {"a": {"rack": "r1", "ray.io/node-id": "a"}, "b": {"rack": "r2"}}
    assert node_domains(labels, "rack") == {"a": "r1", "b": "r2"}
    with pytest.raises(PlacementError) as e:
        node_domains({**labels, "c0ffee": {"zone": "z"}}, "rack")
    for part in ("placement.failure_domain='rack'", "['c0ffee']", "no 'rack' label",
                 "ray start --labels rack=", "failure_domain=None"):
        assert part in str(e.value)


def test_standby_outside_the_rack():
    active, standby = names(4), ["s0", "s1"]
    domains = {**racks(active, 2), "s0": "r0", "s1": "r1"}
    plan = standby_plan(active, standby, "ring", 2, domains=domains, label="rack")
    assert all(hs[0] in standby for hs in plan.values())
    assert outside(plan, domains)
    with pytest.raises(PlacementError) as e:
        standby_plan(active, standby, "ring", 1, domains={**domains, "s1": "r0"}, label="rack")
    assert "every standby node is in rack 'r0'" in str(e.value)


def test_validate_plan_refuses_a_copy_in_the_owners_rack():
    with pytest.raises(PlacementError) as e:
        validate_plan({"a": ("b",), "b": ("a",)}, 1, domains={"a": "r", "b": "r"}, label="rack")
    assert "in its own rack 'r'" in str(e.value)


def test_repair_plan_keeps_copies_outside_the_rack():
    nodes = names(12)
    domains = racks(nodes, 3)
    plan = replica_plan(nodes, "ring", 2, domains=domains)
    alive = [n for n in nodes if domains[n] != "r1"]
    repaired = repair_plan(plan, alive, 2, domains)
    assert set(repaired) == set(alive) and outside(repaired, domains)


# ---- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["", "  ", "rack ", "my rack", 3, ("rack",)])
def test_failure_domain_is_a_label_name(value):
    with pytest.raises(ConfigError) as e:
        PlacementConfig(failure_domain=value)
    assert "placement.failure_domain" in str(e.value) and "None" in str(e.value)


def test_failure_domain_accepted_and_out_of_the_fingerprint():
    assert PlacementConfig().failure_domain is None
    assert PlacementConfig(failure_domain="ray.io/availability-zone").failure_domain
    workers = WorkersConfig(num_workers=4, workers_per_node=2)
    plain = Config(workers=workers)
    racked = Config(workers=workers, placement=PlacementConfig(failure_domain="rack"))
    assert racked.fingerprint() == plain.fingerprint()  # where copies sit, not what they hold


def test_ray_train_holders_outside_the_rack():
    assignment = {r: f"n{r // 2}" for r in range(8)}  # 4 nodes, 2 ranks each
    domains = {"n0": "r0", "n1": "r0", "n2": "r1", "n3": "r1"}
    config = Config(workers=WorkersConfig(num_workers=8, workers_per_node=2),
                    placement=PlacementConfig(failure_domain="rack"))
    holders = holders_for(assignment, config, domains=domains)
    assert all(domains[h] != domains[assignment[r]] for r, hs in holders.items() for h in hs)


# ---- recovery ---------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [1, 2])
def test_a_whole_rack_lost_at_4096_ranks(replicas):
    job = layout(4096, 8, replicas, rack_nodes=8)
    dead = set(job.dead("rack", seed=5))
    assert len(dead) == 8
    alive = [n for n in job.nodes if n not in dead]
    capacity = {n: 16 for n in alive}  # room for the lost rack's ranks on the survivors
    plan = plan_recovery(job.assignment, job.holders, alive, capacity, job.inventory, replicas,
                         STEPS[-1], domains=job.domains)
    assert plan.step == STEPS[-1]
    domains = job.domains
    assert domains is not None
    lost = [r for r, n in job.assignment.items() if n in dead]
    assert len(lost) == 64 and set(plan.moved) == set(lost)
    for r in lost:  # each lost rank's copy sat in another rack, and it restores from there
        assert plan.sources[r] and all(domains[s] != domains[job.assignment[r]]
                                       for s in plan.sources[r])
        assert plan.sources[r][0] == plan.assignment[r]  # moved to the node holding it
    for r, hs in plan.holders.items():
        assert len(hs) == replicas
        assert all(domains[h] != domains[plan.assignment[r]] for h in hs)
    assert plan.notes == ()


def test_repair_falls_back_inside_the_domain_and_says_so():
    nodes = names(4)
    domains = racks(nodes, 2)  # r0: n00, n01; r1: n02, n03
    assignment = {r: n for r, n in enumerate(nodes)}
    ring = replica_plan(nodes, "ring", 1, domains=domains)
    holders = {r: ring[n] for r, n in assignment.items()}
    inv = {n: {r: [6] for r in assignment if n in (assignment[r], *holders[r])} for n in nodes}
    alive = ["n00", "n01"]
    plan = plan_recovery(assignment, holders, alive, {n: 2 for n in alive}, inv, 1, 6,
                         domains=domains)
    assert all(len(hs) == 1 for hs in plan.holders.values())  # a copy on the other node
    assert any("outside their failure domain" in note for note in plan.notes)
    # the same holders as without domains: the only other live node
    assert repair_holders(holders, plan.assignment, alive, 1) == plan.holders


# ---- the least-loaded pick --------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(30))
def test_least_loaded_pick_is_the_minimum(seed):
    rnd = random.Random(seed)
    nodes = names(rnd.randint(1, 20))
    domains = {n: f"d{rnd.randint(0, 3)}" for n in nodes} if seed % 2 else None
    limit = {n: rnd.randint(0, 4) for n in nodes} if seed % 3 == 0 else None
    load = {n: rnd.randint(0, 2) for n in nodes}
    picker = LeastLoaded(nodes, load, domains, limit)
    for _ in range(60):
        exclude = set(rnd.sample(nodes, rnd.randint(0, min(3, len(nodes)))))
        avoid = rnd.choice([None, *(domains or {n: n for n in nodes}).values()])
        room = [n for n in nodes if n not in exclude
                and (domains or {n: n}).get(n, n) != avoid
                and (limit is None or load[n] < limit[n])]
        want = min(room, key=lambda n: (load[n], nodes.index(n))) if room else None
        got = picker.pick(exclude, avoid)
        assert got == want
        if got is not None:
            picker.add(got)
            load[got] += 1
