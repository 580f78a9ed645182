"""``memckpt kill``: recovery drills against a running job, found through its coordinator."""

from __future__ import annotations

import argparse
import random

from memckpt.errors import MemckptError
from memckpt.runtime.faults import kill_node, send_signal
from memckpt.runtime.job_client import fetch_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--worker", type=int, metavar="RANK", help="signal this rank's worker process")
    what.add_argument("--node", metavar="NODE",
                      help="hard-kill this node (its raylet, workers and store): a node id or "
                           "a unique prefix of one, as `memckpt status` shows")
    what.add_argument("--random", action="store_true", help="signal a random rank's worker")
    parser.add_argument("--signal", choices=("KILL", "STOP", "TERM"), default="KILL")
    parser.add_argument("--job", default="memckpt", help="the job_name of the config (default memckpt)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default auto)")


def resolve_node(prefix: str, nodes: list[str]) -> str:
    hits = sorted({n for n in nodes if n.startswith(prefix)})
    if len(hits) != 1:
        raise MemckptError(f"--node {prefix!r} matches {len(hits)} of the job's nodes "
                           f"({', '.join(n[:12] for n in sorted(set(nodes)))}); give a longer prefix")
    return hits[0]


def main(args: argparse.Namespace) -> int:
    s = fetch_status(args.job, args.address)
    workers = {int(r): w for r, w in s["workers"].items()}
    if not workers:
        raise MemckptError(f"job {args.job!r} has no running workers right now (recovering?); retry")
    if args.node is not None:
        node = resolve_node(args.node, list(s["assignment"].values()))
        kill_node(node)
        print(f"killed node {node[:12]} (ranks {[r for r, n in s['assignment'].items() if n == node]})")
        return 0
    rank = random.choice(sorted(workers)) if args.random else args.worker
    if rank not in workers:
        raise MemckptError(f"--worker {rank} is not a rank of job {args.job!r}: ranks are "
                           f"{sorted(workers)}")
    w = workers[rank]
    delivered = send_signal(w["node_id"], w["pid"], args.signal)
    print(f"sent SIG{args.signal} to rank {rank} (pid {w['pid']} on node {w['node_id'][:12]})"
          + ("" if delivered else ": it was already gone"))
    return 0
