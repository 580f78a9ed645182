"""Which ranks placed each step in flight, counted per node: the coordinator's commit rule
(a step commits once every rank's shard is on its own node and on all its holders) at
O(1) per node batch.

A node's store judges its ranks against the holders their specs name and sends a count
with a digest of those holders (:class:`~memckpt.runtime.coordinator.messages.ReadyBatch`);
:class:`Membership` keeps each node's digest of the placement, computed once per
generation, so a batch that matches is taken whole without a look at its ranks. A rank a
store could not vouch for (placed short, or joined without its holders) comes by name and
is judged here, as is a rank with no store on its node (``shard_ready``) and the ranks a
restarted coordinator proves from the stores' inventories.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from memckpt.errors import MemckptError
from memckpt.policy.placement import holders_digest
from memckpt.runtime.coordinator.messages import ReadyBatch


class PlacementMismatch(MemckptError):
    """A node's store judged its ranks against holders other than this generation's
    placement: its ranks' specs and the coordinator disagree."""

    retryable = False


@dataclass(frozen=True)
class Membership:
    """One generation's ranks by node and each node's placement digest."""

    holders: Mapping[str, Sequence[str]] = field(default_factory=dict)  # str(rank) -> holders
    node_ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    rank_node: Mapping[int, str] = field(default_factory=dict)
    digest: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, assignment: Mapping[str, str],
           holders: Mapping[str, Sequence[str]]) -> "Membership":
        """``assignment``: str(rank) -> node; ``holders``: str(rank) -> its holders."""
        by_node: dict[str, list[int]] = {}
        for r, node in assignment.items():
            by_node.setdefault(node, []).append(int(r))
        node_ranks = {n: tuple(sorted(rs)) for n, rs in by_node.items()}
        digest = {n: holders_digest({r: holders.get(str(r), ()) for r in rs})
                  for n, rs in node_ranks.items()}
        return cls(holders, node_ranks, {r: n for n, rs in node_ranks.items() for r in rs},
                   digest)

    def placed(self, rank: int, on: Iterable[str]) -> bool:
        """``rank``'s shard is on every holder placement gave it."""
        return set(self.holders.get(str(rank), ())) <= set(on)


@dataclass
class _Step:
    nodes: dict[str, int] = field(default_factory=dict)  # node -> its ranks counted ready
    ranks: set[int] = field(default_factory=set)  # ranks counted one by one
    by_nodes: int = 0  # sum(nodes.values()), kept as batches come: O(1) a batch

    def node(self, node: str, ready: int) -> None:
        self.by_nodes += ready - self.nodes.get(node, 0)
        self.nodes[node] = ready

    def count(self, rank_node: Mapping[int, str]) -> int:
        # a rank counted alone whose node's batch came too is counted once, with the node
        if not self.ranks:
            return self.by_nodes
        return self.by_nodes + sum(1 for r in self.ranks if rank_node.get(r) not in self.nodes)


class Readiness:
    """The steps in flight (a few): per step, the ranks counted ready. Not thread-safe:
    the coordinator calls it under its lock."""

    def __init__(self) -> None:
        self.members = Membership()
        self._steps: dict[int, _Step] = {}

    def configure(self, members: Membership) -> None:
        self.members = members
        self._steps.clear()

    def node(self, node: str, batch: ReadyBatch) -> None:
        """``node``'s batch: O(1) when its store vouched for every rank, else O(the ranks it
        names). Raises PlacementMismatch when its store judged against other holders."""
        m = self.members
        ranks = m.node_ranks.get(node, ())
        if batch.placed:  # the ranks its store did not vouch for, judged here
            judged = [r for r in ranks if r not in batch.placed]
            digest = holders_digest({r: m.holders.get(str(r), ()) for r in judged})
            vouched, named = len(judged), sum(
                1 for r, on in batch.placed.items()
                if m.rank_node.get(int(r)) == node and m.placed(int(r), on))
        else:  # the usual case: every rank vouched for, one digest to compare
            digest, vouched, named = m.digest.get(node, ""), len(ranks), 0
        if batch.ready and (digest != batch.expected or batch.ready != vouched):
            raise PlacementMismatch(
                f"node {node}'s ranks placed step {batch.step} on holders other than "
                f"generation {batch.gen}'s placement ({batch.ready} of {vouched} vouched "
                "for): its workers' specs and the coordinator disagree; this is a bug in "
                "memckpt, please report it with the job's events.jsonl")
        self._steps.setdefault(batch.step, _Step()).node(node, batch.ready + named)

    def rank(self, step: int, rank: int, on: Iterable[str]) -> bool:
        """One rank's shard of ``step`` is on ``on`` (no store on its node); False: short
        of its placement, not counted."""
        if not self.members.placed(rank, on):
            return False
        self._steps.setdefault(step, _Step()).ranks.add(rank)
        return True

    def proven(self, step: int, ranks: Iterable[int]) -> None:
        """Ranks a restarted coordinator found placed in the stores' inventories."""
        self._steps.setdefault(step, _Step()).ranks.update(ranks)

    def count(self, step: int) -> int:
        got = self._steps.get(step)
        return got.count(self.members.rank_node) if got else 0

    def committed(self, step: int) -> None:
        """``step`` committed: it and the steps before it are no longer in flight."""
        for old in [k for k in self._steps if k <= step]:
            del self._steps[old]

    def in_flight(self) -> list[int]:
        return sorted(self._steps)
