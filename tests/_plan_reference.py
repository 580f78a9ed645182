"""The placement and recovery decisions as they were before they were made near-linear
(memckpt 0.x, issue #40): plain scans, quadratic at thousands of ranks, kept as the
brute-force reference the fast ones must agree with (tests/test_plan_scale.py)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from memckpt.errors import RecoveryError
from memckpt.policy.placement import Plan, validate_plan
from memckpt.policy.recovery_plan import (Inventory, RecoveryPlan, ResizePlan, feasible_size,
                                          lost_copies_error)


def newest_common_step(ranks: Sequence[int], inventory: Inventory,
                       at_most: Optional[int] = None) -> Optional[int]:
    common: Optional[set[int]] = None
    for rank in ranks:
        have = {s for held in inventory.values() for s in held.get(rank, ())}
        common = have if common is None else common & have
    if not common:
        return None
    steps = [s for s in common if at_most is None or s <= at_most]
    return max(steps) if steps else None


def lost_ranks(ranks: Sequence[int], inventory: Inventory, step: int) -> list[int]:
    return [r for r in ranks if not any(step in held.get(r, ()) for held in inventory.values())]


def choose_nodes(assignment: Mapping[int, str], alive: Sequence[str], capacity: Mapping[str, int],
                 inventory: Inventory, step: int) -> dict[int, str]:
    new = {r: n for r, n in assignment.items() if n in alive}
    load = {n: sum(1 for m in new.values() if m == n) for n in alive}
    for rank in sorted(r for r in assignment if r not in new):
        room = [n for n in alive if load[n] < capacity.get(n, 0)]
        if not room:
            raise RecoveryError(f"no live node has room for rank {rank}")
        local = [n for n in room if step in inventory.get(n, {}).get(rank, ())]
        pick = min(local or room, key=lambda n: (load[n], alive.index(n)))
        new[rank] = pick
        load[pick] += 1
    return new


def repair_holders(holders: Mapping[int, Sequence[str]], assignment: Mapping[int, str],
                   alive: Sequence[str], replicas: int) -> dict[int, tuple[str, ...]]:
    out: dict[int, list[str]] = {}
    for rank in sorted(assignment):
        own = assignment[rank]
        out[rank] = [h for h in holders.get(rank, ()) if h in alive and h != own][:replicas]
    load = {n: sum(n in hs for hs in out.values()) for n in alive}
    for rank in sorted(assignment):
        own, hs = assignment[rank], out[rank]
        while len(hs) < replicas:
            cands = [n for n in alive if n != own and n not in hs]
            if not cands:
                break
            pick = min(cands, key=lambda n: (load[n], alive.index(n)))
            hs.append(pick)
            load[pick] += 1
    return {r: tuple(hs) for r, hs in out.items()}


def _restore_step(ranks: Sequence[int], live_inv: Inventory, committed: Optional[int],
                  assignment: Mapping[int, str], holders: Optional[Mapping[int, Sequence[str]]],
                  replicas: Optional[int] = None) -> int:
    step = newest_common_step(ranks, live_inv)
    if step is not None:
        return step
    held = {r: sorted({s for inv in live_inv.values() for s in inv.get(r, ())}) for r in ranks}
    lost = [r for r, steps in held.items() if not steps]
    if lost:
        raise lost_copies_error(lost, assignment, holders, committed, replicas)
    raise RecoveryError(f"no step is held in RAM for every rank (steps held per rank: "
                        f"{held}); configure a persistence tier")


def _plan_at(step: int, old: Mapping[int, str], new: Mapping[int, str],
             holders: dict[int, tuple[str, ...]], alive: Sequence[str], live_inv: Inventory,
             committed: Optional[int], notes: list[str]) -> RecoveryPlan:
    ranks = sorted(new)
    if committed is not None and step < committed:
        notes.insert(0, f"rolled back past committed step {committed} to {step}: copies were lost")
    sources = {}
    for r in ranks:
        nodes = [n for n in alive if step in live_inv.get(n, {}).get(r, ())]
        nodes.sort(key=lambda n: n != new[r])
        sources[r] = tuple(nodes)
    moved = tuple(r for r in ranks if new[r] != old.get(r))
    placed = frozenset(r for r in ranks
                       if all(step in live_inv.get(n, {}).get(r, ())
                              for n in (new[r], *holders.get(r, ()))))
    return RecoveryPlan(step, dict(new), sources, holders, moved, tuple(notes), placed)


def plan_recovery(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                  alive: Sequence[str], capacity: Mapping[str, int], inventory: Inventory,
                  replicas: int, committed: Optional[int] = None) -> RecoveryPlan:
    live_inv = {n: inv for n, inv in inventory.items() if n in alive}
    step = _restore_step(sorted(assignment), live_inv, committed, assignment, holders, replicas)
    new_assignment = choose_nodes(assignment, alive, capacity, live_inv, step)
    new_holders = repair_holders(holders, new_assignment, alive, replicas)
    notes = []
    short = [r for r, hs in new_holders.items() if len(hs) < replicas]
    if short:
        notes.append(f"only {len(alive)} nodes alive: rank(s) {short} keep fewer than "
                     f"{replicas} replicas until nodes are added")
    return _plan_at(step, assignment, new_assignment, new_holders, alive, live_inv, committed,
                    notes)


def plan_in_place(previous: Mapping[int, str], assignment: Mapping[int, str],
                  holders: Mapping[int, Sequence[str]], alive: Sequence[str],
                  inventory: Inventory, committed: Optional[int] = None) -> RecoveryPlan:
    live_inv = {n: inv for n, inv in inventory.items() if n in alive}
    step = _restore_step(sorted(assignment), live_inv, committed, previous, None)
    return _plan_at(step, previous, assignment, {r: tuple(hs) for r, hs in holders.items()},
                    alive, live_inv, committed, [])


def place_ranks(size: int, alive: Sequence[str], capacity: Mapping[str, int],
                per_node: int, keep: Sequence[str] = ()) -> dict[int, str]:
    usable = [n for n in keep if n in alive and capacity.get(n, 0) >= per_node]
    usable = list(dict.fromkeys(usable))
    usable += [n for n in alive if n not in usable and capacity.get(n, 0) >= per_node]
    nodes = usable[: size // per_node]
    if len(nodes) * per_node < size:
        raise RecoveryError(f"{size} ranks need {size // per_node} nodes")
    return {r: nodes[r // per_node] for r in range(size)}


def plan_resize(assignment: Mapping[int, str], alive: Sequence[str],
                capacity: Mapping[str, int], inventory: Inventory, replicas: int,
                sizes: Sequence[int], per_node: int, why: str,
                committed: Optional[int] = None) -> ResizePlan:
    old = sorted(assignment)
    room = sum(capacity.get(n, 0) // per_node for n in alive) * per_node
    size = feasible_size(sizes, room)
    if size is None:
        raise RecoveryError("no size fits")
    live_inv = {n: inv for n, inv in inventory.items() if n in alive}
    step = newest_common_step(old, live_inv)
    if step is None:
        gone = [r for r in old if not any(live_inv.get(n, {}).get(r) for n in alive)]
        raise lost_copies_error(gone, assignment, None, committed, replicas)
    keep = [assignment[r] for r in old]
    new = place_ranks(size, alive, capacity, per_node, keep)
    sources = {}
    for r in old:
        nodes = [n for n in alive if step in live_inv.get(n, {}).get(r, ())]
        nodes.sort(key=lambda n: n not in new.values())
        sources[r] = tuple(nodes)
    nodes_used = list(dict.fromkeys(new.values()))
    new_holders = repair_holders({}, new, nodes_used, replicas)
    notes = []
    if committed is not None and step < committed:
        notes.append(f"rolled back past committed step {committed} to {step}: copies were lost")
    short = [r for r, hs in new_holders.items() if len(hs) < replicas]
    if short:
        notes.append(f"at {len(nodes_used)} node(s) rank(s) {short} keep fewer than {replicas} "
                     "replicas until nodes are added")
    return ResizePlan(step, len(old), size, new, sources, new_holders, why, tuple(notes))


def served_ranks(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                 nodes: Sequence[str]) -> dict[str, tuple[list[int], list[int]]]:
    return {n: (sorted(r for r, at in assignment.items() if at == n),
                sorted(r for r, hs in holders.items() if n in hs)) for n in nodes}


def repair_plan(plan: Mapping[str, Sequence[str]], alive: Sequence[str], replicas: int) -> Plan:
    alive = list(alive)
    up = set(alive)
    target = max(0, min(replicas, len(alive) - 1))
    owners = [o for o in plan if o in up] + [a for a in alive if a not in plan]
    slots: dict[str, list[str | None]] = {}
    for owner in owners:
        kept: list[str | None] = []
        for h in plan.get(owner, ()):
            kept.append(h if h in up and h != owner and h not in kept else None)
        kept += [None] * (target - len(kept))
        while len(kept) > target and None in kept:
            del kept[max(i for i, h in enumerate(kept) if h is None)]
        slots[owner] = kept[:target]
    load = {a: 0 for a in alive}
    for open_slots in slots.values():
        for held in open_slots:
            if held is not None:
                load[held] += 1
    rank = {a: i for i, a in enumerate(alive)}
    out: Plan = {}
    for owner in owners:
        chosen = slots[owner]
        for i, held in enumerate(chosen):
            if held is None:
                pick = min((a for a in alive if a != owner and a not in chosen),
                           key=lambda a: (load[a], rank[a]))
                chosen[i] = pick
                load[pick] += 1
        out[owner] = tuple(h for h in chosen if h is not None)
    validate_plan(out, target)
    return out


def format_plan(plan: Mapping[str, Sequence[str]], rank_nodes: Mapping[int, str] | None = None) -> str:
    lines = []
    for owner, holders in plan.items():
        label = owner
        if rank_nodes is not None:
            ranks = sorted(r for r, n in rank_nodes.items() if n == owner)
            label += f" (ranks {','.join(map(str, ranks))})" if ranks else " (no ranks)"
        lines.append(f"{label} -> {', '.join(holders) if holders else '(none)'}")
    return "\n".join(lines)
