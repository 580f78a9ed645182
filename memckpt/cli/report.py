"""``memckpt report RUN_DIR``: a job's timeline as a picture and as the data drawn.

Reads the run folder the coordinator and runtime write (``events.jsonl``,
``losses.jsonl``, ``steps.jsonl``) of a finished or running job. Top panel: loss
per step, failures, resumes and the steps redone after each resume (shaded), and
the world size over the steps when an elastic job resized; bottom panel: each step's snapshot
stall (every rank, and the slowest). Printed too: each node's peak of memckpt's host RAM
against its budget (the ``node_ram`` events, a node's stores' measures every few seconds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

from memckpt.cli.status import ram_line
from memckpt.errors import ConfigError, MemckptError

WIDTH_PX, HEIGHT_PX, DPI = 1200, 800, 100
STALL_STATS = ("min", "median", "max")  # steps.jsonl's stall of a step over the ranks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a job's run folder (runs/<job>/, or memckpt run's --run-dir)")
    parser.add_argument("--out", metavar="PNG", help="the picture (default RUN_DIR/timeline.png)")
    parser.add_argument("--json", metavar="DATA",
                        help="what was drawn, as JSON (default RUN_DIR/timeline.json)")


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    timeline = load_timeline(run_dir)
    out = Path(args.out) if args.out else run_dir / "timeline.png"
    data = Path(args.json) if args.json else run_dir / "timeline.json"
    for path, flag in ((out, "--out"), (data, "--json")):
        if not path.parent.is_dir():
            raise ConfigError(f"{flag} {str(path)!r} is invalid: its folder does not exist")
    draw(timeline, out)
    data.write_text(json.dumps(timeline, indent=1))
    f, r = len(timeline["failures"]), len(timeline["recoveries"])
    planned = sum(1 for rec in timeline["recoveries"] if rec.get("planned"))
    print(f"{out}: {len(timeline['steps'])} steps, {f} failure(s), {r - planned} recovery(ies)"
          + (f", {planned} planned resize(s)" if planned else "") + f"; data in {data}")
    for node, r in sorted(timeline.get("node_ram", {}).items()):
        print(f"  node {node[:12]}: peak {ram_line(r['peak_bytes'], r['budget_bytes'])}")
    return 0


# -- reading the run folder -------------------------------------------------------------------
def _lines(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue  # a line torn by a crash, or being written right now


def load_timeline(run_dir: Path) -> dict[str, Any]:
    """Everything the picture shows, derived from the run folder's files."""
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} is invalid: no such folder; give a job's "
                          "run folder (runs/<job>/, or the --run-dir of memckpt run)")
    events = list(_lines(run_dir / "events.jsonl"))
    if not events:
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} is invalid: it holds no events.jsonl (or "
                          "an empty one), so it is not a memckpt run folder or its job has not "
                          "started yet")
    losses: dict[int, float] = {}
    for rec in _lines(run_dir / "losses.jsonl"):
        losses[int(rec["step"])] = rec["loss"]  # redone steps: the last line wins
    stalls: dict[int, list[float]] = {}
    stall_of = "ranks"
    for rec in _lines(run_dir / "steps.jsonl"):
        got = rec["stall_s"]
        if isinstance(got, dict):  # min / median / max over the ranks (since #40)
            got, stall_of = [got[k] for k in STALL_STATS], "stats"
        stalls[int(rec["step"])] = [s * 1000 for s in got]
    steps = [{"step": s, "loss": losses.get(s),
              "stall_ms_max": max(stalls[s]) if s in stalls else None,
              "stall_ms": stalls.get(s), "stall_of": stall_of}
             for s in sorted(set(losses) | set(stalls))]
    failures, recoveries, rollbacks = _incidents(events)
    started = next((e["time"] for e in events if e["event"] == "job_started"), events[0]["time"])
    return {"run_dir": str(run_dir), "job_started": started,
            "figure": {"width_px": WIDTH_PX, "height_px": HEIGHT_PX, "dpi": DPI},
            "steps": steps, "failures": failures, "recoveries": recoveries,
            "rollbacks": rollbacks, "world_sizes": _world_sizes(events),
            "node_ram": node_ram(events)}


