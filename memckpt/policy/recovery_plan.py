"""Pure recovery decisions: which step every rank returns to, where it runs, where its
shard comes from, and who holds its replicas afterwards. No Ray, no torch.

The runtime gathers an inventory (which node holds which (rank, step) in RAM),
calls :func:`plan_recovery`, and carries out the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

from memckpt.errors import RecoveryError
from memckpt.policy.loads import Domains, LeastLoaded, domain_of

# node id -> rank -> steps that node holds for that rank (own copy or replica)
Inventory = Mapping[str, Mapping[int, Sequence[int]]]


@dataclass(frozen=True)
class RecoveryPlan:
    step: int  # every rank resumes from this step
    assignment: dict[int, str]  # rank -> node it runs on
    sources: dict[int, tuple[str, ...]]  # rank -> nodes holding its shard at `step`, best first
    holders: dict[int, tuple[str, ...]]  # rank -> replica holders from now on
    moved: tuple[int, ...] = ()  # ranks that changed node
    notes: tuple[str, ...] = field(default=())
    # ranks whose shard at `step` already sits on their (new) node and on all their new
    # holders: nothing to copy again after the restore
    placed: frozenset[int] = frozenset()


def steps_held(ranks: Sequence[int], inventory: Inventory) -> dict[int, set[int]]:
    """rank -> every step some node of ``inventory`` holds for it (one pass over it)."""
    want = set(ranks)
    have: dict[int, set[int]] = {r: set() for r in ranks}
    for held in inventory.values():
        for rank, steps in held.items():
            if rank in want:
                have[rank].update(steps)
    return have


def newest_common_step(ranks: Sequence[int], inventory: Inventory,
                       at_most: Optional[int] = None) -> Optional[int]:
    """Newest step for which every rank has at least one copy somewhere in ``inventory``."""
    common: Optional[set[int]] = None
    for have in steps_held(ranks, inventory).values():
        common = set(have) if common is None else common & have
        if not common:
            return None
    if not common:
        return None
    steps = [s for s in common if at_most is None or s <= at_most]
    return max(steps) if steps else None


def lost_ranks(ranks: Sequence[int], inventory: Inventory, step: int) -> list[int]:
    have = steps_held(ranks, inventory)
    return [r for r in ranks if step not in have[r]]


def nodes_holding(inventory: Inventory, step: int, nodes: Sequence[str],
                  ranks: Optional[Collection[int]] = None) -> dict[int, list[str]]:
    """rank -> the ``nodes`` (in their order, repeats kept) whose inventory holds it at
    ``step``; only ``ranks`` when given."""
    out: dict[int, list[str]] = {}
    for n in nodes:
        for rank, steps in inventory.get(n, {}).items():
            if (ranks is None or rank in ranks) and step in steps:
                out.setdefault(rank, []).append(n)
    return out


def choose_nodes(assignment: Mapping[int, str], alive: Sequence[str], capacity: Mapping[str, int],
                 inventory: Inventory, step: int) -> dict[int, str]:
    """Keep ranks on live nodes; move the others, preferring a node that already holds
    their shard (restore without network), then the least loaded node with room."""
    up = set(alive)
    new = {r: n for r, n in assignment.items() if n in up}
    load = dict.fromkeys(alive, 0)
    for n in new.values():
        load[n] += 1
    nodes = LeastLoaded(alive, load, limit=capacity)
    moving = sorted(r for r in assignment if r not in new)
    local = nodes_holding(inventory, step, alive, set(moving))
    for rank in moving:
        room = [n for n in local.get(rank, ()) if nodes.open(n)]
        pick = (min(room, key=lambda n: (nodes.load[n], nodes.pos[n])) if room
                else nodes.pick())
        if pick is None:
            raise RecoveryError(
                f"no live node has room for rank {rank}: {len(alive)} nodes alive with capacity "
                f"{dict(capacity)}; add a node or lower workers.cpus_per_worker")
        new[rank] = pick
        nodes.add(pick)
    return new


def repair_holders(holders: Mapping[int, Sequence[str]], assignment: Mapping[int, str],
                   alive: Sequence[str], replicas: int,
                   domains: Domains = None) -> dict[int, tuple[str, ...]]:
    """Replica holders per rank after failures: keep live holders that are not the rank's
    own node, fill up to ``replicas`` with the least-loaded other live nodes.

    With ``domains``, a holder sits outside the failure domain of the rank's node: holders
    inside it are replaced, and only when no live node outside it is left does a copy go
    to another node of the same domain (it still survives that node's loss)."""
    up = set(alive)
    out: dict[int, list[str]] = {}
    for rank in sorted(assignment):
        own = assignment[rank]
        out[rank] = [h for h in holders.get(rank, ())
                     if h in up and domain_of(h, domains) != domain_of(own, domains)][:replicas]
    load = dict.fromkeys(alive, 0)
    for hs in out.values():
        for n in set(hs):
            load[n] += 1
    nodes = LeastLoaded(alive, load, domains)
    for rank, hs in out.items():
        own = assignment[rank]
        while len(hs) < replicas:
            taken = {own, *hs}
            pick = nodes.pick(taken, avoid=domain_of(own, domains))
            if pick is None and domains is not None:
                pick = nodes.pick(taken)  # no live node outside the domain: one inside it
            if pick is None:
                break  # fewer nodes than replicas + 1: reduced redundancy, reported by caller
            hs.append(pick)
            nodes.add(pick)
    return {r: tuple(hs) for r, hs in out.items()}


def inside_domain(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                  domains: Domains) -> list[int]:
    """Ranks (sorted) with a replica holder in their own node's failure domain."""
    if domains is None:
        return []
    return sorted(r for r, hs in holders.items()
                  if any(domain_of(h, domains) == domain_of(assignment[r], domains) for h in hs))


def plan_recovery(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                  alive: Sequence[str], capacity: Mapping[str, int], inventory: Inventory,
                  replicas: int, committed: Optional[int] = None,
                  domains: Domains = None) -> RecoveryPlan:
    """Decide the step, placement, sources and new holders after a failure.

    The step is the newest one every rank still has a copy of on a live node.
    ``committed`` (the coordinator's last committed step) only informs the notes
    and messages. If some rank has no copy left, :class:`RecoveryError` names it.
    ``domains`` (node -> failure domain): new holders sit outside the failure domain of
    their rank's node (:func:`repair_holders`). Near-linear in ranks and nodes.
    """
    up = set(alive)
    live_inv = {n: inv for n, inv in inventory.items() if n in up}
    step = _restore_step(sorted(assignment), live_inv, committed, assignment, holders, replicas)
    new_assignment = choose_nodes(assignment, alive, capacity, live_inv, step)
    new_holders = repair_holders(holders, new_assignment, alive, replicas, domains)
    notes = []
    short = [r for r, hs in new_holders.items() if len(hs) < replicas]
    if short:
        notes.append(f"only {len(alive)} nodes alive: rank(s) {short} keep fewer than "
                     f"{replicas} replicas until nodes are added")
    inside = inside_domain(new_assignment, new_holders, domains)
    if inside:
        notes.append(f"no live node outside their failure domain: rank(s) {inside} keep a "
                     "replica inside their own until nodes of another domain are added")
    return _plan_at(step, assignment, new_assignment, new_holders, alive, live_inv, committed,
                    notes)


def plan_in_place(previous: Mapping[int, str], assignment: Mapping[int, str],
                  holders: Mapping[int, Sequence[str]], alive: Sequence[str],
                  inventory: Inventory, committed: Optional[int] = None) -> RecoveryPlan:
    """The same decision where a scheduler already placed every rank (Ray Train restarts the
    whole worker group wherever it finds room): ``assignment`` and the new ``holders`` are
    given; the step and each rank's sources (its own node first) are decided as in
    :func:`plan_recovery`. ``previous`` is where the ranks ran before."""
    up = set(alive)
    live_inv = {n: inv for n, inv in inventory.items() if n in up}
    step = _restore_step(sorted(assignment), live_inv, committed, previous, None)
    return _plan_at(step, previous, assignment, {r: tuple(hs) for r, hs in holders.items()},
                    alive, live_inv, committed, [])


def lost_copies_error(lost: Sequence[int], assignment: Mapping[int, str],
                      holders: Optional[Mapping[int, Sequence[str]]], committed: Optional[int],
                      replicas: Optional[int] = None) -> RecoveryError:
    """The job cannot go on from RAM: names the ranks, where each one's copies were (its
    own node and its replica holders, all dead; ``holders`` None: not known here) and the
    settings that would have kept one."""
    def copies(r: int) -> str:
        own = f"rank {r}: own copy on {assignment[r][:12] if r in assignment else '?'}"
        if holders is None:
            return own
        held = holders.get(r, ())
        return own + (f", replicas on {', '.join(h[:12] for h in held)}" if held
                      else ", no replica")
    where = "; ".join(copies(r) for r in lost)
    more = "raise placement.replicas" + (f" (now {replicas})" if replicas is not None else "")
    return RecoveryError(
        f"every RAM copy of rank(s) {list(lost)} is gone (last committed step {committed}): "
        f"{where}, and every one of those nodes died. To survive this: {more}, keep "
        "placement.standby_nodes (a node holding replicas and running no rank), or "
        "configure a persistence tier")


def _restore_step(ranks: Sequence[int], live_inv: Inventory, committed: Optional[int],
                  assignment: Mapping[int, str], holders: Optional[Mapping[int, Sequence[str]]],
                  replicas: Optional[int] = None) -> int:
    step = newest_common_step(ranks, live_inv)
    if step is not None:
        return step
    held = {r: sorted(steps) for r, steps in steps_held(ranks, live_inv).items()}
    lost = [r for r, steps in held.items() if not steps]
    if lost:
        raise lost_copies_error(lost, assignment, holders, committed, replicas)
    raise RecoveryError(f"no step is held in RAM for every rank (steps held per rank: "
                        f"{held}); configure a persistence tier")


def _plan_at(step: int, old: Mapping[int, str], new: Mapping[int, str],
             holders: dict[int, tuple[str, ...]], alive: Sequence[str], live_inv: Inventory,
             committed: Optional[int], notes: list[str]) -> RecoveryPlan:
    """Sources (the rank's own node first), moved and already-placed ranks at ``step``."""
    ranks = sorted(new)
    if committed is not None and step < committed:
        notes.insert(0, f"rolled back past committed step {committed} to {step}: copies were lost")
    at_step = nodes_holding(live_inv, step, alive)
    sources = {}
    for r in ranks:
        nodes = at_step.get(r, [])
        nodes.sort(key=lambda n: n != new[r])  # the rank's own node first
        sources[r] = tuple(nodes)
    moved = tuple(r for r in ranks if new[r] != old.get(r))
    placed = frozenset(r for r in ranks
                       if all(step in live_inv.get(n, {}).get(r, ())
                              for n in (new[r], *holders.get(r, ()))))
    return RecoveryPlan(step, dict(new), sources, holders, moved, tuple(notes), placed)


def plan_from_persisted(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                        alive: Sequence[str], capacity: Mapping[str, int], replicas: int,
                        step: int, why: str, domains: Domains = None) -> RecoveryPlan:
    """Every RAM copy of some rank is gone: all ranks load ``step`` from the persisted tier."""
    new_assignment = choose_nodes(assignment, alive, capacity, {}, step)
    moved = tuple(r for r in sorted(assignment) if new_assignment[r] != assignment[r])
    return RecoveryPlan(step, new_assignment, {r: ("persist",) for r in assignment},
                        repair_holders(holders, new_assignment, alive, replicas, domains), moved,
                        (f"fell back to persisted step {step}: {why}",))


def plan_from_scratch(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                      alive: Sequence[str], capacity: Mapping[str, int],
                      replicas: int, domains: Domains = None) -> RecoveryPlan:
    """Nothing was ever snapshotted (a failure during start-up): start over at step 0."""
    new_assignment = choose_nodes(assignment, alive, capacity, {}, 0)
    moved = tuple(r for r in sorted(assignment) if new_assignment[r] != assignment[r])
    return RecoveryPlan(0, new_assignment, {r: () for r in assignment},
                        repair_holders(holders, new_assignment, alive, replicas, domains), moved,
                        ("nothing was snapshotted yet: starting over",))


def source_label(sources: tuple[str, ...], node: str) -> str:
    """How a plan's sources read in events: scratch, persisted, local, or the peer's node."""
    if not sources:
        return "scratch"
    if sources == ("persist",):
        return "persisted"
    return "local" if sources[0] == node else f"peer:{sources[0][:12]}"


@dataclass(frozen=True)
class ResizePlan:
    """Restart the job at another world size from step ``step`` held in RAM: every new rank
    reads the chunks it needs of every old rank's shard from ``sources`` (old rank -> live
    nodes holding it, through the universal restore)."""

    step: int
    from_size: int
    to_size: int
    assignment: dict[int, str]  # new rank -> node
    sources: dict[int, tuple[str, ...]]  # OLD rank -> nodes holding its shard at `step`
    holders: dict[int, tuple[str, ...]]  # new rank -> replica holders from now on
    why: str
    notes: tuple[str, ...] = ()


def feasible_size(sizes: Sequence[int], room: int) -> Optional[int]:
    """The largest of ``sizes`` that fits ``room`` rank slots, None if none does."""
    fitting = [s for s in sizes if s <= room]
    return max(fitting) if fitting else None


def place_ranks(size: int, alive: Sequence[str], capacity: Mapping[str, int],
                per_node: int, keep: Sequence[str] = ()) -> dict[int, str]:
    """``size`` ranks on whole nodes of ``per_node`` ranks, nodes in ``keep`` (where the
    job ran, in rank order) first, then the other live nodes with room."""
    up = set(alive)
    usable = [n for n in keep if n in up and capacity.get(n, 0) >= per_node]
    usable = list(dict.fromkeys(usable))
    chosen = set(usable)
    usable += [n for n in alive if n not in chosen and capacity.get(n, 0) >= per_node]
    nodes = usable[: size // per_node]
    if len(nodes) * per_node < size:
        raise RecoveryError(f"{size} ranks need {size // per_node} nodes with room for "
                            f"{per_node} rank(s), only {len(nodes)} have it")
    return {r: nodes[r // per_node] for r in range(size)}


def plan_resize(assignment: Mapping[int, str], alive: Sequence[str],
                capacity: Mapping[str, int], inventory: Inventory, replicas: int,
                sizes: Sequence[int], per_node: int, why: str,
                committed: Optional[int] = None, domains: Domains = None) -> ResizePlan:
    """Where an elastic job goes on after losing (or gaining) nodes: the largest size in
    ``sizes`` (the config's allowed world sizes) that the live nodes' ``capacity`` (rank
    slots per node) can place, from the newest step every old rank still has in RAM;
    new holders sit outside their rank's failure domain (``domains``, as in
    :func:`repair_holders`).

    Raises :class:`RecoveryError` naming ``workers.min_workers`` and the lost nodes when
    even the smallest size does not fit, or naming the ranks whose every copy is gone."""
    old = sorted(assignment)
    room = sum(capacity.get(n, 0) // per_node for n in alive) * per_node
    size = feasible_size(sizes, room)
    up = set(alive)
    lost = sorted({n for n in assignment.values() if n not in up})
    if size is None:
        raise RecoveryError(
            f"node(s) {[n[:12] for n in lost]} lost and the live nodes have room for only "
            f"{room} rank(s), fewer than workers.min_workers={min(sizes)}: add nodes, or lower "
            "workers.min_workers (or configure a persistence tier to restart from later)")
    live_inv = {n: inv for n, inv in inventory.items() if n in up}
    step = newest_common_step(old, live_inv)
    if step is None:
        have = steps_held(old, live_inv)
        gone = [r for r in old if not have[r]]
        raise lost_copies_error(gone, assignment, None, committed, replicas)
    keep = [assignment[r] for r in old]
    new = place_ranks(size, alive, capacity, per_node, keep)
    running = set(new.values())
    at_step = nodes_holding(live_inv, step, alive)
    sources = {}
    for r in old:
        nodes = at_step.get(r, [])
        nodes.sort(key=lambda n: n not in running)  # a node the new job runs on first
        sources[r] = tuple(nodes)
    nodes_used = list(dict.fromkeys(new.values()))
    new_holders = repair_holders({}, new, nodes_used, replicas, domains)
    notes = []
    if committed is not None and step < committed:
        notes.append(f"rolled back past committed step {committed} to {step}: copies were lost")
    short = [r for r, hs in new_holders.items() if len(hs) < replicas]
    if short:
        notes.append(f"at {len(nodes_used)} node(s) rank(s) {short} keep fewer than {replicas} "
                     "replicas until nodes are added")
    return ResizePlan(step, len(old), size, new, sources, new_holders, why, tuple(notes))


def growth_size(current: int, sizes: Sequence[int], alive: Sequence[str],
                capacity: Mapping[str, int], per_node: int) -> Optional[int]:
    """A larger world size the live nodes can now place (a node added or back), or None."""
    room = sum(capacity.get(n, 0) // per_node for n in alive) * per_node
    size = feasible_size(sizes, room)
    return size if size is not None and size > current else None


def served_ranks(assignment: Mapping[int, str], holders: Mapping[int, Sequence[str]],
                 nodes: Sequence[str]) -> dict[str, tuple[list[int], list[int]]]:
    """node -> (ranks whose own slots it keeps, ranks whose replicas it keeps) in a layout:
    once the layout a recovery set up has committed a step, a node's shards of any other
    rank (a resize's old numbering, a moved rank's copies, a former holder's) are never
    read again."""
    out: dict[str, tuple[list[int], list[int]]] = {n: ([], []) for n in nodes}
    for r, at in assignment.items():
        if at in out:
            out[at][0].append(r)
    for r, hs in holders.items():
        for n in set(hs):
            if n in out:
                out[n][1].append(r)
    for own, held in out.values():
        own.sort()
        held.sort()
    return out
