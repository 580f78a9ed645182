"""Shared fixtures: a shared-memory temp dir; a local multi-node Ray cluster per module."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def _shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def ram_root():
    """A fresh directory on the shared-memory tmpfs per test, removed afterwards."""
    path = tempfile.mkdtemp(prefix="memckpt-test-", dir=_shm_base())
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A 3-node local Ray cluster (2 CPUs a node, a 0-CPU head), one per test module."""
    from memckpt.runtime.local_cluster import LocalCluster
    c = LocalCluster(nodes=3, cpus_per_node=2)
    yield c
    c.shutdown()


@pytest.fixture
def full_cluster(cluster):
    """The module's cluster with 3 worker nodes again (a test may have removed some)."""
    while len(cluster.nodes) < 3:
        cluster.add_node()
    return cluster


STORE_JOB, STORE_NODE = "t", "nodeA"


@pytest.fixture
def store(ram_root):
    """A real ReplicaStore (no Ray) for job STORE_JOB on node STORE_NODE, cleared after."""
    from memckpt.runtime.replica_store import ReplicaStore
    s = ReplicaStore(ram_root=ram_root, job=STORE_JOB, node_id=STORE_NODE)
    yield s
    s.clear()


@pytest.fixture
def sender(store):
    """A worker's TCP connection into ``store`` (memckpt.runtime.transport)."""
    from memckpt.runtime.transport import StoreConnection
    snd = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    yield snd
    snd.close()


def held_replica(store, rank: int, step: int):
    """The bytes of ``rank``'s replica of ``step`` as ``store`` holds it on disk."""
    import numpy as np

    from memckpt.runtime.replica_store import scan
    return np.fromfile(scan(store.replicas)[rank][step], dtype=np.uint8)
