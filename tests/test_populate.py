"""Populating a restore's destination memory: pages come in at once, contents never change."""

from __future__ import annotations

import mmap
import resource
import sys

import numpy as np
import pytest
import torch

from memckpt.engine import populate as pop
from memckpt.engine.buffers import MADV_POPULATE_WRITE, libc_madvise
from memckpt.format.state import TrainState

MB = 1 << 20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@linux
def test_populated_memory_takes_no_faults_on_the_copy():
    src = torch.arange(16 * MB // 4, dtype=torch.float32)
    fresh = torch.empty_like(src)  # malloc'd, never touched: the copy would fault each page
    populated = pop.populate([fresh])
    assert populated >= 16 * MB - 2 * pop.PAGE
    before = _faults()
    fresh.copy_(src)
    assert _faults() - before < 16  # 4096 pages, populated: at most the two edge pages
    assert torch.equal(fresh, src)


@linux
def test_populate_never_changes_contents():
    t = torch.randn(4 * MB // 4)
    offset = t[3:]  # starts mid-page: only whole pages inside it are touched
    want = t.clone()
    assert pop.populate([t, offset]) > 0
    assert torch.equal(t, want)


def test_small_strided_and_foreign_memory_are_left_alone():
    small = torch.zeros(100)
    strided = torch.zeros(2048, 2048)[:, ::2]
    assert pop.populate([small, strided]) == 0


@linux
def test_a_mapping_that_cannot_be_populated_is_skipped():
    mm = mmap.mmap(-1, 8 * MB, prot=mmap.PROT_READ)  # read-only: no write population
    with pytest.warns(UserWarning, match="not writable"):
        ro = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    assert pop.populate([ro]) == 0
    assert libc_madvise(MADV_POPULATE_WRITE) is not None  # a refused range turns nothing off
    assert int(ro[-1]) == 0


@linux
def test_populated_clone_is_a_clone():
    t = torch.randn(512, 1024)
    c = pop.populated_clone(t)
    assert torch.equal(c, t) and c.data_ptr() != t.data_ptr() and c.stride() == t.stride()
    c.zero_()
    assert t.abs().sum() > 0


def test_restore_into_an_untouched_model_is_exact():
    """The load path populates the model's parameters and the optimizer state it creates."""
    torch.manual_seed(0)
    src = torch.nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(src.parameters())
    src(torch.randn(4, 1024)).sum().backward()
    opt.step()
    state = TrainState(model=src, optimizer=opt)
    cap = state.capture(7)
    dst = torch.nn.utils.skip_init(torch.nn.Linear, 1024, 1024)  # never touched
    dopt = torch.optim.AdamW(dst.parameters())
    assert TrainState(model=dst, optimizer=dopt).load(dict(cap.tensors), cap.meta,
                                                      memory=pop.FAULTED_IN) == 7
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    for p, q in zip(src.parameters(), dst.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], dopt.state[q][k])


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def test_a_host_reserve_holds_resident_memory_until_released():
    reserve = pop.HostReserve()
    before = _rss()
    assert reserve.hold(96 * MB) == 96 * MB  # two chunks of 64 MiB and 32 MiB
    assert _rss() - before >= 90 * MB  # faulted in, not just mapped
    assert reserve.hold(64 * MB) == 96 * MB  # already holds enough: nothing more
    assert reserve.release() == 96 * MB
    assert _rss() - before < 16 * MB
    assert reserve.hold(64 * MB) == 0  # a spare that took over a rank keeps no reserve


def _hold_cut_short(reserve, nbytes: int):
    """Start ``reserve.hold(nbytes)`` on a thread and release the reserve as soon as the
    first chunk is in; returns (what the hold returned, what the release returned). The
    hold re-takes its lock between chunks at once: the release must still get in."""
    import threading
    held: list[int] = []
    t = threading.Thread(target=lambda: held.append(reserve.hold(nbytes)))
    t.start()
    while reserve.nbytes == 0 and t.is_alive():  # the hold has begun (a chunk is in)
        pass
    released = reserve.release()
    t.join(timeout=60)
    assert not t.is_alive()
    return held[0], released


def test_releasing_a_host_reserve_interrupts_a_hold_in_progress():
    reserve = pop.HostReserve()
    reserve.CHUNK = 4 * MB
    held, freed = _hold_cut_short(reserve, 4096 * MB)
    assert 0 < freed < 4096 * MB and held == 0 and reserve.nbytes == 0


def test_a_pool_hands_out_faulted_in_tensors_by_shape_and_dtype():
    pool = pop.TensorPool()
    pool.fill([((1024, 1024), torch.float32), ((1024, 1024), torch.float32), ((8,), torch.int64)])
    pool.wait()
    assert pool.nbytes == 2 * 4 * MB + 64
    a = pool.take((1024, 1024), torch.float32)
    assert a is not None and a.shape == (1024, 1024) and a.dtype == torch.float32
    before = _faults()
    a.fill_(1.0)
    if sys.platform.startswith("linux"):
        assert _faults() - before < 16  # populated when the pool made it
    assert pool.take((1024, 1024), torch.float64) is None  # another dtype: not this one
    assert pool.take((1024, 1024), torch.float32) is not None
    assert pool.take((1024, 1024), torch.float32) is None  # one per spec
    pool.clear()
    assert pool.nbytes == 0 and pool.take((8,), torch.int64) is None


def test_populated_clone_draws_from_the_process_pool_and_copies_exactly():
    src = torch.randn(512, 1024)
    pop.POOL.fill([((512, 1024), torch.float32)])
    try:
        pop.POOL.wait()
        ready = pop.POOL._free[((512, 1024), torch.float32)][0]
        out = pop.populated_clone(src)
        assert out.data_ptr() == ready.data_ptr()  # the pool's tensor, not new memory
        assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
        again = pop.populated_clone(src)  # the pool is empty now: new memory, same result
        assert torch.equal(again, src) and again.data_ptr() != out.data_ptr()
        strided = src.t()  # not contiguous: never from the pool (clone keeps its strides)
        assert pop.populated_clone(strided).stride() == strided.clone().stride()
    finally:
        pop.POOL.clear()


def test_a_fill_on_several_threads_makes_every_tensor_once():
    pool = pop.TensorPool()
    specs = [((1024, 256 * k), torch.float32) for k in (1, 2, 3, 4, 5)] + [((7,), torch.int64)]
    pool.fill(specs, threads=3)
    pool.wait()
    assert pool.nbytes == sum(4 * 1024 * 256 * k for k in (1, 2, 3, 4, 5)) + 56
    for shape, dtype in specs:
        assert pool.take(shape, dtype) is not None and pool.take(shape, dtype) is None
    pool.clear()


@linux
def test_populate_unless_resident_leaves_touched_memory_alone():
    fresh_map, touched_map = mmap.mmap(-1, 4 * MB), mmap.mmap(-1, 4 * MB)  # never touched
    fresh = torch.frombuffer(fresh_map, dtype=torch.float32)
    touched = torch.frombuffer(touched_map, dtype=torch.float32).fill_(1.0)  # every page in
    assert pop.populate([touched], unless_resident=True) == 0
    assert pop.populate([fresh], unless_resident=True) == 4 * MB
    assert pop.populate([touched]) == 4 * MB  # without the check: walked again
    del fresh, touched


def test_a_checkpointer_finding_a_snapshot_prefills_what_its_restore_creates(ram_root):
    """A process restarted after a crash: its Checkpointer sees the snapshot in RAM and
    faults in the optimizer state in the background; the restore takes exactly that memory,
    and whatever it did not take is dropped."""
    import memckpt

    def job() -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 512)
        opt = torch.optim.Adam(model.parameters())
        return model, opt, TrainState(model=model, optimizer=opt)
    config = memckpt.Config(job_name="prefill", ram_root=ram_root)
    model, opt, state = job()
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    first = memckpt.Checkpointer(config)
    assert pop.POOL.nbytes == 0  # nothing in RAM yet: nothing to prefill
    first.step(state, 1)
    first.close()  # kept in RAM, as after a crash
    try:
        unused = memckpt.Checkpointer(config)  # made and closed without restoring
        unused.close()
        assert pop.POOL.nbytes == 0  # its prefill dropped
        restarted = memckpt.Checkpointer(config)
        pop.POOL.wait()
        ready = {t.data_ptr() for ts in pop.POOL._free.values() for t in ts}
        assert pop.POOL.nbytes == 2 * 1024 * 512 * 4  # Adam's two moments of the weight
        model2, opt2, state2 = job()
        assert restarted.restore(state2) == 1
        moments = opt2.state[model2.weight]
        assert {moments["exp_avg"].data_ptr(), moments["exp_avg_sq"].data_ptr()} == ready
        assert torch.equal(moments["exp_avg"], opt.state[model.weight]["exp_avg"])
        assert pop.POOL.nbytes == 0
        restarted.close(unlink=True)
    finally:
        pop.POOL.clear()


