"""Which bytes of a snapshot have landed in its slot: lets the seal hash a chunk as soon as
the copy has written it, instead of after the whole copy.

A device-to-host copy is queued on a side stream, tensor by tensor, with a CUDA event
after each; :meth:`Landing.wait` blocks (GIL released, in ``Event.synchronize``) until the
tensors overlapping a byte range are in host memory. A host copy is synchronous: it has
landed once :meth:`Landing.queued` is called. The seal's hashing threads wait per batch
of chunks (:func:`memckpt.format.shard.seal`'s ``ready``), so on a GPU the seal runs
behind the copy and ends shortly after it (the bus, ~55 GB/s, is slower than hashing on
a few threads).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Callable, Optional, Sequence


class Landing:
    """The progress of one copy into a slot's data region (offsets relative to it)."""

    def __init__(self) -> None:
        self._queued = threading.Event()
        self._ends: list[int] = []  # the end offset of each copied tensor, ascending
        self._starts: list[int] = []
        self._events: list[Any] = []  # a torch.cuda.Event per tensor, or None (landed)

    @staticmethod
    def done() -> "Landing":
        """A copy with nothing left to land."""
        landing = Landing()
        landing.queued([])
        return landing

    def queued(self, spans: Sequence[tuple[int, int, Any]]) -> None:
        """Every copy is issued: ``spans`` are ``(start, end, event)`` in data order, the
        event None where the bytes are already in place. Also called, with what was
        issued, when issuing failed: waiters must never hang."""
        ordered = sorted(spans, key=lambda s: s[0])
        self._starts = [s for s, _, _ in ordered]
        self._ends = [e for _, e, _ in ordered]
        self._events = [ev for _, _, ev in ordered]
        self._queued.set()

    def landed(self) -> bool:
        """Whether every byte has landed (without waiting)."""
        if not self._queued.is_set():
            return False
        last = next((ev for ev in reversed(self._events) if ev is not None), None)
        return last is None or bool(last.query())

    def wait(self, start: int = 0, end: Optional[int] = None) -> None:
        """Block until the bytes in ``[start, end)`` (default: all) have landed."""
        self._queued.wait()
        if not self._events:
            return
        first = bisect.bisect_right(self._ends, start)
        last = len(self._events) if end is None else bisect.bisect_left(self._starts, end)
        # events complete in stream order: the last one overlapping the range covers the rest
        for event in reversed(self._events[first:last]):
            if event is not None:
                event.synchronize()
                return


def all_landed(landings: Sequence[Landing]) -> Callable[[int, int], None]:
    """A seal's ``ready(start, end)``: wait until every landing has that range."""
    def ready(start: int, end: int) -> None:
        for landing in landings:
            landing.wait(start, end)
    return ready

