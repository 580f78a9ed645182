"""Unit tests for memckpt.runtime.node.replica_store.ReplicaStore, used directly (no Ray).

The shards are real: a Checkpointer snapshots a small model + AdamW into RAM and
the test streams those bytes into a store the way a peer's replication would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import memckpt
from memckpt.format import shard as fmt
from memckpt.errors import ChecksumError, NoSnapshotError, PlacementError, SupersededPutError
from memckpt.runtime.node.replica_store import Freed, ReplicaStore, StaleGenerationError
from memckpt.runtime.wire.ram_files import node_dir, own_dir
from conftest import STORE_JOB as JOB, STORE_NODE as NODE

from _shards import _snapshot, _train_state, shards  # noqa: F401 (fixture)


def _chunks(raw: np.ndarray, n: int = 5) -> list[tuple[int, np.ndarray]]:
    size = -(-len(raw) // n)
    return [(off, raw[off: off + size]) for off in range(0, len(raw), size)]


def _send(store: ReplicaStore, rank: int, step: int, raw: np.ndarray, digest: str,
          order: str = "forward", gen: int = -1) -> str:
    ticket = store.begin(rank, step, len(raw), digest, gen=gen)
    assert ticket > 0
    chunks = _chunks(raw)
    if order == "reverse":
        chunks.reverse()
    elif order == "shuffled":
        chunks = [chunks[i] for i in np.random.default_rng(step).permutation(len(chunks))]
    for off, chunk in chunks:
        assert store.write(ticket, off, chunk) == len(chunk)
    return store.finish(ticket)


def _data_offset(raw: np.ndarray) -> int:
    return fmt.PREFIX.unpack_from(raw, 0)[6]


# ---- receiving ----------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_chunked_transfer_stores_verified_replica(store, shards, order):
    raw, digest = shards[1]
    assert len(_chunks(raw)) == 5 and len(raw) > 4096
    assert _send(store, 2, 1, raw, digest, order) == digest
    assert store.inventory() == {2: [1]}
    got = store.read(2, 1)
    shard = fmt.open_shard(got, "read back", verify=True)
    assert shard.step == 1 and shard.header["data_xxh3"] == digest
    assert shard.header["rank"] == 0  # the sender's identity travels with the bytes
    assert np.array_equal(got, raw)
    assert (store.replicas / "rank2").is_dir()


def test_begin_same_step_same_checksum_is_already_held(store, shards):
    raw, digest = shards[2]
    _send(store, 0, 2, raw, digest)
    assert store.begin(0, 2, len(raw), digest) == 0
    assert store.inventory() == {0: [2]}  # untouched
    assert np.array_equal(store.read(0, 2), raw)
    # a different checksum for the same step is a new transfer into the same slot
    other_raw, other_digest = shards[3]
    assert store.begin(0, 2, len(other_raw), other_digest) > 0
    assert store.inventory() == {}  # invalidated until the new bytes verify


def test_flipped_byte_is_refused_then_retransmission_succeeds(store, shards):
    raw, digest = shards[1]
    bad = raw.copy()
    bad[_data_offset(raw) + 100] ^= 0xFF
    ticket = store.begin(0, 1, len(bad), digest)
    for off, chunk in _chunks(bad):
        store.write(ticket, off, chunk)
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        store.finish(ticket)
    assert store.inventory() == {}
    with pytest.raises(NoSnapshotError):
        store.read(0, 1)
    with pytest.raises(SupersededPutError, match="not open"):
        store.finish(ticket)  # the failed transfer is closed
    # a correct retransmission reuses the slot and succeeds
    assert _send(store, 0, 1, raw, digest) == digest
    assert store.inventory() == {0: [1]}
    assert np.array_equal(store.read(0, 1), raw)
    assert len(list((store.replicas / "rank0").glob("*.shard"))) == 1


def test_flipped_header_byte_is_refused(store, shards):
    raw, digest = shards[1]
    bad = raw.copy()
    bad[fmt.PREFIX.size + 3] ^= 0x01  # inside the JSON header
    ticket = store.begin(0, 1, len(bad), digest)
    for off, chunk in _chunks(bad):
        store.write(ticket, off, chunk)
    with pytest.raises(ChecksumError):
        store.finish(ticket)
    assert store.inventory() == {}


def test_wrong_step_is_refused(store, shards):
    raw, digest = shards[1]
    ticket = store.begin(0, 2, len(raw), digest)  # announced as step 2, bytes are step 1
    for off, chunk in _chunks(raw):
        store.write(ticket, off, chunk)
    with pytest.raises(ChecksumError, match="expected step 2"):
        store.finish(ticket)
    assert store.inventory() == {}


@pytest.mark.parametrize("sent", ["some", "all"])
def test_torn_transfer_is_not_listed(ram_root, store, shards, sent):
    raw, digest = shards[1]
    ticket = store.begin(0, 1, len(raw), digest)
    chunks = _chunks(raw)
    for off, chunk in (chunks[:2] if sent == "some" else chunks):
        store.write(ticket, off, chunk)
    # no finish: the sender died mid-transfer
    assert store.inventory() == {}
    with pytest.raises(NoSnapshotError):
        store.read(0, 1)
    # nor does a restarted store trust it
    assert ReplicaStore(ram_root=ram_root, job=JOB, node_id=NODE).inventory() == {}


def test_torn_transfer_over_old_slot_keeps_the_newer_copy(store, shards):
    for s in (1, 2):
        _send(store, 0, s, *shards[s])
    raw, digest = shards[3]
    store.write(store.begin(0, 3, len(raw), digest), 0, raw[:4096])
    assert store.inventory() == {0: [2]}  # step 1's slot is being overwritten; 2 intact
    assert np.array_equal(store.read(0, 2), shards[2][0])


def test_a_superseded_transfer_never_touches_the_newer_copy(store, shards):
    """A sender died mid-shard and the store's thread for it is still writing a piece (a
    loaded node): the replacement's transfer of the same shard begins, completes and is
    listed meanwhile; then the old thread's piece ends, flagging and writing as it goes.
    The newer copy stays listed and intact, and the old transfer is refused from then on.
    (A fresh-clone run failed this way, CHANGELOG "A replica acknowledged to its sender is no
    longer lost": the old thread's flag landed on the newer copy, which had reused the same
    slot file.)"""
    raw, digest = shards[1]
    old = store.begin(0, 1, len(raw), digest)
    newer: list[int] = []

    def late_piece(view: memoryview) -> None:
        if not newer:  # the newer transfer happens while this piece is being written
            newer.append(store.begin(0, 1, len(raw), digest))
            for off, chunk in _chunks(raw):
                store.write(newer[0], off, chunk)
            assert store.finish(newer[0]) == digest
            assert store.inventory() == {0: [1]}
        np.frombuffer(view, dtype=np.uint8)[:] = 0xEE  # what the dead sender had sent

    store.receive(old, 0, 8192, late_piece)  # the head, the incomplete flag, the rest
    assert newer and newer[0] != old
    assert store.inventory() == {0: [1]}
    assert np.array_equal(store.read(0, 1), raw)
    with pytest.raises(SupersededPutError, match="not open"):
        store.write(old, 8192, raw[8192:9000])
    with pytest.raises(SupersededPutError):
        store.finish(old)
    assert len(list((store.replicas / "rank0").glob("*.shard"))) == 1  # no file left behind


def test_a_transfer_superseded_while_it_verifies_is_not_acknowledged(store, shards,
                                                                    monkeypatch):
    """The same shard begun again while a complete transfer of it is verified: the newer
    one gets a fresh file, the verified one is not acknowledged (its file is gone) and the
    newer one, once finished, is the copy listed."""
    raw, digest = shards[2]
    first = store.begin(0, 2, len(raw), digest)
    for off, chunk in _chunks(raw):
        store.write(first, off, chunk)
    second: list[int] = []
    real_accept = fmt.accept_received

    def accept_while_a_newer_begins(*args, **kwargs):
        second.append(store.begin(0, 2, len(raw), digest))
        return real_accept(*args, **kwargs)

    monkeypatch.setattr(fmt, "accept_received", accept_while_a_newer_begins)
    with pytest.raises(SupersededPutError, match="superseded"):
        store.finish(first)
    monkeypatch.undo()
    assert store.inventory() == {}
    for off, chunk in _chunks(raw):
        store.write(second[0], off, chunk)
    assert store.finish(second[0]) == digest
    assert store.inventory() == {0: [2]}
    assert np.array_equal(store.read(0, 2), raw)


def test_a_transfer_fenced_off_while_it_verifies_is_not_acknowledged(store, shards,
                                                                      monkeypatch):
    """Recovery fences the sender's generation while its complete transfer is verified:
    the store answers with the fence, not an acknowledgement."""
    raw, digest = shards[1]
    ticket = store.begin(0, 1, len(raw), digest, gen=0)
    store.write(ticket, 0, raw)
    real_accept = fmt.accept_received

    def accept_while_recovery_fences(*args, **kwargs):
        store.set_generation(1)
        return real_accept(*args, **kwargs)

    monkeypatch.setattr(fmt, "accept_received", accept_while_recovery_fences)
    with pytest.raises(StaleGenerationError, match="generation"):
        store.finish(ticket)


def test_write_without_begin_is_refused(store, shards):
    raw, _ = shards[1]
    with pytest.raises(SupersededPutError, match="not open"):
        store.write(1, 0, raw[:10])


# ---- slots --------------------------------------------------------------------------------

def test_two_slots_newest_step_overwrites_the_older(store, shards):
    for s in (1, 2, 3):
        _send(store, 0, s, *shards[s])
    assert store.inventory() == {0: [2, 3]}
    assert sorted(p.name for p in (store.replicas / "rank0").glob("*.shard")) == sorted(fmt.SLOT_NAMES)
    for s in (2, 3):
        assert np.array_equal(store.read(0, s), shards[s][0])
    with pytest.raises(NoSnapshotError):
        store.read(0, 1)


def test_resending_a_held_step_reuses_its_slot(store, shards):
    for s in (1, 2, 3):
        _send(store, 0, s, *shards[s])  # holds [2, 3]
    # step 2 announced again with another checksum (a rerun after a rollback): it goes
    # into step 2's slot, never over step 3
    raw2, _ = shards[2]
    ticket = store.begin(0, 2, len(raw2), "0" * 16)
    assert ticket > 0
    assert store.inventory() == {0: [3]}
    for off, chunk in _chunks(raw2):
        store.write(ticket, off, chunk)
    store.finish(ticket)
    assert store.inventory() == {0: [2, 3]}
    assert np.array_equal(store.read(0, 3), shards[3][0])


def test_discard_after_invalidates_newer_steps(store, shards):
    for s in (1, 2, 3):
        _send(store, 0, s, *shards[s])
    _send(store, 1, 3, *shards[3])
    assert store.discard_after(2) == 2
    assert store.inventory() == {0: [2]}
    assert np.array_equal(store.read(0, 2), shards[2][0])
    assert store.discard_after(2) == 0


# ---- generation fencing -------------------------------------------------------------------

def test_generation_fencing(store, shards):
    raw, digest = shards[1]
    older = store.begin(0, 1, len(raw), digest, gen=4)  # under way when recovery fences
    store.set_generation(5)
    with pytest.raises(StaleGenerationError, match="generation 4"):
        store.begin(0, 1, len(raw), digest, gen=4)
    with pytest.raises(StaleGenerationError):
        store.write(older, 0, raw)
    with pytest.raises(StaleGenerationError):
        store.finish(older)
    ticket = store.begin(0, 1, len(raw), digest, gen=5)
    store.write(ticket, 0, raw)
    assert store.finish(ticket) == digest
    assert store.inventory() == {0: [1]}
    store.set_generation(3)  # never goes back
    with pytest.raises(StaleGenerationError):
        store.begin(0, 2, len(raw), digest, gen=4)


def test_new_generation_cancels_in_flight_transfer(store, shards):
    raw, digest = shards[2]
    ticket = store.begin(0, 2, len(raw), digest, gen=1)
    store.write(ticket, 0, raw[:4096])
    store.set_generation(2)
    with pytest.raises(StaleGenerationError):
        store.write(ticket, 4096, raw[4096:])
    with pytest.raises(StaleGenerationError):
        store.finish(ticket)
    assert store.inventory() == {}


# ---- own-node slots and restarts ----------------------------------------------------------

def test_own_slots_are_listed_and_served(ram_root, store, shards):
    directory = own_dir(Path(ram_root), JOB, NODE)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, job_name=JOB), rank=1,
                                world_size=2, directory=directory)
    state = _train_state(seed=1)
    own = {s: _snapshot(ckpt, state, s) for s in (4, 5, 6)}
    _send(store, 0, 1, *shards[1])  # a replica of a peer's rank alongside
    assert (directory / "rank1").is_dir()
    assert store.inventory() == {0: [1], 1: [5, 6]}
    for s in (5, 6):
        got = store.read(1, s)
        assert np.array_equal(got, own[s][0])
        assert fmt.open_shard(got, "own").header["data_xxh3"] == own[s][1]
    # the worker is gone (killed): its slots outlive it
    ckpt.close()
    del ckpt
    assert store.inventory() == {0: [1], 1: [5, 6]}
    assert np.array_equal(store.read(1, 6), own[6][0])
    # rollback discards own slots too
    assert store.discard_after(5) == 1
    assert store.inventory() == {0: [1], 1: [5]}


def test_largest_shard_is_what_a_spare_prepares_for(ram_root, store, shards):
    assert store.largest_shard() is None  # nothing held yet: nothing to prepare
    _send(store, 0, 1, *shards[1])  # a peer's replica
    directory = own_dir(Path(ram_root), JOB, NODE)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, job_name=JOB), rank=1,
                                world_size=2, directory=directory)
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Linear(256, 4))
    big = memckpt.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    raw, _ = _snapshot(ckpt, big, 4)  # this node's own rank, larger than the replica
    assert len(raw) > len(shards[1][0])
    nbytes, table, data_len = store.largest_shard()
    _, layout, _ = fmt.read_header(raw, "own")
    assert nbytes == len(raw)
    assert fmt.Layout.from_json(table, data_len, "answer") == layout
    assert any(row[0].startswith("optim/") for row in table)  # what the pool is made from
    ckpt.close(unlink=True)
    nbytes, table, _ = store.largest_shard()  # the own slots are gone: the replica is left
    assert nbytes == len(shards[1][0])
    assert table == fmt.read_header(shards[1][0], "replica")[1].to_json()


def test_restarted_store_adopts_everything(ram_root, store, shards):
    for s in (1, 2):
        _send(store, 0, s, *shards[s])
    _send(store, 3, 3, *shards[3])
    again = ReplicaStore(ram_root=ram_root, job=JOB, node_id=NODE)
    assert again.inventory() == store.inventory() == {0: [1, 2], 3: [3]}
    assert np.array_equal(again.read(3, 3), shards[3][0])
    raw, digest = shards[2]
    assert again.begin(0, 2, len(raw), digest) == 0
    # and keeps receiving: step 3 of rank 0 replaces step 1
    _send(again, 0, 3, *shards[3])
    assert again.inventory() == {0: [2, 3], 3: [3]}


def test_stores_of_different_nodes_and_jobs_are_separate(ram_root, store, shards):
    _send(store, 0, 1, *shards[1])
    assert ReplicaStore(ram_root=ram_root, job=JOB, node_id="nodeB").inventory() == {}
    assert ReplicaStore(ram_root=ram_root, job="other", node_id=NODE).inventory() == {}
    assert store.root == node_dir(Path(ram_root), JOB, NODE)


# ---- memory, clear, RAM check -------------------------------------------------------------

def test_keep_only_frees_the_ranks_a_new_layout_does_not_serve(ram_root, store, shards):
    """After a resize: own slots of ranks 1 and 2 and replicas of ranks 0 and 2 were held;
    the new layout runs rank 1 here and gives it rank 0's replicas: the rest is freed, what
    stays is served as before."""
    directory = own_dir(Path(ram_root), JOB, NODE)
    state = _train_state(seed=1)
    own = {}
    for rank in (1, 2):
        ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, job_name=JOB),
                                    rank=rank, world_size=3, directory=directory)
        own[rank] = _snapshot(ckpt, state, 3)
        ckpt.close()
    _send(store, 0, 3, *shards[3])
    _send(store, 2, 3, *shards[3])
    assert store.inventory() == {0: [3], 1: [3], 2: [3]}
    store.read(2, 3)  # mapped by the store: a removed file's mapping goes too
    before = store.memory()["held_bytes"]

    out = store.keep_only(own=[1], replicas=[0])

    assert sorted(out.removed) == ["own/rank2", "replicas/rank2"]
    assert out.freed_bytes == before - store.memory()["held_bytes"] > 0
    assert not (directory / "rank2").exists()
    assert store.inventory() == {0: [3], 1: [3]}
    assert np.array_equal(store.read(1, 3), own[1][0])
    assert np.array_equal(store.read(0, 3), shards[3][0])
    with pytest.raises(NoSnapshotError):
        store.read(2, 3)
    assert store.keep_only(own=[1], replicas=[0]) == Freed((), 0)


def test_memory_reports_held_bytes(store, shards):
    assert store.memory()["held_bytes"] == 0
    _send(store, 0, 1, *shards[1])
    _send(store, 0, 2, *shards[2])
    mem = store.memory()
    assert mem["held_bytes"] >= len(shards[1][0]) + len(shards[2][0])
    assert mem["available_bytes"] > 0


def test_clear_removes_node_directory(ram_root, store, shards):
    other = ReplicaStore(ram_root=ram_root, job=JOB, node_id="nodeB")  # same machine, same job
    _send(store, 0, 1, *shards[1])
    _send(other, 1, 1, *shards[1])
    assert store.root.is_dir()
    store.clear()
    assert not store.root.exists()
    assert store.inventory() == {}
    assert store.memory()["held_bytes"] == 0
    assert other.inventory() == {1: [1]}  # the other node's shards are untouched
    other.clear()  # the last one out removes the job's folder too
    assert not (Path(ram_root) / JOB).exists() and Path(ram_root).is_dir()


def test_begin_refuses_when_node_lacks_ram(store, shards):
    _, digest = shards[1]
    with pytest.raises(PlacementError) as e:
        store.begin(0, 1, 1 << 50, digest)
    msg = str(e.value)
    assert "lacks RAM" in msg and "placement.replicas" in msg and "rank 0" in msg
    assert not list(store.replicas.rglob("*.shard"))  # nothing allocated
    assert store.inventory() == {}
