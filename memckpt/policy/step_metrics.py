"""A step's metrics, summarised where they are gathered: pure code shared by each node's
aggregator (its ranks) and the coordinator (the whole job).

A summary is a plain dict, the wire format between them::

    {"step": s, "ranks": n, "stall_s": {rank: seconds}, "loss": rank 0's loss (if among them),
     "replicated_bytes" / "landed" / "skipped" / "requested": the increase over those ranks
     since their last summary (the reports carry cumulative counts per worker process)}
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

COUNTERS = ("replicated_bytes", "landed", "skipped", "requested")
Summary = dict[str, Any]


def summarize(step: int, reports: Mapping[int, Mapping[str, float]],
              counted: MutableMapping[tuple[str, int], float]) -> Summary:
    """The summary of ``reports`` (rank -> its report of ``step``). ``counted`` keeps
    (counter, rank) -> the last cumulative count seen, across calls; a count lower than
    that is a replaced worker counting again from 0."""
    out: Summary = {"step": step, "ranks": len(reports),
                    "stall_s": {r: float(m["stall_s"]) for r, m in reports.items()
                                if "stall_s" in m}}
    if 0 in reports and "loss" in reports[0]:
        out["loss"] = float(reports[0]["loss"])
    for key in COUNTERS:
        total = 0.0
        for r, m in reports.items():
            count = m.get(key)
            if count is None:
                continue
            last = counted.get((key, r), 0.0)
            total += count - last if count >= last else count
            counted[(key, r)] = count
        if total:
            out[key] = total
    return out


def stall_stats(values: list[float]) -> dict[str, float]:
    """min / median / max of one step's snapshot stalls over the ranks (``values`` not
    empty)."""
    if not values:
        raise ValueError("stall_stats needs at least one rank's stall")
    ordered = sorted(values)
    n = len(ordered)
    mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"min": ordered[0], "median": mid, "max": ordered[-1]}
