"""memckpt inside Ray Train against Ray Train's own checkpoints (``memckpt bench ray-train``).

stall     per-step blocking time of a TorchTrainer step loop: memckpt's snapshot
          (MemckptCallback + ctx.step; 2 ranks on 2 nodes, ring, 1 peer replica) vs
          ray.train.report(checkpoint=...) of a torch.save'd directory every step (1 rank;
          the controller polling every 0.1 s, not Ray's 2 s, so the poll is not what is
          measured). Target: >= 10x lower at 1 GiB.
recovery  a killed worker (rank 1 of 2 SIGKILLs itself), from the kill to every rank's first
          resumed step: TorchTrainer + memckpt (restore from RAM) vs TorchTrainer restoring
          its own checkpoint from storage_path (both with the controller polling every
          0.1 s); split into Ray Train's worker-group restart (both pay it), building the
          model, the restore and the first step. Target: the restore >= 3x faster.
lost_work derived from the stall rows: the snapshot interval each can afford at <= 5 % step
          overhead, and the work redone per failure (half an interval on average).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from memckpt.bench.common import parse_sizes, write_rows
from memckpt.bench.ray_train.measure import run
from memckpt.bench.ray_train.report import report
from memckpt.bench.ray_train.rows import PARTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("100M,1G"), metavar="LIST",
                   help="state sizes (default 100M,1G)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per stall run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compute-n", type=int, default=384, help="matmul size of a step's compute")
    p.add_argument("--kill-at", type=int, default=4)
    p.add_argument("--dir", default=None, help="storage_path and scratch (default: a temp dir)")
    p.add_argument("--ram-root", default=None, help="memckpt's RAM folder (default /dev/shm)")
    p.add_argument("--json", default=None, help="write the rows here")


def main(a: argparse.Namespace) -> int:
    import ray
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"memckpt bench ray-train: unknown part(s) {bad}: choose from {','.join(PARTS)}",
              file=sys.stderr)
        return 2
    work = Path(a.dir or tempfile.mkdtemp(prefix="memckpt-bench-rt-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster = None
    if not ray.is_initialized():
        from memckpt.runtime.tools.local_cluster import LocalCluster
        cluster = LocalCluster(nodes=2, cpus_per_node=2)

    def log(msg: str) -> None:
        print(f"[bench ray-train] {msg}", file=sys.stderr, flush=True)

    try:
        rows = [r.to_dict() for r in run(a, parts, work, log)]
    finally:
        if cluster is not None:
            cluster.shutdown()
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    write_rows(a.json, rows)
    print(report(rows))
    return 0
