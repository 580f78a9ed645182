"""The measurements of ``memckpt bench fsdp-stall`` (see :mod:`memckpt.bench.fsdp_stall`):
one process per FSDP2 rank; each times memcpy, memckpt and a gather of its local state."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from statistics import median
from typing import Any

from memckpt.bench.common import end_rank_process, machine_info
from memckpt.bench.foreign_load import Quiet
from memckpt.bench.fsdp_stall.rows import Row
from memckpt.bench.snapshot.measure import build_state, measure_memckpt_sync, measure_memcpy


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
        row = Row(rank, args["ranks"], args["device"], args["size"], local_bytes, sharded,
                  len(model), width, repeats, memcpy_s, stall_s,
                  stall_s / memcpy_s if memcpy_s > 0 else None,
                  min(snap["times"]) / min(memcpy["times"]), snap["capture_s"],
                  median(gathers), memcpy["times"], snap["times"], snap["allocations_flat"],
                  quiet.foreign(), machine_info())
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(row.to_dict()))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank_process()  # without the interpreter's teardown (gloo's can abort at exit)


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
