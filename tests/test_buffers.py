"""RAM regions (shared-memory files): contents and page population."""

from __future__ import annotations

import gc
import threading
import time

import psutil
import pytest

from memckpt.engine.buffers import MADV_POPULATE_READ, RamRegion, libc_madvise
from memckpt.errors import MemckptError

MB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_created_region_is_zeroed_and_shared_with_a_reopen(tmp_path):
    path = tmp_path / "slot.shard"
    region = RamRegion.create(path, 3 * MB + 5)
    assert path.stat().st_size == 3 * MB + 5 and not region.array.any()
    region.array[-5:] = [1, 2, 3, 4, 5]
    for populate in (True, False):
        other = RamRegion.open(path, populate=populate)
        assert other.size == 3 * MB + 5
        assert list(other.array[-5:]) == [1, 2, 3, 4, 5]
        other.array[0] = 9  # MAP_SHARED: the writer sees it
        assert region.array[0] == 9
        other.close()


def test_populated_open_maps_every_page_and_a_header_read_does_not(tmp_path):
    path = tmp_path / "replica.shard"
    size = 64 * MB
    RamRegion.create(path, size).close()
    gc.collect()
    before = _rss()
    lazy = RamRegion.open(path, populate=False)
    lazy_delta = _rss() - before
    lazy.close()
    del lazy
    gc.collect()
    before = _rss()
    eager = RamRegion.open(path)
    eager_delta = _rss() - before
    assert lazy_delta < size // 8, lazy_delta
    assert eager_delta > size * 0.9, eager_delta
    eager.close()


def test_open_refuses_an_empty_file(tmp_path):
    path = tmp_path / "empty.shard"
    path.write_bytes(b"")
    with pytest.raises(MemckptError, match="holds 0 bytes"):
        RamRegion.open(path)



def test_reuse_or_create_maps_a_same_size_file_in_place(tmp_path):
    path = tmp_path / "slot.shard"
    first = RamRegion.create(path, 2 * MB)
    first.array[:4] = [1, 2, 3, 4]
    inode = path.stat().st_ino
    same = RamRegion.reuse_or_create(path, 2 * MB)  # its pages are already in RAM: kept
    assert path.stat().st_ino == inode and list(same.array[:4]) == [1, 2, 3, 4]
    other = RamRegion.reuse_or_create(path, 3 * MB)  # another size: a new, zeroed file
    assert path.stat().st_ino != inode and other.size == 3 * MB and not other.array.any()
    fresh = RamRegion.reuse_or_create(tmp_path / "new.shard", MB)
    assert fresh.size == MB and not fresh.array.any()
    for r in (first, same, other, fresh):
        r.close()


@pytest.mark.skipif(libc_madvise(MADV_POPULATE_READ) is None,
                    reason="the kernel cannot populate with madvise (Linux < 5.14)")
def test_populating_a_region_lets_the_other_threads_run(tmp_path):
    """A region created (or mapped) on a background thread, as the engine maps a restore's
    second slot and a store a replica file, is populated with the GIL released: the other
    threads (the restore's load, the store's other connections) go on meanwhile. With
    MAP_POPULATE they stopped for the whole population (0.6 s per GiB of fresh memory)."""
    done = threading.Event()
    took: list[float] = []

    def create() -> None:
        t0 = time.perf_counter()
        RamRegion.create(tmp_path / "slot.shard", 512 * MB).close()
        took.append(time.perf_counter() - t0)
        done.set()

    # What this thread spent blocked (neither running nor waiting for a CPU) while the
    # region was populated: waiting for the GIL. Not its longest gap in wall time: on a
    # loaded 2-core machine the scheduler alone can hold a runnable thread off the CPU
    # for a good part of the population, GIL or not.
    worker = threading.Thread(target=create)
    before, t0 = _thread_times(), time.perf_counter()
    worker.start()
    while not done.is_set():  # this thread needs the GIL for every iteration
        pass
    after, wall = _thread_times(), time.perf_counter() - t0
    worker.join()
    blocked = wall - (after[0] - before[0]) - (after[1] - before[1])
    # MAP_POPULATE (the bug) holds the GIL for the whole population: blocked ~ took[0]
    assert blocked < 0.5 * took[0], (blocked, took[0], wall)


def _thread_times() -> tuple[float, float]:
    """This thread's seconds on a CPU and seconds runnable but waiting for one (Linux's
    schedstat; the CPU time alone, and no wait, where there is none)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0
