"""The control plane at many ranks, on one machine: the real coordinator and every node's
real aggregator driven in-process by simulated ranks (no Ray, no tensors).

Per size (``--ranks``, ``--per-node`` a node), after a generation starts, every rank
reports each step and says its shard is placed to its node's aggregator, which sends the
coordinator one batch per node per step, plus one heartbeat per node per interval (a step
taken as one interval). Reported per step: the coordinator's CPU, the node side's CPU per
node, the messages and bytes the coordinator takes, the bytes it writes to its state store
(Ray's GCS in a job), the commit latency p50 / p99 (last rank ready -> every rank holds
its answer; in-process, no network); the time until a frozen node is named (on the
coordinator's clock); and the recovery plan's CPU after a node is lost (``plan.time_plan``).
See :mod:`memckpt.bench.control_plane.measure`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from memckpt.bench.common import human_bytes, human_s, positive_int, standalone, write_rows
from memckpt.bench.control_plane.measure import (HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S,
                                                 measure_all)
from memckpt.bench.control_plane.plan import table

DEFAULT_RANKS = (64, 256, 1024, 4096)


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
    parser.add_argument("--steps", type=positive_int, default=5, metavar="N",
                        help="timed steps per size, after one warm-up step (default 5)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows to PATH")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write a log-log plot of coordinator CPU per step against ranks")
    parser.add_argument("--plot-against", default=None, metavar="JSON",
                        help="with --plot: also draw the rows of an earlier --json (another "
                             "version), labelled 'before'")
    parser.add_argument("--plan-only", action="store_true",
                        help="only the recovery plan after a node loss: the CPU ms of each "
                             "decision per size (fast at any size, e.g. --ranks 4096,16384)")


HEAD = (f"{'ranks':>6} {'nodes':>5} {'CPU/step':>9} {'node CPU':>9} {'msgs/step':>9} "
        f"{'B/step':>9} {'state B/step':>12} {'commit p50':>10} {'p99':>9} {'frozen':>7} "
        f"{'gen start':>9} {'writes':>6} {'plan':>9}")


def line(r: dict[str, Any]) -> str:
    return (f"{r['ranks']:>6} {r['nodes']:>5} {human_s(r['cpu_per_step_s']):>9} "
            f"{human_s(r['node_cpu_per_step_s']):>9} {r['messages_per_step']:>9g} "
            f"{human_bytes(r['bytes_per_step']):>9} {human_bytes(r['state_bytes_per_step']):>12} "
            f"{human_s(r['commit_latency_s']):>10} {human_s(r['commit_latency_p99_s']):>9} "
            f"{r['frozen_node_detect_s']:>6.2f}s {human_s(r['start_cpu_s']):>9} "
            f"{r['start_state_writes']:>6} {human_s(r['plan_after_node_loss_s']):>9}")


def report(rows: list[dict[str, Any]]) -> str:
    return "\n".join([
        "coordinator and node aggregators in-process, simulated ranks (median of the timed "
        "steps); CPU/step: the coordinator's; node CPU: each node's aggregation per step; "
        "msgs, B/step: what the coordinator takes; commit: last rank ready -> every rank "
        "answered; frozen: a silent node named after (heartbeat timeout "
        f"{HEARTBEAT_TIMEOUT_S:g} s, interval {HEARTBEAT_INTERVAL_S:g} s); gen start: "
        "configure + every rank's register (writes: state writes then); "
        "plan: the recovery plan after a node loss", HEAD, *map(line, rows)])


def plot(rows: list[dict[str, Any]], path: str,
         before: Optional[list[dict[str, Any]]] = None) -> Path:
    """Coordinator CPU per step against ranks, log-log (``before``: a second line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5), dpi=100)
    for label, rs in (("coordinator", rows), ("before", before or [])):
        if rs:
            ax.plot([r["ranks"] for r in rs], [r["cpu_per_step_s"] for r in rs], marker="o",
                    label=label)
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="coordinator CPU per step (s)",
           title="memckpt bench control-plane")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
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
    print(HEAD, flush=True)
    rows = measure_all(args.ranks, args.per_node, args.steps,
                       progress=lambda r: print(line(r), flush=True))
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
