"""The FSDP2 example job: the demo GPT sharded with ``fully_shard`` (DTensor state).

Run it on a Ray cluster (or, with no cluster, a local Ray instance):

    memckpt run examples/fsdp_job.py:train --config examples/fsdp_config.py

Every transformer block and the root are ``fully_shard``-ed on a device mesh over
all ranks: a CPU mesh over gloo, or a CUDA mesh over NCCL when the workers have
GPUs (``workers.gpus_per_worker=1`` in the config). Parameters and AdamW state are
DTensors; memckpt snapshots each rank's local chunk every step (no gather) and
restores it in place after a failure. ``tp=2`` adds tensor parallelism on each
block's MLP (Colwise/Rowwise) on a 2-D mesh of ``world_size // 2`` x 2.

The job is the demo job in ``memckpt/demo/job.py`` (``FSDPJob``, with ``shard_gpt``
doing the sharding) so ``memckpt demo --model fsdp`` works from a plain install.
``memckpt.demo`` is the demo's own code, not memckpt's API (it may change between
versions): to write your own job, copy it; a training function needs only
``ctx.restore(state)`` and ``ctx.step(state, step, loss=...)``.
"""

from memckpt.demo.job import FSDPJob

train = FSDPJob(steps=60, size="mini", seed=0)
