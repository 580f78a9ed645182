"""A replica store holds its node's memckpt files inside ``Config.ram_budget`` (issue #50): a
node that only holds replicas runs no rank to check it, so the store refuses, before
allocating, a replica that would take its files over the budget (no Ray; real shards, real
shared-memory files, a real socket for the sender's end)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memckpt.engine.buffers import allocated_bytes
from memckpt.errors import PlacementError
from memckpt.policy.footprint import human_bytes
from memckpt.runtime.node.replica_store import ReplicaStore
from memckpt.runtime.wire.data_plane import StoreConnection
from conftest import STORE_JOB as JOB, STORE_NODE as NODE

from _shards import shards  # noqa: F401 (fixture)


def _send(store: ReplicaStore, rank: int, step: int, raw: np.ndarray, digest: str) -> None:
    ticket = store.begin(rank, step, len(raw), digest)
    assert ticket > 0
    store.write(ticket, 0, raw)
    assert store.finish(ticket) == digest


def _files(store: ReplicaStore) -> dict[Path, int]:
    return {p: p.stat().st_size for p in store.root.rglob("*") if p.is_file()}


def _reopen(ram_root: str, budget: int) -> ReplicaStore:
    """The node's store restarted with ``budget`` bytes: it adopts the files held."""
    return ReplicaStore(ram_root=ram_root, job=JOB, node_id=NODE, ram_budget=budget)


def test_replica_within_budget_accepted_one_over_refused_before_allocating(store, ram_root, shards):
    raw, digest = shards[1]
    size = len(raw)
    # an own rank's slot counts too: the node's files are its ranks' slots and its replicas
    (store.own / "rank3").mkdir()
    raw.tofile(store.own / "rank3" / "slot0.shard")
    _send(store, 0, 1, raw, digest)
    held = allocated_bytes(store.root)
    # both count: the own slot and the replica (its header's unused room left unallocated)
    assert allocated_bytes(store.own) >= size and allocated_bytes(store.replicas) > 0
    assert held == allocated_bytes(store.own) + allocated_bytes(store.replicas)
    assert store.footprint()[0] == held

    tight = _reopen(ram_root, held + size - 1)
    before = _files(tight)
    with pytest.raises(PlacementError) as e:
        tight.begin(1, 1, size, digest)
    msg = str(e.value)
    for number in (held, size, held + size, held + size - 1):
        assert human_bytes(number) in msg, (human_bytes(number), msg)
    for words in (NODE, "rank 1", "ram_budget", "placement.replicas", "workers_per_node",
                  "less state"):
        assert words in msg, (words, msg)
    assert _files(tight) == before  # nothing allocated: no new file, none resized
    assert allocated_bytes(tight.root) == held
    assert 1 not in tight.inventory() and tight.inventory()[0] == [1]

    _send(_reopen(ram_root, held + size), 1, 1, raw, digest)  # exactly at the budget: accepted
    assert tight.inventory()[1] == [1]


def test_same_size_overwrite_is_not_counted_again(store, ram_root, shards):
    for step in (1, 2):
        _send(store, 0, step, *shards[step])
    held = allocated_bytes(store.root)
    full = _reopen(ram_root, held)  # not a byte to spare
    raw, digest = shards[3]
    _send(full, 0, 3, raw, digest)  # overwrites step 1's slot in place: no new bytes
    assert full.inventory() == {0: [2, 3]}
    assert allocated_bytes(full.root) == held
    with pytest.raises(PlacementError, match="ram_budget"):  # a new rank's copy takes bytes
        full.begin(1, 3, len(raw), digest)
    # a larger shard replaces the older slot's file: only the difference counts
    extra = 64 << 10
    with pytest.raises(PlacementError, match=human_bytes(extra)):
        _reopen(ram_root, held + extra - 1).begin(0, 4, len(raw) + extra, digest)
    assert allocated_bytes(full.root) == held
    assert _reopen(ram_root, held + extra).begin(0, 4, len(raw) + extra, digest) > 0


def test_sender_gets_the_refusal_as_placement_error(ram_root, shards):
    raw, digest = shards[1]
    store = _reopen(ram_root, len(raw) - 1)
    sender = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    try:
        with pytest.raises(PlacementError, match="ram_budget allows"):
            sender.send(0, 1, raw, digest, gen=-1)
        assert not list(store.replicas.rglob("*.shard"))
        # the connection stays in step: the next put on it is answered (refused again)
        with pytest.raises(PlacementError, match="placement.replicas"):
            sender.send(0, 1, raw, digest, gen=-1)
    finally:
        sender.close()
        store.clear()
