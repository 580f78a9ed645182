"""The snapshot engine: torn snapshots, double buffering, no per-step allocation, fall-behind."""

from __future__ import annotations

import gc
import threading
import time

import psutil
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memckpt
from memckpt.errors import ChecksumError, NoSnapshotError, StateError
from memckpt.format import shard as fmt
from memckpt.engine.slot import verify_slot


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))


def _train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    opt.zero_grad()
    F.mse_loss(model(torch.randn(3, 4, generator=g)), torch.randn(3, 2, generator=g)).backward()
    opt.step()


def _values(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_model_is(model, values):
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), k


def _restore_fresh(ckpt):
    fresh = _model()
    for p in fresh.parameters():
        p.data.fill_(7.0)
    step = ckpt.restore(memckpt.TrainState(model=fresh, optimizer=torch.optim.SGD(
        fresh.parameters(), lr=0.1, momentum=0.9)))
    return step, fresh


def _assert_restores_then_close(ckpt, step, values):
    """``ckpt`` restores ``step`` with the model ``values`` into a fresh model; then closes."""
    got, fresh = _restore_fresh(ckpt)
    assert got == step
    _assert_model_is(fresh, values)
    ckpt.close(unlink=True)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_failed_copy_leaves_previous_snapshot_complete(ram_root, mode):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    cfg = memckpt.Config(ram_root=ram_root, snapshot_mode=mode)
    ckpt = memckpt.Checkpointer(cfg)
    _train(model, opt, 1)
    assert ckpt.step(state, 1)
    ckpt.wait()
    step1 = _values(model)
    _train(model, opt, 2)
    step2 = _values(model)

    # A real failure midway: the last layer's weight now lives on the meta device,
    # so copying it out raises after the tensors before it were already copied.
    last = model[2].weight
    real = nn.Parameter(torch.empty(last.shape, device="meta"))
    torch.utils.swap_tensors(last, real)  # `real` now holds the CPU data
    with pytest.raises(NotImplementedError, match="meta"):
        ckpt.step(state, 2)  # sync: raised by the copy itself
        ckpt.wait()  # overlap: the background copy failed; reported here
    torn = next(s for s in ckpt.engine.slots if s.step is None)
    assert torch.equal(torn.views["model/model/0.weight"], step2["0.weight"]), "not torn midway"
    with pytest.raises(ChecksumError, match="incomplete shard"):
        verify_slot(torn.path)
    assert ckpt.engine.steps() == [1]

    step, fresh = _restore_fresh(ckpt)
    assert step == 1
    _assert_model_is(fresh, step1)
    other = memckpt.Checkpointer(cfg)  # what a new process finds in RAM
    assert other.engine.steps() == [1]
    step, fresh = _restore_fresh(other)
    assert step == 1
    _assert_model_is(fresh, step1)
    other.engine.close()

    # fixed model: the engine goes on, reusing the torn slot
    torch.utils.swap_tensors(last, real)
    assert last.device.type == "cpu" and model[2].weight is last
    assert ckpt.step(state, 3)
    ckpt.wait()
    assert ckpt.engine.steps() == [3, 1]
    assert ckpt.stats.allocations == 2
    step, fresh = _restore_fresh(ckpt)
    assert step == 3
    _assert_model_is(fresh, step2)
    ckpt.close(unlink=True)


def test_a_new_process_overwrites_a_torn_slot_in_place(ram_root):
    """A process killed mid-copy leaves a torn slot: the next process's first snapshot
    overwrites that file in place (its pages are in RAM) instead of allocating a new one."""
    from memckpt.format import shard as fmt
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    cfg = memckpt.Config(ram_root=ram_root)
    ckpt = memckpt.Checkpointer(cfg)
    for s in (1, 2):
        _train(model, opt, s)
        assert ckpt.step(state, s)
    ckpt.wait()
    torn = next(sl for sl in ckpt.engine.slots if sl.step == 2)
    fmt.mark_writing(torn.region.array)  # what a SIGKILL mid-copy leaves
    inode = torn.path.stat().st_ino
    ckpt.engine.close()
    again = memckpt.Checkpointer(cfg)  # the next process
    assert again.engine.steps() == [1]
    _train(model, opt, 3)
    assert again.step(state, 3)
    again.wait()
    assert again.engine.steps() == [3, 1] and torn.path.stat().st_ino == inode
    _assert_restores_then_close(again, 3, _values(model))


