"""The report of ``memckpt bench persist``: one Markdown table."""

from __future__ import annotations

from typing import Any


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | shard | median | throughput | fraction of raw |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['state_bytes'] / 2**20:.0f} MiB | "
                     f"{r['median_s']:.3f} s | {r['throughput_Bps'] / 1e9:.2f} GB/s | "
                     f"{100 * r['fraction_of_raw']:.0f}% |")
    return "\n".join(lines)
