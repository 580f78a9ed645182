"""The report of ``memckpt bench lora``: the table, what the job was, and the targets."""

from __future__ import annotations

from typing import Optional

from memckpt.bench.common import finish_report, human_bytes, human_s, machine_line
from memckpt.bench.lora.rows import Row
from memckpt.bench.snapshot.report import BUSY_THRESHOLD

# #50: with a frozen base, a snapshot blocks the loop for at most 1.5x what checkpointing
# the trainable part alone would
TARGET_VS_TRAINABLE = 1.5


def _x(ratio: Optional[float]) -> str:
    if ratio is None:
        return "–"
    return f"{ratio:.0f}×" if ratio >= 100 else f"{ratio:.2f}×" if ratio >= 0.1 else f"{ratio:.3f}×"


def format_table(rows: list[Row]) -> str:
    lines = ["| checkpointer | state | blocked / step | × off | × trainable alone | "
             "copied / step | sent to a holder / step | seal | own slots in RAM | "
             "own + holder's (× state) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        sent = f"{human_bytes(r.sent_bytes)} ({100 * r.sent_vs_shard:.0f}% of the shard)"
        lines.append(f"| {r.label} | {human_bytes(r.state_bytes)} | {human_s(r.blocked_s)} | "
                     f"{_x(r.blocked_vs_off)} | {_x(r.blocked_vs_trainable)} | "
                     f"{human_bytes(r.copied_bytes)} | {sent} | {human_s(r.seal_s)} | "
                     f"{human_bytes(r.ram_bytes)} ({r.ram_over_state:.2f}× state) | "
                     f"{human_bytes(r.ram_bytes + r.holder_bytes)} ({r.held_over_state:.2f}×) |")
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[tuple[bool, str]]:
    """The issue's target, on the rows at hand: (met, description)."""
    return [(r.blocked_vs_trainable <= TARGET_VS_TRAINABLE,
             f'{r.label}: blocked {r.blocked_vs_trainable:.2f}× the trainable part alone '
             f'(target ≤ {TARGET_VS_TRAINABLE})')
            for r in rows if r.variant in ("verify", "trust") and r.blocked_vs_trainable is not None]


def report(rows: list[Row], job: str) -> str:
    """``job``: what the job is (the model, its parameters), one line."""
    if not rows:
        return "no rows measured"
    first = rows[0]
    m = first.machine
    head = machine_line(m, f"CPU {m.get('cpu_model') or 'unknown'}", threads=True)
    notes = [f"job ({first.preset}): {job}; state {human_bytes(first.job_state_bytes)}, the frozen "
             f"base {100 * first.frozen_share:.2f}% of it",
             f"medians over {first.steps} steps after {first.warmup} warm-up snapshots; each step "
             "every checkpointer in turn (the order rotates), the seal waited for, then the step "
             "sent to the checkpointer's own replica holder (a ReplicaStore over TCP on the "
             "loopback, as the runtime's replicator sends)",
             "blocked: Checkpointer.step (capture + copy); copied: EngineStats.last_copied_bytes; "
             "sent: what StoreConnection.send returned. A holder reuses every chunk whose "
             "checksum did not change (left in place from its copy two steps back, or copied "
             "from the one before) whatever skip_unchanged says: that setting decides what this "
             "node copies and hashes, not what crosses the network"]
    if first.quiet_timeouts:
        notes.append(f"--wait-quiet ran out before {first.quiet_timeouts} of "
                     f"{first.warmup + first.steps} steps: measured on a busy machine")
    return finish_report([head, "", format_table(rows), "", *notes],
                         [r.to_dict() for r in rows], BUSY_THRESHOLD, lambda r: r["label"],
                         check_targets(rows))