def node_ram(events: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """node -> the most memckpt's files held in its RAM (``peak_bytes``) and the budget then
    (``budget_bytes``), from the coordinator's ``node_ram`` events (one per new peak)."""
    out: dict[str, dict[str, int]] = {}
    for e in events:
        if e["event"] == "node_ram" and e["held_bytes"] >= out.get(e["node"], {}).get(
                "peak_bytes", -1):
            out[e["node"]] = {"peak_bytes": e["held_bytes"], "budget_bytes": e["budget_bytes"]}
    return out


def _world_sizes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The world size from each step on: the job's start, then every resize (elastic)."""
    out = [{"from_step": 1, "world_size": e["world_size"], "time": e["time"]}
           for e in events[:1] if e["event"] == "job_started" and "world_size" in e]
    out += [{"from_step": e["step"] + 1, "world_size": e["to_world_size"], "time": e["time"],
             "why": e.get("why")} for e in events if e["event"] == "resized"]
    return out


def _incidents(events: list[dict[str, Any]]
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Failures (``failure_detected``: the step the job had reached), recoveries
    (``recovery_plan``: the resumed step; ``recovery_finished``: its phases; ``resized``:
    ``planned`` when it grew the job, which is no failure) and rollbacks: the steps resumed
    step + 1 .. reached step, which the job redoes."""
    failures: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []
    rollbacks: list[dict[str, Any]] = []
    finished = {e.get("gen"): e for e in events if e["event"] == "recovery_finished"}
    for e in events:
        if e["event"] == "failure_detected":
            failures.append({"time": e["time"], "step": e.get("reached_step"),
                             "committed": e.get("committed"), "what": e.get("what"),
                             "ranks": e.get("ranks"), "gen": e.get("gen")})
        elif e["event"] in ("recovery_plan", "resized"):
            done = finished.get(e.get("gen"), {})
            resumed = e["resumed_step"] if e["event"] == "recovery_plan" else e["step"]
            planned = e["event"] == "resized" and \
                (e.get("to_world_size") or 0) > (e.get("from_world_size") or 0)
            rec = {"time": e["time"], "resumed_step": resumed, "gen": e.get("gen"),
                   "what": e.get("what", e.get("why")), "sources": e.get("sources"),
                   "dead_nodes": e.get("dead_nodes", e.get("lost_nodes")),
                   "frozen_nodes": e.get("frozen_nodes", []),
                   "finished_at": done.get("time"), "planned": planned,
                   "world_size": e.get("to_world_size"),
                   "phases_s": done.get("phases_s")}
            recoveries.append(rec)
            reached = failures[-1]["step"] if failures and not planned else None
            if reached is not None and rec["resumed_step"] is not None \
                    and reached > rec["resumed_step"]:
                rollbacks.append({"from_step": rec["resumed_step"] + 1, "to_step": reached,
                                  "gen": rec["gen"], "time": rec["time"]})
    return failures, recoveries, rollbacks


# -- drawing ----------------------------------------------------------------------------------
def draw(timeline: dict[str, Any], out: Path) -> Any:
    """A ``WIDTH_PX`` x ``HEIGHT_PX`` PNG (fixed size: no tight bounding box); returns the
    matplotlib ``Figure`` drawn. Each event label has a row of its own (failures from the
    top of the loss panel down, resumes and resizes from its bottom up), so no two overlap;
    the legends sit above the panels, outside the data."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise MemckptError("memckpt report needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    steps = timeline["steps"]
    failures = [f for f in timeline["failures"] if f["step"] is not None]
    recoveries = [r for r in timeline["recoveries"] if r["resumed_step"] is not None]
    with_loss = [s for s in steps if s["loss"] is not None]
    top.plot([s["step"] for s in with_loss], [s["loss"] for s in with_loss], ".-",
             color="tab:blue", label="loss")
    for ax in (top, bottom):
        lab = ax is top
        for i, rb in enumerate(timeline["rollbacks"]):
            ax.axvspan(rb["from_step"] - 0.5, rb["to_step"] + 0.5, color="tab:orange", alpha=0.25,
                       label="redone after resume" if i == 0 and lab else None)
        for i, f in enumerate(failures):
            ax.axvline(f["step"] + 0.5, color="tab:red", ls="--",
                       label="failure" if i == 0 and lab else None)
        resumed = [r for r in recoveries if not r.get("planned")]
        for i, r in enumerate(resumed):
            ax.axvline(r["resumed_step"], color="tab:green", ls=":",
                       label="resumed at" if i == 0 and lab else None)
        for i, r in enumerate(r for r in recoveries if r.get("planned")):
            ax.axvline(r["resumed_step"] + 0.5, color="tab:purple", ls="-.",
                       label="planned resize" if i == 0 and lab else None)
    last_step = steps[-1]["step"] if steps else 1
    _label_rows(top, [(f["step"] + 0.5, _failure_label(f, timeline["job_started"]), "tab:red")
                      for f in failures], last_step, from_top=True)
    _label_rows(top, [(r["resumed_step"] + (0.5 if r.get("planned") else 0.0),
                       _recovery_label(r), "tab:purple" if r.get("planned") else "tab:green")
                      for r in recoveries], last_step, from_top=False)
    top.set_ylabel("loss")
    handles, labels = top.get_legend_handles_labels()
    sizes = timeline.get("world_sizes") or []
    right = 0.98
    if len(sizes) > 1 and steps:  # an elastic job resized: its world size over the steps
        ws = top.twinx()
        xs = [s["from_step"] - 0.5 for s in sizes] + [steps[-1]["step"] + 0.5]
        ys = [s["world_size"] for s in sizes] + [sizes[-1]["world_size"]]
        ws.step(xs, ys, where="post", color="tab:purple", lw=2, alpha=0.5,
                label="world size (ranks)")
        ws.set_ylabel("world size (ranks)", color="tab:purple")
        ws.set_ylim(0, max(ys) + 1)
        ws.yaxis.set_major_locator(MaxNLocator(integer=True))  # a count of ranks
        h, lb = ws.get_legend_handles_labels()
        handles, labels, right = handles + h, labels + lb, 0.93
    planned = sum(1 for r in recoveries if r.get("planned"))
    fig.suptitle(f"{Path(timeline['run_dir']).name}: {len(steps)} steps, "
                 f"{len(timeline['failures'])} failure(s), "
                 f"{len(recoveries) - planned} recovery(ies)"
                 + (f", {planned} planned resize(s)" if planned else ""),
                 x=0.07, y=0.985, ha="left", fontsize=11)
    if handles:
        top.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                   ncol=len(handles), fontsize=8, frameon=False, borderaxespad=0.2)
    _draw_stalls(bottom, steps)
    bottom.set_xlabel("step")
    if not steps:
        top.text(0.5, 0.5, "no steps recorded yet", transform=top.transAxes, ha="center")
    fig.subplots_adjust(left=0.07, right=right, top=0.9, bottom=0.08, hspace=0.15)
    fig.savefig(out, dpi=DPI)
    return fig


LABEL_ROW = 0.055  # axes fraction per label row (one line of 8 pt text in the loss panel)


def _failure_label(f: dict[str, Any], t0: float) -> str:
    return f"{f['what']} (+{f['time'] - t0:.1f} s)"


def _recovery_label(r: dict[str, Any]) -> str:
    total = (r.get("phases_s") or {}).get("total")
    took = f", back in {total:.1f} s" if total is not None else ""
    if r.get("planned"):
        return f"grown to {r.get('world_size')} ranks after step {r['resumed_step']}{took}"
    ranks = f" on {r['world_size']} ranks" if r.get("world_size") else ""
    return f"resumed at step {r['resumed_step']}{ranks}{took}"


def _label_rows(ax: Any, labels: list[tuple[float, str, str]], last_step: int,
                from_top: bool) -> None:
    """One line of text per label, each on its own row (so none can overlap another),
    left of its line in the right half of the panel and right of it in the left half."""
    for i, (x, text, color) in enumerate(labels):
        y = 1.0 - LABEL_ROW * (i + 0.5) if from_top else LABEL_ROW * (i + 0.5)
        right_half = x > (last_step + 1) / 2
        ax.annotate(text, (x, y), xycoords=("data", "axes fraction"),
                    xytext=(-4 if right_half else 4, 0), textcoords="offset points",
                    ha="right" if right_half else "left", va="center", fontsize=8,
                    color=color, bbox={"boxstyle": "round,pad=0.15", "fc": "white",
                                       "ec": "none", "alpha": 0.8})


def _draw_stalls(ax: Any, steps: list[dict[str, Any]]) -> None:
    with_stall = [s for s in steps if s["stall_ms"]]
    ranks = max((len(s["stall_ms"]) for s in with_stall), default=0)
    stats = any(s.get("stall_of") == "stats" for s in with_stall)
    for r in range(ranks):
        pts = [(s["step"], s["stall_ms"][r]) for s in with_stall if r < len(s["stall_ms"])]
        label = f"{STALL_STATS[r]} over the ranks" if stats else f"rank {r}"
        ax.plot(*zip(*pts), ".", ms=4, alpha=0.6, label=label)
    if with_stall:
        ax.plot([s["step"] for s in with_stall], [s["stall_ms_max"] for s in with_stall], "-",
                color="black", lw=1, label="slowest rank")
        positive = [v for s in with_stall for v in s["stall_ms"] if v > 0]
        if positive and max(positive) > 50 * min(positive):
            ax.set_yscale("log")  # a first snapshot (buffer allocation) would flatten the rest
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False,
                  ncol=min(ranks + 1, 6), borderaxespad=0.2)  # above the panel, off the data
    else:
        ax.text(0.5, 0.5, "no snapshot stalls recorded (steps.jsonl)", transform=ax.transAxes,
                ha="center")
    ax.set_ylabel("snapshot stall (ms)")

