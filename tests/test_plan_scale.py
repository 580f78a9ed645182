"""The near-linear placement and recovery decisions give the same answers as the plain scans
they replaced (tests/_plan_reference.py): on many small random layouts and on jobs of 4,096
ranks losing one node, two nodes or a whole rack. Nothing here is timed
(memckpt.bench.control_plane.plan times them). Pure: no Ray, no torch."""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

import _plan_reference as ref
from memckpt.bench.control_plane.plan import STEPS, layout
from memckpt.errors import RecoveryError
from memckpt.policy import placement, recovery_plan as fast


def same(run: Callable[[Any], Any]) -> Any:
    """``run(fast)`` and ``run(ref)`` agree: the same value, or both a RecoveryError."""
    try:
        want = run(ref)
    except RecoveryError:
        with pytest.raises(RecoveryError):
            run(fast)
        return None
    got = run(fast)
    assert got == want
    if isinstance(want, dict):  # the order a plan or a report lists things in, too
        assert list(got) == list(want)
    return got


def small_case(seed: int) -> dict[str, Any]:
    """A random job on 3-12 nodes: holders partly dead or repeated, inventories with
    gaps, capacities that may be short, spare nodes, the live nodes in any order."""
    rnd = random.Random(seed)
    nodes = [f"n{i}" for i in range(rnd.randint(3, 12))]
    per = rnd.randint(1, 3)
    assignment = {r: nodes[r // per] for r in range(len(nodes) * per)}
    holders = {r: tuple(rnd.sample(nodes, rnd.randint(0, 3))) for r in assignment}
    if rnd.random() < 0.3:
        holders[0] = holders[0] + holders[0][:1]  # a holder repeated
    dead = set(rnd.sample(nodes, rnd.randint(1, len(nodes) - 1)))
    alive = [n for n in nodes if n not in dead] + [f"s{i}" for i in range(rnd.randint(0, 2))]
    rnd.shuffle(alive)
    inventory: dict[str, dict[int, list[int]]] = {}
    for n in [*nodes, *alive]:
        inventory[n] = {r: sorted(rnd.sample([4, 5, 6], rnd.randint(1, 3)))
                        for r in assignment if rnd.random() < 0.5}
    capacity = {n: rnd.randint(0, 2 * per + 1) for n in alive}
    return dict(assignment=assignment, holders=holders, alive=alive, inventory=inventory,
                capacity=capacity, replicas=rnd.randint(1, 3), committed=rnd.choice([None, 5, 6]),
                nodes=nodes, per=per)


def check_all(c: dict[str, Any], big: bool = False) -> None:
    """Every decision of both implementations on one case (``big``: not those whose
    reference takes seconds at thousands of ranks)."""
    a, h, alive, inv, cap, k = (c["assignment"], c["holders"], c["alive"], c["inventory"],
                                c["capacity"], c["replicas"])
    ranks = sorted(a)
    same(lambda m: m.newest_common_step(ranks, inv))
    same(lambda m: m.newest_common_step(ranks, inv, at_most=5))
    for step in (5, 6):
        same(lambda m: m.lost_ranks(ranks, inv, step))
        same(lambda m: m.choose_nodes(a, alive, cap, inv, step))
    moved = {r: alive[r % len(alive)] for r in a}
    same(lambda m: m.repair_holders(h, moved, alive, k))
    if not big:  # a node listed once per rank (the reference's scans take seconds)
        same(lambda m: m.repair_holders(h, a, list(a.values()) + alive, k))
    same(lambda m: m.plan_recovery(a, h, alive, cap, inv, k, c["committed"]))
    same(lambda m: m.plan_in_place(a, moved, h, alive, inv, c["committed"]))
    same(lambda m: m.served_ranks(a, h, [*c["nodes"], *alive]))
    same(lambda m: m.place_ranks(c["per"], alive, cap, c["per"], list(a.values())[::-1]))
    if big:
        return
    sizes = list(range(len(a), 0, -c["per"]))
    same(lambda m: m.plan_resize(a, alive, cap, inv, k, sizes, c["per"], "lost",
                                 c["committed"]))


@pytest.mark.parametrize("seed", range(150))
def test_small_random_layouts_agree(seed):
    check_all(small_case(seed))


@pytest.mark.parametrize("seed", range(60))
def test_repair_plan_and_format_agree(seed):
    rnd = random.Random(seed)
    nodes = [f"n{i}" for i in range(rnd.randint(2, 14))]
    k = rnd.randint(1, len(nodes) - 1)
    plan = placement.replica_plan(nodes, "ring", k)
    alive = [n for n in nodes if rnd.random() < 0.7] + [f"s{i}" for i in range(rnd.randint(0, 2))]
    rnd.shuffle(alive)
    for replicas in (k, k + 1, max(1, k - 1)):
        assert placement.repair_plan(plan, alive, replicas) == ref.repair_plan(plan, alive, replicas)
    ranks = {r: rnd.choice(nodes) for r in range(3 * len(nodes))}
    assert placement.format_plan(plan, ranks) == ref.format_plan(plan, ranks)


def big_case(lose: str, seed: int, replicas: int = 1, room: int | None = None,
             ranks: int = 4096) -> dict[str, Any]:
    """``ranks`` ranks, 8 a node, racks of 8 nodes; ``lose`` (node, two, rack) picked by
    ``seed``, one spare node per lost node; some copies miss the newest step."""
    job = layout(ranks, 8, replicas, rack_nodes=8, spare_nodes=0, room=room)
    dead = set(job.dead(lose, seed))
    job = layout(ranks, 8, replicas, rack_nodes=8, spare_nodes=len(dead), room=room)
    rnd = random.Random(seed)
    for held in job.inventory.values():
        for r in rnd.sample(sorted(held), len(held) // 20):
            held[r] = [STEPS[0]]  # this copy of the newest step was not finished
    alive = [n for n in [*job.nodes, *job.spares] if n not in dead]
    return dict(assignment=job.assignment, holders=job.holders, alive=alive,
                inventory=job.inventory, capacity=job.capacity, replicas=replicas,
                committed=STEPS[-1], nodes=job.nodes, per=8)


@pytest.mark.parametrize("lose", ["node", "two", "rack"])
@pytest.mark.parametrize("seed", [0, 1])
def test_4096_ranks_agree(lose, seed):
    c = big_case(lose, seed, replicas=1 + seed, room=None if seed else 12)
    check_all(c, big=True)
    plan = fast.plan_recovery(c["assignment"], c["holders"], c["alive"], c["capacity"],
                              c["inventory"], c["replicas"], c["committed"])
    assert len(plan.assignment) == 4096 and all(plan.sources.values())


def test_4096_ranks_repair_plan_agrees():
    nodes = [f"node{i:04d}" for i in range(512)]
    plan = placement.replica_plan(nodes, "ring", 2)
    for dead in ({"node0007"}, {"node0007", "node0300"}, set(nodes[64:72])):
        alive = [n for n in nodes if n not in dead] + ["spare0"]
        assert placement.repair_plan(plan, alive, 2) == ref.repair_plan(plan, alive, 2)


@pytest.mark.parametrize("lose", ["node", "rack"])
def test_1024_ranks_resize_agrees(lose):
    c = big_case(lose, 3, ranks=1024)
    a, alive = c["assignment"], c["alive"][:-2]  # no spare for the last two lost nodes
    sizes = list(range(1024, 0, -8))
    same(lambda m: m.plan_resize(a, alive, c["capacity"], c["inventory"], 1, sizes, 8, "lost", 10))
    same(lambda m: m.repair_holders(c["holders"], a, list(a.values()) + alive, 1))


def test_time_plan_names_every_decision():
    # the benchmark's entry point runs (its figures are not checked: tests time nothing)
    from memckpt.bench.control_plane.plan import table, time_plan
    parts = time_plan(256, "rack", repeat=1)
    assert list(parts) == ["placement", "decide", "inventory", "choose_nodes", "repair_holders",
                           "plan_recovery", "total"]
    assert all(v >= 0 for v in parts.values())
    assert table((128,), "two").splitlines()[1].split()[0] == "128"
