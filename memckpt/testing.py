"""Drill and test utilities, at an import path that stays put while the modules behind it move.

``from memckpt.testing import LocalCluster, FaultInjector`` is what the docs show; the classes
live in :mod:`memckpt.runtime.tools.local_cluster` and :mod:`memckpt.runtime.chaos.faults`.
Kept out of the top-level ``memckpt`` namespace (not part of the training API); importing
this module imports Ray, ``import memckpt`` does not.
"""

from memckpt.runtime.chaos.faults import FaultInjector
from memckpt.runtime.tools.local_cluster import LocalCluster, local_cluster

__all__ = ["FaultInjector", "LocalCluster", "local_cluster"]
