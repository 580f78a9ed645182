"""The worker's interface to the snapshot engine (memckpt.runtime.worker.rank_checkpointer), without Ray:
gated commits, rolling back to a restored step, discarding a corrupt copy, installing a
fetched copy into a slot of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import memckpt
from memckpt.errors import ChecksumError
from memckpt.runtime.worker.rank_checkpointer import RankCheckpointer


def _state(seed: int) -> memckpt.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return memckpt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def ckpt(ram_root):
    sealed: list[int] = []
    config = memckpt.Config(job_name="rank-ckpt", ram_root=ram_root)
    c = RankCheckpointer(config, 0, 1, Path(ram_root) / "node", lambda s, _p: sealed.append(s))
    c.sealed = sealed
    yield c
    c.close(unlink=True)


def test_steps_seal_then_count_as_committed_only_when_told(ckpt):
    state = _state(0)
    ckpt.step(state, 1)
    ckpt.wait()
    assert ckpt.sealed == [1] and ckpt.holds(1) and ckpt.committed is None
    with ckpt.read(1) as shard:
        assert shard.step == 1
    ckpt.commit(1)
    assert ckpt.committed == 1
    assert ckpt.newest_layout() is not None


def test_resuming_at_a_step_voids_newer_ones_and_commits_it(ckpt):
    state = _state(0)
    for step in (1, 2):
        ckpt.step(state, step)
        ckpt.wait()
        if step == 1:
            ckpt.commit(1)
    ckpt.resume_at(1)
    assert ckpt.holds(1) and not ckpt.holds(2) and ckpt.committed == 1


def test_a_discarded_copy_is_never_read_again(ckpt):
    ckpt.step(_state(0), 1)
    ckpt.wait()
    ckpt.discard(1)
    assert not ckpt.holds(1) and ckpt.newest_layout() is None
    with pytest.raises(Exception):
        with ckpt.read(1):
            pass


def test_an_installed_copy_is_verified_and_loads_exactly(ckpt, ram_root):
    source = _state(1)
    other = RankCheckpointer(memckpt.Config(job_name="rank-ckpt", ram_root=ram_root), 0, 1,
                             Path(ram_root) / "peer", lambda *_: None)
    try:
        other.step(source, 3)
        other.wait()
        with other.read(3) as shard:
            raw = np.array(shard.raw, copy=True)

        def receive(into):
            buf = into(len(raw))
            buf[:] = raw
            return buf

        target = _state(2)
        shard = ckpt.install(3, receive, "peer:test")
        assert ckpt.load_shard(target, shard, "peer:test") == 3
        assert torch.equal(target.models["model"].weight, source.models["model"].weight)

        def corrupt(into):
            buf = receive(into)
            buf[-1] ^= 0xFF
            return buf

        with pytest.raises(ChecksumError):
            ckpt.install(3, corrupt, "peer:bad")
    finally:
        other.close(unlink=True)


def test_a_steps_report_travels_with_its_shard_and_comes_back_on_restore(ckpt, ram_root):
    """The step's metrics live in the shard's header: a restore from the rank's own slot or
    from a copy fetched off a peer gives them back; a step snapshotted without them gives
    none (and a later restore never shows an earlier one's)."""
    source = _state(1)
    ckpt.step(source, 4, loss=2.5)
    ckpt.wait()
    ckpt.commit(4)  # a slot is reused only once the newest step is committed
    ckpt.step(source, 6)
    ckpt.wait()
    target = _state(2)
    with ckpt.read(4) as shard:
        assert shard.meta["report"] == {"loss": 2.5}
        assert ckpt.load_shard(target, shard, "local:test") == 4
    assert ckpt.restored_report == {"loss": 2.5}
    with ckpt.read(6) as shard:
        ckpt.load_shard(target, shard, "local:test")
    assert ckpt.restored_report is None
    with ckpt.read(4) as shard:
        raw = np.array(shard.raw, copy=True)
    other = RankCheckpointer(memckpt.Config(job_name="rank-ckpt", ram_root=ram_root), 0, 1,
                             Path(ram_root) / "peer", lambda *_: None)
    try:
        def receive(into):
            buf = into(len(raw))
            buf[:] = raw
            return buf
        fetched = other.install(4, receive, "peer:test")
        assert other.load_shard(target, fetched, "peer:test") == 4
        assert other.restored_report == {"loss": 2.5}
    finally:
        other.close(unlink=True)
