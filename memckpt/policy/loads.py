"""The least-loaded node, without scanning every node: the pick that placement repair and
recovery repeat for every replica slot and every moved rank.

A pick returns the node with the fewest copies (or ranks) so far, ties to the earliest in
ring order, outside the nodes and the failure domain it must avoid. Nodes sit in one heap
per failure domain and the domains' best nodes in one more heap, so a pick costs
O((excluded nodes + 1) log n) instead of a pass over every node: a plan at thousands of
ranks stays near-linear. Pure (stdlib only).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from typing import Optional

Entry = tuple[int, int, str]  # (load, ring position, node)
# node -> its failure domain (the value of a Ray node label such as a rack); None, or a
# node missing from it: every node is its own failure domain
Domains = Optional[Mapping[str, str]]


def domain_of(node: str, domains: Domains) -> str:
    """``node``'s failure domain: the node itself where ``domains`` does not name one."""
    return node if domains is None else domains.get(node, node)


class LeastLoaded:
    """Nodes by (load, position in ``nodes``); ``domains`` maps a node to its failure domain
    (None, or a node missing from it: the node is its own); a node whose load reaches its
    ``limit`` (when given; missing: 0) is never picked again."""

    def __init__(self, nodes: Sequence[str], load: Optional[Mapping[str, int]] = None,
                 domains: Domains = None,
                 limit: Optional[Mapping[str, int]] = None) -> None:
        self.pos: dict[str, int] = {}
        for i, n in enumerate(nodes):
            self.pos.setdefault(n, i)
        self.load = {n: (load or {}).get(n, 0) for n in self.pos}
        self._limit = limit
        self._domain = {n: domain_of(n, domains) for n in self.pos}
        self._heaps: dict[str, list[Entry]] = {}
        for n in self.pos:
            if self.open(n):
                self._heaps.setdefault(self._domain[n], []).append(self._entry(n))
        self._top: list[Entry] = []  # (load, position, domain) of each domain's best node
        self._shown: dict[str, tuple[int, int]] = {}  # the top entry each domain has now
        for d, heap in self._heaps.items():
            heapq.heapify(heap)
            self._show(d)

    def _entry(self, n: str) -> Entry:
        return self.load[n], self.pos[n], n

    def open(self, n: str) -> bool:
        """``n`` is one of the nodes and below its limit."""
        return n in self.pos and (self._limit is None or self.load[n] < self._limit.get(n, 0))

    def _live(self, e: Entry) -> bool:
        return e[0] == self.load[e[2]] and self.open(e[2])

    def _head(self, d: str) -> Optional[Entry]:
        heap = self._heaps.get(d, [])
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _show(self, d: str) -> None:
        """Put domain ``d``'s best node on the top heap, if it changed."""
        head = self._head(d)
        if head is not None and self._shown.get(d) != head[:2]:
            self._shown[d] = head[:2]
            heapq.heappush(self._top, (head[0], head[1], d))

    def add(self, n: str) -> None:
        """One more copy (or rank) on ``n``."""
        self.load[n] += 1
        if self.open(n):
            heapq.heappush(self._heaps[self._domain[n]], self._entry(n))
        self._show(self._domain[n])

    def _best_outside(self, d: str, exclude: Collection[str]) -> Optional[Entry]:
        """Domain ``d``'s best node not in ``exclude``."""
        heap, aside, found = self._heaps.get(d, []), [], None
        while heap:
            e = heapq.heappop(heap)
            if not self._live(e):
                continue  # stale: dropped for good
            aside.append(e)
            if e[2] not in exclude:
                found = e
                break
        for e in aside:
            heapq.heappush(heap, e)
        return found

    def pick(self, exclude: Collection[str] = (), avoid: Optional[str] = None) -> Optional[str]:
        """The least-loaded open node not in ``exclude`` and not in failure domain ``avoid``
        (ties: the earliest), or None if there is none. Loads do not change."""
        held: list[Entry] = []
        best: Optional[Entry] = None
        while self._top:
            load, pos, d = self._top[0]
            head = self._head(d)
            if head is None or head[:2] != (load, pos):
                heapq.heappop(self._top)  # stale: that domain shows a newer best, or is full
                continue
            if best is not None and (load, pos) > best[:2]:
                break  # every other domain's best is worse
            held.append(heapq.heappop(self._top))
            if d == avoid:
                continue
            if head[2] not in exclude:
                best = head if best is None else min(best, head)
                break  # no domain left has a better node than this one's best
            found = self._best_outside(d, exclude)
            if found is not None and (best is None or found < best):
                best = found
        for e in held:
            heapq.heappush(self._top, e)
        return None if best is None else best[2]
