"""The report of ``memckpt bench reshard``: one table, each row against dcp.load."""

from __future__ import annotations

from typing import Any

from memckpt.bench.common import human_bytes, human_s, machine_line
from memckpt.bench.reshard.measure import WRITERS


def report(rows: list[dict[str, Any]]) -> str:
    lines = [machine_line(rows[0]["machine"], f"state {human_bytes(rows[0]['state_bytes'])} "
                          f"written by {WRITERS} FSDP2 ranks"),
             "| source | ranks | restore | vs dcp.load | bytes read | peak RSS growth / rank "
             "| new shard |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = {r["to_ranks"]: r["seconds"] for r in rows if r["source"] == "dcp"}
    for r in rows:
        ratio = base[r["to_ranks"]] / r["seconds"]
        lines.append(f"| {r['source']} | {r['from_ranks']}->{r['to_ranks']} | "
                     f"{human_s(r['seconds'])} | {ratio:.2f}x | {human_bytes(r['bytes_read'])} | "
                     f"{human_bytes(r['peak_growth'])} | {human_bytes(r['new_shard_bytes'])} |")
    return "\n".join(lines)
