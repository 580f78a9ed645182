"""The resize-footprint drills' training job (not a test module): a ``width`` x ``width``
linear layer under Adam, gradients all-reduced over gloo, so each rank's slot is ~12 bytes
a parameter (parameters and two moments) plus its header, the same at every world size."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import memckpt


@dataclass
class ResizeJob:
    steps: int
    width: int = 512  # 512: ~3 MiB a slot
    pace_s: float = 0.05

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch.distributed as dist
        torch.manual_seed(0)
        model = nn.Linear(self.width, self.width, bias=False)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        state = memckpt.TrainState(model=model, optimizer=opt)
        start = ctx.restore(state)
        for step in range(start + 1, self.steps + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, self.width, generator=g)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            if ctx.world_size > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= ctx.world_size
            opt.step()
            ctx.step(state, step, loss=loss.item())
            time.sleep(self.pace_s)
        return {"world_size": ctx.world_size}
