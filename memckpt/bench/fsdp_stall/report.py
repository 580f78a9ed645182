"""The report of ``memckpt bench fsdp-stall``: one row per rank, and the targets."""

from __future__ import annotations

from typing import Any

from memckpt.bench.common import finish_report, human_bytes, human_s, machine_line
from memckpt.bench.snapshot.report import BUSY_THRESHOLD

# On every rank the median memckpt stall is at most 1.3x the median memcpy of its local bytes
TARGET = 1.3


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| rank | local bytes | memcpy | memckpt stall | × memcpy | × memcpy (best of each) "
             "| capture() | gather (info) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['rank']} | {human_bytes(r['local_bytes'])} | {human_s(r['memcpy_s'])} | "
                     f"{human_s(r['memckpt_s'])} | {r['ratio_to_memcpy']:.2f} | "
                     f"{r['best_ratio_to_memcpy']:.2f} | {human_s(r['capture_s'])} | "
                     f"{human_s(r['gather_s'])} |")
    return "\n".join(lines)


def report(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    head = machine_line(first["machine"], f"FSDP2 over {first['ranks']} ranks "
                        f"({'NCCL, CUDA mesh' if first['device'] == 'cuda' else 'gloo, CPU mesh'})",
                        f"model {human_bytes(first['size_bytes'])} with AdamW "
                        f"({first['layers']} × Linear({first['width']}), every layer fully_shard-ed)")
    worst = max(rows, key=lambda r: r["ratio_to_memcpy"] or 0)
    checks = [(worst["ratio_to_memcpy"] <= TARGET,
               f"memckpt stall ≤ {TARGET} × memcpy of the local bytes on every rank (worst: rank "
               f"{worst['rank']}, {worst['ratio_to_memcpy']:.2f} ×)"),
              (all(r["allocations_flat"] for r in rows), "no slot allocation after warm-up")]
    return finish_report([head, "", format_table(rows)], rows, BUSY_THRESHOLD,
                         lambda r: f"rank {r['rank']}", checks)
