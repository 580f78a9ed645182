"""Host memory a restore fills, faulted in before it is needed.

``populate`` faults in a tensor's memory in one system call; ``TensorPool`` (the process's
``POOL``) makes the tensors a restore will create ahead of time; ``HostReserve`` is memory
an idle spare keeps faulted in and hands back when it takes over a rank; ``SlotReserve`` is
a shared-memory file it keeps populated to become the snapshot slot its restore fetches into.

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
import os
import threading
from pathlib import Path
from typing import Iterable, Optional

import psutil
import torch

from memckpt.engine.buffers import (MADV_POPULATE_READ, MADV_POPULATE_WRITE, PAGE, libc_madvise,
                             map_memory, page_resident, populate_mapping)
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


class SlotReserve:
    """A shared-memory file an idle warm spare keeps populated in its node's RAM folder: the
    snapshot slot its restore fetches a peer's replica into, should it take over a rank whose
    shards this node does not hold.

    Such a rank needs a new slot before the fetch can land a byte, and on a VM that hands
    freed memory back to its host that slot is fresh memory: 0.9-1.2 s per GiB here, a
    quarter of a lost node's recovery. The spare populates the file while it idles; at
    takeover the snapshot engine renames it in as that slot
    (:meth:`memckpt.engine.snapshot.SnapshotEngine.offer_files`). A restore that needs no new slot
    (the rank's shards are on this node) unlinks it first, and its pages serve that
    restore's allocations as a :class:`HostReserve`'s do.

    A spare keeps one per snapshot slot (``spare-<pid>-<index>.mem``, outside the folders
    stores scan): the second slot is mapped while the restore loads, and on a node whose
    cores are busy populating it there slowed that load as much as the first slot's did.
    The files of a spare that died are taken over by the next spare on the node, pages and
    all, so they never hold RAM for nobody. ``hold`` populates chunk by chunk, so a ``release``
    (the spare is needed now) never waits for more than one chunk. Thread-safe: the two run
    on different actor threads.
    """

    CHUNK = 64 << 20
    PREFIX, SUFFIX = "spare-", ".mem"

    def __init__(self, folder: Path, index: int = 0) -> None:
        self.folder = Path(folder)
        self.index = index
        self.path = self.folder / f"{self.PREFIX}{os.getpid()}-{index}{self.SUFFIX}"
        self._lock = threading.Lock()
        self._released = False
        self._populated = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the file populated so far."""
        return self._populated

    def hold(self, nbytes: int) -> int:
        """Size the file to ``nbytes`` (no more than the tmpfs has room for) and fault its
        pages in; returns the bytes populated. A no-op after ``release`` (and 0 when one
        interrupts it: the file is the taker's now)."""
        with self._lock:
            if self._released:
                return 0
            self.folder.mkdir(parents=True, exist_ok=True)
            self._take_stale()
            st = os.statvfs(self.folder)
            have = self.path.stat().st_size if self.path.exists() else 0
            room = (st.f_bavail * st.f_frsize + have) // PAGE * PAGE
            nbytes = min(-(-nbytes // PAGE) * PAGE, room)  # whole pages, covering nbytes
            if nbytes <= 0:
                self._discard()
                return 0
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                mm = map_memory(fd, nbytes, populate=False)
            finally:
                os.close(fd)
            self._populated = 0  # pages already resident (a dead spare's) pass in no time
        try:
            while True:
                with self._lock:
                    if self._released:
                        return 0
                    if self._populated >= nbytes:
                        return self._populated
                    n = min(self.CHUNK, nbytes - self._populated)
                    if libc_madvise(MADV_POPULATE_READ) is None:  # not Linux >= 5.14
                        for off in range(self._populated, self._populated + n, PAGE):
                            mm[off] = 0
                    elif not populate_mapping(mm, MADV_POPULATE_READ, self._populated, n):
                        self._discard()  # no room after all: hold nothing rather than a hole
                        return 0
                    self._populated += n
        finally:
            mm.close()  # the pages stay in the file

    def release(self) -> Optional[Path]:
        """Stop holding (a hold in progress ends after its chunk; later holds do nothing);
        returns the file, if any, for the caller to take over or unlink."""
        self._released = True  # first: a hold re-takes the lock between chunks at once
        with self._lock:
            if self._populated and self.path.exists():
                return self.path
            self._discard()
            return None

    def _discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self._populated = 0

    def _take_stale(self) -> None:
        """Rename a file of ours (same index) that a spare on this node left when it died into
        ours (its pages are still resident); unlink any more of them."""
        for f in self.folder.glob(f"{self.PREFIX}*-{self.index}{self.SUFFIX}"):
            try:
                pid = int(f.name[len(self.PREFIX):].split("-")[0])
            except ValueError:
                continue
            if pid == os.getpid() or psutil.pid_exists(pid):
                continue
            try:
                if self.path.exists():
                    f.unlink()
                else:
                    f.replace(self.path)
            except FileNotFoundError:
                pass  # another spare took it
