"""Snapshot stall of an FSDP2 job: each rank's step pays for a copy of its local bytes only.

``--ranks`` processes form a process group (gloo on a CPU mesh; ``--device cuda``:
NCCL on a CUDA mesh, one GPU a rank). Each builds the stack of nn.Linear layers of
``memckpt bench snapshot`` sized so that parameters + AdamW state total ``--size``,
shards every layer and the root with ``fully_shard``, and takes one real training
step. Then, all ranks at once, method by method:

  memcpy        copy_ of the rank's local tensors (parameters and AdamW state, what
                ``TrainState.capture`` yields) into one preallocated buffer: the limit
  memckpt       Checkpointer.step() in sync mode after warm-up: capture (DTensor ->
                local tensor + layout record) and the copy into the RAM slot
  gather        full_tensor() of every parameter: what a snapshot that gathered the
                model would pay on the step (a collective), for scale

Target: on every rank, the median memckpt stall is at most 1.3x the median memcpy of its
local bytes (the table also shows the ratio of the fastest repeats, steadier on a busy
machine). Repeats start on all ranks together.
Sizes are binary: 100M = 100 MiB.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from memckpt.bench.common import parse_size, positive_int, standalone, write_rows
from memckpt.bench.fsdp_stall.measure import measure
from memckpt.bench.fsdp_stall.report import report
from memckpt.bench.snapshot.measure import DEFAULT_LAYERS

DEFAULT_SIZE = "512M"
DEFAULT_RANKS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE),
                        metavar="SIZE", help=f"parameters + AdamW state of the whole model, "
                                             f"before sharding (default {DEFAULT_SIZE})")
    parser.add_argument("--ranks", type=positive_int, default=DEFAULT_RANKS,
                        help=f"FSDP2 ranks (processes; default {DEFAULT_RANKS})")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed snapshots per method (default 5)")
    parser.add_argument("--layers", type=positive_int, default=DEFAULT_LAYERS,
                        help=f"nn.Linear layers, each fully_shard-ed (default {DEFAULT_LAYERS})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="mesh device: cpu (gloo) or cuda (NCCL, one GPU a rank, "
                             "device-to-host into pinned slots)")
    parser.add_argument("--ram-root", default=None,
                        help="where the snapshot slots live (default: memckpt's ram_root)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        import torch
        if torch.cuda.device_count() < args.ranks:
            print(f"memckpt bench fsdp-stall: --device cuda needs {args.ranks} GPUs, "
                  f"{torch.cuda.device_count()} visible: lower --ranks", file=sys.stderr)
            return 2
    rows = measure(args)
    write_rows(args.json, rows)
    print(report(rows), flush=True)
    return 0


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.fsdp_stall.command``."""
    return standalone("memckpt bench fsdp-stall", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    raise SystemExit(_cli())
