"""memckpt inside Ray Train: per-step RAM snapshots with peer replicas for ``TorchTrainer``.

Three lines::

    from memckpt.ray_train import MemckptCallback, context
    run_config = RunConfig(callbacks=[MemckptCallback(config)], storage_path=...)
    # in train_loop_per_worker:
    ctx = context(); start = ctx.restore(state); ...; ctx.step(state, step, loss=loss)

See docs/ray-train.md.
"""

from memckpt.ray_train.callback import MemckptCallback
from memckpt.ray_train.context import RayTrainContext, context

__all__ = ["MemckptCallback", "RayTrainContext", "context"]
