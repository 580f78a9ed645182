"""The rows of ``memckpt bench ray-train``: stall, recovery and lost work, one per method
and size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

from memckpt.bench.common import KindedRow

PARTS = ("stall", "recovery", "lost_work")
OVERHEAD = 0.05  # the step overhead a checkpoint interval may cost

# The keys each part's rows have, in the order the JSON output has always had them.
KEYS: dict[str, tuple[str, ...]] = {
    "stall": ("benchmark", "method", "size", "state_bytes", "median", "compute_s", "unit",
              "samples"),
    "recovery": ("benchmark", "method", "size", "state_bytes", "median", "unit", "phases_s",
                 "sources"),
    "lost_work": ("benchmark", "method", "size", "state_bytes", "interval_steps", "compute_s",
                  "median", "unit"),
}


@dataclass(frozen=True)
class Row(KindedRow):
    benchmark: str  # one of PARTS: it names the keys the row reports (KEYS)
    method: str
    size: str  # the size as given (--sizes)
    state_bytes: int
    median: float  # seconds: blocking per step, recovery total, or work redone per failure
    unit: str = "s"
    compute_s: Optional[float] = None  # stall, lost_work: the step's compute
    samples: Optional[list[float]] = None  # stall: every step's blocking time
    phases_s: Optional[dict[str, float]] = None  # recovery: restart, build, restore, ...
    sources: Optional[list[str]] = None  # recovery: where each rank restored from
    interval_steps: Optional[int] = None  # lost_work: the affordable snapshot interval
    KIND: ClassVar[str] = "benchmark"
    KEYS: ClassVar[Mapping[str, tuple[str, ...]]] = KEYS


def lost_work(stall: list[Row]) -> list[Row]:
    """Per method and size: the interval (steps) whose blocking costs <= 5 % of a step, and
    the training time a failure redoes on average (half an interval). Both sides run the
    same compute; its fastest measurement at that size is the step both are held to."""
    rows = []
    for r in stall:
        compute = min(o.compute_s or 0.0 for o in stall if o.size == r.size)
        interval = max(1, math.ceil(r.median / (OVERHEAD * compute)))
        rows.append(Row("lost_work", r.method, r.size, r.state_bytes,
                        interval / 2 * (compute + r.median / interval),
                        interval_steps=interval, compute_s=compute))
    return rows
