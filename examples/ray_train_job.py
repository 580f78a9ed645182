"""The demo GPT (DDP + ZeroRedundancyOptimizer over gloo) as a Ray Train ``TorchTrainer``
job with memckpt's per-step RAM snapshots and peer replicas.

    python examples/ray_train_job.py [--storage-path DIR] [--steps N]

On a Ray cluster (``RAY_ADDRESS`` set, or ``ray job submit --working-dir . -- python
examples/ray_train_job.py``) it runs there; without one, a local Ray instance is started.
Kill a worker process while it trains (``kill -9 <pid of a RayTrainWorker>``): Ray Train
restarts the worker group and every rank resumes at the last committed step from RAM.
The training function is the demo job, ``memckpt/demo/job.py``; the memckpt lines are
marked below. ``memckpt.demo`` is the demo's own code, not memckpt's API (it may change between
versions): to write your own job, copy it; a training function needs only
``ctx.restore(state)`` and ``ctx.step(state, step, loss=...)``.
"""

from __future__ import annotations

import argparse
import os

import ray
import ray.train
from ray.train.torch import TorchTrainer

import memckpt
from memckpt.demo.job import GPTJob
from memckpt.ray_train import MemckptCallback, context  # memckpt (1/3)


def train_loop_per_worker(cfg: dict) -> None:
    ctx = context()  # memckpt (2/3): restore / step, as in memckpt.run
    cfg["job"](ctx)  # calls ctx.restore(state) once, then ctx.step(state, step, loss=...)
    ctx.finish()  # report the last persisted step to Ray Train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage-path", default=os.path.abspath("ray_results"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=50)
    a = p.parse_args()
    ray.init(namespace="memckpt")
    config = memckpt.Config(
        job_name="gpt-ray-train",
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": GPTJob(steps=a.steps, size="mini", seed=0)},
        scaling_config=ray.train.ScalingConfig(num_workers=a.workers,
                                               resources_per_worker={"CPU": 1},
                                               placement_strategy="SPREAD"),
        run_config=ray.train.RunConfig(
            name="gpt-ray-train", storage_path=a.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=3),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            # memckpt (3/3)
            callbacks=[MemckptCallback(config, checkpoint_every=a.checkpoint_every)]))
    result = trainer.fit()
    print(f"done: {result.metrics}, checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
