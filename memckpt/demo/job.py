"""The multi-node demo job: a small GPT trained data-parallel over gloo.

Each rank runs DDP with a ``ZeroRedundancyOptimizer`` (AdamW sharded across
ranks), so every rank holds a unique slice of the optimizer state whose only
other copy is in a peer node's RAM: losing a node without memckpt's replicas
would lose that slice for good.

``GPTJob`` is a small picklable callable: ``memckpt.run(GPTJob(steps=40), config)``.
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
        import time

        import torch
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader

        import memckpt
        from memckpt.demo.local import lr_factor
        from memckpt.demo.model import PRESETS, build

        distributed = dist.is_available() and dist.is_initialized()
        model, data = build(PRESETS[self.size], self.seed)
        # find_unused_parameters=True keeps DDP's gradient buckets in one fixed layout:
        # without it DDP re-buckets after its first iteration, and a restarted worker's
        # first iteration would sum gradients in a different order (last-bit differences).
        net = DDP(model, find_unused_parameters=True) if distributed else model
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        if distributed and self.zero:
            opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=self.lr,
                                          betas=(0.9, 0.95))
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        warmup = max(1, self.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, self.steps))
        sampler = memckpt.ResumableSampler(len(data), shuffle=True, seed=self.seed,
                                           rank=ctx.rank, world_size=ctx.world_size)
        loader = DataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=0,
                            drop_last=True, generator=torch.Generator())
        state = memckpt.TrainState(model=model, optimizer=opt, scheduler=sched, data=sampler)
        start = ctx.restore(state)

        def batches():
            while True:
                yield from loader

        stream = batches()
        net.train()
        accum = ctx.batch_plan(self.global_batch, self.batch_size) if self.global_batch else 1
        for step in range(start + 1, self.steps + 1):
            opt.zero_grad(set_to_none=True)
            mean = torch.zeros(())
            for k in range(accum):
                x, y = next(stream)
                # DDP all-reduces the gradients once, after the last micro batch
                sync = contextlib.nullcontext() if k == accum - 1 or not distributed \
                    else net.no_sync()
                with sync:
                    _, loss = net(x, y)
                    (loss / accum if accum > 1 else loss).backward()
                mean += loss.detach() / accum
            opt.step()
            sched.step()
            if distributed:
                dist.all_reduce(mean)
                mean /= ctx.world_size
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            ctx.step(state, step, loss=mean.item())
        return {"steps": self.steps, "epoch": sampler.epoch}
