"""Train overhead: what a snapshot every step costs a compute-bound training loop.

A state of --size (nn.Linear layers + AdamW, as in ``memckpt bench snapshot``) on
--device is trained for --steps steps: matmuls standing in for forward and backward
(--compute-ms per step), a real AdamW update of the whole state, then
``Checkpointer.step`` every step. The loops:

  none           no snapshots: the step time to compare with
  sync-wait      snapshot_mode="sync", engine.on_sealing="wait" (the default)
  sync-skip      sync, a snapshot due while the previous one still seals is skipped
  overlap-wait   snapshot_mode="overlap", wait
  overlap-skip   overlap, skip

For each: the median step time, the overhead over ``none``, and how many of the due
snapshots landed (sealed and restorable).
"""

from __future__ import annotations

import argparse
import sys
from statistics import median
from typing import Optional

from memckpt.bench.common import machine_info, parse_size, positive_int, standalone, write_rows
from memckpt.bench.train_overhead.report import report
from memckpt.bench.train_overhead.rows import Row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=parse_size, default=parse_size("256M"), metavar="SIZE",
                        help="training state size (default 256M; binary units: 1G = 1 GiB)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the training state lives (default cpu)")
    parser.add_argument("--steps", type=positive_int, default=20, metavar="N",
                        help="timed steps per loop, after 2 warm-up steps (default 20)")
    parser.add_argument("--compute-ms", type=float, default=100.0, metavar="MS",
                        help="simulated forward+backward per step (default 100)")
    parser.add_argument("--seal-threads", type=int, default=0, metavar="N",
                        help="engine.seal_threads (default 0: automatic)")
    parser.add_argument("--ram-root", metavar="DIR", default=None,
                        help="memckpt ram_root for the snapshot slots (default /dev/shm/memckpt)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as a JSON list to PATH")


def _say(msg: str) -> None:
    print(f"[bench train-overhead] {msg}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    if args.compute_ms <= 0 or args.seal_threads < 0:
        print("memckpt bench train-overhead: --compute-ms must be > 0 and --seal-threads >= 0",
              file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("memckpt bench train-overhead: --device cuda but torch sees no GPU; "
                  "run it on a CUDA machine or use --device cpu", file=sys.stderr)
            return 2
    try:
        from memckpt.bench.train_overhead.measure import measure  # torch: not for --help
        measured = measure(args.size, args.device, args.steps, args.compute_ms / 1e3,
                           args.ram_root, args.seal_threads, _say)
    except (MemoryError, RuntimeError, OSError) as e:
        print(f"memckpt bench train-overhead: {e}", file=sys.stderr)
        return 1
    machine = machine_info()
    base: Optional[float] = None
    rows = []
    for m in measured:
        step_s = median(m["step_times_s"])
        base = step_s if m["mode"] is None else base
        rows.append(Row(device=args.device, step_s=step_s, machine=machine,
                        overhead=None if m["mode"] is None or not base else step_s / base - 1,
                        **m))
    write_rows(args.json, [r.to_dict() for r in rows])
    print(report(rows))
    return 0


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.train_overhead.command``."""
    return standalone("memckpt bench train-overhead", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(_cli())
