"""A step's metrics, summarised where they are gathered: pure code shared by each node's
aggregator (its ranks) and the coordinator (the whole job).

A summary is a plain dict, the wire format between them::

    {"step": s, "ranks": n, "stall_s": {rank: seconds}, "loss": rank 0's loss (if among them),
     "replicated_bytes" / "landed" / "skipped" / "requested": the increase over those ranks
     since their last report}

A worker counts cumulatively; its rank's line to the control plane sends each report with
the increase since its previous one (:func:`increments`), so a summary is a plain sum and
nothing on the way keeps per-rank counts: a store that restarts, or a report sent again,
cannot count a rank's whole history twice.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

COUNTERS = ("replicated_bytes", "landed", "skipped", "requested")
Summary = dict[str, Any]


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


def summarize(step: int, reports: Mapping[int, Mapping[str, float]]) -> Summary:
    """The summary of ``reports`` (rank -> its report of ``step``, counters as increments)."""
    out: Summary = {"step": step, "ranks": len(reports),
                    "stall_s": {r: float(m["stall_s"]) for r, m in reports.items()
                                if "stall_s" in m}}
    if 0 in reports and "loss" in reports[0]:
        out["loss"] = float(reports[0]["loss"])
    for key in COUNTERS:
        total = sum(float(m[key]) for m in reports.values() if key in m)
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
