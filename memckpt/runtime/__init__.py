"""Everything that needs Ray, one room per process that runs it: ``driver/`` (``memckpt.run``'s
driver; Ray Train's controller starts the same actors through ``driver/actors.py``),
``worker/`` (one rank's actor), ``node/`` (each node's replica store, its data plane, the
janitor), ``coordinator/``, and the operator tools in ``tools/`` (faults, a local cluster, the
job client). ``ray_nodes.py`` is what they share.

Importing this package imports nothing: the replica stores and the coordinator never import
torch, nor the driver's or a worker's code, and the pure failure decisions
(:mod:`memckpt.policy.failure`) never import Ray.
"""
