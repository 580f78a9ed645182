"""Helper module for tests/test_integration_lightning.py (not a test module): the Lightning
fit of examples/lightning_fit.py as ``memckpt.run``'s training function, one Trainer per rank
(DDP over gloo, in the process group memckpt made), memckpt's callback on the run's context.

The workers cannot import tests/ or examples/: the test registers this module and
examples/lightning_fit.py with Ray's pickle-by-value."""

from __future__ import annotations

from typing import Any

from lightning_fit import build, trainer_for

from memckpt.integrations.lightning import MemckptCallback


class LightningRankJob:
    """Each rank's ``trainer.fit()``; returns the losses this rank logged ("epoch:batch" ->
    loss), the step memckpt resumed from and the Trainer's world size."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __call__(self, ctx: Any) -> dict[str, Any]:
        model, loader, sampler = build(self.samples)
        callback = MemckptCallback(ctx, sampler)
        trainer = trainer_for([callback], num_nodes=ctx.world_size)
        trainer.fit(model, loader)
        return {"losses": model.losses, "resumed_from": callback.restored_step,
                "world_size": trainer.world_size, "rank": trainer.global_rank,
                "step": trainer.global_step}
