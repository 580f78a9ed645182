"""Which node's store relays which nodes' step batches to the coordinator (pure).

At a few thousand nodes the coordinator's cost is the number of messages it takes, not what
is in them: a node's batch costs about as much to receive, unpickle and dispatch as to act
on. So on a large job the nodes are cut into groups of at most ``fanout`` (a rack's nodes
together, where the job names failure domains), and one store per group, its *leader*,
merges its members' batches for a step into one message. A member whose leader does not
answer sends its batch straight to the coordinator (:mod:`memckpt.runtime.node.relay`):
the relay saves messages, it is never a node the job depends on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RelayGroup:
    """A group of nodes whose batches one store merges: ``leader`` is ``members[0]``."""

    members: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.members or len(set(self.members)) != len(self.members):
            raise ValueError(f"a relay group needs distinct members, got {self.members!r}")

    @property
    def leader(self) -> str:
        return self.members[0]


def relay_groups(nodes: Sequence[str], fanout: int, min_nodes: int,
                 domains: Optional[Mapping[str, str]] = None) -> dict[str, RelayGroup]:
    """node -> its group, for the ``nodes`` that run ranks this generation; {} (every store
    sends its own batches) when ``fanout`` < 2 or there are fewer than ``min_nodes``.
    ``domains`` (node -> its failure domain, e.g. its rack): a group never spans two, so a
    rack's batches cross the rack's uplink once. Groups are as even as ``fanout`` allows
    (a domain of 17 nodes at fanout 16 makes groups of 9 and 8, not 16 and 1), and the
    order of ``nodes`` does not change them."""
    if fanout < 2 or len(nodes) < max(min_nodes, 2):
        return {}
    by_domain: dict[str, list[str]] = {}
    for n in sorted(set(nodes)):
        by_domain.setdefault((domains or {}).get(n, ""), []).append(n)
    out: dict[str, RelayGroup] = {}
    for _, members in sorted(by_domain.items()):
        count = -(-len(members) // fanout)  # groups in this domain
        size, extra = divmod(len(members), count)
        start = 0
        for i in range(count):
            end = start + size + (1 if i < extra else 0)
            group = RelayGroup(tuple(members[start:end]))
            if len(group.members) > 1:  # a node alone in its rack sends its own
                out.update({n: group for n in group.members})
            start = end
    return out
