"""The seal behind a copy still landing (memckpt.engine.landing): a chunk is hashed only
once its bytes are in place, so a seal started before the copy ends seals the final
bytes. On CPU the landing is driven by a writer thread; the CUDA path (events on the
side stream) is in tests/test_gpu.py."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
import pytest
import torch

from memckpt.engine.landing import Landing, all_landed
from memckpt.format import shard as fmt


def _layout(n_tensors: int, numel: int) -> tuple[fmt.Layout, int, list[tuple[str, torch.Tensor]]]:
    tensors = [(f"t{i}", torch.full((numel,), float(i + 1))) for i in range(n_tensors)]
    layout = fmt.Layout.of(tensors)
    return layout, fmt.header_capacity_for(layout), tensors


class _Gate:
    """Stands in for a device's events: range [start, end) lands when the writer says."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.landed_to = 0

    def advance(self, end: int) -> None:
        with self.cond:
            self.landed_to = end
            self.cond.notify_all()

    def ready(self, start: int, end: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.landed_to >= end, timeout=30), \
                f"bytes up to {end} never landed"


def test_a_seal_started_before_the_copy_seals_the_bytes_that_land_later():
    layout, cap, tensors = _layout(8, 300_000)  # ~9.6 MB: several chunks per tensor
    region = np.zeros(fmt.region_size(layout, cap), dtype=np.uint8)
    views = fmt.tensor_views(torch.from_numpy(region), layout, cap)
    gate = _Gate()
    with cf.ThreadPoolExecutor(4) as pool:
        sealing = pool.submit(fmt.seal, region, layout, cap, 3, {}, map, gate.ready)
        for entry, (name, t) in zip(layout.entries, tensors):
            views[name].copy_(t)  # the bytes land tensor by tensor, after the seal started
            gate.advance(entry.offset + entry.nbytes)
        gate.advance(layout.data_len)
        digest = sealing.result(timeout=60)
    shard = fmt.open_shard(region, "slot")  # verifies every chunk against the final bytes
    assert shard.header["data_xxh3"] == digest
    for name, t in tensors:
        assert torch.equal(shard.tensors[name], t)


def test_ready_is_asked_for_every_byte_exactly_once_in_chunk_batches():
    data = np.arange(5_000_000, dtype=np.uint8)
    asked: list[tuple[int, int]] = []
    lock = threading.Lock()

    def ready(start: int, end: int) -> None:
        with lock:
            asked.append((start, end))
    size = 64 << 10
    with cf.ThreadPoolExecutor(3) as pool:
        got = fmt.chunk_digests(data, size, pool.map, ready)
    assert got == fmt.chunk_digests(data, size)  # the same digests with or without gating
    asked.sort()
    assert asked[0][0] == 0 and asked[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(asked, asked[1:]))  # contiguous, no overlap
    assert all(start % size == 0 for start, _ in asked)


def test_a_landing_waits_only_for_what_overlaps_the_range():
    class Event:  # a CUDA event's interface: synchronize() blocks until the copy is done
        def __init__(self) -> None:
            self.done = threading.Event()
            self.waited = False

        def synchronize(self) -> None:
            self.waited = True
            assert self.done.wait(30)

        def query(self) -> bool:
            return self.done.is_set()
    first, second = Event(), Event()
    landing = Landing()
    assert not landing.landed()
    landing.queued([(0, 100, first), (128, 228, None), (256, 356, second)])
    first.done.set()
    landing.wait(0, 100)  # only the first tensor's bytes: does not wait on the second
    assert first.waited and not second.waited
    landing.wait(110, 200)  # host bytes: landed already
    assert not second.waited and not landing.landed()
    second.done.set()
    landing.wait()
    assert second.waited and landing.landed()


def test_a_copy_that_fails_still_releases_its_waiters():
    landing = Landing()
    waiter = threading.Thread(target=landing.wait)
    waiter.start()
    landing.queued([])  # what _copy does in its finally when a copy raised
    waiter.join(timeout=30)
    assert not waiter.is_alive() and landing.landed()


def test_all_landed_waits_on_each_copy():
    fg, bg = Landing.done(), Landing()
    ready = all_landed([fg, bg])
    done = threading.Event()
    threading.Thread(target=lambda: (ready(0, 10), done.set())).start()
    assert not done.wait(0.2)  # the background copy has not been issued yet
    bg.queued([])
    assert done.wait(30)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_the_engine_seals_what_it_copied(mode, tmp_path):
    from memckpt.engine.snapshot import SnapshotEngine
    from memckpt.format.state import Captured
    tensors = [(f"model/w{i}", torch.randn(200_000)) for i in range(6)]
    captured = Captured(tensors=tensors, meta={"m": 1},
                        stable=frozenset(n for n, _ in tensors) if mode == "overlap" else frozenset())
    engine = SnapshotEngine(tmp_path, mode=mode, seal_threads=3)
    try:
        assert engine.snapshot(captured, 1)
        engine.wait_copy()
        engine.wait()
        with engine.reading(1) as shard:  # verified
            for name, t in tensors:
                assert torch.equal(shard.tensors[name], t)
    finally:
        engine.close(unlink=True)
