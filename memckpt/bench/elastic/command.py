"""Elastic shrink: time from a node's death to the first step at the smaller world size.

Three one-rank nodes with no room to spare run a DDP job (Adam; ``--state-mb`` of
parameters and optimizer state per rank) with ``min_workers=2``. One node is removed:

* **memckpt elastic**: the job goes on with 2 ranks, each resharding the committed step
  from the surviving nodes' RAM (the run's ``phases_s.total``: node death -> every rank's
  first step at 2 ranks).
* **restart + DCP load**: what a job without it does (Ray Train's elastic restart too):
  the same failure detection, then a new 2-rank job that loads the same step from a
  persisted DCP-resharded checkpoint on local disk (memckpt's persisted tier, read
  through DCP's planner), timed from its start to its first step.

Both run in the same invocation on the same cluster.
"""

from __future__ import annotations

import argparse

from memckpt.bench.common import positive_int, standalone, write_rows
from memckpt.bench.elastic.measure import measure
from memckpt.bench.elastic.report import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-mb", type=positive_int, default=256,
                        help="parameters + Adam state per rank, MiB (default 256)")
    parser.add_argument("--steps", type=positive_int, default=8, help="steps (default 8)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    rows = [r.to_dict() for r in measure(args.state_mb, args.steps)]
    print(report(rows, args.state_mb))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone("memckpt bench elastic", __doc__, add_arguments, main))
