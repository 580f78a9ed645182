"""Host memory a restore fills, faulted in before it is needed.

``populate`` faults in a tensor's memory in one system call; ``TensorPool`` (the process's
``POOL``) makes the tensors a restore will create ahead of time; ``HostReserve`` is memory
an idle spare keeps faulted in and hands back when it takes over a rank.

A restore writes the whole state into memory the process has never touched: a new
process's parameters, or the optimizer state it creates. Faulting that in 4 KiB at a
time costs a kernel entry per page; ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14)
allocates the same pages in one pass. Measured here for 1 GiB: 0.41-2.6 s of faults
against 0.25 s populated, before the 0.16 s copy. Populating never changes what the
memory holds (a page already there is left alone, a new one reads as zero as it would
have), so it is safe on any writable mapping; where it is unsupported it does nothing.
"""

from __future__ import annotations

import functools
import math
import mmap
import threading
from typing import Iterable, Optional

import torch

from memckpt.engine.buffers import (MADV_POPULATE_WRITE, PAGE, libc_madvise,
                             map_memory, page_resident)
from memckpt.format.state import LoadMemory

MIN_BYTES = 1 << 20  # below this a system call costs more than the faults it saves


def populate(tensors: Iterable[torch.Tensor], unless_resident: bool = False) -> int:
    """Fault in the whole pages inside each large CPU tensor's memory; returns the bytes
    populated (0 where the kernel cannot: older than 5.14, or not Linux).
    ``unless_resident``: leave a tensor whose first page is in memory (a model's
    initialised parameters: walking pages already there costs 0.3 s per GiB here)."""
    madvise = libc_madvise(MADV_POPULATE_WRITE)
    if madvise is None:
        return 0
    done = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < MIN_BYTES or not t.is_contiguous():
            continue
        # only pages wholly inside the tensor: its neighbours' edge pages fault as usual
        start = (t.data_ptr() + PAGE - 1) & ~(PAGE - 1)
        end = (t.data_ptr() + nbytes) & ~(PAGE - 1)
        if end <= start or (unless_resident and page_resident(start)):
            continue
        if madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
            done += end - start
        # else a read-only or special mapping: the copy takes its faults as it would have
    return done


