"""Helper module for tests/test_integration_hf.py (not a test module): the Hugging Face
Trainer of examples/hf_trainer.py as each rank's training (DDP over gloo under the Trainer),
memckpt attached to the rank's context: ``memckpt.run``'s, or ``memckpt.ray_train.context()``
inside a ``TorchTrainer`` (:func:`ray_train_loop`).

The workers cannot import tests/ or examples/: the test registers this module and
examples/hf_trainer.py with Ray's pickle-by-value."""

from __future__ import annotations

from typing import Any

from _trainer_result import trainer_result
from hf_trainer import build

from memckpt.integrations.hf import attach



class HFRankJob:
    """One rank's ``trainer.train()``. Returns (and writes to ``<out>/rank<r>.json``) the
    Trainer's log without wall-clock figures, a hash of the final parameters, and the step
    memckpt resumed from."""

    def __init__(self, out: str, samples: int, ray_train: bool = False) -> None:
        self.out, self.samples, self.ray_train = out, samples, ray_train

    def __call__(self, ctx: Any) -> dict[str, Any]:
        trainer = build(f"{self.out}/rank{ctx.rank}", samples=self.samples)
        if self.ray_train:  # as Ray Train's guide has it
            from ray.train.huggingface.transformers import prepare_trainer
            trainer = prepare_trainer(trainer)
        hooks = attach(trainer, ctx)
        trainer.train()
        return trainer_result(trainer, hooks, self.out, ctx.rank,
                              world_size=trainer.args.world_size)


def ray_train_loop(cfg: dict[str, Any]) -> None:
    """The ``TorchTrainer``'s ``train_loop_per_worker``."""
    from memckpt.ray_train import context
    ctx = context()
    cfg["job"](ctx)
    ctx.finish()
