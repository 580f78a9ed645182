"""Persistence throughput: memckpt's tier writes vs a raw write of the same bytes.

For each size, one real shard (a model + AdamW state snapshotted by a
``Checkpointer``) is written

  disk:  ``CheckpointStore.write_shard`` + manifest commit, vs one file written
         with ``write`` + ``fsync`` (the raw limit of the same filesystem)
  s3:    the same store on an S3 URI, vs one boto3 ``upload_fileobj`` of the same
         bytes to the same endpoint (``--s3 URI``; endpoint and credentials from the
         AWS environment, e.g. ``AWS_ENDPOINT_URL``)

and the ratio raw-time / memckpt-time is reported (target >= 70%).
"""

from __future__ import annotations

import argparse

from memckpt.bench.common import parse_size, positive_int, usable_dir, write_rows
from memckpt.bench.persist.measure import run_persist_bench
from memckpt.bench.persist.report import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=[1 << 30], metavar="LIST",
                        type=lambda text: [parse_size(t) for t in text.split(",")],
                        help="shard sizes, comma-separated, e.g. 100M,1G (default 1G)")
    parser.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                        help="timed repeats per method; medians are reported (default 3)")
    parser.add_argument("--dir", help="where the disk tier lives (default: the temp dir, on disk)")
    parser.add_argument("--s3", metavar="URI", help="also measure an S3 tier at this s3://bucket/prefix")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    if args.dir:
        usable_dir(args.dir)
    rows = run_persist_bench(args.sizes, args.repeats, args.dir, args.s3)
    print(report(rows))
    write_rows(args.json, rows, indent=1)
    return 0