def populated_clone(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()`` into memory faulted in before the copy: a tensor of the same shape and
    dtype from the process's :data:`POOL` (faulted in ahead of time), else new memory
    populated now."""
    out = POOL.take(tuple(t.shape), t.dtype) if t.device.type == "cpu" and t.is_contiguous() \
        else None
    if out is None:
        out = torch.empty_like(t)
        populate((out,))
    return out.copy_(t)


class TensorPool:
    """CPU tensors faulted in ahead of a restore, handed out by shape and dtype.

    A restore creates the optimizer state (two thirds of an Adam job's bytes) as new
    tensors, and faulting their pages in (0.27 s per GiB here, zeroing included) sat on
    the recovery's critical path. A worker fills the pool before it is needed: a survivor
    as recovery ends its generation (while the runtime stops and plans), a spare while it
    idles. :func:`populated_clone` takes from it; what a restore did not take is dropped
    with :meth:`clear`. A take waits for a fill in progress rather than fault in the same
    bytes twice.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._filler: Optional[threading.Thread] = None
        self._cancel = False

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def fill(self, specs: Iterable[tuple[tuple[int, ...], torch.dtype]], threads: int = 1) -> None:
        """Replace the pool's contents with one populated tensor per (shape, dtype) in
        ``specs``, made in the background on ``threads`` threads (the kernel zeroes pages
        on each thread's core: two threads fault 1 GiB in about half the time here)."""
        self.clear()
        self._cancel = False
        specs = list(specs)
        threads = max(1, threads)

        def run(mine: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
            for shape, dtype in mine:
                if self._cancel:
                    return
                t = torch.empty(shape, dtype=dtype)
                populate((t,))
                with self._lock:
                    self._free.setdefault((tuple(shape), dtype), []).append(t)

        specs.sort(key=lambda spec: -math.prod(spec[0]) * spec[1].itemsize)  # balance the threads

        def fill_all() -> None:
            parts = [specs[i::threads] for i in range(1, threads)]
            helpers = [threading.Thread(target=run, args=(part,), name="memckpt-pool", daemon=True)
                       for part in parts if part]
            for h in helpers:
                h.start()
            run(specs[::threads])
            for h in helpers:
                h.join()

        self._filler = threading.Thread(target=fill_all, name="memckpt-pool", daemon=True)
        self._filler.start()

    @property
    def in_use(self) -> bool:
        """Something filled the pool, or is filling it (a worker, for its restore)."""
        filler = self._filler
        return self.nbytes > 0 or (filler is not None and filler.is_alive())

    def wait(self) -> None:
        """Until a fill in progress is done (or stopped)."""
        filler = self._filler
        if filler is not None:
            filler.join()

    def stop(self) -> None:
        """End a fill in progress early; what it made stays."""
        self._cancel = True
        self.wait()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
        self.wait()
        with self._lock:
            free = self._free.get((shape, dtype))
            return free.pop() if free else None

    def clear(self) -> None:
        """Stop a fill in progress and drop every tensor not taken."""
        self.stop()
        with self._lock:
            self._free.clear()


POOL = TensorPool()  # the process's pool: filled by memckpt.runtime.worker.worker, drawn from by restores
# How restores load (TrainState.load's ``memory``): into memory faulted in before the copy.
FAULTED_IN = LoadMemory(before_copy=functools.partial(populate, unless_resident=True),
                        clone=populated_clone)


def spare_budget(want: int, shard_bytes: int, available: int, total: int) -> int:
    """How much of ``want`` a warm spare may hold: all of it, unless that would leave the
    node less than a recovery may still need there (slots and state for a rank moving in:
    three shards of ``shard_bytes``) plus a tenth of its RAM. A spare's memory only speeds
    up a restore; it must never be the reason a snapshot finds no room."""
    return max(0, min(want, available - 3 * shard_bytes - total // 10))


class HostReserve:
    """Host memory an idle warm spare keeps faulted in, handed back when it takes over a rank.

    A spare that takes over restores a whole shard into memory its process has never
    touched. On a VM that returns freed guest memory to its host (free page reporting, a
    balloon), touching such memory costs a host fault per page: 2.8 s per GiB measured
    here, against 0.3 s for memory freed a moment ago. So the spare faults in a shard's
    worth while it idles and unmaps it just before the restore: the kernel hands those
    still-resident pages straight back to the allocations that follow.

    ``hold`` populates chunk by chunk so a ``release`` (the spare is needed now) never waits
    for more than one chunk. Thread-safe: the two run on different actor threads.
    """

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self._chunks: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._released = False

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self._chunks)

    def hold(self, nbytes: int) -> int:
        """Fault in (at least) ``nbytes`` of private memory; returns the bytes held. A no-op
        after ``release`` (and 0 when one interrupts it): a spare that became a rank keeps
        no reserve."""
        while True:
            with self._lock:
                if self._released:
                    return 0
                if self.nbytes >= nbytes:
                    return self.nbytes
                chunk = map_memory(-1, min(self.CHUNK, nbytes - self.nbytes))
                if not getattr(mmap, "MAP_POPULATE", 0):  # not Linux: touch every page
                    for off in range(0, len(chunk), PAGE):
                        chunk[off] = 0
                self._chunks.append(chunk)

    def release(self) -> int:
        """Unmap what is held (and refuse further holds); returns the bytes freed."""
        self._released = True  # first: a hold re-takes the lock between chunks at once
        with self._lock:
            freed = self.nbytes
            for chunk in self._chunks:
                chunk.close()
            self._chunks.clear()
            return freed
