"""Everything that needs Ray, one room per process that runs it: ``driver/`` (``memckpt.run``'s
driver; Ray Train's controller starts the same actors through ``driver/actors.py``),
``worker/`` (one rank's actor), ``node/`` (each node's replica store, its end of the data
plane, the janitor), ``coordinator/``; and what they share: ``wire/`` (what a worker and its
node's store both speak: the shared-memory layout, the data plane's protocol and the worker's
end of it), ``chaos/`` (fault injection, run by the driver and by a worker at its step),
``ray_nodes.py``, and the operator tools in ``tools/`` (a local cluster, the job client).
``local_cluster.py`` is the old path of ``LocalCluster``, a deprecated alias for one version.

Importing this package imports nothing: the replica stores and the coordinator never import
torch, nor the driver's or a worker's code, and the pure failure decisions
(:mod:`memckpt.policy.failure`) never import Ray.
"""
