"""The control plane at many ranks on one machine, driven the way a job drives it: the real
coordinator in a process of its own, called through a pipe with every argument and reply
pickled (the stand-in for Ray's actor RPC), one real ``Uplink`` per node (the replica
store's aggregation, its heartbeat thread at the job's interval), commit waits held until
the commit, the driver's polls at their rates, 1 s steps (no Ray, no tensors, no workers).

Per size (``--ranks``, ``--per-node`` a node; ``--sweep`` adds a fixed node count at more
ranks a node, and more nodes at 8 a node): the coordinator process's CPU per step (of it:
inside its methods, and pickling), the messages and bytes it takes per step, the state it
writes per step (Ray's GCS in a job), the commit latency p50 / p99 (the last node's batch
-> every node's answer back through the pipe), the node side's CPU per node per step, the
time until a frozen node is named (real time, the default heartbeat settings) and the
recovery plan's CPU after a node is lost (``plan.time_plan``). ``--plot``: log-log, the
coordinator's CPU against ranks and against nodes. See
:mod:`memckpt.bench.control_plane.measure`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from memckpt.bench.common import human_bytes, human_s, positive_int, standalone, write_rows
from memckpt.bench.control_plane.measure import (HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S,
                                                 STEP_S, measure_all)
from memckpt.bench.control_plane.plan import table
from memckpt.config import ConfigError, ControlConfig

DEFAULT_RANKS = (1024, 4096, 16384)
SWEEP_NODES = 128  # --sweep: this many nodes at each of SWEEP_PER_NODE ranks a node
SWEEP_PER_NODE = (8, 32, 128)
SWEEP_NODE_COUNTS = (128, 512, 2048)  # and these many nodes at 8 ranks a node
TARGETS = ((4096, 0.05), (16384, 0.1))  # (ranks at 8 a node, coordinator CPU a step)
COMMIT_P99_TARGET = (4096, 0.1)
NODE_CPU_TARGET_S = 1e-3


def sweep_shapes() -> list[tuple[int, int]]:
    """``--sweep``'s (ranks, ranks a node): the coordinator's cost at a fixed node count as
    ranks grow, and at a fixed number a node as nodes grow."""
    return [*((SWEEP_NODES * k, k) for k in SWEEP_PER_NODE),
            *((n * 8, 8) for n in SWEEP_NODE_COUNTS)]


def _ranks(text: str) -> list[int]:
    try:
        sizes = [int(p) for p in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n < 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"invalid rank counts {text!r}: give whole numbers "
                                         ">= 2 separated by commas, e.g. 64,256,1024")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=_ranks, default=list(DEFAULT_RANKS), metavar="LIST",
                        help=f"simulated ranks (default {','.join(map(str, DEFAULT_RANKS))})")
    parser.add_argument("--per-node", type=positive_int, default=8, metavar="N",
                        help="ranks a node (default 8)")
    parser.add_argument("--steps", type=positive_int, default=10, metavar="N",
                        help=f"timed steps of {STEP_S:g} s per size, after two warm-up steps "
                             "(default 10)")
    parser.add_argument("--step-s", type=float, default=STEP_S, metavar="S",
                        help=f"the steps' pace in seconds (default {STEP_S:g}, the targets')")
    parser.add_argument("--sweep", action="store_true",
                        help=f"also {SWEEP_NODES} nodes at "
                             f"{'/'.join(map(str, SWEEP_PER_NODE))} ranks a node, and 8 a "
                             f"node on {'/'.join(map(str, SWEEP_NODE_COUNTS))} nodes (what "
                             "--plot draws: cost against ranks and against nodes)")
    parser.add_argument("--relay-fanout", type=int, default=ControlConfig().relay_fanout,
                        metavar="N",
                        help="nodes a relay merges (Config.control.relay_fanout, on jobs of "
                        f"at least {ControlConfig().relay_min_nodes} nodes; default "
                        "%(default)s); 0: every node sends its own batches")
    parser.add_argument("--no-frozen", action="store_true",
                        help="skip the frozen node's detection (it takes the heartbeat "
                             f"timeout, {HEARTBEAT_TIMEOUT_S:g} s, and more per size)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows to PATH")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write a log-log plot of the coordinator's CPU per step against "
                             "ranks and against nodes")
    parser.add_argument("--plot-against", default=None, metavar="JSON",
                        help="with --plot: also draw the rows of an earlier --json (another "
                             "version), labelled 'before'")
    parser.add_argument("--plan-only", action="store_true",
                        help="only the recovery plan after a node loss: the CPU ms of each "
                             "decision per size (fast at any size, e.g. --ranks 4096,16384)")


HEAD = (f"{'ranks':>6} {'nodes':>5} {'/node':>5} {'relays':>6} {'CPU/step':>9} {'inside':>8} "
        f"{'pickle':>8} {'msgs/step':>9} {'B/step':>9} {'state B':>7} {'commit p50':>10} "
        f"{'p99':>8} {'coord p99':>9} {'node CPU':>8} {'step':>7} {'frozen':>7} "
        f"{'gen start':>9} {'writes':>6} {'plan':>8}")


def _frozen(r: dict[str, Any]) -> str:
    s = r.get("frozen_node_detect_s")
    return "–" if s is None else f"{s:.2f}s"


def line(r: dict[str, Any]) -> str:
    return (f"{r['ranks']:>6} {r['nodes']:>5} {r['per_node']:>5} {r.get('relay_groups', 0):>6} "
            f"{human_s(r['cpu_per_step_s']):>9} {human_s(r['inside_per_step_s']):>8} "
            f"{human_s(r['serial_per_step_s']):>8} {r['messages_per_step']:>9.0f} "
            f"{human_bytes(r['bytes_per_step']):>9} {r['state_bytes_per_step']:>7.0f} "
            f"{human_s(r['commit_latency_s']):>10} {human_s(r['commit_latency_p99_s']):>8} "
            f"{human_s(r['commit_at_coordinator_p99_s']):>9} "
            f"{human_s(r['node_cpu_per_step_s']):>8} {r['wall_per_step_s']:>6.2f}s "
            f"{_frozen(r):>7} {human_s(r['start_cpu_s']):>9} {r['start_state_writes']:>6} "
            f"{human_s(r['plan_after_node_loss_s']):>8}")


def _find(rows: list[dict[str, Any]], ranks: int, per_node: int = 8) -> Optional[dict[str, Any]]:
    return next((r for r in rows if r["ranks"] == ranks and r["per_node"] == per_node), None)


def checks(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """The targets a run has rows for: (met, what)."""
    out = []
    for ranks, limit in TARGETS:
        r = _find(rows, ranks)
        if r is not None:
            out.append((r["cpu_per_step_s"] <= limit,
                        f"coordinator CPU at {ranks} ranks {human_s(r['cpu_per_step_s'])} a "
                        f"step (<= {human_s(limit)})"))
    ranks, limit = COMMIT_P99_TARGET
    r = _find(rows, ranks)
    if r is not None:
        out.append((r["commit_latency_p99_s"] <= limit,
                    f"commit p99 at {ranks} ranks {human_s(r['commit_latency_p99_s'])} "
                    f"(<= {human_s(limit)})"))
    paced = [r for r in rows if r["per_node"] == 8 and not r["steps_late"]]
    if paced:  # a row not kept at 1 s a step: this machine's CPUs were short (see below)
        worst = max(paced, key=lambda r: r["node_cpu_per_step_s"])
        out.append((worst["node_cpu_per_step_s"] <= NODE_CPU_TARGET_S,
                    f"node-side CPU a step at most {human_s(worst['node_cpu_per_step_s'])} a "
                    f"node (8 ranks a node, up to {worst['ranks']} ranks; <= "
                    f"{human_s(NODE_CPU_TARGET_S)})"))
    late = [r for r in rows if r["steps_late"]]
    if late:
        out.append((False, "steps kept at 1 s: not at " + ", ".join(
            f"{r['ranks']} ranks ({r['per_node']} a node, {r['wall_per_step_s']:.2f} s a step)"
            for r in late) + ": this machine could not drive them at 1 s a step"))
    return out


def report(rows: list[dict[str, Any]]) -> str:
    text = [
        f"the coordinator in its own process called through a pipe (arguments and replies "
        f"pickled), one Uplink per node (heartbeat every {HEARTBEAT_INTERVAL_S:g} s), commit "
        f"waits held, the driver's polls at their rates, {STEP_S:g} s steps (medians over the "
        "timed steps). CPU/step: the coordinator process's (inside: in its methods; pickle: "
        "(de)serializing); relays: groups whose batches one node merges (0: every node sends "
        "its own); msgs, B/step: calls and argument bytes it takes; commit: the last "
        "batch -> every node's answer back (coord: of it, in the coordinator's process); "
        "node CPU: each node's Uplink per step; step: achieved wall time a step; frozen: a "
        f"silent node named after (timeout {HEARTBEAT_TIMEOUT_S:g} s); gen start: configure + "
        "every rank's register (writes: state writes before the first step); plan: the "
        "recovery plan after a node loss", HEAD, *map(line, rows)]
    done = checks(rows)
    if done:
        text += ["", "targets:"] + [f"- {'met' if ok else 'MISSED'}: {d}" for ok, d in done]
    return "\n".join(text)


def plot(rows: list[dict[str, Any]], path: str,
         before: Optional[list[dict[str, Any]]] = None) -> Path:
    """The coordinator's CPU per step, log-log: against ranks (a line per node count that
    has several ranks a node, and per number a node) and against nodes (``before``: the
    same, dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    fig, (by_ranks, by_nodes) = plt.subplots(1, 2, figsize=(11, 4.8), dpi=100)
    colors: dict[str, str] = {}  # a series keeps its colour before and after
    for tag, rs, style in (("", rows, "-"), (" (before)", before or [], "--")):
        for key, other, name in (("nodes", "per_node", "{} nodes"),
                                 ("per_node", "nodes", "{} ranks a node")):
            groups: dict[int, list[dict[str, Any]]] = {}
            for r in rs:
                groups.setdefault(r[key], []).append(r)
            for value, g in sorted(groups.items()):
                if len({r[other] for r in g}) < 2:
                    continue
                g = sorted(g, key=lambda r: r["ranks"])
                series = name.format(value)
                color = colors.setdefault(series, f"C{len(colors)}")
                for ax, x in ((by_ranks, "ranks"), (by_nodes, "nodes")):
                    ax.plot([r[x] for r in g], [r["cpu_per_step_s"] for r in g], style,
                            marker="o", color=color, label=series + tag)
        if not any(len({r["per_node"] for r in rs if r["nodes"] == n}) > 1
                   or len({r["nodes"] for r in rs if r["per_node"] == n}) > 1
                   for n in {r["nodes"] for r in rs} | {r["per_node"] for r in rs}) and rs:
            for ax, x in ((by_ranks, "ranks"), (by_nodes, "nodes")):  # single points
                ax.plot([r[x] for r in rs], [r["cpu_per_step_s"] for r in rs], style,
                        marker="o", label="coordinator" + tag)
    by_ranks.plot([n for n, _ in TARGETS], [t for _, t in TARGETS], "rx", markersize=9,
                  label="target (8 ranks a node)")
    for ax, x in ((by_ranks, "ranks"), (by_nodes, "nodes")):
        ax.set(xscale="log", yscale="log", xlabel=x,
               ylabel=f"coordinator CPU per {STEP_S:g} s step (s)")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("memckpt bench control-plane: the coordinator's process, driven as in a job")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(args: argparse.Namespace) -> int:
    if args.plan_only:
        print("CPU ms of each decision after a node loss (best of 3; total: placement + "
              "decide + plan_recovery, which does the inventory, choose_nodes and "
              "repair_holders parts itself)")
        print(table(args.ranks, per_node=args.per_node))
        return 0
    try:
        control = ControlConfig(relay_fanout=args.relay_fanout)
    except ConfigError as e:
        raise SystemExit(f"memckpt bench control-plane: --relay-fanout: {e}") from None
    shapes = [s for s in (sweep_shapes() if args.sweep else [])
              if s not in {(n, args.per_node) for n in args.ranks}]
    print(HEAD, flush=True)
    rows = measure_all(args.ranks, args.per_node, args.steps, frozen=not args.no_frozen,
                       progress=lambda r: print(line(r), flush=True), shapes=shapes,
                       step_s=args.step_s, control=control)
    print()
    print(report(rows))
    write_rows(args.json, rows)
    if args.plot:
        before = json.loads(Path(args.plot_against).read_text()) if args.plot_against else None
        print(f"plot: {plot(rows, args.plot, before)}")
    return 0


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.control_plane.command``."""
    return standalone("memckpt bench control-plane", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    raise SystemExit(_cli())
