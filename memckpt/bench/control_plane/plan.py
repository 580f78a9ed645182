"""Placement and recovery planning at thousands of ranks, timed on one core.

A synthetic job (``ranks`` ranks, ``per_node`` a node, ring placement, racks of
``rack_nodes`` nodes as failure domains) loses one node, two nodes or a whole rack; each
pure decision the driver makes from there is timed in CPU milliseconds: the placement at
start-up, the failure decision, the inventory's newest common step, where the ranks go,
the new holders, and the whole recovery plan. Pure (no Ray, no torch): a benchmark or a
test calls :func:`layout` and :func:`time_plan` directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from memckpt.policy import placement
from memckpt.policy.failure import Observation, decide
from memckpt.policy.recovery_plan import (Inventory, choose_nodes, newest_common_step,
                                          plan_recovery, repair_holders)

STEPS = (9, 10)  # the two steps every store holds (the committed one and the one before)


@dataclass(frozen=True)
class Layout:
    """A job's layout before a failure: nodes in ring order, where each rank runs, its
    replica holders, what each node's store holds, its rank slots and its rack."""

    nodes: list[str]
    assignment: dict[int, str]
    holders: dict[int, tuple[str, ...]]
    inventory: dict[str, dict[int, list[int]]]
    capacity: dict[str, int]
    domains: Optional[dict[str, str]]
    spares: tuple[str, ...] = ()  # empty nodes with room, joined to replace lost ones

    def dead(self, lose: str, seed: int = 0) -> list[str]:
        """The nodes ``lose`` names: ``node`` (one), ``two`` (two in different places) or
        ``rack`` (the whole rack of one node), picked by ``seed``."""
        n = len(self.nodes)
        first = self.nodes[(seed * 7919) % n]
        if lose == "node":
            return [first]
        if lose == "two":
            return [first, self.nodes[(seed * 7919 + n // 2 + 1) % n]]
        if lose == "rack" and self.domains is not None:
            return [m for m in self.nodes if self.domains[m] == self.domains[first]]
        raise ValueError(f"lose={lose!r}: one of 'node', 'two', 'rack' (racks need rack_nodes)")


def layout(ranks: int, per_node: int = 8, replicas: int = 1, rack_nodes: Optional[int] = None,
           spare_nodes: int = 0, room: Optional[int] = None, strategy: str = "ring",
           group_size: int = 2) -> Layout:
    """``ranks`` ranks on ``ranks // per_node`` nodes placed by ``strategy``; with
    ``rack_nodes``, racks of that many consecutive nodes are the failure domains. Every
    node holds :data:`STEPS` of its own ranks and of the ranks it is a holder of; each has
    ``room`` rank slots (default ``per_node``); ``spare_nodes`` more are empty."""
    count = ranks // per_node
    nodes = [f"node{i:05d}" for i in range(count)]
    spares = tuple(f"spare{i:03d}" for i in range(spare_nodes))
    domains = None if rack_nodes is None else {
        n: f"rack{i // rack_nodes:04d}" for i, n in enumerate([*nodes, *spares])}
    plan = placement.replica_plan(nodes, strategy, replicas, group_size, domains=domains)
    assignment = {r: nodes[r // per_node] for r in range(count * per_node)}
    holders = placement.rank_holders(assignment, plan)
    inventory: dict[str, dict[int, list[int]]] = {n: {} for n in [*nodes, *spares]}
    for rank, node in assignment.items():
        for n in (node, *holders[rank]):
            inventory[n][rank] = list(STEPS)
    capacity = {n: per_node if room is None else room for n in [*nodes, *spares]}
    return Layout(nodes, assignment, holders, inventory, capacity, domains, spares)


def _cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in CPU milliseconds of this process."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best * 1e3


def time_plan(ranks: int, lose: str = "node", per_node: int = 8, replicas: int = 1,
              rack_nodes: Optional[int] = 8, repeat: int = 3) -> dict[str, float]:
    """CPU milliseconds of each decision after losing ``lose`` (see :meth:`Layout.dead`)
    at ``ranks`` ranks, one spare node per lost node, the best of ``repeat`` runs;
    ``total``: placement + decide + plan_recovery (the plan includes the other parts)."""
    base = layout(ranks, per_node, replicas, rack_nodes)
    dead = base.dead(lose)
    job = layout(ranks, per_node, replicas, rack_nodes, spare_nodes=len(dead))
    gone = set(dead)
    alive = [n for n in [*job.nodes, *job.spares] if n not in gone]
    inventory: Inventory = {n: job.inventory[n] for n in alive}
    died = tuple(r for r, n in job.assignment.items() if n in gone)
    everyone = sorted(job.assignment)
    nodes = list(job.nodes)
    step = STEPS[-1]
    moved: dict[int, str] = {}

    def choose() -> None:
        moved.update(choose_nodes(job.assignment, alive, job.capacity, inventory, step))

    parts: dict[str, Callable[[], object]] = {
        "placement": lambda: placement.rank_holders(job.assignment, placement.replica_plan(
            nodes, "ring", replicas, domains=job.domains)),
        "decide": lambda: decide(Observation(pending=tuple(everyone), died=died)),
        "inventory": lambda: newest_common_step(everyone, inventory),
        "choose_nodes": choose,
    }
    out = {name: _cpu_ms(fn, repeat) for name, fn in parts.items()}
    out["repair_holders"] = _cpu_ms(lambda: repair_holders(job.holders, moved, alive, replicas,
                                                           domains=job.domains), repeat)
    out["plan_recovery"] = _cpu_ms(lambda: plan_recovery(
        job.assignment, job.holders, alive, job.capacity, inventory, replicas, step,
        domains=job.domains), repeat)
    # what a job pays: the placement at start-up; at a failure, the decision and the plan
    # (which does the inventory, choose_nodes and repair_holders parts itself)
    out["total"] = out["placement"] + out["decide"] + out["plan_recovery"]
    return out


def table(sizes: Sequence[int] = (1024, 4096, 16384), lose: str = "node",
          per_node: int = 8) -> str:
    """One line per size: the CPU milliseconds of each decision."""
    rows = [(n, time_plan(n, lose, per_node, rack_nodes=None)) for n in sizes]
    names = list(rows[0][1])
    head = f"{'ranks':>7} " + " ".join(f"{k:>14}" for k in names)
    return "\n".join([head] + [f"{n:>7} " + " ".join(f"{v[k]:>14.2f}" for k in names)
                               for n, v in rows])
