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
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional

from memckpt.bench.recovery import workload as rjob
from memckpt.bench.compare.alternatives import (StallJob, raytrain_poll, raytrain_recovery,
                                        raytrain_stall)
from memckpt.bench.common import (human_bytes, human_s, machine_info, machine_line, parse_sizes,
                                  write_rows)

PARTS = ("stall", "recovery", "lost_work")
OVERHEAD = 0.05  # the step overhead a checkpoint interval may cost
POLL_S = 0.1  # Ray Train controller poll for both sides


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


def lost_work(stall: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and size: the interval (steps) whose blocking costs <= 5 % of a step, and
    the training time a failure redoes on average (half an interval). Both sides run the
    same compute; its fastest measurement at that size is the step both are held to."""
    rows = []
    for r in stall:
        compute = min(o["compute_s"] for o in stall if o["size"] == r["size"])
        interval = max(1, math.ceil(r["median"] / (OVERHEAD * compute)))
        rows.append({"benchmark": "lost_work", "method": r["method"], "size": r["size"],
                     "state_bytes": r["state_bytes"], "interval_steps": interval,
                     "compute_s": compute,
                     "median": interval / 2 * (compute + r["median"] / interval), "unit": "s"})
    return rows


def run(a: argparse.Namespace, parts: list[str], work: Path, log) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
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
                rows.append({"benchmark": "stall", "method": method, "size": label,
                             "state_bytes": res["state_bytes"], "median": median(res["blocking_s"]),
                             "compute_s": median(res["compute_s"]), "unit": "s",
                             "samples": res["blocking_s"]})
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
                rows.append({"benchmark": "recovery", "method": method, "size": label,
                             "state_bytes": rjob.state_nbytes(d, n), "median": res["total_s"],
                             "unit": "s", "phases_s": res["phases_s"],
                             "sources": res.get("sources")})
    if "lost_work" in parts:
        rows += lost_work([r for r in rows if r["benchmark"] == "stall"])
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    text = [machine_line(machine_info()), ""]
    by = {(r["benchmark"], r["method"], r["size"]): r for r in rows}
    checks = []
    for r in rows:
        if r["benchmark"] == "stall":
            text.append(f"stall     {r['size']:>5} {r['method']:<18} blocking {human_s(r['median'])}"
                        f" per step (compute {human_s(r['compute_s'])}, state "
                        f"{human_bytes(r['state_bytes'])})")
        elif r["benchmark"] == "recovery":
            ph = r["phases_s"]
            text.append(f"recovery  {r['size']:>5} {r['method']:<18} total {human_s(r['median'])}:"
                        f" restart {human_s(ph['restart'])}, build {human_s(ph['build'])}, "
                        f"restore {human_s(ph['restore'])}, first step {human_s(ph['first_step'])}")
        else:
            text.append(f"lost work {r['size']:>5} {r['method']:<18} interval {r['interval_steps']}"
                        f" steps at <= 5 %: {human_s(r['median'])} redone per failure")
    for (bench, method, size), r in by.items():
        other = by.get((bench, "ray-train-report" if bench == "stall" else "ray-train-restore",
                        size))
        if method != "memckpt" or other is None or size != "1G":
            continue
        if bench == "stall":
            ratio = other["median"] / max(r["median"], 1e-9)
            checks.append((ratio >= 10, f"stall at 1 GiB {ratio:.1f}x lower (target >= 10x)"))
        if bench == "recovery":
            ratio = other["phases_s"]["restore"] / max(r["phases_s"]["restore"], 1e-9)
            checks.append((ratio >= 3, f"restore at 1 GiB {ratio:.1f}x faster (target >= 3x); "
                                       f"whole recovery {other['median'] / r['median']:.2f}x"))
    if checks:
        text += ["", "targets:"] + [f"- {'met' if ok else 'MISSED'}: {d}" for ok, d in checks]
    return "\n".join(text)


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
        from memckpt.runtime.local_cluster import LocalCluster
        cluster = LocalCluster(nodes=2, cpus_per_node=2)

    def log(msg: str) -> None:
        print(f"[bench ray-train] {msg}", file=sys.stderr, flush=True)

    try:
        rows = run(a, parts, work, log)
    finally:
        if cluster is not None:
            cluster.shutdown()
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    write_rows(a.json, rows)
    print(report(rows))
    return 0