def test_stopping_a_fill_keeps_what_it_made():
    pool = pop.TensorPool()
    pool.fill([((256, 1024), torch.float32)] * 64)
    pool.stop()
    made = pool.nbytes
    assert made % MB == 0 and made <= 64 * MB
    pool.wait()
    assert pool.nbytes == made  # nothing more after the stop
    pool.clear()


def test_a_spare_holds_a_shard_only_where_a_recovery_keeps_its_room():
    GiB = 1 << 30
    # plenty: all it wants (a shard of state and a slot file)
    assert pop.spare_budget(2 * GiB, 1 * GiB, available=20 * GiB, total=24 * GiB) == 2 * GiB
    # a node must keep 3 shards + a tenth of its RAM available for a rank moving in
    assert pop.spare_budget(2 * GiB, 1 * GiB, available=6 * GiB, total=10 * GiB) == 2 * GiB
    assert pop.spare_budget(2 * GiB, 1 * GiB, available=5 * GiB, total=10 * GiB) == 1 * GiB
    assert pop.spare_budget(2 * GiB, 1 * GiB, available=4 * GiB + GiB // 2, total=10 * GiB) \
        == GiB // 2
    assert pop.spare_budget(2 * GiB, 1 * GiB, available=3 * GiB, total=10 * GiB) == 0