def test_failure_before_the_copy_does_not_cost_the_newest_snapshot(ram_root):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    for s in (1, 2):
        _train(model, opt, s)
        ckpt.step(state, s)
    ckpt.wait()
    step2 = _values(model)
    model.register_buffer("bad", torch.zeros(3, dtype=torch.uint16))  # no shard dtype for it
    with pytest.raises(StateError, match="uint16"):
        ckpt.step(state, 3)
    assert ckpt.engine.steps() == [2, 1]
    del model.bad
    _train(model, opt, 4)
    assert ckpt.step(state, 4)
    ckpt.wait()
    # step 4 must have replaced the older step 1, never the newest complete step 2
    assert ckpt.engine.steps() == [4, 2]
    with ckpt.engine.reading(2) as shard:
        assert torch.equal(shard.tensors["model/model/0.weight"], step2["0.weight"])
    ckpt.close(unlink=True)


def test_double_buffering_keeps_the_two_newest_steps(ram_root):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    values, paths = {}, {}
    for s in range(1, 6):
        _train(model, opt, s)
        assert ckpt.step(state, s)
        ckpt.wait()
        values[s] = _values(model)
        assert ckpt.engine.steps() == ([s, s - 1] if s > 1 else [1])
        paths[s] = next(sl.path for sl in ckpt.engine.slots if sl.step == s)
    assert ckpt.engine.steps() == [5, 4]
    assert paths[1] == paths[3] == paths[5] != paths[2] == paths[4]
    for s in (5, 4):
        with ckpt.engine.reading(s) as shard:
            assert shard.step == s
            assert torch.equal(shard.tensors["model/model/1.weight"], values[s]["1.weight"])
    with ckpt.engine.reading() as shard:
        assert shard.step == 5
    assert ckpt.stats.allocations == 2 and ckpt.stats.snapshots == 5
    ckpt.close(unlink=True)


def test_in_flight_snapshot_never_touches_the_newest_complete_one(ram_root):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, snapshot_mode="overlap"))
    for s in (1, 2):
        _train(model, opt, s)
        ckpt.step(state, s)
    ckpt.wait()
    step2 = _values(model)
    _train(model, opt, 3)
    engine = ckpt.engine
    # Hold the engine's single background worker, so the step-3 snapshot stays in
    # flight (slot invalidated, small tensors copied, parameters not yet) for as long
    # as this test looks at it.
    gate, busy = threading.Event(), threading.Event()
    blocker = engine._pool.submit(lambda: (busy.set(), gate.wait(30)))
    assert busy.wait(10)
    try:
        assert ckpt.step(state, 3)
        writing = next(s for s in engine.slots if s.step is None)
        with pytest.raises(ChecksumError, match="incomplete shard"):
            verify_slot(writing.path)
        assert engine.steps() == [2]
        with engine.reading(2) as shard:  # verify=True: its checksum still holds
            assert shard.step == 2
            assert torch.equal(shard.tensors["model/model/2.weight"], step2["2.weight"])
        with engine.reading() as shard:
            assert shard.step == 2
        assert writing.path != next(s.path for s in engine.slots if s.step == 2)
    finally:
        gate.set()
        blocker.result(timeout=30)
    ckpt.wait()
    assert engine.steps() == [3, 2]
    with engine.reading(3) as shard:
        assert torch.equal(shard.tensors["model/model/2.weight"], model[2].weight)
    ckpt.close(unlink=True)


