"""A group leader's store merging its group's step batches into one message
(:mod:`memckpt.policy.relay_groups` says who leads which nodes, and why).

Each member's store hands the leader its :class:`ReadyBatch` for a step (``take``, the
store's ``relay_ready`` call; a step no rank snapshotted: a batch of its summaries alone,
``ready`` 0, merged apart from the readiness batches) and gets back a future of the coordinator's answer: a
reference the member resolves itself, so its ranks hear the commit from the coordinator
directly and a leader that dies after forwarding costs nothing. The leader sends the
group's batches as one ``group_ready`` once every member's is in, or, when one is missing
(a slow or lost member), what it has once the first has waited :attr:`RelayPoint.wait_s`
(the store's heartbeat thread looks every interval: :meth:`RelayPoint.tick`). A step
commits only when every rank is ready, so waiting for the last member never delays a
commit; the wait only bounds how late the others' batches (their signs of life) arrive.

What a member does when its leader fails is on its side (:class:`~memckpt.runtime.node.uplink.Uplink`):
it sends the batch itself and stops relaying for the generation. Plain threads, no Ray.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from memckpt.runtime.coordinator.messages import ReadyBatch

KEEP_STEPS = 8  # keys a leader remembers as sent (a few steps in flight, batches and summaries)
# (generation, step, 0 for a batch that readies ranks or 1 for step summaries alone): a
# step's two kinds of message are merged apart
Key = tuple[int, int, int]


class NotLeader(Exception):
    """This store does not lead the sender's group for that generation (it restarted, or
    the generation is over): the member sends its own batch."""


class RelayPoint:
    """One leader's merging (thread-safe). ``send(parts)`` sends a ``group_ready`` of
    ``parts`` (node -> its batch, one step) and returns the coordinator's reference."""

    def __init__(self, node: str, clock: Callable[[], float]) -> None:
        self.node = node
        self.clock = clock
        self.gen = -1
        self.members: frozenset[str] = frozenset()
        self.wait_s = 0.5
        self._send: Optional[Callable[[dict[str, ReadyBatch]], Any]] = None
        self._lock = threading.Lock()
        self._parts: dict[Key, dict[str, ReadyBatch]] = {}  # not sent yet
        self._first: dict[Key, float] = {}  # when a key's first unsent part came
        self._futures: dict[Key, dict[str, Future[Any]]] = {}  # node -> its answer's future
        self._sent: dict[Key, set[str]] = {}  # members already forwarded, by key

    def configure(self, gen: int, members: tuple[str, ...], wait_s: float,
                  send: Callable[[dict[str, ReadyBatch]], Any]) -> None:
        """Lead ``members`` (this node among them) for generation ``gen`` (a newer one
        drops what an older one left)."""
        with self._lock:
            if gen < self.gen:
                return
            if gen > self.gen:
                self._fail_all(NotLeader(f"{self.node}: generation {self.gen} is over"))
            self.gen, self.members, self.wait_s, self._send = gen, frozenset(members), wait_s, send

    def take(self, node: str, batch: ReadyBatch) -> Future[Any]:
        """``node``'s batch; the future resolves to the coordinator's reference once the
        batch went (or to :class:`NotLeader`)."""
        fut: Future[Any] = Future()
        with self._lock:
            if batch.gen != self.gen or node not in self.members or self._send is None:
                fut.set_exception(NotLeader(
                    f"{self.node} does not relay {node}'s batches of generation {batch.gen}"))
                return fut
            key = (batch.gen, batch.step, 0 if batch.readies else 1)
            self._parts.setdefault(key, {})[node] = batch
            self._first.setdefault(key, self.clock())
            self._futures.setdefault(key, {})[node] = fut
            if self.members <= self._sent.get(key, set()) | set(self._parts[key]):
                self._forward(key)
        return fut

    def tick(self) -> None:
        """Send what waited :attr:`wait_s` for a member that has not come (the heartbeat
        thread's tick)."""
        with self._lock:
            now = self.clock()
            for key in [k for k, t in self._first.items() if now - t >= self.wait_s]:
                self._forward(key)

    def _forward(self, key: Key) -> None:
        parts = self._parts.pop(key, {})
        self._first.pop(key, None)
        futures = self._futures.pop(key, {})
        if not parts:
            return
        assert self._send is not None
        self._sent.setdefault(key, set()).update(parts)
        for old in sorted(self._sent)[:-KEEP_STEPS]:
            del self._sent[old]
        try:
            ref = self._send(parts)
        except Exception as e:  # noqa: BLE001 - the members send their own
            for fut in futures.values():
                fut.set_exception(e)
            return
        for fut in futures.values():
            fut.set_result(ref)

    def _fail_all(self, error: Exception) -> None:
        for futures in self._futures.values():
            for fut in futures.values():
                if not fut.done():
                    fut.set_exception(error)
        self._parts.clear()
        self._first.clear()
        self._futures.clear()
        self._sent.clear()
