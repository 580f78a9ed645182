"""The measurements of ``memckpt bench ray-train`` (see :mod:`memckpt.bench.ray_train`): the
training loops Ray Train's workers run, and both sides of each part."""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional

from memckpt.bench.compare.alternatives import (StallJob, raytrain_poll, raytrain_recovery,
                                                raytrain_stall)
from memckpt.bench.ray_train.rows import Row, lost_work
from memckpt.bench.recovery import workload as rjob

POLL_S = 0.1  # Ray Train controller poll for both sides


# -- the training loops (run inside Ray Train workers) -----------------------------------------
def _stall_loop(cfg: dict[str, Any]) -> None:
    from memckpt.ray_train import context
    ctx = context()
    res = cfg["job"](ctx)
    if ctx.rank == 0:
        Path(cfg["out"]).write_text(json.dumps(res))


def _recovery_loop(cfg: dict[str, Any]) -> None:
    """2 ranks snapshot every step; rank 1 SIGKILLs itself at ``kill_at``; after Ray Train's
    restart every rank times its context, restore and first step."""
    import torch

    import memckpt
    from memckpt.ray_train import context
    torch.set_num_threads(1)
    t_enter = time.time()
    ctx = context()
    x, w = rjob.compute_inputs()
    resumed = ctx.generation > 0
    model, opt = rjob.build_state(cfg["d"], cfg["n"], fresh=not resumed, seed=ctx.rank)
    state = memckpt.TrainState(model=model, optimizer=opt)
    t1 = time.time()
    start = ctx.restore(state)
    t2 = time.time()
    for step in range(start + 1, cfg["kill_at"] + 2):
        float(rjob.all_reduce_mean(rjob.compute_loss(x, w, cfg["compute_iters"]), ctx.world_size))
        if not resumed and step == cfg["kill_at"]:
            if ctx.rank == 1:
                Path(cfg["marker"]).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # rank 0 waits for the failure (as a collective would)
        ctx.step(state, step)
        if resumed:
            Path(cfg["out_dir"], f"resumed-{ctx.rank}.json").write_text(json.dumps(
                {"t_enter": t_enter, "build": t1 - t_enter, "load": t2 - t1,
                 "first_step": time.time() - t2, "t_done": time.time(), "resumed_step": start,
                 "source": ctx.restore_source}))
            return


# -- measurements ------------------------------------------------------------------------------
def _trainer(loop, cfg: dict[str, Any], workers: int, name: str, storage: Path, callback,
             max_failures: int = 0):
    import ray.train
    from ray.train.torch import TorchTrainer
    return TorchTrainer(
        loop, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1},
                                               placement_strategy="SPREAD"),
        run_config=ray.train.RunConfig(name=name, storage_path=str(storage), callbacks=[callback],
                                       failure_config=ray.train.FailureConfig(max_failures)))


def _config(name: str, ram_root: Optional[str]):
    import memckpt
    return memckpt.Config(job_name=name, ram_root=ram_root,
                          placement=memckpt.PlacementConfig("ring", 1),
                          failure=memckpt.FailureConfig(heartbeat_interval_s=0.5,
                                                        heartbeat_timeout_s=10.0))


def memckpt_stall(size: int, a: argparse.Namespace, work: Path, name: str) -> dict[str, Any]:
    from memckpt.ray_train import MemckptCallback
    out = work / f"{name}.json"
    job = StallJob(size, a.steps, a.warmup, a.compute_n, full_ranks=1, threads=1)
    _trainer(_stall_loop, {"job": job, "out": str(out)}, 2, name, work / "storage",
             MemckptCallback(_config(name, a.ram_root), checkpoint_every=None,
                             run_dir=work / name)).fit()
    return json.loads(out.read_text())


def memckpt_recovery(size: int, a: argparse.Namespace, work: Path, name: str) -> dict[str, Any]:
    from memckpt.ray_train import MemckptCallback
    d, n = rjob.layout(size)
    out_dir = Path(tempfile.mkdtemp(prefix="bench-rt-", dir=work))
    marker = out_dir / "fault"
    cfg = {"d": d, "n": n, "kill_at": a.kill_at, "compute_iters": rjob.DEFAULT_COMPUTE_ITERS,
           "out_dir": str(out_dir), "marker": str(marker)}
    _trainer(_recovery_loop, cfg, 2, name, work / "storage",
             MemckptCallback(_config(name, a.ram_root), checkpoint_every=None,
                             run_dir=work / name), max_failures=1).fit()
    t_fault = float(marker.read_text())
    outs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("resumed-*.json"))]
    slow = max(outs, key=lambda o: o["t_done"])
    phases = {"restart": slow["t_enter"] - t_fault, "build": slow["build"],
              "restore": slow["load"], "first_step": slow["first_step"],
              "total": slow["t_done"] - t_fault}
    return {"total_s": phases["total"], "phases_s": phases, "resumed_step": slow["resumed_step"],
            "sources": [o["source"] for o in outs]}


def run(a: argparse.Namespace, parts: list[str], work: Path,
        log: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    for label, size in a.sizes:
        if "stall" in parts or "lost_work" in parts:
            log(f"stall {label}: memckpt")
            m = memckpt_stall(size, a, work, f"bench-rt-stall-{label.lower()}")
            log(f"stall {label}: ray.train.report(checkpoint=...)")
            with raytrain_poll(POLL_S):
                r = raytrain_stall(size, a.steps, a.warmup, a.compute_n, checkpoint=True,
                                   storage=work / "storage", local_dir=work,
                                   name=f"bench-rt-report-{label.lower()}")
            for method, res in (("memckpt", m), ("ray-train-report", r)):
                rows.append(Row("stall", method, label, res["state_bytes"],
                                median(res["blocking_s"]), compute_s=median(res["compute_s"]),
                                samples=res["blocking_s"]))
        if "recovery" in parts:
            log(f"recovery {label}: memckpt")
            with raytrain_poll(POLL_S):  # the same restart for both
                m = memckpt_recovery(size, a, work, f"bench-rt-rec-{label.lower()}")
            log(f"recovery {label}: Ray Train restoring from storage_path")
            d, n = rjob.layout(size)
            with raytrain_poll(POLL_S):
                r = raytrain_recovery(d, n, a.kill_at, rjob.DEFAULT_COMPUTE_ITERS,
                                      work / "storage", work, f"bench-rt-rrec-{label.lower()}", 1)
            r["phases_s"]["restore"] = r["phases_s"].pop("torch_load")
            for method, res in (("memckpt", m), ("ray-train-restore", r)):
                rows.append(Row("recovery", method, label, rjob.state_nbytes(d, n),
                                res["total_s"], phases_s=res["phases_s"],
                                sources=res.get("sources")))
    if "lost_work" in parts:
        rows += lost_work([r for r in rows if r.benchmark == "stall"])
    return rows
