"""Replica placement: which peer nodes hold a copy of each node's shards.

Pure functions (stdlib only): node ids and ranks in, replica holders out.
The order of the node list is the ring order. Strategies (after Gemini, SOSP'23):

- ``ring``:  each node's holders are the next ``k`` nodes around the ring.
- ``group``: nodes form consecutive groups of ``group_size``; holders are the
  next ``k`` nodes inside the owner's group (cyclic), so a failure stays local.
- ``mixed``: full groups as in ``group``; the leftover nodes
  (``num_nodes % group_size``) use ``ring`` over all nodes.

With standby nodes (nodes that run no ranks at the start) each node's first holder is
a standby instead (:func:`standby_plan`): a dead node's ranks then restart where their
shards already are.

Guarantees of every plan built or repaired here (checked by :func:`validate_plan`):
no copy sits on the node it protects, no node holds two copies of one owner's
shards, every holder is a node of the plan (or one of its standby nodes). Plans are
deterministic.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from memckpt.errors import PlacementError

__all__ = [
    "STRATEGIES",
    "check_feasible",
    "format_plan",
    "lost_nodes",
    "rank_holders",
    "repair_plan",
    "replica_plan",
    "standby_plan",
    "validate_plan",
]

STRATEGIES = ("ring", "group", "mixed")

Plan = dict[str, tuple[str, ...]]


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlacementError(f"placement.{name}={value!r} must be an integer: set it to a whole number")


def check_feasible(num_nodes: int, strategy: str, replicas: int, group_size: int) -> None:
    """Raise :class:`PlacementError` unless ``replicas`` copies can be placed.

    Each message names the field, its value and the fix. ``group_size`` is
    ignored for ``ring``.
    """
    if strategy not in STRATEGIES:
        raise PlacementError(
            f"placement.strategy={strategy!r} is not known: use one of {', '.join(map(repr, STRATEGIES))}"
        )
    _check_int("replicas", replicas)
    _check_int("group_size", group_size)
    if num_nodes < 2:
        raise PlacementError(
            f"placement needs at least 2 nodes but there are {num_nodes}: a single node cannot protect "
            f"against its own failure, so placement.replicas={replicas} can't be placed off the owner's "
            f"node; add nodes"
        )
    if replicas < 1:
        raise PlacementError(f"placement.replicas={replicas} must be >= 1: "
                             "set placement.replicas to 1 or more")
    if replicas > num_nodes - 1:
        raise PlacementError(
            f"placement.replicas={replicas} needs at least {replicas + 1} nodes (k replicas + the owner) "
            f"but there are {num_nodes}: lower placement.replicas to <= {num_nodes - 1} or add nodes"
        )
    if strategy == "ring":
        return
    need = max(2, replicas + 1)  # the owner plus k peers, and a group of one protects nothing
    if group_size < 2:
        raise PlacementError(
            f"placement.group_size={group_size} must be >= 2 (a group of one has no peer to hold a "
            f"replica): set placement.group_size >= {need}"
        )
    if group_size < replicas + 1:
        raise PlacementError(
            f"placement.group_size={group_size} is too small for placement.replicas={replicas}: a group "
            f"needs k replicas + the owner = {replicas + 1} nodes; raise placement.group_size to >= "
            f"{replicas + 1} or lower placement.replicas to <= {group_size - 1}"
        )
    if strategy == "mixed":
        return  # leftover nodes fall back to ring over all nodes, which replicas <= n-1 makes feasible
    fits = [d for d in range(need, num_nodes + 1) if num_nodes % d == 0]
    if group_size > num_nodes:
        raise PlacementError(
            f"placement.group_size={group_size} is larger than the {num_nodes} nodes: set "
            f"placement.group_size to one of {fits} or use placement.strategy='ring'"
        )
    if num_nodes % group_size:
        raise PlacementError(
            f"placement.group_size={group_size} does not divide the {num_nodes} nodes "
            f"({num_nodes % group_size} left over): use placement.strategy='mixed' or a "
            f"placement.group_size dividing {num_nodes} (one of {fits})"
        )


def _next_k(ring: Sequence[str], i: int, k: int) -> tuple[str, ...]:
    """The ``k`` nodes after ``ring[i]``, cyclically."""
    return tuple(ring[(i + j) % len(ring)] for j in range(1, k + 1))


def replica_plan(nodes: Sequence[str], strategy: str, replicas: int, group_size: int = 2) -> Plan:
    """Map each node (in ``nodes`` order) to the ordered tuple of its ``replicas`` holders.

    Raises :class:`PlacementError` if the layout is infeasible or node ids repeat.
    For ``ring`` and ``group`` every node also holds exactly ``replicas`` copies.
    """
    nodes = list(nodes)
    if len(set(nodes)) != len(nodes):
        dupes = sorted({n for n in nodes if nodes.count(n) > 1})
        raise PlacementError(f"node ids must be unique but {dupes} repeat: pass each node once")
    check_feasible(len(nodes), strategy, replicas, group_size)
    n = len(nodes)
    grouped = 0 if strategy == "ring" else (n // group_size) * group_size  # nodes inside full groups
    plan: Plan = {}
    for i, node in enumerate(nodes):
        if i < grouped:
            start = i - i % group_size
            plan[node] = _next_k(nodes[start:start + group_size], i - start, replicas)
        else:  # ring, or a mixed leftover: ring over all nodes
            plan[node] = _next_k(nodes, i, replicas)
    validate_plan(plan, replicas)
    return plan


def standby_plan(active: Sequence[str], standby: Sequence[str], strategy: str, replicas: int,
                 group_size: int = 2) -> Plan:
    """A plan whose first holder of each active node is a standby node (round-robin), so a
    dead node's ranks restart on a node that already holds their shards; the other
    ``replicas - 1`` copies follow ``strategy`` over the active nodes.

    Standby nodes run no ranks at the start and own nothing in the plan.
    """
    if not standby:
        return replica_plan(active, strategy, replicas, group_size)
    if replicas < 1:
        raise PlacementError(f"placement.standby_nodes={len(standby)} needs placement.replicas >= 1 "
                             "(a standby restores a dead node's ranks from the replicas it holds): "
                             "set placement.replicas to 1 or more, or placement.standby_nodes=0")
    overlap = sorted(set(active) & set(standby))
    if overlap:
        raise PlacementError(f"nodes {overlap} are both active and standby: pass each node once")
    rest = (replica_plan(active, strategy, replicas - 1, group_size) if replicas > 1
            else {n: () for n in active})
    plan = {n: (standby[i % len(standby)], *rest[n]) for i, n in enumerate(active)}
    validate_plan(plan, replicas, extra_holders=standby)
    return plan


def validate_plan(plan: Mapping[str, Sequence[str]], replicas: int,
                  extra_holders: Collection[str] = ()) -> None:
    """Raise :class:`PlacementError` unless every owner has exactly ``replicas`` distinct
    holders, none of them the owner itself and all of them owners in ``plan`` (or
    ``extra_holders``: standby nodes, which hold copies but run no ranks yet)."""
    for owner, holders in plan.items():
        if owner in holders:
            raise PlacementError(f"node {owner!r} holds its own replica: a copy must sit on another node")
        if len(set(holders)) != len(holders):
            raise PlacementError(f"node {owner!r} has a holder twice in {list(holders)}: "
                                 "holders must be distinct")
        unknown = [h for h in holders if h not in plan and h not in extra_holders]
        if unknown:
            raise PlacementError(f"node {owner!r} has holders {unknown} that are not nodes of the plan")
        if len(holders) != replicas:
            raise PlacementError(
                f"node {owner!r} has {len(holders)} holders but placement.replicas={replicas}"
            )


def rank_holders(rank_nodes: Mapping[int, str],
                 plan: Mapping[str, Sequence[str]]) -> dict[int, tuple[str, ...]]:
    """For each rank (sorted), the holders of its shard: those of the node it runs on."""
    out: dict[int, tuple[str, ...]] = {}
    for rank in sorted(rank_nodes):
        node = rank_nodes[rank]
        if node not in plan:
            raise PlacementError(
                f"rank {rank} runs on node {node!r} which is not in the placement plan "
                f"(nodes {list(plan)}): build the plan over every node that runs ranks"
            )
        out[rank] = tuple(plan[node])
    return out


def repair_plan(plan: Mapping[str, Sequence[str]], alive: Sequence[str], replicas: int) -> Plan:
    """Rebuild ``plan`` for the ``alive`` nodes (in ring order) after failures.

    - Dead owners are dropped; alive nodes unknown to ``plan`` (replacements)
      become owners after the known ones, so every holder is an owner.
    - Surviving holders stay at their position (their copies need not move);
      each dead or missing holder is replaced by the alive node, neither the
      owner nor already a holder, that holds the fewest replicas so far (ties:
      earliest in ``alive``).
    - With fewer than ``replicas + 1`` alive nodes, each owner gets
      ``len(alive) - 1`` holders (possibly 0); this does not raise, the caller
      reports the reduced redundancy.
    """
    alive = list(alive)
    if len(set(alive)) != len(alive):
        raise PlacementError(f"alive node ids must be unique, got {alive}")
    up = set(alive)
    target = max(0, min(replicas, len(alive) - 1))
    owners = [o for o in plan if o in up] + [a for a in alive if a not in plan]
    # Keep survivors in place; None marks a slot that needs a new holder.
    slots: dict[str, list[str | None]] = {}
    for owner in owners:
        kept: list[str | None] = []
        for h in plan.get(owner, ()):
            kept.append(h if h in up and h != owner and h not in kept else None)
        kept += [None] * (target - len(kept))
        while len(kept) > target and None in kept:  # more open slots than alive nodes can fill
            del kept[max(i for i, h in enumerate(kept) if h is None)]
        slots[owner] = kept[:target]  # replicas lowered: keep the first survivors
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


def lost_nodes(plan: Mapping[str, Sequence[str]], dead: Collection[str]) -> list[str]:
    """Dead owners whose holders are all dead too: no RAM copy of their shards survives."""
    gone = set(dead)
    return [o for o, holders in plan.items() if o in gone and all(h in gone for h in holders)]


def format_plan(plan: Mapping[str, Sequence[str]], rank_nodes: Mapping[int, str] | None = None) -> str:
    """One line per owner, e.g. ``node-a (ranks 0,1) -> node-b, node-c``."""
    lines = []
    for owner, holders in plan.items():
        label = owner
        if rank_nodes is not None:
            ranks = sorted(r for r, n in rank_nodes.items() if n == owner)
            label += f" (ranks {','.join(map(str, ranks))})" if ranks else " (no ranks)"
        lines.append(f"{label} -> {', '.join(holders) if holders else '(none)'}")
    return "\n".join(lines)
