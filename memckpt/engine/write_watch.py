"""Which pages of the frozen tensors were written since the last look: userfaultfd's
asynchronous write-protect and the ``PAGEMAP_SCAN`` ioctl (Linux 6.7 and newer).

Under ``skip_unchanged="verify"`` a frozen tensor's bytes were compared with the slot's at
every snapshot (a write through ``p.data`` moves no version counter): a read of the whole
frozen base, twice, on the training thread. The kernel can say instead which pages were
written. A watched tensor's whole pages are write-protected asynchronously: a write is
never stopped, the kernel lifts the protection of the page it lands on, and one scan per
snapshot reports the pages so lifted and protects them again, atomically. Only those pages,
and the partial pages at a tensor's two ends (shared with what the allocator put beside
it: :meth:`WriteWatch.edges`), are then compared.

A scan walks page table entries: one per 4 KiB page, one per 2 MiB transparent huge page.
Before a tensor is watched, its whole 2 MiB extents are collapsed into huge pages
(``MADV_COLLAPSE``, Linux 6.1; on a background thread, once: until then it is compared whole),
which makes a scan of a frozen base about 500 times cheaper; a write splits only the huge page
it lands on.

Every write through this process's page tables shows: ``p.data.copy_``, an in-place op, a
kernel's ``read()`` into the tensor, another thread's. What writes without them does not: a
device's DMA into pinned memory, another process through shared memory. Pinned and shared
tensors are therefore never watched (:func:`watchable`), and file-backed pages (a model
loaded with ``mmap=True``, whose untouched pages follow the file) always count as written.

Where the kernel or a sandbox refuses any of it (an older kernel, a seccomp profile without
``userfaultfd``), :meth:`WriteWatch.open` returns None and every compare stays whole.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import ctypes
import logging
import os
import platform
import weakref
from dataclasses import dataclass
from typing import Any, Collection, Iterable, KeysView, Optional, Sequence

import torch

from memckpt.engine.buffers import page_resident
from memckpt.engine.slot import Slot

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
WATCH_MIN = 64 << 10  # smaller tensors are compared whole: as cheap as a scan of their pages

_SYSCALL = {"x86_64": 323, "aarch64": 282}  # __NR_userfaultfd
_USER_MODE_ONLY = 1  # allowed where vm.unprivileged_userfaultfd is 0
_FEATURES = (1 << 15) | (1 << 13)  # UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED
_MODE_WP = 1 << 1  # UFFDIO_REGISTER_MODE_WP
_WRITTEN, _FILE = 1 << 1, 1 << 2  # PAGE_IS_WRITTEN, PAGE_IS_FILE
_WP_MATCHING, _CHECK_WPASYNC = 1, 2
_VEC = 256  # page regions one scan call returns
HUGE = 2 << 20  # a transparent huge page (x86-64, and arm64 with 4 KiB pages)
_MADV_COLLAPSE = 25


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _ioc(3, 0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0xAA, 0x00, 32)
_UFFDIO_WRITEPROTECT = _ioc(3, 0xAA, 0x06, 24)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


def watchable(t: torch.Tensor) -> bool:
    """Whether writes to ``t`` all go through this process's page tables, and it is big
    enough to be worth a page range: a contiguous CPU tensor, neither pinned nor shared."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.is_pinned()
            and not t.is_shared() and t.numel() * t.element_size() >= WATCH_MIN)


@dataclass
class _Watched:
    start: int  # the tensor's bytes
    end: int
    first: int  # its pages scanned: [first, last)
    last: int
    storage: Any  # held: the pages stay this tensor's while watched


