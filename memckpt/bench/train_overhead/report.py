"""The report of ``memckpt bench train-overhead``."""

from __future__ import annotations

from memckpt.bench.common import finish_report, human_bytes, human_s, machine_line
from memckpt.bench.train_overhead.rows import Row


def report(rows: list[Row]) -> str:
    if not rows:
        return "no rows measured"
    lines = ["| loop | state | step time | overhead | snapshots landed |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        over = "–" if r.overhead is None else f"{100 * r.overhead:+.0f}%"
        landed = "–" if r.mode is None else f"{r.landed} of {r.requested}"
        lines.append(f"| {r.variant} | {human_bytes(r.state_bytes)} | {human_s(r.step_s)} | "
                     f"{over} | {landed} |")
    head = machine_line(rows[0].machine, f"state on {rows[0].device}",
                        f"{rows[0].seal_threads or rows[-1].seal_threads} seal threads")
    notes = ("wait: every due snapshot lands, the step waits for a seal slower than itself; "
             "skip: the step never waits, a snapshot due while the previous one is still "
             "sealing is skipped (a failure then loses up to the steps between landed ones)")
    return finish_report([head, "", "\n".join(lines), "", notes], [r.to_dict() for r in rows],
                         None, lambda r: r["variant"], [])
