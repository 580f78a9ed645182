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

Failure domains (``placement.failure_domain``: a Ray node label such as a rack or a
zone): given ``domains`` (node -> the label's value, :func:`node_domains`), every copy
sits outside its owner's domain, so the loss of a whole domain leaves a copy of each of
its nodes' shards. The ring is then the nodes with each domain's nodes spread evenly
around it (equal domains alternate: r1, r2, r3, r1, r2, r3, ...), groups are consecutive
in that ring, and a node's holders are the next ones around its ring or group that are
outside its domain. Without ``domains`` every node is its own domain and plans are as
above; a layout that cannot keep copies outside the domains raises
:class:`PlacementError` naming the label and the domains.

Guarantees of every plan built or repaired here (checked by :func:`validate_plan`):
no copy sits on the node it protects (nor, with ``domains``, in its domain), no node
holds two copies of one owner's shards, every holder is a node of the plan (or one of
its standby nodes). Plans are deterministic; building, checking and repairing one is
near-linear in the nodes.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from fractions import Fraction
from typing import Optional

from memckpt.errors import PlacementError
from memckpt.policy.loads import Domains, LeastLoaded, domain_of

__all__ = [
    "STRATEGIES",
    "check_domains",
    "check_feasible",
    "format_plan",
    "lost_nodes",
    "node_domains",
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


def _next_k(ring: Sequence[str], start: int, size: int, i: int, k: int) -> tuple[str, ...]:
    """The ``k`` nodes after ``ring[i]`` in ``ring[start:start + size]``, cyclically."""
    return tuple(ring[start + (i - start + j) % size] for j in range(1, k + 1))


def _words(label: Optional[str]) -> tuple[str, str]:
    """The setting and the noun a failure-domain message names."""
    if label:
        return f"placement.failure_domain={label!r}", label
    return "placement.failure_domain", "failure domain"


def node_domains(labels: Mapping[str, Mapping[str, str]], label: str) -> dict[str, str]:
    """node -> its failure domain: the value of its Ray node label ``label`` (``labels``:
    node id -> that node's labels, as ``ray.nodes()`` lists them under ``"Labels"``).

    Raises :class:`PlacementError` naming the nodes without that label."""
    missing = [n for n, own in labels.items() if not own.get(label)]
    if missing:
        setting, _ = _words(label)
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise PlacementError(
            f"{setting}: node(s) {[n[:12] for n in missing[:8]]}{more} have no {label!r} "
            f"label: start every node with one (ray start --labels {label}=...) or set "
            "placement.failure_domain=None")
    return {n: str(own[label]) for n, own in labels.items()}


def _spread(nodes: Sequence[str], domains: Mapping[str, str]) -> list[str]:
    """``nodes`` in ring order with each domain's nodes spread evenly around the ring (the
    j-th of a domain's s nodes at (j + 1/2) / s of the way; ties: the domain seen first)."""
    members: dict[str, list[str]] = {}
    for n in nodes:
        members.setdefault(domains[n], []).append(n)
    keyed = sorted((Fraction(2 * j + 1, 2 * len(ms)), i, n)
                   for i, ms in enumerate(members.values()) for j, n in enumerate(ms))
    return [n for _, _, n in keyed]


def _next_outside(ring: Sequence[str], domains: Mapping[str, str], k: int) -> Plan:
    """Each node of ``ring`` -> the next ``k`` nodes around it outside its domain (fewer if
    there are fewer), skipping a run of its own domain in one jump."""
    n = len(ring)
    dom = [domains[m] for m in ring] * 2
    end = [2 * n] * (2 * n)  # end[p]: the first position after p's run of one domain
    for p in range(2 * n - 2, -1, -1):
        end[p] = end[p + 1] if dom[p] == dom[p + 1] else p + 1
    plan: Plan = {}
    for i, owner in enumerate(ring):
        out: list[str] = []
        p = i + 1
        while len(out) < k and p < i + n:
            if dom[p] == dom[i]:
                p = end[p]
            else:
                out.append(ring[p % n])
                p += 1
        plan[owner] = tuple(out)
    return plan


def check_domains(nodes: Sequence[str], domains: Mapping[str, str], replicas: int,
                   label: Optional[str]) -> None:
    """Raise :class:`PlacementError` (naming ``label`` and the domains) unless every node
    has a domain and each has ``replicas`` nodes outside its domain."""
    setting, noun = _words(label)
    missing = [n for n in nodes if n not in domains]
    if missing:
        raise PlacementError(f"{setting}: node(s) {[n[:12] for n in missing[:8]]} have no "
                             f"{noun}: give every node a {noun} label, or set "
                             "placement.failure_domain=None")
    sizes = Counter(domains[n] for n in nodes)
    if len(sizes) == 1 and replicas > 0:
        only = next(iter(sizes))
        tag = f"another {label!r} label" if label else "another failure domain"
        raise PlacementError(f"{setting}: every node is in {noun} {only!r}; copies need a "
                             f"second {noun}: add nodes with {tag} or set failure_domain=None")
    big, count = max(sizes.items(), key=lambda dc: dc[1])
    if len(nodes) - count < replicas:
        raise PlacementError(
            f"{setting}: {noun} {big!r} has {count} of the {len(nodes)} nodes, so its nodes have "
            f"only {len(nodes) - count} outside it for placement.replicas={replicas} (the "
            f"{noun}s: {dict(sizes)}): add nodes in other {noun}s, lower placement.replicas to "
            f"<= {len(nodes) - count}, or set failure_domain=None")


def _domain_plan(nodes: Sequence[str], strategy: str, replicas: int, group_size: int,
                 domains: Mapping[str, str], label: Optional[str]) -> Plan:
    """:func:`replica_plan` with every copy outside its owner's failure domain."""
    check_domains(nodes, domains, replicas, label)
    ring = _spread(nodes, domains)
    grouped = 0 if strategy == "ring" else (len(ring) // group_size) * group_size
    built = _next_outside(ring, domains, replicas) if grouped < len(ring) else {}
    for start in range(0, grouped, group_size):
        group = ring[start:start + group_size]
        built.update(_next_outside(group, domains, replicas))
        short = [m for m in group if len(built[m]) < replicas]
        if short:
            setting, noun = _words(label)
            inside = Counter(domains[m] for m in group)
            raise PlacementError(
                f"{setting} with placement.strategy={strategy!r}: node {short[0]!r}'s group of "
                f"{group_size} (spread over the {noun}s: {dict(inside)}) has fewer than "
                f"placement.replicas={replicas} node(s) outside its {noun} "
                f"{domains[short[0]]!r}: raise placement.group_size, add nodes in other "
                f"{noun}s, or use placement.strategy='ring'")
    return {m: built[m] for m in nodes}


def replica_plan(nodes: Sequence[str], strategy: str, replicas: int, group_size: int = 2,
                 domains: Domains = None, label: Optional[str] = None) -> Plan:
    """Map each node (in ``nodes`` order) to the ordered tuple of its ``replicas`` holders.

    Raises :class:`PlacementError` if the layout is infeasible or node ids repeat.
    For ``ring`` and ``group`` every node also holds exactly ``replicas`` copies (with
    ``domains``, when the domains are of equal size). ``domains`` (node -> failure domain,
    every node in it) keeps each copy outside its owner's domain; ``label`` (the
    ``placement.failure_domain`` label) names it in messages.
    """
    nodes = list(nodes)
    if len(set(nodes)) != len(nodes):
        dupes = sorted(n for n, c in Counter(nodes).items() if c > 1)
        raise PlacementError(f"node ids must be unique but {dupes} repeat: pass each node once")
    check_feasible(len(nodes), strategy, replicas, group_size)
    if domains is not None:
        plan = _domain_plan(nodes, strategy, replicas, group_size, domains, label)
        validate_plan(plan, replicas, domains=domains, label=label)
        return plan
    n = len(nodes)
    grouped = 0 if strategy == "ring" else (n // group_size) * group_size  # nodes inside full groups
    plan = {}
    for i, node in enumerate(nodes):
        if i < grouped:
            plan[node] = _next_k(nodes, i - i % group_size, group_size, i, replicas)
        else:  # ring, or a mixed leftover: ring over all nodes
            plan[node] = _next_k(nodes, 0, n, i, replicas)
    validate_plan(plan, replicas)
    return plan


def standby_plan(active: Sequence[str], standby: Sequence[str], strategy: str, replicas: int,
                 group_size: int = 2, domains: Domains = None,
                 label: Optional[str] = None) -> Plan:
    """A plan whose first holder of each active node is a standby node (round-robin), so a
    dead node's ranks restart on a node that already holds their shards; the other
    ``replicas - 1`` copies follow ``strategy`` over the active nodes.

    Standby nodes run no ranks at the start and own nothing in the plan. With ``domains``
    (every active and standby node in it) each node's standby is the next one round the
    robin outside its failure domain, and the other copies as in :func:`replica_plan`.
    """
    if not standby:
        return replica_plan(active, strategy, replicas, group_size, domains, label)
    if replicas < 1:
        raise PlacementError(f"placement.standby_nodes={len(standby)} needs placement.replicas >= 1 "
                             "(a standby restores a dead node's ranks from the replicas it holds): "
                             "set placement.replicas to 1 or more, or placement.standby_nodes=0")
    overlap = sorted(set(active) & set(standby))
    if overlap:
        raise PlacementError(f"nodes {overlap} are both active and standby: pass each node once")
    if domains is not None:
        check_domains([*active, *standby], domains, replicas, label)
    rest = (replica_plan(active, strategy, replicas - 1, group_size, domains, label)
            if replicas > 1 else {n: () for n in active})
    plan = {n: (_standby_for(n, i, standby, domains, label), *rest[n])
            for i, n in enumerate(active)}
    validate_plan(plan, replicas, extra_holders=standby, domains=domains, label=label)
    return plan


def _standby_for(node: str, i: int, standby: Sequence[str], domains: Domains,
                 label: Optional[str]) -> str:
    """The ``i``-th active node's standby: round-robin, skipping those in its domain."""
    if domains is None:
        return standby[i % len(standby)]
    for j in range(len(standby)):
        pick = standby[(i + j) % len(standby)]
        if domains[pick] != domains[node]:
            return pick
    setting, noun = _words(label)
    raise PlacementError(
        f"{setting}: every standby node is in {noun} {domains[node]!r}, so its active nodes "
        f"(such as {node!r}) have no standby outside their {noun}: put standby nodes in a "
        f"second {noun}, or set failure_domain=None")


def validate_plan(plan: Mapping[str, Sequence[str]], replicas: int,
                  extra_holders: Collection[str] = (), domains: Domains = None,
                  label: Optional[str] = None) -> None:
    """Raise :class:`PlacementError` unless every owner has exactly ``replicas`` distinct
    holders, none of them the owner itself and all of them owners in ``plan`` (or
    ``extra_holders``: standby nodes, which hold copies but run no ranks yet); with
    ``domains``, none of them in the owner's failure domain either."""
    extra_holders = set(extra_holders)
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
        home = domain_of(owner, domains)
        inside = [h for h in holders if domains is not None and domain_of(h, domains) == home]
        if inside:
            setting, noun = _words(label)
            raise PlacementError(f"{setting}: node {owner!r} has holders {inside} in its own "
                                 f"{noun} {home!r}: a copy must sit outside the owner's {noun}")


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


def holders_digest(holders: Mapping[int, Sequence[str]]) -> str:
    """A short fingerprint of some ranks' replica holders (rank -> holder nodes; order of
    holders ignored). A node's store judges its ranks' readiness against the holders their
    specs name and sends this of them; the coordinator compares it with its own placement's
    (computed once per generation), so a step's batch is checked in O(1), not per rank."""
    text = ";".join(f"{r}:{','.join(sorted(holders[r]))}" for r in sorted(holders))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def repair_plan(plan: Mapping[str, Sequence[str]], alive: Sequence[str], replicas: int,
                domains: Domains = None) -> Plan:
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
    - With ``domains``, a holder in its owner's failure domain is replaced too, and a new
      one is picked outside it; only when no alive node outside it is left does a copy
      go to another node of the owner's domain (not checked against ``domains`` then).
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
            ok = h in up and domain_of(h, domains) != domain_of(owner, domains) and h not in kept
            kept.append(h if ok else None)
        kept += [None] * (target - len(kept))
        while len(kept) > target and None in kept:  # more open slots than alive nodes can fill
            del kept[max(i for i, h in enumerate(kept) if h is None)]
        slots[owner] = kept[:target]  # replicas lowered: keep the first survivors
    load = Counter(h for open_slots in slots.values() for h in open_slots if h is not None)
    nodes = LeastLoaded(alive, load, domains)
    out: Plan = {}
    for owner in owners:
        chosen = slots[owner]
        for i, held in enumerate(chosen):
            if held is None:
                taken = {owner, *(h for h in chosen if h is not None)}
                pick = nodes.pick(taken, avoid=domain_of(owner, domains))
                if pick is None:  # no alive node outside the domain: one inside it
                    pick = nodes.pick(taken)
                if pick is None:
                    break  # target < len(alive) leaves one, unless domains said otherwise
                chosen[i] = pick
                nodes.add(pick)
        out[owner] = tuple(h for h in chosen if h is not None)
    validate_plan(out, target)
    return out


def lost_nodes(plan: Mapping[str, Sequence[str]], dead: Collection[str]) -> list[str]:
    """Dead owners whose holders are all dead too: no RAM copy of their shards survives."""
    gone = set(dead)
    return [o for o, holders in plan.items() if o in gone and all(h in gone for h in holders)]


def format_plan(plan: Mapping[str, Sequence[str]], rank_nodes: Mapping[int, str] | None = None) -> str:
    """One line per owner, e.g. ``node-a (ranks 0,1) -> node-b, node-c``."""
    on: dict[str, list[int]] = {}
    for r, n in (rank_nodes or {}).items():
        on.setdefault(n, []).append(r)
    lines = []
    for owner, holders in plan.items():
        label = owner
        if rank_nodes is not None:
            ranks = sorted(on.get(owner, ()))
            label += f" (ranks {','.join(map(str, ranks))})" if ranks else " (no ranks)"
        lines.append(f"{label} -> {', '.join(holders) if holders else '(none)'}")
    return "\n".join(lines)
