"""The report of ``memckpt bench compare``: one table of every part, and the targets."""

from __future__ import annotations

from typing import Any, Optional

from memckpt.bench.common import GIB, finish_report, human_bytes, human_s, machine_line
from memckpt.bench.compare.rows import (BASELINE_NODE, OVERHEAD_BUDGET, PARTS, base_method,
                                        is_baseline)

# What memckpt aims for: a snapshot's stall at most 1.3x a plain memcpy of the same bytes,
# and 10x below torch.save's from 0.5 GiB of state; a recovery 3x faster than the fastest
# alternative (a lost node's, after the same failure); at most 1 step lost per failure at
# the overhead budget (OVERHEAD_BUDGET).
TARGET_X_MEMCPY = 1.3
TARGET_VS_TORCH_SAVE = 10.0
TARGET_RECOVERY_SPEEDUP = 3.0
TARGET_LOST_STEPS = 1.0


def _fmt(r: dict[str, Any]) -> str:
    if r["unit"] == "s":
        return human_s(r["median"])
    if r["unit"] == "bytes":
        return human_bytes(r["median"])
    return f"{r['median']:.2f} steps"


def _x(v: Optional[float]) -> str:
    return "–" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.0f}")


def _detail(r: dict[str, Any]) -> str:
    b, m = r["benchmark"], r["method"]
    if b == "stall":
        if is_baseline(m):
            return f"{r['harness']}, no checkpoint"
        parts = [f"blocking {human_s(r['blocking_s'])}"]
        if r.get("step_increase_s") is not None:
            parts.append(f"step +{human_s(max(0.0, r['step_increase_s']))}")
        if r.get("fraction_of_limit"):
            parts.append(f"{100 * r['fraction_of_limit']:.0f}% of memcpy speed")
        if r.get("replicate_s"):
            parts.append(f"replication {human_s(r['replicate_s'])} behind")
        if r.get("persist_s"):
            parts.append(f"write done {human_s(r['persist_s'])} after the call")
        if r.get("report_s") is not None and base_method(m) == "ray-train":
            parts.append(f"torch.save {human_s(r['write_s'])} + report {human_s(r['report_s'])}")
        return "; ".join(parts)
    if b == "lost_work":
        return (f"every {r['interval_steps']} steps ({100 * r['overhead_at_interval']:.1f}% "
                f"overhead; {100 * r['overhead_every_step']:.0f}% every step)")
    if b == "recovery":
        s = r["phases_s"]
        keys = [k for k in ("detect", "restart", "start_actors", "resume", "torch_load", "first_step")
                if k in s]
        out = ", ".join(f"{k} {s[k]:.2f}" for k in keys)
        if r.get("speedup_vs_fastest_alternative"):
            out += f"; {r['speedup_vs_fastest_alternative']:.2f}× faster than the fastest alternative"
        if r.get("speedup_vs_same_failure"):
            out += (f" (after a killed worker), {r['speedup_vs_same_failure']:.2f}× faster than "
                    "restart+torch.load after the same node loss")
        if r.get("fraction_of_limit"):
            out += f"; peer fetch at {100 * r['fraction_of_limit']:.0f}% of a raw TCP transfer"
        return out
    if b == "scaling":
        if m.endswith("memory"):
            return f"{r['x_state']:.2f}× the shard (expected {r['expected_x_state']})"
        if r.get("base_step_s"):
            return (f"{r['nodes']} nodes, k={r['k']}: +{100 * r['median'] / r['base_step_s']:.0f}% "
                    f"on a {human_s(r['base_step_s'])} step")
        return f"{r['nodes']} nodes, k={r['k']}, every rank training on the same 2 cores"
    return ""


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | method | state | median | × memcpy | × memckpt | details |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    order = {p: i for i, p in enumerate(PARTS)}

    def key(r: dict[str, Any]) -> tuple[int, int, int]:
        return (order[r["benchmark"]], r["state_bytes"] if r["benchmark"] != "scaling" else 0,
                r.get("nodes", 0))

    for r in sorted(rows, key=key):
        name = r["method"] + (f" ({r['nodes']} nodes)" if r["benchmark"] == "scaling" else "")
        lines.append(f"| {r['benchmark']} | {name} | {human_bytes(r['state_bytes'])} | {_fmt(r)} | "
                     f"{_x(r.get('x_memcpy'))} | {_x(r.get('x_memckpt'))} | {_detail(r)} |")
    return "\n".join(lines)


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    checks: list[tuple[bool, str]] = []
    st = {(r["size"], r["method"]): r for r in rows if r["benchmark"] == "stall"}
    for (size, m), r in st.items():
        if m in ("memckpt", "memckpt-local") and r.get("x_memcpy"):
            memcpy = st[(size, "memcpy")]["stall_s"]
            checks.append((r["x_memcpy"] <= TARGET_X_MEMCPY,
                           f"{size}: {m} stall {r['x_memcpy']:.2f}× memcpy (target ≤ {TARGET_X_MEMCPY})"))
            checks.append((r["blocking_s"] / memcpy <= TARGET_X_MEMCPY,
                           f"{size}: {m} blocking part alone {r['blocking_s'] / memcpy:.2f}× memcpy"))
    for (size, m), r in st.items():
        if m not in ("memckpt", "memckpt-local") or r["state_bytes"] < GIB // 2:
            continue
        for what, mine in (("stall", r["stall_s"]), ("blocking part", r["blocking_s"])):
            if (size, "torch.save") in st:
                x = st[(size, "torch.save")]["stall_s"] / mine
                checks.append((x >= TARGET_VS_TORCH_SAVE,
                               f"{size}: torch.save stall / {m} {what} = {x:.1f}× (target ≥ 10)"))
            if (size, "dcp-async") in st:
                x = st[(size, "dcp-async")]["blocking_s"]
                checks.append((mine < x, f"{size}: {m} {what} {human_s(mine)} vs DCP async_save "
                                         f"blocking part {human_s(x)} (target: lower)"))
    for r in rows:
        if r["benchmark"] == "recovery" and r["method"] == "memckpt-worker" and \
                r.get("speedup_vs_fastest_alternative"):
            for m in ("memckpt-worker", "memckpt-node"):
                rr = next((x for x in rows if x["benchmark"] == "recovery" and x["method"] == m
                           and x["size"] == r["size"]), None)
                if rr and rr.get("speedup_vs_same_failure"):  # a lost node's alternative
                    s = rr["speedup_vs_same_failure"]
                    checks.append((s >= TARGET_RECOVERY_SPEEDUP,
                                   f"{r['size']}: {m} recovery {s:.2f}× faster than "
                                   f"{BASELINE_NODE} (the same failure; target ≥ 3)"))
                elif rr and rr.get("speedup_vs_fastest_alternative"):
                    s = rr["speedup_vs_fastest_alternative"]
                    checks.append((s >= TARGET_RECOVERY_SPEEDUP,
                                   f"{r['size']}: {m} recovery {s:.2f}× faster than the fastest "
                                   f"alternative (target ≥ 3)"))
        if r["benchmark"] == "lost_work" and r["method"] == "memckpt":
            checks.append((r["median"] <= TARGET_LOST_STEPS and r["overhead_at_interval"] <= OVERHEAD_BUDGET,
                           f"{r['size']}: memckpt loses {r['median']:.2f} steps per failure at "
                           f"{100 * r['overhead_at_interval']:.1f}% overhead (target ≤ 1 at ≤ 5%)"))
    return checks


def report(rows: list[dict[str, Any]]) -> str:
    peers = [r for r in rows if r["benchmark"] == "peers"]
    rows = [r for r in rows if r["benchmark"] != "peers"]
    if peers:
        from memckpt.bench.compare.peer_rows import format_peers
        side = format_peers(peers)
        if not rows:
            return machine_line(peers[0]["machine"]) + "\n\n" + side
        return _report(rows) + "\n\n" + side
    return _report(rows)


def _report(rows: list[dict[str, Any]]) -> str:
    step = max(rows, key=lambda r: r.get("compute_alone_s") or 0, default=None)
    if step is None:
        return "no rows"
    head = machine_line(rows[0]["machine"],
                        f"simulated step {step.get('compute_alone_s') or 0:.2f} s "
                        f"({step.get('compute_matmuls') or 0} matmuls)")
    # no CPU-share warning: the compare rows do not record what other processes took
    return finish_report([head, "", format_table(rows)], rows, None,
                         lambda r: f"{r['benchmark']} {r['method']}", check_targets(rows),
                         missed="NOT met")

