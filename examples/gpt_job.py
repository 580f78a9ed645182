"""The example training job: a small GPT (DDP + ZeroRedundancyOptimizer over gloo).

Run it on a Ray cluster (or, with no cluster, a local Ray instance):

    memckpt run examples/gpt_job.py:train --config examples/gpt_config.py

The job is the demo job, ``memckpt/demo/job.py`` (so ``memckpt demo`` works from a
plain install); read it there to see how a training function uses
``ctx.restore(state)`` and ``ctx.step(state, step, loss=...)``. The model (~4M
parameters, "mini"; "small" is ~14M) and its synthetic token data are in
``memckpt/demo/model.py``. ``memckpt.demo`` is the demo's own code, not memckpt's API (it may change between
versions): to write your own job, copy it; a training function needs only
``ctx.restore(state)`` and ``ctx.step(state, step, loss=...)``.
"""

from memckpt.demo.job import GPTJob

train = GPTJob(steps=60, size="mini", seed=0)
