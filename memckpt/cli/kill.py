"""``memckpt kill``: recovery drills against a running job, found through its coordinator."""

from __future__ import annotations

import argparse
import random

from memckpt.config import SIGNALS
from memckpt.errors import MemckptError
from memckpt.runtime.chaos.faults import freeze_node, kill_node, send_signals
from memckpt.runtime.tools.job_client import fetch_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--worker", type=ranks_arg, metavar="RANK[,RANK...]",
                      help="signal this rank's worker process; several ranks (0,1) are "
                           "signalled in the same instant")
    what.add_argument("--node", metavar="NODE",
                      help="hard-kill this node (its raylet, workers and store), or freeze "
                           "it with --signal STOP: a node id or a unique prefix of one, as "
                           "`memckpt status` shows")
    what.add_argument("--random", action="store_true", help="signal a random rank's worker")
    parser.add_argument("--signal", choices=SIGNALS, default="KILL")
    parser.add_argument("--job", default="memckpt", help="the job_name of the config (default memckpt)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    parser.set_defaults(_kill_parser=parser)


def ranks_arg(text: str) -> list[int]:
    """``--worker 1`` or ``--worker 0,1``: the ranks, each once."""
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rank or a comma-separated list of ranks (e.g. 1 or 0,1)") from None
    if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: give ranks >= 0, each once (e.g. 0,1)")
    return ranks


def resolve_node(prefix: str, nodes: list[str]) -> str:
    hits = sorted({n for n in nodes if n.startswith(prefix)})
    if len(hits) != 1:
        raise MemckptError(f"--node {prefix!r} matches {len(hits)} of the job's nodes "
                           f"({', '.join(n[:12] for n in sorted(set(nodes)))}); give a longer prefix")
    return hits[0]


def main(args: argparse.Namespace) -> int:
    if args.node is not None and args.signal not in ("KILL", "STOP"):
        # refused before the cluster is asked anything
        args._kill_parser.error(f"argument --signal: --node takes KILL (the node lost) or STOP "
                                f"(the node frozen), not {args.signal}; to stop one worker "
                                f"gracefully, give --worker RANK --signal TERM")
    s = fetch_status(args.job, args.address)
    workers = {int(r): w for r, w in s["workers"].items()}
    if not workers:
        raise MemckptError(f"job {args.job!r} has no running workers right now (recovering?); retry")
    if args.node is not None:
        node = resolve_node(args.node, list(s["assignment"].values()))
        ranks_there = [r for r, n in s["assignment"].items() if n == node]
        if args.signal == "STOP":
            pids = freeze_node(node)
            print(f"froze node {node[:12]} (ranks {ranks_there}): SIGSTOP to {len(pids)} "
                  f"processes; to thaw it, on that machine: kill -CONT {' '.join(map(str, pids))}")
            return 0
        kill_node(node)
        print(f"killed node {node[:12]} (ranks {ranks_there})")
        return 0
    ranks = [random.choice(sorted(workers))] if args.random else args.worker
    unknown = [r for r in ranks if r not in workers]
    if unknown:
        raise MemckptError(f"--worker {','.join(map(str, unknown))}: not a rank of job "
                           f"{args.job!r}: ranks are {sorted(workers)}")
    targets = [(workers[r]["node_id"], workers[r]["pid"]) for r in ranks]
    delivered = send_signals(targets, args.signal)  # all in the same instant
    for r, (node, pid), ok in zip(ranks, targets, delivered):
        print(f"sent SIG{args.signal} to rank {r} (pid {pid} on node {node[:12]})"
              + ("" if ok else ": it was already gone"))
    return 0
