"""Helper module for tests/test_integration_lightning.py (not a test module): the Lightning
fit of examples/lightning_fit.py as each rank's training (DDP over gloo), memckpt's callback
on the rank's context: ``memckpt.run``'s (in the process group memckpt made), or
``memckpt.ray_train.context()`` inside a ``TorchTrainer`` (:func:`ray_train_loop`, Ray's
Lightning strategy in the group Ray Train made).

The workers cannot import tests/ or examples/: the test registers this module and
examples/lightning_fit.py with Ray's pickle-by-value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_fit import build, trainer_for

from memckpt.integrations.lightning import MemckptCallback


class LightningRankJob:
    """Each rank's ``trainer.fit()``; returns the losses this rank logged ("epoch:batch" ->
    loss), the step memckpt resumed from and the Trainer's world size."""

    def __init__(self, samples: int, ray_train: bool = False) -> None:
        self.samples, self.ray_train = samples, ray_train

    def __call__(self, ctx: Any) -> dict[str, Any]:
        model, loader, sampler = build(self.samples)
        callback = MemckptCallback(ctx, sampler)
        trainer = trainer_for([callback], num_nodes=ctx.world_size, ray_train=self.ray_train)
        trainer.fit(model, loader)
        return {"losses": model.losses, "resumed_from": callback.restored_step,
                "world_size": trainer.world_size, "rank": trainer.global_rank,
                "step": trainer.global_step}


def ray_train_loop(cfg: dict[str, Any]) -> None:
    """The ``TorchTrainer``'s ``train_loop_per_worker``: writes ``<out>/rank<r>.json``, the
    job's result and the digest of the rank's state (parameters, optimizer, loop position)."""
    from memckpt.ray_train import context
    ctx = context()
    result = cfg["job"](ctx)
    ctx.finish()
    result["digest"] = ctx.digest()
    Path(cfg["out"], f"rank{ctx.rank}.json").write_text(json.dumps(result))
