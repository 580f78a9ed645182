"""A node's agent toward the coordinator: its ranks' readiness, per-step metrics and
heartbeats, gathered into one message per node per step and one per heartbeat interval.

Plain Python, no Ray: the replica store (one actor per node) hosts a
:class:`NodeAggregator` and sends what it returns. Per step, a node sends the coordinator
exactly one message:

- :class:`ReadyBatch` once every local rank's shard of the step and its replicas are in
  place (``node_ready``), carrying the metrics of the steps its ranks finished meanwhile;
- or, for a step no local rank snapshotted, the step's metrics alone (``node_metrics``).

(A generation's first step also sends its metrics at once, before its batch: the driver
times a recovery's resume by them. One more message per node per generation.)

Each batch is O(1) in the node's ranks when all is well: the store judges each rank's
placement against the holders its spec names (given at its join) and sends how many were
placed on all of theirs, with a digest of those holders that the coordinator compares with
its own placement's; only a rank placed short is named, with where it did place.

Once per interval, :meth:`NodeAggregator.heartbeat` gives the node's newest step and its
oldest sign of life, naming only the ranks silent for longer than ``late_s`` (their *age*:
seconds on this node's clock, so the coordinator's own clock places it whatever the skew),
plus any metrics still held (a step some ranks snapshotted and others skipped: its readiness
never completes on this node). Every rank's age stays here (:meth:`NodeAggregator.detail`,
for ``memckpt status --ranks``).

A step's metrics go as a :class:`~memckpt.policy.step_metrics.StepSummary` of the node's
ranks: the same size however many ranks the node runs.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from memckpt.policy.placement import holders_digest
from memckpt.policy.step_metrics import StepSummary, summarize
from memckpt.runtime.coordinator.messages import Heartbeat, ReadyBatch

__all__ = ["Heartbeat", "NodeAggregator", "ReadyBatch"]


class NodeAggregator:
    """One node's ranks of the current generation (the store joins each generation with
    the ranks placement put on the node). Not thread-safe: the store calls it under its
    lock. Calls of an older generation change nothing (a thawed node's workers)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.gen = -1
        self.ranks: frozenset[int] = frozenset()
        self._ready: dict[int, dict[int, tuple[str, ...]]] = {}  # step -> rank -> holders
        self._sent: set[int] = set()  # steps whose ReadyBatch went out (this generation)
        self._reports: dict[int, dict[int, Mapping[str, float]]] = {}  # step -> rank -> report
        self._snapshotted: dict[int, int] = {}  # step -> local ranks that snapshotted it
        self._held: list[StepSummary] = []  # complete summaries waiting for their step's batch
        self._last: dict[int, tuple[float, int]] = {}  # rank -> (time of last sign, step)
        self._expect: dict[int, tuple[str, ...]] = {}  # rank -> the holders its spec names
        self._digest: Optional[str] = None  # holders_digest of _expect, once every rank's in
        self._summarized = False  # a step of this generation was summarised

    # -- membership -------------------------------------------------------------------------
    def join(self, gen: int, ranks: Iterable[int], now: float) -> bool:
        """Generation ``gen`` places ``ranks`` on this node. A newer generation starts
        afresh; the current one is a no-op; an older one is refused (False)."""
        if gen < self.gen:
            return False
        if gen > self.gen:
            self.gen, self.ranks = gen, frozenset(int(r) for r in ranks)
            self._ready.clear()
            self._sent.clear()
            self._reports.clear()
            self._snapshotted.clear()
            self._held.clear()
            self._expect.clear()
            self._digest = None
            self._summarized = False
            self._last = {r: (now, -1) for r in self.ranks}
        return True

    def expect(self, rank: int, gen: int, holders: Iterable[str]) -> None:
        """``rank``'s spec names ``holders`` for its shards (said at its join)."""
        if self.knows(gen, rank):
            self._expect[rank] = tuple(sorted(holders))
            self._digest = None

    def knows(self, gen: int, rank: int) -> bool:
        return gen == self.gen and rank in self.ranks

    # -- per step ---------------------------------------------------------------------------
    def ready(self, rank: int, gen: int, step: int, holders: Iterable[str],
              now: float) -> Optional[ReadyBatch]:
        """``rank``'s shard of ``step`` is placed on ``holders``. Returns the node's batch
        once every local rank's is (once per step: a repeated call returns None)."""
        if not self.knows(gen, rank) or step in self._sent:
            return None
        self._touch(rank, now)
        got = self._ready.setdefault(step, {})
        got[rank] = tuple(holders)
        if len(got) < len(self.ranks):
            return None
        del self._ready[step]
        for old in [s for s in self._ready if s < step]:  # a rank that never will: dropped
            del self._ready[old]
        self._sent = {s for s in self._sent if s > step - 8} | {step}
        held = tuple(m for m in self._held if m.step <= step)
        self._held = [m for m in self._held if m.step > step]
        return self._batch(gen, step, got, held)

    def _batch(self, gen: int, step: int, got: Mapping[int, tuple[str, ...]],
               held: tuple[StepSummary, ...]) -> ReadyBatch:
        """Each rank judged against its spec's holders: the usual case, every one placed on
        all of them, costs the coordinator O(1)."""
        short = {r: h for r, h in got.items()
                 if r not in self._expect or not set(self._expect[r]) <= set(h)}
        if not short:
            if self._digest is None:
                self._digest = holders_digest(self._expect)
            return ReadyBatch(gen, step, len(got), self._digest, {}, held)
        judged = {r: self._expect[r] for r in got if r not in short}
        return ReadyBatch(gen, step, len(judged), holders_digest(judged), short, held)

    def report(self, rank: int, gen: int, step: int, metrics: Mapping[str, float],
               snapshotted: bool, now: float) -> list[StepSummary]:
        """``rank`` finished ``step`` (its report; ``snapshotted``: it took a snapshot of the
        step, whose readiness will follow). Returns the summaries to send now: the step's,
        once every local rank reported it, unless every one snapshotted it (then it rides on
        the step's ReadyBatch, or on the next heartbeat if that never completes)."""
        if not self.knows(gen, rank):
            return []
        self._last[rank] = (now, step)
        got = self._reports.setdefault(step, {})
        got[rank] = metrics
        if snapshotted:
            self._snapshotted[step] = self._snapshotted.get(step, 0) + 1
        if len(got) < len(self.ranks):
            return []
        del self._reports[step]
        for old in [s for s in self._reports if s < step]:  # ranks report in order
            del self._reports[old]
            self._snapshotted.pop(old, None)
        summary = summarize(step, got)
        first, self._summarized = not self._summarized, True
        every = self._snapshotted.pop(step, 0) == len(self.ranks)
        # the generation's first step goes at once: the driver times a recovery's resume by it
        if every and not first and step not in self._sent:
            self._held.append(summary)
            return []
        return [summary]

    # -- liveness -------------------------------------------------------------------------
    def beat(self, rank: int, gen: int, step: int, now: float) -> None:
        if self.knows(gen, rank):
            self._last[rank] = (now, max(step, self._last.get(rank, (now, -1))[1]))

    def _touch(self, rank: int, now: float) -> None:
        self._last[rank] = (now, self._last.get(rank, (now, -1))[1])

    def take_held(self) -> list[StepSummary]:
        """The summaries still held (their step's readiness has not gone): a rank's run ended."""
        held, self._held = self._held, []
        return held

    def take_ended(self) -> list[StepSummary]:
        """As the generation ends (a newer one joins): the summaries still held, and rank
        0's report of a step some local rank had not reported yet (its loss, which the
        coordinator keeps for a step the new generation resumed from)."""
        partial = [summarize(step, {0: got[0]}) for step, got in sorted(self._reports.items())
                   if 0 in got and "loss" in got[0]]
        self._reports.clear()
        return self.take_held() + partial

    def detail(self, now: float) -> dict[int, tuple[float, int]]:
        """Every local rank's (age of its last sign of life, its step)."""
        return {r: (max(0.0, now - t), s) for r, (t, s) in self._last.items()}

    def heartbeat(self, now: float, late_s: float) -> Optional[Heartbeat]:
        """The node's heartbeat for this interval (None before any generation joined),
        naming the ranks silent longer than ``late_s``; takes the metrics still held."""
        if self.gen < 0:
            return None
        top, oldest, late = -1, 0.0, {}
        for r, (t, s) in self._last.items():
            age = max(0.0, now - t)
            top, oldest = max(top, s), max(oldest, age)
            if age > late_s:
                late[r] = (age, s)
        return Heartbeat(self.gen, top, oldest, late, tuple(self.take_held()))
