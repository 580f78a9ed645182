"""Everything that needs Ray: the driver, the worker actors, the coordinator, the replica
stores and their data plane, failure monitoring and recovery, faults, a local cluster.

Importing this package imports nothing: the replica stores and the coordinator never import
torch, and the pure failure decisions (:mod:`memckpt.policy.failure`) never import Ray.
"""
