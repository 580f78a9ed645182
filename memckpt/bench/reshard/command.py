"""Resharded restore: FSDP2 state (parameters + AdamW moments) written by 4 ranks,
restored into 2 and into 3 ranks, from memckpt's disk tier, from the RAM of a replica
store (byte ranges over its TCP data plane), and with ``dcp.load`` of a DCP checkpoint
of the same state saved by the same 4 ranks in the same run.

Every rank is a process (gloo, CPU mesh). A row's time is the slowest rank's restore
(memckpt: ``load_resharded``; DCP: ``get_optimizer_state_dict`` + ``dcp.load`` +
``set_optimizer_state_dict``, what a torchtitan-style job runs). Peak memory is each
rank's RSS high-water mark during the restore (VmHWM, reset just before it) minus its RSS
just before (the model's local shards already allocated, not yet touched), against its new
shard's bytes (parameters + 2 moments). Files were just written: both disk readers find
them in the page cache.
"""

from __future__ import annotations

import argparse

from memckpt.bench.common import parse_size, write_rows
from memckpt.bench.reshard.measure import run_reshard_bench
from memckpt.bench.reshard.report import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=parse_size, default=1 << 30,
                        help="total state written by the 4 ranks, e.g. 64M (default 1G)")
    parser.add_argument("--dir", help="where the disk tier and the DCP checkpoint go (default: temp)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    rows = run_reshard_bench(args.size, directory=args.dir)
    print(report(rows))
    write_rows(args.json, rows)
    return 0