def _anon_rss() -> int:
    """This process's anonymous resident memory (its heap): not the slots' shared-memory
    pages (mapped twice where the two slots share them) nor shared libraries' (whose
    proportional share moves as other processes come and go)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return psutil.Process().memory_info().rss  # not Linux


def test_no_allocation_and_bounded_rss_over_many_snapshots(ram_root):
    torch.manual_seed(0)
    model = nn.Linear(3600, 3600)  # ~52 MB of float32
    state = memckpt.TrainState(model=model, rng=False)
    nbytes = state.capture(0).nbytes
    assert 45e6 < nbytes < 60e6
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    for s in (1, 2):  # warm-up: one allocation per slot
        with torch.no_grad():  # changed, as every later step: no chunk shared between slots
            model.weight[s, :8] += 1.0
        ckpt.step(state, s)
    ckpt.wait()
    assert ckpt.stats.allocations == 2
    gc.collect()
    rss0 = _anon_rss()
    with torch.no_grad():
        for s in range(3, 53):
            model.weight[s % 3600, :8] += 1.0  # the state changes every step
            model.bias[s] = float(s)
            assert ckpt.step(state, s)
    ckpt.wait()
    gc.collect()
    growth = _anon_rss() - rss0
    assert ckpt.stats.allocations == 2
    assert ckpt.stats.snapshots == 52
    assert growth < 0.1 * nbytes, f"anonymous RSS grew {growth / 1e6:.1f} MB over 50 snapshots"
    with ckpt.engine.reading() as shard:
        assert shard.step == 52
        assert torch.equal(shard.tensors["model/model/weight"], model.weight)
        assert torch.equal(shard.tensors["model/model/bias"], model.bias)
    ckpt.close(unlink=True)


def test_changed_layout_reallocates_and_still_round_trips(ram_root):
    model = _model()
    state = memckpt.TrainState(model=model)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    ckpt.step(state, 1)
    ckpt.step(state, 2)
    model.register_buffer("extra", torch.arange(10))
    ckpt.step(state, 3)
    ckpt.wait()
    assert ckpt.stats.allocations == 3
    with ckpt.engine.reading(3) as shard:
        assert torch.equal(shard.tensors["model/model/extra"], torch.arange(10))
    with ckpt.engine.reading(2) as shard:
        assert "model/model/extra" not in shard.tensors
    ckpt.close(unlink=True)


def _two_snapshots(ram_root, policy):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    ckpt = memckpt.Checkpointer(memckpt.Config(
        ram_root=ram_root, failure=memckpt.FailureConfig(on_fall_behind=policy)))
    for s in (1, 2):
        _train(model, opt, s)
        assert ckpt.step(state, s)
        ckpt.wait()  # sealed: the next snapshot does not have to wait for it
    return model, opt, state, ckpt


def test_a_discarded_step_is_never_read_again_and_its_slot_is_taken_next(ram_root):
    """What a restore does with its own snapshot that failed the checksum: discard it."""
    from memckpt.runtime.wire.ram_files import scan
    model, opt, state, ckpt = _two_snapshots(ram_root, "wait")
    newest = next(sl for sl in ckpt.engine.slots if sl.step == 2)
    ckpt.engine.discard_step(2)
    assert ckpt.engine.steps() == [1]
    with pytest.raises(NoSnapshotError):
        with ckpt.engine.reading(2):
            pass
    # flagged in the file too: a store scanning the node lists only step 1
    assert {s for steps in scan(ckpt.directory.parent).values() for s in steps} == {1}
    _train(model, opt, 3)
    assert ckpt.step(state, 3)
    ckpt.wait()
    assert newest.step == 3  # the discarded slot is overwritten, step 1 is kept
    assert ckpt.engine.steps() == [3, 1]
    ckpt.close(unlink=True)


def test_fall_behind_skip_while_a_reader_pins_the_other_slot(ram_root):
    model, opt, state, ckpt = _two_snapshots(ram_root, "skip")
    _train(model, opt, 3)
    with ckpt.engine.reading(1) as pinned:  # the slot step 3 would overwrite
        assert ckpt.step(state, 3) is False
        assert ckpt.stats.skipped == 1
        assert ckpt.step(state, 3) is False
        assert ckpt.stats.skipped == 2
        assert pinned.step == 1 and ckpt.engine.steps() == [2, 1]
    assert ckpt.step(state, 3) is True
    ckpt.wait()
    assert ckpt.engine.steps() == [3, 2] and ckpt.stats.skipped == 2
    # pinning the newest does not block: the snapshot goes to the other slot
    step3 = _values(model)
    _train(model, opt, 4)
    with ckpt.engine.reading(3) as pinned:
        assert ckpt.step(state, 4) is True
        ckpt.wait()
        assert torch.equal(pinned.tensors["model/model/0.weight"], step3["0.weight"])
    assert ckpt.engine.steps() == [4, 3] and ckpt.stats.skipped == 2
    ckpt.close(unlink=True)


def test_fall_behind_wait_blocks_until_the_reader_releases(ram_root):
    model, opt, state, ckpt = _two_snapshots(ram_root, "wait")
    _train(model, opt, 3)
    pinned, release = threading.Event(), threading.Event()

    def reader():
        with ckpt.engine.reading(1):
            pinned.set()
            release.wait(30)

    result, returned = {}, threading.Event()

    def snapshot():
        result["took"] = ckpt.step(state, 3)
        result["at"] = time.monotonic()
        returned.set()

    r = threading.Thread(target=reader)
    r.start()
    assert pinned.wait(10)
    t = threading.Thread(target=snapshot)
    t.start()
    try:
        assert not returned.wait(0.3), "snapshot() overwrote a slot a reader was holding"
        assert ckpt.engine.steps() == [2, 1]
    finally:
        released_at = time.monotonic()
        release.set()
        r.join(10)
    assert returned.wait(10)
    t.join(10)
    assert result["took"] is True and result["at"] >= released_at
    ckpt.wait()
    assert ckpt.engine.steps() == [3, 2]
    assert ckpt.stats.skipped == 0 and ckpt.stats.waited_s > 0
    ckpt.close(unlink=True)


def test_abort_wakes_a_snapshot_waiting_for_a_commit(ram_root):
    """Gated (multi-node) engine: step 3 waits for step 2's commit. When recovery ends the
    generation, abort() must fail that wait at once (the commit will never come), leave
    both held snapshots intact, and fail every later snapshot too."""
    from memckpt.errors import GenerationEnded
    from memckpt.engine.snapshot import SnapshotEngine
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    engine = SnapshotEngine(ram_root, gated=True)
    for s in (1, 2):
        _train(model, opt, s)
        assert engine.snapshot(state.capture(s), s)
        engine.wait()
        if s == 1:
            engine.set_committed(1)
    outcome, done = {}, threading.Event()

    def third():
        try:
            engine.snapshot(state.capture(3), 3)
            outcome["error"] = None
        except GenerationEnded as e:
            outcome["error"] = e
        done.set()

    t = threading.Thread(target=third)
    t.start()
    assert not done.wait(0.3), "step 3 overwrote committed step 1 before step 2 committed"
    engine.abort(GenerationEnded("generation 0 was ended by recovery"))
    assert done.wait(5) and isinstance(outcome["error"], GenerationEnded)
    t.join(5)
    assert engine.steps() == [2, 1]
    with pytest.raises(GenerationEnded):
        engine.snapshot(state.capture(3), 3)
    engine.close(unlink=True)


def test_adopted_replica_files_become_the_slots_without_a_copy(ram_root, tmp_path):
    """A rank that moves to the node holding its replicas takes the holder's files as its
    own slots (renamed in): they read back bit-identical, the files leave the replica
    folder, and the next snapshot rewrites the older one in place (nothing allocated)."""
    import shutil

    import numpy as np

    from memckpt.engine.snapshot import SnapshotEngine
    model, opt, state, ckpt = _two_snapshots(ram_root, "wait")
    held = {}
    replicas = tmp_path / "replicas" / "rank0"
    replicas.mkdir(parents=True)
    for slot in ckpt.engine.slots:  # what a holder's store keeps for this rank
        with ckpt.engine.reading(slot.step) as shard:
            held[slot.step] = shard.raw.copy()
        shutil.copyfile(slot.path, replicas / slot.path.name)
    moved = SnapshotEngine(tmp_path / "own" / "rank0", gated=True)
    files = sorted(replicas.iterdir())
    assert moved.adopt(files) == [2, 1]
    assert not any(f.exists() for f in files)
    for step, raw in held.items():
        with moved.reading(step, verify=True) as shard:
            assert np.array_equal(shard.raw, raw)
    moved.set_committed(2)
    _train(model, opt, 3)
    assert moved.snapshot(state.capture(3), 3)
    moved.wait()
    assert moved.steps() == [3, 2] and moved.stats.allocations == 0
    with moved.reading(3, verify=True) as shard:
        for name, t in state.capture(3).tensors:
            assert torch.equal(shard.tensors[name], t), name
    moved.close()
    ckpt.close(unlink=True)


def test_adopting_replaces_what_the_slots_held(ram_root, tmp_path):
    """The rank's own folder on that node may hold stale slots from an earlier stay: the
    adopted files replace them, so only the adopted steps remain."""
    import shutil

    from memckpt.engine.snapshot import SnapshotEngine
    _, _, _, ckpt = _two_snapshots(ram_root, "wait")
    newest = next(sl for sl in ckpt.engine.slots if sl.step == 2)
    replica = tmp_path / "replica.shard"
    shutil.copyfile(newest.path, replica)
    stale = SnapshotEngine(tmp_path / "own", gated=True)  # two stale slots of steps 1, 2
    for slot in ckpt.engine.slots:
        shutil.copyfile(slot.path, stale.directory / slot.path.name)
    stale.close()
    engine = SnapshotEngine(tmp_path / "own", gated=True)
    assert engine.steps() == [2, 1]
    assert engine.adopt([replica]) == [2]
    assert sorted(p.name for p in engine.directory.iterdir()) == ["slot0.shard"]
    engine.close()
    ckpt.close(unlink=True)


def _gated_seal(ram_root, on_sealing):
    """A Checkpointer whose seal of step 1 holds (on_complete blocks on an event) until the
    test releases it: the second snapshot is due while the first is still being sealed."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = memckpt.TrainState(model=model, optimizer=opt)
    release, sealing = threading.Event(), threading.Event()

    def hold(step, path):
        sealing.set()
        release.wait(timeout=60)
    ckpt = memckpt.Checkpointer(memckpt.Config(
        ram_root=ram_root, engine=memckpt.config.EngineConfig(on_sealing=on_sealing)),
        on_sealed=hold)
    _train(model, opt, 1)
    assert ckpt.step(state, 1)
    assert sealing.wait(timeout=60)
    return model, opt, state, ckpt, release


