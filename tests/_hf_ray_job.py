"""Helper module for tests/test_integration_hf.py (not a test module): the Hugging Face
Trainer of examples/hf_trainer.py as ``memckpt.run``'s training function, one Trainer per
rank (DDP over gloo under the Trainer), memckpt attached to the run's context.

The workers cannot import tests/ or examples/: the test registers this module and
examples/hf_trainer.py with Ray's pickle-by-value."""

from __future__ import annotations

from typing import Any

from hf_trainer import build

from memckpt.integrations.hf import attach

VOLATILE = ("_runtime", "_per_second")  # wall-clock figures in the Trainer's log entries


class HFRankJob:
    """Each rank's ``trainer.train()``; returns the Trainer's log (without wall-clock
    figures) and the step memckpt resumed from."""

    def __init__(self, out: str, samples: int) -> None:
        self.out, self.samples = out, samples

    def __call__(self, ctx: Any) -> dict[str, Any]:
        trainer = build(f"{self.out}/rank{ctx.rank}", samples=self.samples)
        hooks = attach(trainer, ctx)
        trainer.train()
        log = [{k: v for k, v in entry.items() if not k.endswith(VOLATILE)}
               for entry in trainer.state.log_history]
        return {"log_history": log, "resumed_from": hooks.restored_step,
                "world_size": trainer.args.world_size}