class WriteWatch:
    """Write-protected page ranges of named tensors and the writes seen since the last
    :meth:`scan`. Used by one thread (a snapshot engine's training thread)."""

    def __init__(self, libc: Any, uffd: int, pagemap: int) -> None:
        self._libc, self._uffd, self._pagemap = libc, uffd, pagemap
        self._watched: dict[str, _Watched] = {}
        self._armed: list[tuple[int, int]] = []  # sorted, disjoint page ranges protected
        self._scanned: Optional[list[tuple[int, int]]] = None  # watched tensors. whole pages
        self._order: Optional[list[tuple[int, int, str]]] = None  # by first page scanned
        self._reach = 0  # the most pages one tensor's scan spans, in bytes
        self._vec = (_Region * _VEC)()
        # name -> (address, collapse of its whole huge extents into huge pages), before it is
        # watched; the tensor's storage is held meanwhile
        self._collapsing: dict[str, tuple[int, cf.Future, Any]] = {}
        self._collapser: Optional[cf.ThreadPoolExecutor] = None
        self._refused: dict[str, int] = {}  # name -> the address it cannot be watched at
        self._closed = weakref.finalize(self, _close_fds, uffd, pagemap)

    @classmethod
    def open(cls) -> Optional["WriteWatch"]:
        """A watch, or None where this kernel or sandbox does not offer one."""
        nr = _SYSCALL.get(platform.machine())
        if nr is None or not os.path.exists("/proc/self/pagemap"):
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        uffd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if uffd < 0:
            log.debug("no userfaultfd (errno %d): frozen tensors are compared whole",
                      ctypes.get_errno())
            return None
        api = (ctypes.c_uint64 * 3)(0xAA, _FEATURES, 0)
        if libc.ioctl(uffd, _UFFDIO_API, ctypes.addressof(api)) != 0:
            os.close(uffd)
            log.debug("userfaultfd without asynchronous write-protect: compared whole")
            return None
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(uffd)
            return None
        watch = cls(libc, uffd, pagemap)
        if not watch._scans():
            watch.close()
            return None
        return watch

    def _scans(self) -> bool:
        """Whether PAGEMAP_SCAN answers (Linux 6.7): on an empty range it reports nothing."""
        return self._scan_range(0, 0) == []

    # -- what is watched ----------------------------------------------------------------
    def watching(self, name: str, t: torch.Tensor) -> bool:
        """Whether ``name`` is watched at ``t``'s bytes."""
        w = self._watched.get(name)
        return w is not None and w.start == t.data_ptr() and w.storage is t.untyped_storage()

    def watch(self, name: str, t: torch.Tensor) -> bool:
        """Watch ``t``'s whole pages as ``name`` from now on (call :meth:`scan` first: a
        page protected anew no longer shows the writes it had). False where it cannot be,
        or not yet (its pages' collapse into huge pages under way): then ``name`` is not
        watched."""
        self._watched.pop(name, None)
        self._scanned = self._order = None
        if not watchable(t):
            self._collapsing.pop(name, None)
            return False
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if last <= first or self._refused.get(name) == start:
            return False
        pending = self._collapsing.get(name)
        if pending is None or pending[0] != start:
            if self._collapser is None:
                self._collapser = cf.ThreadPoolExecutor(1, thread_name_prefix="memckpt-watch")
            future = self._collapser.submit(self._collapse, first, last)
            self._collapsing[name] = pending = (start, future, t.untyped_storage())
        if not pending[1].done():
            return False
        del self._collapsing[name]
        lo, hi = pending[1].result()
        if self._scan_range(first, last, protect=False, category=_FILE, check=False):
            self._refused[name] = start  # follows a file: every page would count as written
            return False
        if not self._arm(lo, hi):
            if (lo, hi) == (first, last) or not self._arm(first, last):
                self._refused[name] = start
                return False
            lo, hi = first, last
        # the partial pages at its ends are scanned too where they were protected with it
        # (a write beside it there then shows, and is compared, instead of every time)
        first, last = max(lo, start // PAGE * PAGE), min(hi, -(-end // PAGE) * PAGE)
        self._watched[name] = _Watched(start, end, first, last, t.untyped_storage())
        return True

    def _collapse(self, first: int, last: int) -> tuple[int, int]:
        """Collapse the 2 MiB extents over [first, last) whose pages are all in memory into
        huge pages (best effort: the kernel may refuse any). The range to protect: out to
        the ends of the huge extents at the two ends, where they were collapsed (protecting
        part of a huge page would split it back into small ones; what else lies there is
        never reported, its writes only take one fault each)."""
        lo, hi = first // HUGE * HUGE, -(-last // HUGE) * HUGE
        # only extents wholly in memory: a collapse would fill the pages that are not
        done = [page_resident(x, HUGE) and self._libc.madvise(x, HUGE, _MADV_COLLAPSE) == 0
                for x in range(lo, hi, HUGE)]
        return (lo if done[0] else first), (hi if done[-1] else last)

    def wait_ready(self) -> None:
        """Wait for the collapses under way (a benchmark's warm-up, tests): the next
        :func:`look` watches their tensors."""
        for _, future, _ in list(self._collapsing.values()):
            future.result()

    def drop(self, name: str) -> None:
        """Stop watching ``name`` (its pages stay protected: harmless, writes go through)."""
        self._watched.pop(name, None)
        self._collapsing.pop(name, None)
        self._scanned = self._order = None

    @property
    def names(self) -> KeysView[str]:
        return self._watched.keys()

    def edges(self, name: str) -> list[tuple[int, int]]:
        """The byte ranges of ``name`` (from its first byte) outside the pages scanned for
        it (on partial pages that could not be protected with it): always compared."""
        w = self._watched[name]
        return [r for r in ((0, w.first - w.start), (w.last - w.start, w.end - w.start))
                if r[1] > r[0]]

    def _arm(self, first: int, last: int) -> bool:
        """Register and protect the pages of [first, last) not protected yet (protecting a
        page again would hide a write not yet scanned)."""
        at = first
        for lo, hi in self._armed:
            if hi <= at or lo >= last:
                continue
            if lo > at and not self._protect(at, lo):
                return False
            at = max(at, hi)
        if at < last and not self._protect(at, last):
            return False
        self._armed = _merged([*self._armed, (first, last)])
        return True

    def _protect(self, first: int, last: int) -> bool:
        register = (ctypes.c_uint64 * 4)(first, last - first, _MODE_WP, 0)
        protect = (ctypes.c_uint64 * 3)(first, last - first, 1)
        ok = (self._libc.ioctl(self._uffd, _UFFDIO_REGISTER, ctypes.addressof(register)) == 0
              and self._libc.ioctl(self._uffd, _UFFDIO_WRITEPROTECT,
                                   ctypes.addressof(protect)) == 0)
        if not ok:
            log.debug("cannot write-protect %#x-%#x (errno %d): compared whole", first, last,
                      ctypes.get_errno())
        return ok

    # -- what was written ---------------------------------------------------------------
    def scan(self) -> dict[str, list[tuple[int, int]]]:
        """For each watched name written, the byte ranges (from its first byte) of its pages
        written since the last scan (or since it was watched); those pages are protected
        again. Two passes: one that only reads, over every protected range (a few calls
        however many tensors), then one that reads and protects again, over the written
        pages wholly of watched tensors alone (none, mostly; a write after a page's pass
        stays unprotected and shows at the next scan). A partial page at a tensor's end is
        not protected again once written: an allocator writes there beside it all the time,
        and the tensor's bytes there are then compared at every snapshot. A range the
        kernel no longer scans (memory mapped anew in it): :meth:`_scan_or_rearm`."""
        if self._scanned is None:
            self._scanned = _merged((-(-w.start // PAGE) * PAGE, w.end // PAGE * PAGE)
                                    for w in self._watched.values())
        inner = self._scanned
        written: list[tuple[int, int]] = []
        for lo, hi in list(self._armed):
            seen = self._scan_or_rearm(lo, hi, protect=False)
            written.extend(seen)
            for a, b in _within(seen, inner):  # whole pages of tensors: protected again
                written.extend(self._scan_or_rearm(a, b, protect=True))
        if self._order is None:
            self._order = sorted((w.first, w.last, name) for name, w in self._watched.items())
            self._reach = max((last - first for first, last, _ in self._order), default=0)
        out: dict[str, list[tuple[int, int]]] = {}
        for lo, hi in _merged(written):
            # the watched tensors whose scanned pages this range touches (by first page)
            i = bisect.bisect_left(self._order, (lo - self._reach,))
            for first, last, name in self._order[i:]:
                if first >= hi:
                    break
                if last > lo:
                    w = self._watched[name]
                    a, b = max(lo, w.start), min(hi, w.end)
                    if b > a:
                        out.setdefault(name, []).append((a - w.start, b - w.start))
        return out

    def _scan_or_rearm(self, lo: int, hi: int, protect: bool) -> list[tuple[int, int]]:
        """:meth:`_scan_range`. Where the kernel refuses (memory mapped anew there since it
        was protected: the end of a huge extent beside a tensor, say), the range is given
        up and each watched tensor in it scanned alone; one the kernel refuses too counts
        as written whole and is protected anew, or no longer watched where it cannot be."""
        found = self._scan_range(lo, hi, protect)
        if found is not None:
            return found
        self._armed = _without(self._armed, lo, hi)
        self._scanned = self._order = None
        found = []
        for name, w in list(self._watched.items()):
            a, b = max(lo, w.first), min(hi, w.last)
            if b <= a:
                continue
            alone = self._scan_range(w.first, w.last, protect)
            if alone is not None:  # all it says: pages of this tensor protected again
                found.extend(alone)
                self._armed = _merged([*self._armed, (w.first, w.last)])
                continue
            found.append((w.first, w.last))
            if not self._arm(w.first, w.last):
                self.drop(name)
        return _merged(found)

    def _scan_range(self, lo: int, hi: int, protect: bool = True,
                    category: int = _WRITTEN | _FILE, check: bool = True
                    ) -> Optional[list[tuple[int, int]]]:
        """The written (or file-backed: ``category``) pages of [lo, hi), protected again
        where ``protect``; None when the kernel refuses (with ``check``: a page there not
        under asynchronous write-protect)."""
        found: list[tuple[int, int]] = []
        at = lo
        flags = (_CHECK_WPASYNC if check else 0) | (_WP_MATCHING if protect else 0)
        while True:
            arg = (ctypes.c_uint64 * 12)(96, flags, at, hi, 0, ctypes.addressof(self._vec),
                                         _VEC, 0, 0, 0, category, category)
            n = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.addressof(arg))
            if n < 0:
                return None
            found.extend((self._vec[i].start, self._vec[i].end) for i in range(n))
            at = int(arg[4])  # walk_end
            if n < _VEC or at >= hi:
                return found

    def close(self) -> None:
        """Close the userfaultfd: the kernel drops every registration and protection."""
        if self._collapser is not None:
            self._collapser.shutdown(wait=True)
        self._collapsing.clear()
        self._watched.clear()
        self._armed, self._scanned, self._order = [], None, None
        self._closed()


# -- a snapshot engine's use: each slot's suspect ranges (memckpt.engine.slot.Slot.suspect) ---
def look(watch: WriteWatch, slots: Sequence[Slot], tensors: Sequence[tuple[str, torch.Tensor]],
         frozen: Collection[str]) -> None:
    """At a snapshot's start: the writes seen since the last one join every slot's suspect
    ranges; the frozen tensors not yet watched (or watched at other bytes) are watched from
    now on, before this snapshot compares or copies them; a slot knows nothing of a name
    no longer watched."""
    written = watch.scan()
    fresh = set()
    for name, t in tensors:
        if name in frozen and not watch.watching(name, t):
            fresh.add(name)
            watch.watch(name, t)
    frozen_now = {n for n, _ in tensors if n in frozen}
    for name in watch.names - frozen_now:
        watch.drop(name)
    for slot in slots:
        for name in list(slot.suspect):
            if name in fresh or name not in watch.names:
                del slot.suspect[name]
            elif written.get(name):
                slot.suspect[name] = _merged([*slot.suspect[name], *written[name]])


def suspects(watch: Optional[WriteWatch], slot: Slot) -> Optional[dict[str, list[tuple[int, int]]]]:
    """What of ``slot``'s watched tensors a compare must read: the written ranges and the
    two ends (for :func:`memckpt.engine.unchanged.held_unchanged`)."""
    if watch is None:
        return None
    return {n: _merged([*ranges, *watch.edges(n)]) for n, ranges in slot.suspect.items()
            if n in watch.names}


def settled(watch: Optional[WriteWatch], slot: Slot, names: Iterable[str]) -> None:
    """``slot``'s copies of ``names`` are now known to be their bytes (copied, or compared
    equal, after this snapshot's :func:`look`): only later writes are suspect."""
    if watch is None:
        return
    for name in names:
        if name in watch.names:
            slot.suspect[name] = []
        else:
            slot.suspect.pop(name, None)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _without(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``ranges`` less [lo, hi)."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        out.extend(r for r in ((a, min(b, lo)), (max(a, hi), b)) if r[1] > r[0])
    return out


def _within(ranges: list[tuple[int, int]], bounds: list[tuple[int, int]]
            ) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint ``ranges`` inside sorted, disjoint ``bounds``."""
    out, j = [], 0
    for lo, hi in ranges:
        while j < len(bounds) and bounds[j][1] <= lo:
            j += 1
        k = j
        while k < len(bounds) and bounds[k][0] < hi:
            a, b = max(lo, bounds[k][0]), min(hi, bounds[k][1])
            if b > a:
                out.append((a, b))
            k += 1
    return out


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
