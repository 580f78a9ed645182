"""The measurements of ``memckpt bench elastic`` (see :mod:`memckpt.bench.elastic`): the
shrinking job, its config, and both ways back to a first step at 2 ranks on one cluster."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memckpt.bench.elastic.rows import Row

KILL_AT = 4


@dataclass
class ShrinkJob:
    """DDP over gloo with Adam: ``state_mb`` of parameters + two moments per rank."""

    steps: int
    state_mb: int

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        import memckpt
        torch.manual_seed(0)
        width = 1024
        layers = max(1, (self.state_mb << 20) // (3 * 4 * width * width))
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        state = memckpt.TrainState(model=model, optimizer=opt)
        start = ctx.restore(state)
        accum = ctx.batch_plan(12, 2)
        for step in range(start + 1, self.steps + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(12, width, generator=g)
            opt.zero_grad()
            for k in range(accum):
                i = (k * ctx.world_size + ctx.rank) * 2
                (model(x[i:i + 2]).square().mean() / accum).backward()
            if ctx.world_size > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= ctx.world_size
            opt.step()
            ctx.step(state, step, loss=float(step))
        return {}


def _config(name: str, num: int, min_workers: int, persist: Optional[str]):
    import memckpt
    return memckpt.Config(
        job_name=name,
        workers=memckpt.WorkersConfig(num_workers=num, min_workers=min_workers,
                                      cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        persistence=(memckpt.PersistTier(persist, every=1, keep_last=50),) if persist else (),
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      collective_timeout_s=60.0, replace_timeout_s=0.0,
                                      warm_spares=False))


def _restored_at(run_dir: Path, gen: int) -> float:
    """When the last rank of generation ``gen`` had loaded its state (its "restored" event)."""
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return max(e["time"] for e in events if e["event"] == "restored" and e.get("gen") == gen)


def measure(state_mb: int, steps: int) -> list[Row]:
    import memckpt
    from memckpt.runtime.chaos.faults import FaultInjector
    from memckpt.runtime.tools.local_cluster import LocalCluster
    root = Path(tempfile.mkdtemp(prefix="memckpt-bench-elastic-"))
    cluster = LocalCluster(nodes=3, cpus_per_node=1)
    try:
        job = ShrinkJob(steps, state_mb)
        inj = FaultInjector(node_killer=cluster.remove_node).kill_node(rank=1, at_step=KILL_AT)
        result = memckpt.run(job, _config("bench-elastic", 3, 2, None), run_dir=root / "ram",
                             injector=inj, quiet=True)
        (rec,) = result["recoveries"]
        ours = rec["phases_s"]["total"]
        detect = rec["phases_s"]["detect"] or 0.0
        step = rec["resumed_step"]
        ours_restored = _restored_at(root / "ram", rec["gen"]) - rec["fault_at"]
        cluster.add_node()
        disk = str(root / "disk")
        memckpt.run(ShrinkJob(step, state_mb), _config("bench-elastic-dcp", 3, 3, disk),
                    run_dir=root / "persist", quiet=True)
        t0 = time.time()
        memckpt.run(ShrinkJob(step + 1, state_mb), _config("bench-elastic-dcp", 2, 2, disk),
                    run_dir=root / "dcp", quiet=True)
        restart = time.time() - t0
        restart_restored = detect + _restored_at(root / "dcp", 0) - t0
        return [Row("memckpt elastic (RAM reshard)", state_mb, ours, detect, ours_restored,
                    3, 2, step),
                Row("restart + DCP load (disk)", state_mb, detect + restart, detect,
                    restart_restored, 3, 2, step)]
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
