"""The multi-node demo jobs: a small GPT trained data-parallel (DDP + ZeRO) or sharded (FSDP2, TP).

:class:`GPTJob` runs DDP with a ``ZeroRedundancyOptimizer`` (AdamW sharded across
ranks), so every rank holds a unique slice of the optimizer state whose only
other copy is in a peer node's RAM: losing a node without memckpt's replicas
would lose that slice for good.

:class:`FSDPJob` shards the same model with FSDP2 (``fully_shard`` on every block and
the root) and, with ``tp > 1``, splits each block's MLP across ``tp`` ranks with
tensor parallelism (``ColwiseParallel`` / ``RowwiseParallel``) on a 2-D mesh
(``world_size // tp`` x ``tp``; ``tp == world_size`` is TP alone). Parameters and
AdamW state are DTensors; memckpt snapshots each rank's local chunk. It runs on a
CPU mesh over gloo, or on a CUDA mesh over NCCL where the workers have GPUs.

Both are small picklable callables: ``memckpt.run(FSDPJob(steps=40), config)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class GPTJob:
    steps: int = 40
    size: str = "mini"  # a preset of memckpt.demo.model.PRESETS
    seed: int = 0
    batch_size: int = 4  # per rank (the micro batch with global_batch)
    # samples per optimizer step over all ranks, kept at any world size (an elastic job)
    # with ctx.batch_plan's gradient accumulation; None: batch_size per rank, no accumulation
    global_batch: Optional[int] = None
    lr: float = 3e-3
    step_delay_s: float = 0.0  # stretch steps (drills on fast models)
    zero: bool = True  # shard AdamW's state across ranks (ZeroRedundancyOptimizer)

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        from memckpt.demo.model import PRESETS, build

        distributed = dist.is_available() and dist.is_initialized()
        model, data = build(PRESETS[self.size], self.seed)
        # find_unused_parameters=True keeps DDP's gradient buckets in one fixed layout:
        # without it DDP re-buckets after its first iteration, and a restarted worker's
        # first iteration would sum gradients in a different order (last-bit differences).
        net = DDP(model, find_unused_parameters=True) if distributed else model
        groups = _param_groups(model)
        opt: torch.optim.Optimizer
        if distributed and self.zero:
            opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=self.lr,
                                          betas=(0.9, 0.95))
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        return _train(self, ctx, net, model, opt, data, ctx.rank, ctx.world_size, "cpu")


@dataclass(frozen=True)
class FSDPJob:
    steps: int = 40
    size: str = "mini"
    seed: int = 0
    batch_size: int = 4  # per data-parallel rank (ranks of one TP group share a batch)
    lr: float = 3e-3
    step_delay_s: float = 0.0
    tp: int = 1  # tensor-parallel degree; the world size must be a multiple of it

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"FSDPJob.tp={self.tp!r} is invalid: use a whole number >= 1 "
                             "(1: FSDP2 alone)")

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from memckpt.demo.model import PRESETS, build

        world = ctx.world_size
        if world % self.tp:
            raise ValueError(f"FSDPJob.tp={self.tp} does not divide the world size {world}: "
                             "use a tp that divides num_workers")
        model, data = build(PRESETS[self.size], self.seed)
        device = "cpu"
        if dist.is_initialized() and dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        model.to(device)
        dp_rank = shard_gpt(model, world, self.tp, device.split(":")[0])
        opt = torch.optim.AdamW(_param_groups(model), lr=self.lr, betas=(0.9, 0.95))
        return _train(self, ctx, model, model, opt, data, dp_rank, world // self.tp, device)


def shard_gpt(model: Any, world: int, tp: int, device_type: str = "cpu") -> int:
    """Shard a :class:`memckpt.demo.model.GPT` in place over ``world`` ranks: each block's
    MLP split over ``tp`` ranks (Colwise fc, Rowwise proj), then FSDP2 over the
    ``world // tp`` data-parallel ranks (each block, then the root). Returns this rank's
    data-parallel rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    dp = world // tp
    if tp == 1:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(),
                                                       "proj": RowwiseParallel()})
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"].get_local_rank()


def _param_groups(model: Any) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _train(job: Any, ctx: Any, net: Any, model: Any, opt: Any, data: Any, dp_rank: int,
           dp_size: int, device: str) -> dict[str, Any]:
    """The demo's loop: restore, then train to ``job.steps``, reporting each step's loss
    (the mean over every rank) to ``ctx.step``."""
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import memckpt
    from memckpt.demo.single_process import lr_factor

    distributed = dist.is_available() and dist.is_initialized()
    warmup = max(1, job.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, job.steps))
    sampler = memckpt.ResumableSampler(len(data), shuffle=True, seed=job.seed,
                                       rank=dp_rank, world_size=dp_size)
    loader = DataLoader(data, batch_size=job.batch_size, sampler=sampler, num_workers=0,
                        drop_last=True, generator=torch.Generator())
    state = memckpt.TrainState(model=model, optimizer=opt, scheduler=sched, data=sampler)
    start = ctx.restore(state)

    def batches():
        while True:
            yield from loader

    stream = batches()
    net.train()
    global_batch = getattr(job, "global_batch", None)
    accum = ctx.batch_plan(global_batch, job.batch_size) if global_batch else 1
    for step in range(start + 1, job.steps + 1):
        opt.zero_grad(set_to_none=True)
        mean = torch.zeros((), device=device)
        for k in range(accum):
            x, y = (t.to(device) for t in next(stream))
            # DDP all-reduces the gradients once, after the last micro batch
            last = k == accum - 1 or not hasattr(net, "no_sync")
            with contextlib.nullcontext() if last else net.no_sync():
                _, loss = net(x, y)
                (loss / accum if accum > 1 else loss).backward()
            mean += loss.detach() / accum
        opt.step()
        sched.step()
        if distributed:
            dist.all_reduce(mean)
            mean /= ctx.world_size
        if job.step_delay_s:
            time.sleep(job.step_delay_s)
        ctx.step(state, step, loss=mean.item())
    return {"steps": job.steps, "epoch": sampler.epoch}
