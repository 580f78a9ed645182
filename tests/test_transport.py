"""The shard data plane over real TCP sockets into a real ReplicaStore (no Ray).

Shards are real snapshots (the ``shards`` fixture of test_store); what lands in
the store must verify, and every refusal must reach the sender as the store's
own error type without desynchronising the connection.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

from memckpt.format import shard as fmt
from memckpt.errors import (ChecksumError, NoSnapshotError, PlacementError, StaleGenerationError,
                            SupersededPutError)
from memckpt.engine.snapshot import SnapshotEngine
from memckpt.runtime.wire.data_plane import StoreConnection, send_msg
from memckpt.runtime.wire.ram_files import scan
from _shards import _train_state, shards  # noqa: F401 (fixture)
from conftest import held_replica, wait_for

def test_streamed_shard_lands_verified_and_byte_identical(store, sender, shards):
    for step in (1, 2):
        raw, digest = shards[step]
        assert sender.send(0, step, raw, digest, gen=0) == len(raw)
        held = held_replica(store, 0, step)
        assert np.array_equal(held, raw)
        assert fmt.open_shard(held, "held", verify=True).step == step
    assert store.inventory() == {0: [1, 2]}


def test_one_connection_carries_many_ranks_and_resends(store, sender, shards):
    raw, digest = shards[3]
    assert sender.send(1, 3, raw, digest, gen=0) == len(raw)
    assert sender.send(1, 3, raw, digest, gen=0) == 0  # already held intact: not resent
    assert sender.send(2, 3, raw, digest, gen=0) == len(raw)
    assert store.inventory() == {1: [3], 2: [3]}


def test_flipped_byte_is_refused_and_connection_stays_usable(store, sender, shards):
    raw, digest = shards[1]
    bad = raw.copy()
    bad[-1] ^= 0xFF  # last data byte
    with pytest.raises(ChecksumError):
        sender.send(0, 1, bad, digest, gen=0)
    assert store.inventory() == {}  # nothing unverified is listed
    assert sender.send(0, 1, raw, digest, gen=0) == len(raw)
    assert np.array_equal(held_replica(store, 0, 1), raw)


def test_stale_generation_is_refused_by_type(store, sender, shards):
    raw, digest = shards[1]
    store.set_generation(3)
    with pytest.raises(StaleGenerationError, match="generation 2"):
        sender.send(0, 1, raw, digest, gen=2)
    assert sender.send(0, 1, raw, digest, gen=3) == len(raw)


def test_generation_change_mid_stream_drops_the_shard(store, shards, monkeypatch):
    """Recovery fences a new generation while an old one is still streaming: the rest of
    the bytes are drained, the shard is refused, and the slot is never listed."""
    import memckpt.runtime.wire.data_plane as tr
    monkeypatch.setattr(tr, "RECV_CHUNK", 4096)
    raw, digest = shards[2]
    assert len(raw) > 3 * 4096
    real_receive, fenced = store.receive, []

    def receive(ticket, offset, nbytes, fill):
        if offset == 4096 and not fenced:  # recovery starts generation 1 mid-stream
            fenced.append(store.set_generation(1))
        return real_receive(ticket, offset, nbytes, fill)

    monkeypatch.setattr(store, "receive", receive)
    snd = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    try:
        with pytest.raises(StaleGenerationError):
            snd.send(0, 2, raw, digest, gen=0)
        assert store.inventory() == {}
        assert snd.send(0, 2, raw, digest, gen=1) == len(raw)  # the stream is still in step
    finally:
        snd.close()


def test_sender_dying_mid_shard_leaves_nothing_listed(store, shards):
    raw, digest = shards[1]
    sock = socket.create_connection(store.address("127.0.0.1"), timeout=30)
    send_msg(sock, {"rank": 0, "step": 1, "nbytes": len(raw), "checksum": digest, "gen": 0})
    sock.recv(1024)  # the go-ahead
    sock.sendall(memoryview(raw)[: len(raw) // 2])
    sock.close()  # the worker died half-way
    assert 0 not in store.inventory()
    snd = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    try:  # the half-written slot is reused for a complete copy
        assert snd.send(0, 1, raw, digest, gen=0) == len(raw)
    finally:
        snd.close()
    assert store.inventory() == {0: [1]}


def test_a_dead_senders_late_bytes_never_touch_the_replacements_copy(store, shards,
                                                                   monkeypatch):
    """A sender dies half-way through a shard and the store's thread for its connection gets
    to the bytes late (a loaded node); the replacement sends the same shard and is
    acknowledged; only then does the dead sender's thread go on: it is refused, and the
    acknowledged copy stays listed and intact. (The old thread caught mid-piece instead:
    test_store.py's test_a_superseded_transfer_never_touches_the_newer_copy.)"""
    raw, digest = shards[1]
    real_receive, replaced = store.receive, threading.Event()
    first: list[int] = []
    outcome: list[BaseException] = []

    def receive(ticket, offset, nbytes, fill):
        first[:] = first or [ticket]
        if ticket != first[0]:
            return real_receive(ticket, offset, nbytes, fill)
        replaced.wait(30)
        try:
            return real_receive(ticket, offset, nbytes, fill)
        except BaseException as e:
            outcome.append(e)
            raise

    monkeypatch.setattr(store, "receive", receive)
    sock = socket.create_connection(store.address("127.0.0.1"), timeout=30)
    send_msg(sock, {"rank": 0, "step": 1, "nbytes": len(raw), "checksum": digest, "gen": 0})
    sock.recv(1024)  # the go-ahead
    sock.sendall(memoryview(raw)[: len(raw) // 2])
    sock.close()  # the worker died half-way; its thread at the store waits to read
    wait_for(lambda: first, 10, "the dead sender's thread to reach its bytes")
    snd = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    try:
        assert snd.send(0, 1, raw, digest, gen=0) == len(raw)
    finally:
        snd.close()
    replaced.set()
    wait_for(lambda: outcome, 10, "the dead sender's thread to be refused")
    assert isinstance(outcome[0], SupersededPutError), outcome
    assert store.inventory() == {0: [1]}
    assert np.array_equal(held_replica(store, 0, 1), raw)


def test_cancelled_send_stops_and_closes(store, sender, shards):
    raw, digest = shards[1]
    with pytest.raises(ConnectionError, match="cancelled"):
        sender.send(0, 1, raw, digest, gen=0, cancelled=lambda: True)
    assert store.inventory() == {}


def test_lack_of_ram_reaches_the_sender(store, sender, shards, monkeypatch):
    import memckpt.runtime.node.replica_store as st
    raw, digest = shards[1]
    monkeypatch.setattr(st, "RAM_HEADROOM", 1 << 60)
    with pytest.raises(PlacementError, match="lacks RAM"):
        sender.send(0, 1, raw, digest, gen=0)


def test_fetch_returns_the_held_shard_and_refuses_what_is_notheld_replica(store, sender, shards):
    raw, digest = shards[2]
    assert sender.send(3, 2, raw, digest, gen=0) == len(raw)
    got = sender.fetch(3, 2)
    with pytest.raises(ChecksumError, match="incomplete"):  # unverified: not yet trusted
        fmt.open_shard(got, "fetched")
    assert fmt.accept_received(got, "fetched", 2).step == 2
    assert np.array_equal(got, raw)  # verified: byte-identical, flagged complete again
    with pytest.raises(NoSnapshotError, match="rank 3 at step 1"):
        sender.fetch(3, 1)
    again = sender.fetch(3, 2)  # the connection is still in step
    assert fmt.accept_received(again, "again", 2) and again.tobytes() == got.tobytes()
    with pytest.raises(ChecksumError, match="expected step 3, got 2"):
        fmt.accept_received(sender.fetch(3, 2), "wrong step", 3)


def test_fetched_corrupt_replica_fails_verification(store, sender, shards):
    """The store streams what it holds; the restoring worker's check catches a flipped byte."""
    raw, digest = shards[1]
    assert sender.send(0, 1, raw, digest, gen=0) == len(raw)
    path = scan(store.replicas)[0][1]
    with open(path, "r+b") as f:
        f.seek(len(raw) - 1)
        last = f.read(1)
        f.seek(len(raw) - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    fetched = sender.fetch(0, 1)
    with pytest.raises(ChecksumError, match="data checksum mismatch"):
        fmt.accept_received(fetched, "fetched", 1)
    with pytest.raises(ChecksumError, match="incomplete"):  # and it stays untrusted
        fmt.open_shard(fetched, "fetched", verify=False)


def test_fetch_into_a_snapshot_slot_holds_the_step_for_the_next_process(store, sender, shards,
                                                                      tmp_path):
    """A peer restore streams the replica straight into the rank's own slot: verified, then
    held as if snapshotted there (a restarted process adopts it; replication reads it)."""
    raw, digest = shards[2]
    assert sender.send(3, 2, raw, digest, gen=0) == len(raw)
    engine = SnapshotEngine(tmp_path / "own", gated=True)
    shard = engine.install(2, lambda into: sender.fetch(3, 2, into), "peer")
    assert shard.step == 2 and engine.steps() == [2]
    with engine.reading(2) as held:
        assert np.array_equal(held.raw, raw)
    engine.close()
    adopted = SnapshotEngine(tmp_path / "own", gated=True)
    assert adopted.steps() == [2]
    adopted.close()


def test_after_a_fetch_the_other_slot_is_ready_for_the_first_snapshot(store, sender, shards,
                                                                     tmp_path):
    """A peer restore lands on a node with no slots of the rank: the second slot is mapped
    in the background while the restore loads, so the first snapshot allocates nothing."""
    raw, digest = shards[2]
    assert sender.send(0, 2, raw, digest, gen=0) == len(raw)
    engine = SnapshotEngine(tmp_path / "own", gated=True)
    shard = engine.install(2, lambda into: sender.fetch(0, 2, into), "peer")
    state = _train_state(seed=1)
    assert state.load(shard.tensors, shard.meta) == 2
    engine._reserving.result(timeout=60)  # the background reservation, done while loading
    assert sorted(p.stat().st_size for p in (tmp_path / "own").glob("slot*.shard")) == \
        [len(raw), len(raw)]
    assert engine.stats.allocations == 2
    engine.set_committed(2)
    assert engine.snapshot(state.capture(3), 3)
    engine.wait()
    assert engine.stats.allocations == 2  # the first snapshot allocated nothing
    assert engine.steps() == [3, 2]
    with engine.reading(3, verify=True) as snap:
        for name, t in state.capture(3).tensors:
            assert torch.equal(snap.tensors[name], t), name
    with engine.reading(2, verify=True) as held:  # the restored step is untouched
        assert np.array_equal(held.raw, raw)
    engine.close()


def test_a_fetched_restore_fills_both_slots_and_the_next_snapshot_allocates_nothing(
        store, sender, shards, tmp_path):
    """A rank restored from a peer's copy on a node that holds none of its shards: the fetch
    lands in a new slot, the other slot is mapped while the restore loads, and the first
    snapshot after it allocates nothing (no third file, no spare's file: a spare holds
    none, #50)."""
    raw, digest = shards[2]
    assert sender.send(0, 2, raw, digest, gen=0) == len(raw)
    engine = SnapshotEngine(tmp_path / "own", gated=True)
    shard = engine.install(2, lambda into: sender.fetch(0, 2, into), "peer")
    assert np.array_equal(shard.raw, raw)
    engine._reserving.result(timeout=60)  # the other slot, mapped while the restore loads
    held_slot = next(sl for sl in engine.slots if sl.step == 2)
    other = next(sl for sl in engine.slots if sl is not held_slot)
    assert held_slot.path.stat().st_size == other.path.stat().st_size == len(raw)
    with engine.reading(2, verify=True) as held:
        assert np.array_equal(held.raw, raw)
    state = _train_state(seed=1)  # the first snapshot after the restore allocates nothing
    assert state.load(shard.tensors, shard.meta) == 2
    engine.set_committed(2)
    allocations = engine.stats.allocations
    assert engine.snapshot(state.capture(3), 3)
    engine.wait()
    assert engine.stats.allocations == allocations and engine.steps() == [3, 2]
    engine.close()


def test_fetch_cut_short_leaves_no_trusted_slot(store, sender, shards, tmp_path):
    raw, digest = shards[1]
    assert sender.send(0, 1, raw, digest, gen=0) == len(raw)
    engine = SnapshotEngine(tmp_path / "own", gated=True)

    def half_then_drop(into):  # what fetch does when the holder dies mid-stream
        buf, src, at = into(len(raw)), memoryview(raw), [0]

        def recv_into(view):
            view[:] = src[at[0]: at[0] + len(view)]
            at[0] += len(view)

        fmt.fill_flagged(buf, 0, len(raw) // 2, recv_into)  # the prefix says "complete"
        raise ConnectionError("peer closed the connection mid-message")

    with pytest.raises(ConnectionError):
        engine.install(1, half_then_drop, "peer")
    assert engine.steps() == []
    engine.close()
    assert SnapshotEngine(tmp_path / "own", gated=True).steps() == []


def test_install_does_not_wait_for_a_commit_that_will_never_come(store, sender, shards, tmp_path):
    """A restarted process adopts its slots (an uncommitted newer step among them) and the
    restore pulls the resumed step from a peer: the install must not wait on the gate."""
    raw, digest = shards[1]
    assert sender.send(0, 1, raw, digest, gen=0) == len(raw)
    own = tmp_path / "own"
    first = SnapshotEngine(own, gated=True)
    first.install(1, lambda into: sender.fetch(0, 1, into), "peer")
    first.close()
    restarted = SnapshotEngine(own, gated=True)  # holds step 1, never committed here
    assert restarted.steps() == [1] and restarted.committed is None
    raw2, digest2 = shards[2]
    assert sender.send(0, 2, raw2, digest2, gen=0) == len(raw2)
    done = []
    t = threading.Thread(target=lambda: done.append(
        restarted.install(2, lambda into: sender.fetch(0, 2, into), "peer")))
    t.start()
    t.join(timeout=30)
    assert done and done[0].step == 2 and restarted.steps() == [2, 1]
    restarted.close()
