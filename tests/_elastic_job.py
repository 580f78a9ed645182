"""The elastic tests' training job (not a test module): DDP over gloo, a fixed global
batch kept at every world size with ``ctx.batch_plan``; rank 0 saves the full parameters
and optimizer state after every step and right after every restore."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import memckpt

IN, OUT, GLOBAL, MICRO = 12, 4, 12, 2  # 12 samples: 2 x (3 ranks), 3 x (2), 6 x (1)


def samples(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, IN, generator=g), torch.randn(GLOBAL, OUT, generator=g)


def full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict()["state"]}


@dataclass
class ElasticJob:
    steps: int
    out: str  # rank 0 writes params-<step>.pt and restored-<step>-ws<W>.pt here
    pace_s: float = 0.0  # sleep per step: leaves time for a node to join mid-run
    pace_at: int = 0  # ... only at this world size (0: at every size)

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch.distributed as dist
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        state = memckpt.TrainState(model=model, optimizer=opt)
        start = ctx.restore(state)
        out = Path(self.out)
        if ctx.rank == 0 and start:
            torch.save(full(model, opt), out / f"restored-{start}-ws{ctx.world_size}.pt")
        accum = ctx.batch_plan(GLOBAL, MICRO)
        for step in range(start + 1, self.steps + 1):
            x, y = samples(step)
            opt.zero_grad()
            total = torch.zeros(())
            for k in range(accum):
                i = (k * ctx.world_size + ctx.rank) * MICRO
                loss = nn.functional.mse_loss(model(x[i:i + MICRO]), y[i:i + MICRO]) / accum
                loss.backward()
                total += loss.detach()
            if ctx.world_size > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= ctx.world_size
                dist.all_reduce(total)
                total /= ctx.world_size
            opt.step()
            if ctx.rank == 0:
                torch.save(full(model, opt), out / f"params-{step}-ws{ctx.world_size}.pt")
            ctx.step(state, step, loss=total.item())
            if self.pace_at in (0, ctx.world_size):
                time.sleep(self.pace_s)
        return {"world_size": ctx.world_size}