def test_on_sealing_skip_never_waits_and_counts_what_landed(ram_root, caplog):
    model, opt, state, ckpt, release = _gated_seal(ram_root, "skip")
    _train(model, opt, 2)
    with caplog.at_level("INFO", logger="memckpt"):
        assert ckpt.step(state, 2) is False  # the seal of step 1 still runs: skipped
    assert "snapshot of step 2 skipped" in caplog.text and "engine.on_sealing='wait'" in caplog.text
    release.set()
    ckpt.wait()
    _train(model, opt, 3)
    assert ckpt.step(state, 3)
    ckpt.wait()
    st = ckpt.stats
    assert (st.landed, st.skipped, st.requested) == (2, 1, 3)
    assert ckpt.engine.steps() == [3, 1]
    ckpt.close(unlink=True)


def test_on_sealing_wait_takes_every_snapshot_once_the_seal_lands(ram_root):
    model, opt, state, ckpt, release = _gated_seal(ram_root, "wait")
    _train(model, opt, 2)
    took = []
    t = threading.Thread(target=lambda: took.append(ckpt.step(state, 2)))
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive() and not took  # waits for the seal of step 1
    release.set()
    t.join(timeout=60)
    ckpt.wait()
    assert took == [True] and ckpt.stats.skipped == 0 and ckpt.stats.landed == 2
    assert ckpt.engine.steps() == [2, 1]
    ckpt.close(unlink=True)


