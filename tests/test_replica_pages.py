"""A holder's two replica slots of a rank share the pages of the chunks that did not change
(#50): a frozen weight is held once per holder, every replica is the sender's bytes exactly,
and a transfer cut half way, superseded, or into a slot whose layout grew never touches the
committed copy. No Ray: a real ReplicaStore on the tmpfs, real TCP transfers from real
Checkpointers' slots, allocated blocks counted."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import memckpt
from memckpt.engine import shared_pages
from memckpt.engine.buffers import RamRegion, allocated_bytes
from memckpt.format import shard as fmt
from memckpt.runtime.node import replica_pages
from memckpt.runtime.wire.data_plane import StoreConnection

from conftest import held_replica
from test_replica_fill import (PARAM_BYTES, _moments_move, _send, _send_steps,  # noqa: F401
                               _snapshot, _state, sender_rank, senders)

KiB = 1 << 10


def _assert_holds(store, step: int, shard: fmt.Shard) -> None:
    """``store``'s replica of ``step`` is ``shard`` bit for bit, on disk, and as served."""
    held = held_replica(store, 0, step)
    assert np.array_equal(held, shard.raw)
    assert fmt.open_shard(held, "replica", verify=True).step == step
    assert np.array_equal(store.read(0, step), shard.raw)


class _NodeLost(Exception):
    pass


def _cut(store, shard: fmt.Shard, upto: int) -> None:
    """Send ``shard`` over a new connection, the sender's node lost once ``upto`` bytes
    crossed (the byte a drill's ``at_byte`` aims at: the connection's own stop)."""
    conn = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    crossed = []

    def lost() -> None:
        crossed.append(upto)
        conn.close()  # the transfer stays open, half written, until a new one supersedes it
        raise _NodeLost

    with pytest.raises(_NodeLost):
        conn.send(0, shard.step, shard.raw, shard.header["data_xxh3"], 0, chunks=shard.chunks,
                  stop_at=(upto, lost))
    assert crossed == [upto]


def test_a_holder_holds_a_frozen_weight_once_and_every_replica_is_exact(store, sender,
                                                                        sender_rank):
    state = _state(moment_shift=0.0)
    shards = {}
    for step in (1, 2, 3, 4):
        shards.update(_send_steps(sender, sender_rank, state, (step,)))
        _assert_holds(store, step, shards[step])
    assert store.inventory() == {0: [3, 4]}
    _assert_holds(store, 3, shards[3])  # the older copy too, after the newer one landed
    size = len(shards[4].raw)
    # two slots of the shard, less one copy of the 3 MiB weight (header room not written
    # stays unallocated)
    assert allocated_bytes(store.replicas) <= 2 * size - PARAM_BYTES + 64 * KiB


