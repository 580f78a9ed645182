"""Who is alive, as the coordinator hears it: each node store's heartbeat (its newest step,
its oldest rank's age and the ranks late to beat, by name) and the signs of life of ranks
heard one by one (a rank with no store on its node, or registered before its node's first
heartbeat). ``liveness`` names silent nodes and hung ranks in O(nodes + ranks named), so
the driver's check every heartbeat interval costs the same at 8 ranks a node as at 128.

A rank's age is judged at its store's last heartbeat, not now: a store that went silent
says nothing of its ranks since, and its ranks' last signs precede its own, so judged now
they would go stale first and a frozen node be taken for a hung rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Callable, Optional

from memckpt.runtime.coordinator.messages import Heartbeat, LivenessStatus, NodeBeat, RankBeat


class Liveness:
    """One generation's signs of life, on the coordinator's clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.node_beats: dict[str, tuple[float, int, float]] = {}  # node -> (at, top, oldest)
        self.late: dict[str, dict[int, tuple[float, int]]] = {}  # node -> rank -> (sign, step)
        self.ranks: dict[int, tuple[float, int]] = {}  # heard alone: rank -> (sign, step)

    def reset(self) -> None:
        self.node_beats.clear()
        self.late.clear()
        self.ranks.clear()

    def rank_heard(self, rank: int, step: int, node: Optional[str]) -> None:
        """A rank's own sign of life; kept only while its node's store is not beating for
        it (a node's heartbeat speaks for all its ranks)."""
        if node not in self.node_beats:
            self.ranks[rank] = (self.clock(), step)

    def node_beat(self, node: str, hb: Heartbeat, ranks: Iterable[int]) -> None:
        """``node``'s heartbeat; ``ranks``: the node's ranks (dropped from those heard alone
        at its first beat of the generation: once)."""
        now = self.clock()
        self._first_word(node, ranks)
        self.node_beats[node] = (now, hb.top, hb.oldest_s)
        if hb.late or node in self.late:
            self.late[node] = {int(r): (now - age, step) for r, (age, step) in hb.late.items()}

    def node_spoke(self, node: str, step: int, ranks: Iterable[int]) -> None:
        """``node``'s store sent a step's batch or metrics: a sign of life like a heartbeat
        (a store sends a heartbeat only when it has said nothing for an interval, or has a
        late rank to name; a job stepping faster than the interval may send none at all)."""
        self._first_word(node, ranks)
        _, top, oldest = self.node_beats.get(node, (0.0, -1, 0.0))
        self.node_beats[node] = (self.clock(), max(top, step), oldest)

    def _first_word(self, node: str, ranks: Iterable[int]) -> None:
        """``node``'s first sign of the generation speaks for its ``ranks`` from now on:
        they are no longer watched one by one (once a generation)."""
        if node not in self.node_beats:
            for r in ranks:
                self.ranks.pop(r, None)

    def judge(self, timeout_s: float, startup_timeout_s: float,
              node_ranks: Mapping[str, Iterable[int]]) -> tuple[list[int], list[str]]:
        """(hung ranks, silent nodes): a node whose heartbeat is older than the timeout is
        frozen or cut off, with all its ranks; a rank is hung when its last sign is older
        than the timeout (``startup_timeout_s`` while it has not finished a first step)."""
        now = self.clock()

        def stale(t: float, step: int, at: float) -> bool:
            return at - t > (timeout_s if step >= 0 else startup_timeout_s)

        silent = sorted(n for n, (t, step, _) in self.node_beats.items() if stale(t, step, now))
        hung: set[int] = set()
        for node, late in self.late.items():
            at = self.node_beats[node][0]
            hung.update(r for r, (t, step) in late.items() if stale(t, step, at))
        hung.update(r for r, (t, step) in self.ranks.items() if stale(t, step, now))
        for node in silent:
            hung.update(node_ranks.get(node, ()))
        return sorted(hung), silent

    def last_heard(self, ranks: Iterable[int], nodes: Iterable[str]) -> Optional[float]:
        """The earliest last sign of life of ``nodes``' stores and ``ranks``: where a hang or
        a freeze began, as far as anyone can tell."""
        times = [self.node_beats[n][0] for n in nodes if n in self.node_beats]
        named = {r: t for late in self.late.values() for r, (t, _) in late.items()}
        named.update({r: t for r, (t, _) in self.ranks.items()})
        times += [named[r] for r in ranks if r in named]
        return min(times, default=None)

    def status(self) -> LivenessStatus:
        """The ``status`` fields: nodes' beats, and the ranks named (late or heard alone)."""
        now = self.clock()
        named = {r: v for late in self.late.values() for r, v in late.items()}
        named.update(self.ranks)
        return {"node_beats": {n: NodeBeat(age_s=now - t, step=s, oldest_rank_age_s=o)
                               for n, (t, s, o) in self.node_beats.items()},
                "heartbeats": {str(r): RankBeat(age_s=now - t, step=s)
                               for r, (t, s) in named.items()}}