def test_restore_prepares_both_slots_so_the_first_snapshot_allocates_nothing(ram_root):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    _train(model, opt, 1)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    assert ckpt.restore(state) == 0
    ckpt.engine.wait_prepared()
    assert ckpt.stats.allocations == 2 and all(s.region is not None for s in ckpt.engine.slots)
    for s in (1, 2, 3):
        _train(model, opt, s)
        ckpt.step(state, s)
        ckpt.wait()
    assert ckpt.stats.allocations == 2  # the steps mapped nothing
    _assert_restores_then_close(ckpt, 3, _values(model))


def test_a_corrupt_chunk_leaves_the_live_model_untouched(ram_root):
    """The only snapshot has a flipped byte in its first tensor: restore refuses it before
    a single parameter of the live model is overwritten."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = memckpt.TrainState(model=model, optimizer=opt)
    _train(model, opt, 1)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    ckpt.step(state, 1)
    ckpt.wait()
    slot = next(s for s in ckpt.engine.slots if s.complete)
    first = slot.layout.entries[0]
    ckpt.close()
    with open(slot.path, "r+b") as f:
        at = fmt.data_offset(slot.header_capacity) + first.offset + 1
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    again = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    fresh = _model()
    for p in fresh.parameters():
        p.data.fill_(7.0)
    with pytest.raises(ChecksumError, match="mismatch in chunk 0"):
        again.restore(memckpt.TrainState(model=fresh, optimizer=torch.optim.SGD(
            fresh.parameters(), lr=0.1, momentum=0.9)))
    assert all(bool((p == 7.0).all()) for p in fresh.parameters())
    again.close(unlink=True)