def test_a_transfer_cut_half_way_through_the_shared_bytes_leaves_the_committed_copy_whole(
        store, sender, sender_rank):
    """Steps 1 and 2 share the weight's pages; step 3 changes the weight, and its transfer
    into step 1's slot is cut half way through those chunks: step 2, committed, is
    untouched, and a new transfer of step 3 lands exactly."""
    state = _state(moment_shift=0.0)
    shards = _send_steps(sender, sender_rank, state, (1, 2))
    (weight,) = state.model.parameters()
    with torch.no_grad():
        weight.add_(1.0)
    shards[3] = _snapshot(sender_rank, state, 3)
    # the header, then half the weight's bytes: into pages step 2 must not be using
    _cut(store, shards[3], upto=fmt.data_offset(shards[3].header_capacity) + PARAM_BYTES // 2)
    assert store.inventory() == {0: [2]}
    _assert_holds(store, 2, shards[2])
    again = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    try:
        assert _send(again, shards[3]) > PARAM_BYTES  # the changed weight crossed
    finally:
        again.close()
    _assert_holds(store, 3, shards[3])
    _assert_holds(store, 2, shards[2])


@pytest.mark.parametrize("piece", [None, 28_928])  # two halves; pieces off the page grid
def test_a_receive_never_holds_the_header_room_and_the_shard_arrives_exact(ram_root,
                                                                         sender_rank, piece):
    """A shard received into a file the size of a slot that held an older one (stale bytes
    in its room): the prefix, the header and every data byte land; the header's unused
    room is read and dropped, its pages given back (it holds no byte, no checksum covers
    it), so the file holds the shard less that room, and verifies."""
    shard = _snapshot(sender_rank, _state(moment_shift=0.0), 1)
    start, stop = fmt.header_room(shard.raw[:fmt.PREFIX.size], "sender")
    assert stop - start >= 32 * KiB  # most of a small shard's header
    path = Path(ram_root) / "slot"
    path.write_bytes(b"\xab" * len(shard.raw))  # an older shard's bytes, allocated
    region = RamRegion.open(path, populate=False)
    try:
        sent, half = memoryview(shard.raw).cast("B"), len(shard.raw) // 2 + 1000

        def fill(view: memoryview) -> None:  # what the socket's recv_into does
            nonlocal at
            view[:] = sent[at: at + len(view)]
            at += len(view)
        at = 0
        cuts = [0, half] if piece is None else list(range(0, len(shard.raw), piece))
        for off, stop_at in zip(cuts, cuts[1:] + [len(shard.raw)]):  # consecutive pieces
            replica_pages.receive(region, off, stop_at - off, fill)
        assert fmt.accept_received(region.array, "received", 1).step == 1  # flags complete
        got = np.array(region.array)
        assert np.array_equal(got[:start], shard.raw[:start])
        assert not got[start:stop].any()  # the room reads as zeros
        assert np.array_equal(got[stop:], shard.raw[stop:])
        assert allocated_bytes(path) <= len(shard.raw) - (stop - start)
    finally:
        region.close()


def test_a_fault_aimed_past_a_transfers_end_fires_once_every_byte_crossed(store, sender,
                                                                         sender_rank):
    """``at_byte`` past what a transfer sends: the fault fires once its last byte crossed,
    before the holder's answer; the holder, with every byte in, keeps the step whole."""
    state = _state(moment_shift=0.0)
    shards = _send_steps(sender, sender_rank, state, (1,))
    shards[2] = _snapshot(sender_rank, state, 2)
    _cut(store, shards[2], upto=10 * len(shards[2].raw))
    deadline = time.monotonic() + 30
    while store.inventory() != {0: [1, 2]} and time.monotonic() < deadline:
        time.sleep(0.05)  # the holder verifies and lists it on its own thread
    _assert_holds(store, 2, shards[2])
    _assert_holds(store, 1, shards[1])


def test_a_superseded_transfer_keeps_the_committed_copy_whole(store, sender, sender_rank):
    """A transfer of step 3 stalls half way (its sender stuck) and a new one of the same
    shard supersedes it: the stalled one's file is replaced, after the committed step 2
    took home the pages it kept in it."""
    state = _state(moment_shift=0.0)
    shards = _send_steps(sender, sender_rank, state, (1, 2))
    _moments_move(state, 0.5)
    shards[3] = _snapshot(sender_rank, state, 3)
    raw = shards[3].raw
    stalled = store.begin(0, 3, len(raw), shards[3].header["data_xxh3"])
    store.fill_local(stalled, shards[3].chunks)
    store.write(stalled, 0, raw[: 64 * KiB])
    _send(sender, shards[3])  # supersedes the stalled transfer
    with pytest.raises(memckpt.errors.MemckptError):
        store.write(stalled, 64 * KiB, raw[64 * KiB: 128 * KiB])
    _assert_holds(store, 3, shards[3])
    _assert_holds(store, 2, shards[2])


def test_a_replica_slot_whose_layout_grows_keeps_its_partner_whole(store, sender, senders):
    """Step 1 has no optimizer state; from step 2 on Adam's moments make the shard larger.
    Step 2's replica shares the weight with step 1's slot; step 3 goes into step 1's slot,
    which grows in place under the pages step 2 keeps there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 768, bias=False)
    model.requires_grad_(False)
    head = torch.nn.Linear(768, 4)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    state = memckpt.TrainState(model=torch.nn.Sequential(model, head), optimizer=opt)
    ckpt = senders(0)
    shards = {}
    for step in (1, 2, 3):
        if step > 1:
            head(model(torch.ones(2, 1024))).sum().backward()
            opt.step()
        shards[step] = _snapshot(ckpt, state, step)
        _send(sender, shards[step])
        _assert_holds(store, step, shards[step])
    assert len(shards[2].raw) > len(shards[1].raw)
    _assert_holds(store, 2, shards[2])
    assert allocated_bytes(store.replicas) < 2 * len(shards[3].raw) - PARAM_BYTES // 2


@pytest.mark.parametrize("both,share", [(True, True), (False, True), (True, False)])
def test_replica_files_adopted_as_a_ranks_own_slots_restore_exactly(store, sender, sender_rank,
                                                                    both, share):
    """A rank moved to its holder's node takes the replicas there as its own slots (renamed):
    both (still partners), or the newest alone (it takes home the pages it kept in the
    other's file first). Its next snapshot, sharing or not (a CUDA host's pinned slots do
    not), never writes over the pages the step before it keeps in the slot it writes."""
    from memckpt.engine.snapshot import SnapshotEngine
    state = _state(moment_shift=0.0)
    shards = _send_steps(sender, sender_rank, state, (1, 2))
    files = [store.locate(0, 2)] + ([store.locate(0, 1)] if both else [])
    assert shared_pages.read_away(files[0])  # step 2 keeps the weight in step 1's file
    engine = SnapshotEngine(store.own / "rank0", share_unchanged=share)  # the same tmpfs
    try:
        assert engine.adopt(files) == ([2, 1] if both else [2])
        for step in engine.steps():
            with engine.reading(step, verify=True) as shard:
                assert np.array_equal(shard.raw, shards[step].raw)
        with torch.no_grad():
            next(iter(state.model.parameters())).add_(1.0)  # the weight changes too
        assert engine.snapshot(state.capture(3), 3)
        engine.wait()
        assert engine.steps() == [3, 2]
        with engine.reading(2, verify=True) as shard:
            assert np.array_equal(shard.raw, shards[2].raw)
        with engine.reading(3, verify=True) as shard:
            assert torch.equal(shard.tensors["model/model/weight"], state.model.weight)
    finally:
        engine.close()


def test_a_sharing_that_fails_half_way_receives_everything_and_spares_the_committed_copy(
        store, sender, sender_rank, monkeypatch):
    """The layout of step 4's transfer (into step 2's slot) fails after it mapped the weight's
    chunks to the pages step 3 keeps them in: the transfer falls back to its own pages for
    every chunk, receives all of them, and step 3 stays whole."""
    state = _state(moment_shift=0.0)
    shards = _send_steps(sender, sender_rank, state, (1, 2, 3))
    _moments_move(state, 0.5)
    shards[4] = _snapshot(sender_rank, state, 4)
    real = shared_pages.apply

    def fails_after(region, geometry, was, new):
        real(region, geometry, was, new)  # the shared chunks now map step 2's pages
        raise memckpt.errors.MemckptError("cannot record the homes (injected)")
    monkeypatch.setattr(shared_pages, "apply", fails_after)
    assert _send(sender, shards[4]) > PARAM_BYTES  # nothing shared: the weight crossed too
    monkeypatch.setattr(shared_pages, "apply", real)
    _assert_holds(store, 4, shards[4])
    _assert_holds(store, 3, shards[3])
