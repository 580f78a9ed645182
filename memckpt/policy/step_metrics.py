"""A step's metrics, summarised where they are gathered: pure code shared by each node's
aggregator (its ranks) and the coordinator (the whole job).

A :class:`StepSummary` is the wire record between them: one step of some ranks (a node's),
its size whatever their number: their snapshot stalls as a mergeable :class:`Stalls`
(count, min, max, sum and a log-scale histogram, so the job's min / median / max is put
together from the nodes' in O(nodes), never from every rank's value), rank 0's loss when
it is among them, and the counters' increase over those ranks.

A worker counts cumulatively; its rank's line to the control plane sends each report with
the increase since its previous one (:func:`increments`), so a summary is a plain sum and
nothing on the way keeps per-rank counts: a store that restarts, or a report sent again,
cannot count a rank's whole history twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Optional

COUNTERS = ("replicated_bytes", "landed", "skipped", "requested")
# Histogram buckets per doubling: a bucket spans 2**(1/16), so a median read from it is
# within about 2.2% of the true one (min and max are exact).
BUCKETS_PER_DOUBLING = 16
ZERO = -(1 << 30)  # the bucket of a stall of 0 s (or less)


def bucket(seconds: float) -> int:
    return ZERO if seconds <= 0 else math.floor(math.log2(seconds) * BUCKETS_PER_DOUBLING)


def _bucket_value(b: int) -> float:
    return 0.0 if b == ZERO else 2.0 ** ((b + 0.5) / BUCKETS_PER_DOUBLING)


@dataclass(frozen=True)
class Stalls:
    """Some ranks' snapshot stalls of one step: ``n`` values, their min, max and sum, and
    ``hist`` (bucket -> count, see :func:`bucket`). Merged with :func:`merge_stalls`."""

    n: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    total: float = 0.0
    hist: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, values: list[float]) -> "Stalls":
        hist: dict[int, int] = {}
        for v in values:
            b = bucket(v)
            hist[b] = hist.get(b, 0) + 1
        return cls(len(values), min(values, default=math.inf), max(values, default=-math.inf),
                   sum(values), tuple(sorted(hist.items())))


class StallTally:
    """A step's stalls as they arrive, node by node (the coordinator's side): O(buckets)
    per merge."""

    def __init__(self) -> None:
        self.n, self.lo, self.hi, self.total = 0, math.inf, -math.inf, 0.0
        self.hist: dict[int, int] = {}

    def add(self, s: Stalls) -> None:
        self.n += s.n
        self.lo, self.hi, self.total = min(self.lo, s.lo), max(self.hi, s.hi), self.total + s.total
        for b, c in s.hist:
            self.hist[b] = self.hist.get(b, 0) + c

    def _order_stat(self, k: int) -> float:
        """The ``k``-th smallest value (0-based), estimated from the histogram."""
        if k <= 0:
            return self.lo
        if k >= self.n - 1:
            return self.hi
        seen = 0
        for b in sorted(self.hist):
            seen += self.hist[b]
            if seen > k:
                return min(self.hi, max(self.lo, _bucket_value(b)))
        return self.hi

    def stats(self) -> dict[str, float]:
        """min / median / max (min and max exact; the median to the histogram's resolution,
        exact for one or two values)."""
        if self.n == 0:
            raise ValueError("no rank's stall to summarise")
        n = self.n
        mid = (self._order_stat(n // 2) if n % 2
               else (self._order_stat(n // 2 - 1) + self._order_stat(n // 2)) / 2)
        return {"min": self.lo, "median": mid, "max": self.hi}


@dataclass(frozen=True)
class StepSummary:
    """One step of ``ranks`` ranks (a node's, or one rank's): their stalls, rank 0's loss
    (None unless rank 0 is among them and reported one), ``has_rank0`` (rank 0 is among
    them: the job's pace is read from it), and each counter's increase over them."""

    step: int
    ranks: int
    stalls: Stalls = field(default_factory=Stalls)
    loss: Optional[float] = None
    has_rank0: bool = False
    counters: tuple[tuple[str, float], ...] = ()

    def counter(self, key: str) -> float:
        for k, v in self.counters:  # a few at most
            if k == key:
                return v
        return 0.0


def increments(report: Mapping[str, float], last: MutableMapping[str, float]) -> dict[str, float]:
    """``report`` with its cumulative :data:`COUNTERS` turned into the increase since the
    same worker's last report (``last``: counter -> the last cumulative count, kept by the
    caller across calls); a count lower than the last is a worker counting again from 0."""
    out = dict(report)
    for key in COUNTERS:
        if key in out:
            count, prev = float(out[key]), last.get(key, 0.0)
            out[key] = count - prev if count >= prev else count
            last[key] = count
    return out


def without_counters(report: Mapping[str, float]) -> dict[str, float]:
    """``report`` sent again (to a restarted store): its increase may be counted already."""
    return {k: v for k, v in report.items() if k not in COUNTERS}


def summarize(step: int, reports: Mapping[int, Mapping[str, float]]) -> StepSummary:
    """The summary of ``reports`` (rank -> its report of ``step``, counters as increments)."""
    loss = None
    if 0 in reports and "loss" in reports[0]:
        loss = float(reports[0]["loss"])
    counters = []
    for key in COUNTERS:
        total = sum(float(m[key]) for m in reports.values() if key in m)
        if total:
            counters.append((key, total))
    stalls = Stalls.of([float(m["stall_s"]) for m in reports.values() if "stall_s" in m])
    return StepSummary(step, len(reports), stalls, loss, 0 in reports, tuple(counters))

