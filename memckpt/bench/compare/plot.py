"""The PNG of ``memckpt bench compare --plot``: stall, recovery, lost work, scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memckpt.bench.compare.rows import base_method

WIDTH_PX, HEIGHT_PX, DPI = 1400, 1000, 100
COLORS = {"memckpt": "#d62728", "memckpt-local": "#ff9896", "memcpy": "#7f7f7f",
          "raw-disk-write": "#c7c7c7", "torch.save": "#1f77b4", "dcp-async": "#2ca02c",
          "ray-train": "#9467bd", "memckpt-worker": "#d62728", "memckpt-node": "#ff9896",
          "restart+torch.load": "#1f77b4", "restart+torch.load-node-lost": "#aec7e8",
          "restart+dcp.load": "#2ca02c",
          "ray-train-restore": "#9467bd", "memckpt-k1": "#d62728", "memckpt-k2": "#8c564b"}


def _color(method: str) -> str:
    return COLORS.get(method) or COLORS.get(base_method(method)) or "#bcbd22"


def _rows(rows: list[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["benchmark"] == bench]


def plot_compare(rows: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    (a_stall, a_rec), (a_lost, a_scale) = axes

    # stall vs state size, log-log
    stall = [r for r in _rows(rows, "stall") if r.get("stall_s")]  # not the baselines
    for m in dict.fromkeys(r["method"] for r in stall):
        pts = sorted((r["state_bytes"] / 2**20, r["stall_s"]) for r in stall if r["method"] == m)
        style = "--" if m in ("memcpy", "raw-disk-write") else ":" if "poll" in m else "-"
        a_stall.plot(*zip(*pts), style, marker="o", label=m, color=_color(m))
    a_stall.set(xscale="log", yscale="log", xlabel="state (MiB)", ylabel="stall per step (s)",
                title="Stall, checkpoint every step (dashed: physical limits)")
    if stall:
        a_stall.legend(fontsize=8)
    a_stall.grid(True, which="both", alpha=0.3)

    # recovery: grouped bars per size
    rec = _rows(rows, "recovery")
    sizes = list(dict.fromkeys(r["size"] for r in sorted(rec, key=lambda r: r["state_bytes"])))
    methods = list(dict.fromkeys(r["method"] for r in rec))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs, ys = [], []
        for j, s in enumerate(sizes):
            r = next((r for r in rec if r["method"] == m and r["size"] == s), None)
            if r:
                xs.append(j + i * width)
                ys.append(r["median"])
        a_rec.bar(xs, ys, width, label=m, color=_color(m))
    a_rec.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s}/rank" for s in sizes])
    a_rec.set(ylabel="fault -> first resumed step (s)",
              title="Recovery (killed worker; *-node*: a lost node)")
    if methods:
        a_rec.legend(fontsize=8)
    a_rec.grid(True, axis="y", alpha=0.3)

    # lost work: expected recomputed steps per failure at the affordable interval
    lost = _rows(rows, "lost_work")
    labels = [f"{r['method']}\n{r['size']}" for r in lost]
    a_lost.bar(range(len(lost)), [r["median"] for r in lost],
               color=[_color(r["method"]) for r in lost])
    for i, r in enumerate(lost):
        a_lost.annotate(f"every {r['interval_steps']}", (i, r["median"]), ha="center",
                        va="bottom", fontsize=7)
    a_lost.set_xticks(range(len(lost)), labels, fontsize=7, rotation=45, ha="right")
    a_lost.set(yscale="log", ylabel="recomputed steps per failure",
               title="Lost work at <= 5% checkpoint overhead")
    a_lost.axhline(1.0, color="k", lw=0.8, ls=":")
    a_lost.grid(True, axis="y", alpha=0.3)

    # scaling over nodes: stall (left axis), memory per node (right axis)
    sc = _rows(rows, "scaling")
    mem_ax = a_scale.twinx()
    for k in (1, 2):
        pts = sorted((r["nodes"], r["median"]) for r in sc if r["method"] == f"memckpt-k{k}")
        if pts:
            a_scale.plot(*zip(*pts), marker="o", color=COLORS[f"memckpt-k{k}"], label=f"stall, k={k}")
        mem = sorted((r["nodes"], r["median"] / 2**20) for r in sc
                     if r["method"] == f"memckpt-k{k}-memory")
        if mem:
            mem_ax.plot(*zip(*mem), marker="s", ls="--", color=COLORS[f"memckpt-k{k}"],
                        label=f"store MiB per node, k={k}")
    a_scale.set(xlabel="simulated nodes", ylabel="stall per step (s)",
                title="memckpt scaling over nodes (one rank per node)")
    mem_ax.set_ylabel("bytes held per node (MiB)")
    handles = a_scale.get_legend_handles_labels()
    mh = mem_ax.get_legend_handles_labels()
    if handles[0] + mh[0]:
        a_scale.legend(handles[0] + mh[0], handles[1] + mh[1], fontsize=8)
    a_scale.grid(True, alpha=0.3)
    if sc:
        a_scale.set_xticks(sorted({r["nodes"] for r in sc}))

    m = rows[0].get("machine", {}) if rows else {}
    fig.suptitle(f"memckpt bench compare — {m.get('cpus', '?')} CPUs, "
                 f"{(m.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, torch {m.get('torch', '?')}",
                 fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    from PIL import Image  # a matplotlib dependency: a palette PNG is a third of the size
    with Image.open(out) as im:
        small = im.convert("RGB").quantize(colors=128)
    small.save(out, optimize=True)
    return out
