"""The report of ``memckpt bench elastic``: both ways back, and the speed-up."""

from __future__ import annotations

from typing import Any

from memckpt.bench.common import human_s

# memckpt's elastic shrink aims to reach the first step at the smaller size at least 3x
# sooner than a restart that loads the same step from disk
TARGET_SPEEDUP = 3.0


def report(rows: list[dict[str, Any]], state_mb: int) -> str:
    ours, base = rows[0]["seconds"], rows[1]["seconds"]
    lines = [f"node death -> first step at 2 ranks, {state_mb} MiB state per rank "
             "(of which: node death -> every rank's state loaded; then its first snapshot at "
             "the new size, the first step and its commit):"]
    for r in rows:
        lines.append(f"  {r['method']:<32} {human_s(r['seconds'])}  (restored "
                     f"{human_s(r['restored_s'])}, first step "
                     f"{human_s(r['seconds'] - r['restored_s'])})")
    speedup = base / ours if ours else float("inf")
    restore_x = rows[1]["restored_s"] / rows[0]["restored_s"]
    lines.append(f"speed-up {speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x): "
                 f"{'met' if speedup >= TARGET_SPEEDUP else 'MISSED'}; to every rank restored "
                 f"{restore_x:.1f}x")
    return "\n".join(lines)
