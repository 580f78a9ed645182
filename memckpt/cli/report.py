"""``memckpt report RUN_DIR``: a job's timeline as a picture and as the data drawn.

Reads the run folder the coordinator and runtime write (``events.jsonl``,
``losses.jsonl``, ``steps.jsonl``) of a finished or running job. Top panel: loss
per step, failures, resumes and the steps redone after each resume (shaded), and
the world size over the steps when an elastic job resized; bottom panel: each step's snapshot stall (every rank, and the slowest).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

from memckpt.errors import ConfigError, MemckptError

WIDTH_PX, HEIGHT_PX, DPI = 1200, 800, 100


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
    print(f"{out}: {len(timeline['steps'])} steps, {f} failure(s), {r} recovery(ies); "
          f"data in {data}")
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
    for rec in _lines(run_dir / "steps.jsonl"):
        stalls[int(rec["step"])] = [s * 1000 for s in rec["stall_s"]]
    steps = [{"step": s, "loss": losses.get(s),
              "stall_ms_max": max(stalls[s]) if s in stalls else None,
              "stall_ms": stalls.get(s)}
             for s in sorted(set(losses) | set(stalls))]
    failures, recoveries, rollbacks = _incidents(events)
    started = next((e["time"] for e in events if e["event"] == "job_started"), events[0]["time"])
    return {"run_dir": str(run_dir), "job_started": started,
            "figure": {"width_px": WIDTH_PX, "height_px": HEIGHT_PX, "dpi": DPI},
            "steps": steps, "failures": failures, "recoveries": recoveries,
            "rollbacks": rollbacks, "world_sizes": _world_sizes(events)}


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
    (``recovery_plan``: the resumed step; ``recovery_finished``: its phases) and
    rollbacks: the steps resumed step + 1 .. reached step, which the job redoes."""
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
            rec = {"time": e["time"], "resumed_step": resumed, "gen": e.get("gen"),
                   "what": e.get("what"), "sources": e.get("sources"),
                   "dead_nodes": e.get("dead_nodes", e.get("lost_nodes")),
                   "finished_at": done.get("time"),
                   "phases_s": done.get("phases_s")}
            recoveries.append(rec)
            reached = failures[-1]["step"] if failures else None
            if reached is not None and rec["resumed_step"] is not None \
                    and reached > rec["resumed_step"]:
                rollbacks.append({"from_step": rec["resumed_step"] + 1, "to_step": reached,
                                  "gen": rec["gen"], "time": rec["time"]})
    return failures, recoveries, rollbacks


# -- drawing ----------------------------------------------------------------------------------
def draw(timeline: dict[str, Any], out: Path) -> None:
    """A ``WIDTH_PX`` x ``HEIGHT_PX`` PNG (fixed size: no tight bounding box)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MemckptError("memckpt report needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    steps = timeline["steps"]
    t0 = timeline["job_started"]
    with_loss = [s for s in steps if s["loss"] is not None]
    top.plot([s["step"] for s in with_loss], [s["loss"] for s in with_loss], ".-",
             color="tab:blue", label="loss")
    for ax in (top, bottom):
        for i, rb in enumerate(timeline["rollbacks"]):
            ax.axvspan(rb["from_step"] - 0.5, rb["to_step"] + 0.5, color="tab:orange", alpha=0.25,
                       label="redone after resume" if i == 0 and ax is top else None)
        for i, f in enumerate(timeline["failures"]):
            if f["step"] is not None:
                ax.axvline(f["step"] + 0.5, color="tab:red", ls="--",
                           label="failure" if i == 0 and ax is top else None)
        for i, r in enumerate(timeline["recoveries"]):
            ax.axvline(r["resumed_step"], color="tab:green", ls=":",
                       label="resumed at" if i == 0 and ax is top else None)
    for f in timeline["failures"]:
        if f["step"] is not None:
            top.annotate(f"{f['what']}\nat +{f['time'] - t0:.1f} s", (f["step"] + 0.5, 1.0),
                         xycoords=("data", "axes fraction"), xytext=(4, -4),
                         textcoords="offset points", va="top", fontsize=8, color="tab:red")
    for r in timeline["recoveries"]:
        total = (r.get("phases_s") or {}).get("total")
        took = f", back in {total:.1f} s" if total is not None else ""
        top.annotate(f"resume at step {r['resumed_step']}{took}", (r["resumed_step"], 0.0),
                     xycoords=("data", "axes fraction"), xytext=(-4, 4),
                     textcoords="offset points", ha="right", fontsize=8, color="tab:green")
    top.set_ylabel("loss")
    sizes = timeline.get("world_sizes") or []
    if len(sizes) > 1 and steps:  # an elastic job resized: its world size over the steps
        ws = top.twinx()
        xs = [s["from_step"] - 0.5 for s in sizes] + [steps[-1]["step"] + 0.5]
        ys = [s["world_size"] for s in sizes] + [sizes[-1]["world_size"]]
        ws.step(xs, ys, where="post", color="tab:purple", lw=2, label="world size (ranks)")
        ws.set_ylabel("world size (ranks)", color="tab:purple")
        ws.set_ylim(0, max(ys) + 1)
        ws.legend(loc="lower left", fontsize=8)
    top.set_title(f"{Path(timeline['run_dir']).name}: {len(steps)} steps, "
                  f"{len(timeline['failures'])} failure(s), "
                  f"{len(timeline['recoveries'])} recovery(ies)")
    top.legend(loc="upper right", fontsize=8)
    _draw_stalls(bottom, steps)
    bottom.set_xlabel("step")
    if not steps:
        top.text(0.5, 0.5, "no steps recorded yet", transform=top.transAxes, ha="center")
    fig.subplots_adjust(left=0.07, right=0.98, top=0.95, bottom=0.08, hspace=0.08)
    fig.savefig(out, dpi=DPI)


def _draw_stalls(ax: Any, steps: list[dict[str, Any]]) -> None:
    with_stall = [s for s in steps if s["stall_ms"]]
    ranks = max((len(s["stall_ms"]) for s in with_stall), default=0)
    for r in range(ranks):
        pts = [(s["step"], s["stall_ms"][r]) for s in with_stall if r < len(s["stall_ms"])]
        ax.plot(*zip(*pts), ".", ms=4, alpha=0.6, label=f"rank {r}")
    if with_stall:
        ax.plot([s["step"] for s in with_stall], [s["stall_ms_max"] for s in with_stall], "-",
                color="black", lw=1, label="slowest rank")
        positive = [v for s in with_stall for v in s["stall_ms"] if v > 0]
        if positive and max(positive) > 50 * min(positive):
            ax.set_yscale("log")  # a first snapshot (buffer allocation) would flatten the rest
        ax.legend(loc="upper right", fontsize=8, ncol=min(ranks + 1, 6))
    else:
        ax.text(0.5, 0.5, "no snapshot stalls recorded (steps.jsonl)", transform=ax.transAxes,
                ha="center")
    ax.set_ylabel("snapshot stall (ms)")

