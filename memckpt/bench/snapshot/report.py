"""The report of ``memckpt bench snapshot``: the table, the notes per size, the targets."""

from __future__ import annotations

from typing import Any, Optional

from memckpt.bench.common import GIB, finish_report, human_bytes, human_s, machine_line

BUSY_THRESHOLD = 0.05  # foreign CPU share above which a measurement is flagged


def _ratio(x: Optional[float]) -> str:
    return "–" if x is None else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | state size | median stall | × memcpy | × memckpt | peak RSS |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {human_bytes(r['state_bytes'])} | {human_s(r['stall_s'])} | "
                     f"{_ratio(r['ratio_to_memcpy'])} | {_ratio(r['ratio_to_memckpt'])} | "
                     f"{human_bytes(r['peak_rss_bytes'])} |")
    return "\n".join(lines)


def format_notes(rows: list[dict[str, Any]]) -> str:
    out = []
    by = {(r["size"], r["method"]): r for r in rows}
    for size in dict.fromkeys(r["size"] for r in rows):
        parts = []
        m, o = by.get((size, "memckpt")), by.get((size, "memckpt-overlap"))
        if m:
            parts.append(f"memckpt sync: RSS after warm-up = {m['rss_over_state']:.2f} × state "
                         f"(expected ≈ 3: live state + two slots; the slots alone "
                         f"{m['snapshot_rss_over_state']:.2f} ×); slot allocations "
                         f"{m['allocations_after_warmup']} after warm-up, {m['allocations']} at the "
                         f"end ({'flat' if m['allocations_flat'] else 'NOT flat'}); capture() "
                         f"{human_s(m['capture_s'])}; background seal (xxh3) {human_s(m['seal_s'])}")
        if o:
            parts.append(f"memckpt overlap: step() {human_s(o['step_s'])} (of which waiting for "
                         f"the previous seal {human_s(o['seal_wait_s'])}) + pre-hook wait "
                         f"{human_s(o['hook_wait_s'])}; simulated forward+backward "
                         f"{human_s(o['compute_alone_s'])} alone, {human_s(o['compute_overlap_s'])} "
                         f"while the copy runs (+{human_s(o['compute_slowdown_s'])}: visible stall + "
                         f"slowdown = {human_s(o['stall_with_slowdown_s'])}); allocations "
                         f"{'flat' if o['allocations_flat'] else 'NOT flat'} ({o['allocations']})")
        if m:
            parts.append(f"step → sealed {human_s(m['stall_s'] + m['seal_s'])} "
                         f"({(m['stall_s'] + m['seal_s']) / by[(size, 'memcpy')]['stall_s']:.2f} × "
                         f"the {'D2H' if m.get('device') == 'cuda' else 'memcpy'} bound)")
        r, f = by.get((size, "memckpt-restore")), by.get((size, "memckpt-first"))
        if r:
            parts.append(f"restore {human_s(r['stall_s'])} vs the copy back "
                         f"{human_s(r['bound_s'])} ({r['stall_s'] / r['bound_s']:.2f} ×)")
        if f:
            parts.append(f"first snapshot {human_s(f['stall_s'])} with prepared slots, "
                         f"{human_s(f['cold_s'])} cold")
        d = by.get((size, "torch.save-disk"))
        if d:
            parts.append(f"torch.save-disk: {d['dir']} ({d['dir_fs']})")
        first = next(r for r in rows if r["size"] == size)
        parts.insert(0, f"model {first['layers']} × Linear({first['width']}) + AdamW, "
                        f"{first['tensors']} tensors")
        out.append(f"- {size}: " + "; ".join(parts))
    return "\n".join(out)


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """The issue's targets, evaluated on the rows at hand: (met, description)."""
    checks = []
    by = {(r["size"], r["method"]): r for r in rows}
    for (size, method), r in by.items():
        big = r["target_bytes"] >= GIB
        if method == "memckpt" and big:
            checks.append((r["ratio_to_memcpy"] <= 1.3,
                           f"{size}: memckpt sync stall {r['ratio_to_memcpy']:.2f} × memcpy (target ≤ 1.3)"))
        if method == "memckpt-overlap":
            checks.append((r["ratio_to_memcpy"] <= 0.3,
                           f"{size}: overlap visible stall {r['ratio_to_memcpy']:.2f} × memcpy "
                           "(target ≤ 0.3)"))
        if method == "torch.save-disk" and r["target_bytes"] == GIB and (size, "memckpt") in by:
            x = r["stall_s"] / by[(size, "memckpt")]["stall_s"]
            checks.append((x >= 10, f"{size}: torch.save-disk / memckpt = {x:.1f} × (target ≥ 10)"))
    return checks


def report(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no rows measured"
    head = machine_line(rows[0]["machine"], threads=True)
    return finish_report([head, "", format_table(rows), "", format_notes(rows)], rows,
                         BUSY_THRESHOLD, lambda r: f"{r['size']} {r['method']}", check_targets(rows))

