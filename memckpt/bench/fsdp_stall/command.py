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
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from statistics import median
from typing import Any, Optional

from memckpt.bench.common import (finish_report, human_bytes, human_s, machine_info, machine_line,
                                  parse_size, positive_int, standalone, write_rows)
from memckpt.bench.foreign_load import Quiet
from memckpt.bench.snapshot_measure import (DEFAULT_LAYERS, build_state, measure_memckpt_sync,
                                            measure_memcpy)
from memckpt.bench.snapshot_report import BUSY_THRESHOLD

DEFAULT_SIZE = "512M"
DEFAULT_RANKS = 2
TARGET = 1.3


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


class _Lockstep(Quiet):
    """Starts every timed repeat on all ranks together: a rank's background seal of its
    last snapshot (a checksum pass) must not run during another rank's timed copy."""

    def settle(self) -> None:
        import torch.distributed as dist
        super().settle()
        dist.barrier()


def _rank(rank: int, args: dict[str, Any], port: int, out: str) -> None:
    import psutil
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memckpt.format.state import TrainState

    torch.set_num_threads(1)
    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args["ranks"],
                            timeout=timedelta(minutes=10))
    try:
        rss_base = psutil.Process().memory_info().rss
        model = build_state(args["size"], args["layers"])[0]  # its AdamW state is dropped
        model.to(args["device"])
        mesh = init_device_mesh(args["device"], (args["ranks"],))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        width = model[0].in_features
        model(torch.randn(4, width, device=args["device"])).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = TrainState(model=model, optimizer=opt)
        captured = state.capture(0)
        tensors, local_bytes = list(captured.tensors), captured.nbytes
        sharded = len(captured.meta["dtensors"])
        del captured
        rss_state = psutil.Process().memory_info().rss
        quiet, repeats = _Lockstep(), args["repeats"]
        dist.barrier()
        memcpy = measure_memcpy(tensors, repeats, quiet)
        del tensors
        dist.barrier()
        snap = measure_memckpt_sync(state, repeats, quiet, args["ram_root"], rss_base, rss_state,
                                    local_bytes)
        dist.barrier()
        gathers = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            full = [p.full_tensor() for p in model.parameters()]
            if cuda:
                torch.cuda.synchronize()
            gathers.append(time.perf_counter() - t0)
            del full
        memcpy_s, stall_s = median(memcpy["times"]), median(snap["times"])
        row = {"rank": rank, "ranks": args["ranks"], "device": args["device"],
               "size_bytes": args["size"], "local_bytes": local_bytes, "dtensors": sharded,
               "layers": len(model), "width": width, "repeats": repeats,
               "memcpy_s": memcpy_s, "memckpt_s": stall_s,
               "ratio_to_memcpy": stall_s / memcpy_s if memcpy_s > 0 else None,
               "best_ratio_to_memcpy": min(snap["times"]) / min(memcpy["times"]),
               "capture_s": snap["capture_s"], "gather_s": median(gathers),
               "memcpy_times_s": memcpy["times"], "memckpt_times_s": snap["times"],
               "allocations_flat": snap["allocations_flat"], "foreign_cpu": quiet.foreign(),
               "machine": machine_info()}
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(row))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn the ranks and return one row per rank."""
    import torch.multiprocessing as mp

    from memckpt.util.netutil import free_port
    params = {k: getattr(args, k) for k in ("size", "ranks", "repeats", "layers", "device",
                                            "ram_root")}
    with tempfile.TemporaryDirectory(prefix="memckpt-bench-fsdp-") as tmp:
        out = str(Path(tmp) / "row")
        mp.spawn(_rank, args=(params, free_port(), out), nprocs=args.ranks, join=True)
        return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(args.ranks)]


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| rank | local bytes | memcpy | memckpt stall | × memcpy | × memcpy (best of each) "
             "| capture() | gather (info) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['rank']} | {human_bytes(r['local_bytes'])} | {human_s(r['memcpy_s'])} | "
                     f"{human_s(r['memckpt_s'])} | {r['ratio_to_memcpy']:.2f} | "
                     f"{r['best_ratio_to_memcpy']:.2f} | {human_s(r['capture_s'])} | "
                     f"{human_s(r['gather_s'])} |")
    return "\n".join(lines)


def report(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    head = machine_line(first["machine"], f"FSDP2 over {first['ranks']} ranks "
                        f"({'NCCL, CUDA mesh' if first['device'] == 'cuda' else 'gloo, CPU mesh'})",
                        f"model {human_bytes(first['size_bytes'])} with AdamW "
                        f"({first['layers']} × Linear({first['width']}), every layer fully_shard-ed)")
    worst = max(rows, key=lambda r: r["ratio_to_memcpy"] or 0)
    checks = [(worst["ratio_to_memcpy"] <= TARGET,
               f"memckpt stall ≤ {TARGET} × memcpy of the local bytes on every rank (worst: rank "
               f"{worst['rank']}, {worst['ratio_to_memcpy']:.2f} ×)"),
              (all(r["allocations_flat"] for r in rows), "no slot allocation after warm-up")]
    return finish_report([head, "", format_table(rows)], rows, BUSY_THRESHOLD,
                         lambda r: f"rank {r['rank']}", checks)


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
