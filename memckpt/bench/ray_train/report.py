"""The report of ``memckpt bench ray-train``: a line per row, and the targets at 1 GiB."""

from __future__ import annotations

from typing import Any

from memckpt.bench.common import human_bytes, human_s, machine_info, machine_line


def report(rows: list[dict[str, Any]]) -> str:
    text = [machine_line(machine_info()), ""]
    by = {(r["benchmark"], r["method"], r["size"]): r for r in rows}
    checks = []
    for r in rows:
        if r["benchmark"] == "stall":
            text.append(f"stall     {r['size']:>5} {r['method']:<18} blocking {human_s(r['median'])}"
                        f" per step (compute {human_s(r['compute_s'])}, state "
                        f"{human_bytes(r['state_bytes'])})")
        elif r["benchmark"] == "recovery":
            ph = r["phases_s"]
            text.append(f"recovery  {r['size']:>5} {r['method']:<18} total {human_s(r['median'])}:"
                        f" restart {human_s(ph['restart'])}, build {human_s(ph['build'])}, "
                        f"restore {human_s(ph['restore'])}, first step {human_s(ph['first_step'])}")
        else:
            text.append(f"lost work {r['size']:>5} {r['method']:<18} interval {r['interval_steps']}"
                        f" steps at <= 5 %: {human_s(r['median'])} redone per failure")
    for (bench, method, size), r in by.items():
        other = by.get((bench, "ray-train-report" if bench == "stall" else "ray-train-restore",
                        size))
        if method != "memckpt" or other is None or size != "1G":
            continue
        if bench == "stall":
            ratio = other["median"] / max(r["median"], 1e-9)
            checks.append((ratio >= 10, f"stall at 1 GiB {ratio:.1f}x lower (target >= 10x)"))
        if bench == "recovery":
            ratio = other["phases_s"]["restore"] / max(r["phases_s"]["restore"], 1e-9)
            checks.append((ratio >= 3, f"restore at 1 GiB {ratio:.1f}x faster (target >= 3x); "
                                       f"whole recovery {other['median'] / r['median']:.2f}x"))
    if checks:
        text += ["", "targets:"] + [f"- {'met' if ok else 'MISSED'}: {d}" for ok, d in checks]
    return "\n".join(text)
