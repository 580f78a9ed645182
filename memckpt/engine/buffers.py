"""Host-RAM regions backed by files in a tmpfs (``/dev/shm`` by default).

A snapshot slot lives in a shared-memory file rather than the worker's private
heap, so it outlives the process that wrote it: when a worker is killed, the
node's replica store (or the next process) still has the bytes, with no extra
copy on the training step. On CUDA the mapping is registered as pinned memory
so device-to-host copies run at full speed and asynchronously on a side stream.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Container, Optional

import numpy as np
import psutil

from memckpt.format.shard import SLOT_NAMES
from memckpt.errors import ConfigError, MemckptError
from memckpt.util.fsutil import fs_type

PINNABLE_FS = ("tmpfs", "ramfs", "hugetlbfs")  # file systems whose pages CUDA can register

if TYPE_CHECKING:
    import torch


def default_ram_root() -> Path:
    """``/dev/shm/memckpt`` where a tmpfs exists there, else the temp directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "memckpt"


def resolve_ram_root(ram_root: Optional[str]) -> Path:
    root = Path(ram_root) if ram_root else default_ram_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"ram_root={str(root)!r} is invalid: cannot create it ({e.strerror}); "
                          "point ram_root at a writable tmpfs such as /dev/shm") from None
    return root


def allocated_bytes(folder: Path) -> int:
    """The bytes the files under ``folder`` hold in RAM (a tmpfs's allocated blocks, not
    their sizes: a file is sized before its pages are touched)."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # removed while we walked
    return total


class PeakFootprint:
    """Samples :func:`allocated_bytes` under ``folder`` on a thread every ``every_s`` and
    keeps the peak, with where it was: the bytes per top-level part of the path below
    ``folder`` (``<job>/<node>/own``, ``.../replicas``, a spare's file). What a benchmark or
    drill reports as memckpt's host-RAM footprint (a peak between two samples is missed:
    sample faster than slots are made). :attr:`state_bytes` is what it is measured against:
    one copy of each rank's state, the shard of the largest own slot (``rank<r>/slot*.shard``
    not under ``replicas``) seen for each rank: its tensor bytes and its header, from that
    header (a slot's room for a larger header and its alignment gaps are memckpt's: held,
    not state). Files under a first-level folder named in ``gone``
    (a job's folder holds one per node: nodes a drill removed, whose RAM went with them, but
    whose files a one-machine cluster's shared tmpfs keeps) count from then on no more."""

    def __init__(self, folder: Path, every_s: float = 0.05, depth: int = 3,
                 gone: Container[str] = ()) -> None:
        self.folder, self.every_s, self.depth = Path(folder), every_s, depth
        self.gone = gone
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._shards: dict[str, int] = {}  # rank<r> -> the shard bytes of its largest own slot
        self._read: dict[tuple[str, int, int], int] = {}  # (file, inode, size) -> shard bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memckpt-footprint")

    def __enter__(self) -> "PeakFootprint":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # and once more at the end

    def _sample(self) -> None:
        parts: dict[str, int] = {}
        for dirpath, _, names in os.walk(self.folder):
            rel = Path(dirpath).relative_to(self.folder).parts
            if rel and rel[0] in self.gone:
                continue
            key = "/".join(rel[:self.depth]) or "."
            rank = Path(dirpath).name
            own = rank.startswith("rank") and "replicas" not in rel
            for name in names:
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                parts[key] = parts.get(key, 0) + st.st_blocks * 512
                if own and name in SLOT_NAMES:
                    nbytes = self._tensor_bytes(os.path.join(dirpath, name), st)
                    self._shards[rank] = max(self._shards.get(rank, 0), nbytes)
        total = sum(parts.values())
        if total > self.peak:
            self.peak, self.at_peak = total, parts

    def _tensor_bytes(self, path: str, st: os.stat_result) -> int:
        """The tensor bytes a slot file's header lays out, and the header's (read once per
        file and size; 0 while it holds no complete header)."""
        key = (path, st.st_ino, st.st_size)
        if key not in self._read:
            from memckpt.format.shard import PREFIX, header_end, read_header
            try:
                with open(path, "rb") as f:  # the prefix and header, never the data
                    head = f.read(PREFIX.size)
                    head += f.read(header_end(head, path) - len(head))
                _, layout, _ = read_header(np.frombuffer(head, np.uint8), path,
                                           check_length=False, require_complete=False)
                self._read[key] = len(head) + sum(e.nbytes for e in layout.entries)
            except (OSError, MemckptError):
                return 0  # being written: read once it is whole
        return self._read[key]

    @property
    def state_bytes(self) -> int:
        return sum(self._shards.values())

    @property
    def ratio(self) -> float:
        """The peak over the state (0.0 before any slot was seen)."""
        return self.peak / self.state_bytes if self.state_bytes else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()


def free_bytes(folder: Path) -> int:
    """What the file system under ``folder`` has free for an unprivileged writer."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


class RamRegion:
    """A file of ``size`` bytes mapped shared into this process, as numpy and torch views."""

    def __init__(self, path: Path, size: int, create: bool, pin: bool = False,
                 populate: bool = True) -> None:
        self.path = path
        self.size = size
        self._registered = False
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".alloc")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, max(size, 1))
                # Populated: the kernel allocates every page in one pass, so the first
                # snapshot does not pay a fault per 4 KiB (about as fast as zero-filling
                # from here, measured, and it leaves the pages to the first real write).
                self._mm = map_memory(fd, max(size, 1), populate)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                actual = os.fstat(fd).st_size
                if actual < size or actual == 0:
                    raise MemckptError(f"{path} holds {actual} bytes, expected {size}")
                # Populated: faulting 4 KiB pages on first touch made copying a 1 GiB
                # slot take 0.29 s, after one populate pass (0.03 s) it takes 0.09 s.
                self._mm = map_memory(fd, actual, populate)
                self.size = actual
            finally:
                os.close(fd)
        self.array = np.frombuffer(self._mm, dtype=np.uint8, count=self.size)
        self._tensor: Optional["torch.Tensor"] = None
        # CUDA registers only memory-backed mappings: a file on a disk (ram_root off a tmpfs)
        # fails, and the failure would stay CUDA's last error for torch's next call to find
        if pin and self.size and fs_type(path.parent) in PINNABLE_FS:
            import torch
            if torch.cuda.is_available():
                rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
                self._registered = int(rc) == 0

    @property
    def mm(self) -> mmap.mmap:
        return self._mm

    @property
    def tensor(self) -> "torch.Tensor":
        """The region as a uint8 tensor (torch is imported on first use: a replica store
        only moves bytes and never needs it)."""
        if self._tensor is None:
            import torch
            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    @staticmethod
    def create(path: Path, size: int, pin: bool = False, populate: bool = True) -> "RamRegion":
        # A tmpfs that runs out of room kills the writer with SIGBUS instead of raising:
        # check the room first and say what to change.
        path.parent.mkdir(parents=True, exist_ok=True)
        old = path.stat().st_size if path.exists() else 0
        room = free_bytes(path.parent) + old
        avail = psutil.virtual_memory().available + old
        if size > room or size > avail:
            raise MemckptError(
                f"cannot allocate {size / 2**30:.2f} GiB for a snapshot at {path}: "
                f"{room / 2**30:.2f} GiB free there, {avail / 2**30:.2f} GiB RAM available; free "
                "RAM, enlarge the tmpfs, point ram_root elsewhere, or snapshot less state")
        try:
            return RamRegion(path, size, create=True, pin=pin, populate=populate)
        except OSError as e:
            raise MemckptError(f"cannot allocate {size} bytes for a snapshot at {path} "
                               f"({e.strerror}): free RAM or point ram_root at a larger tmpfs") from None

    @staticmethod
    def reuse_or_create(path: Path, size: int, pin: bool = False,
                        populate: bool = True) -> "RamRegion":
        """``path`` mapped at ``size`` bytes for the caller to overwrite. A file of exactly
        that size is mapped as it is: its pages are already in RAM, where a new file takes
        fresh memory (0.3 s per GiB on bare metal, 1.5-2.8 s on a VM that hands freed pages
        back to its host, like this project's). Anything else is created anew, zeroed; a file
        of another size is unlinked first, so that its pages go back before the new ones are
        taken (the caller drops its own mappings of it first): replaced in place by a rename,
        the two would be held together for a moment, a third slot's worth at the peak.
        ``populate=False``: no page is faulted in (a slot that will share most of its
        partner's pages takes only those it writes)."""
        try:
            if path.stat().st_size == size:
                return RamRegion(path, size, create=False, pin=pin, populate=populate)
            path.unlink()
        except FileNotFoundError:
            pass
        return RamRegion.create(path, size, pin=pin, populate=populate)

    @staticmethod
    def open(path: Path, populate: bool = True, pin: bool = False) -> "RamRegion":
        """Map an existing file; ``populate=False`` for a reader that only needs its header;
        ``pin`` registers it with CUDA (a slot restored from: host-to-device at bus speed)."""
        return RamRegion(path, 0, create=False, pin=pin, populate=populate)

    def close(self, unlink: bool = False) -> None:
        if self._registered:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        # Views handed out keep the mapping alive; it is unmapped when the last one goes.
        self._tensor = None
        self.array = None  # type: ignore[assignment]
        if unlink:
            remove_path(self.path)


MADV_POPULATE_READ = 22  # fault a mapping's pages in (a shared file's: what MAP_POPULATE does)
MADV_POPULATE_WRITE = 23  # fault them in writable (private memory a copy will fill)
PAGE = 4096


@functools.cache
def libc_madvise(advice: int) -> Optional[Callable[[int, int, int], int]]:
    """libc's madvise if this kernel knows ``advice`` (the POPULATE ones: Linux >= 5.14),
    else None. Tried once per advice, on a page of our own: EINVAL means both "unknown
    advice" and "this range cannot be".

    Called through ctypes, which releases the GIL. ``mmap.mmap(..., MAP_POPULATE)`` and
    ``mmap.madvise`` hold it while the kernel populates (0.6-0.7 s per GiB of fresh memory
    here), and every other thread of the process stops meanwhile: a replica store's other
    connections, or a restore's load while the second slot is mapped behind it."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    page = mmap.mmap(-1, PAGE)
    view = ctypes.c_char.from_buffer(page)
    ok = fn(ctypes.addressof(view), PAGE, advice) == 0
    del view  # the mmap cannot close while a ctypes view exports it
    page.close()
    return fn if ok else None


@functools.cache
def _libc_memcmp() -> Callable[[int, int, int], int]:
    fn = ctypes.CDLL(None).memcmp
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def same_bytes(a: int, b: int, nbytes: int) -> bool:
    """Whether the ``nbytes`` at addresses ``a`` and ``b`` are equal: libc's memcmp, through
    ctypes (which releases the GIL). Reads both once and writes nothing: measured here at
    0.6x the time of copying the same bytes, and no hashing after it."""
    return nbytes == 0 or _libc_memcmp()(a, b, nbytes) == 0


@functools.cache
def _libc_mincore() -> Optional[Callable[[int, int, Any], int]]:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).mincore
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def page_resident(address: int, nbytes: int = PAGE) -> bool:
    """Whether the ``nbytes`` from the page-aligned ``address`` are mapped and all in memory
    (False where it cannot be told)."""
    fn = _libc_mincore()
    if fn is None:
        return False
    vec = (ctypes.c_ubyte * -(-nbytes // PAGE))()
    return fn(address, nbytes, vec) == 0 and all(b & 1 for b in vec)


def populate_mapping(mm: mmap.mmap, advice: int = MADV_POPULATE_READ, offset: int = 0,
                     length: Optional[int] = None) -> bool:
    """Fault in the pages of the writable mapping ``mm`` (``length`` bytes from the
    page-aligned ``offset``; all of it by default) without holding the GIL; False where the
    kernel cannot (the pages then fault in on first touch) or the memory is not there (a
    full tmpfs: the kernel refuses instead of raising SIGBUS)."""
    fn = libc_madvise(advice)
    length = len(mm) - offset if length is None else length
    if fn is None or length <= 0:
        return False
    view = ctypes.c_char.from_buffer(mm)
    try:
        return fn(ctypes.addressof(view) + offset, length, advice) == 0
    finally:
        del view


def map_memory(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    """``size`` bytes of the file ``fd`` mapped shared (``fd=-1``: private anonymous memory),
    with ``populate`` faulted in: with the GIL released where the kernel can
    (:func:`libc_madvise`), else with MAP_POPULATE (on a system with neither, not at all)."""
    anonymous = fd < 0
    # private memory needs WRITE (READ would map the shared zero page); a file needs READ
    advice = MADV_POPULATE_WRITE if anonymous else MADV_POPULATE_READ
    held = populate and libc_madvise(advice) is None
    flags = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if anonymous else mmap.MAP_SHARED
    mm = mmap.mmap(fd, size, flags=flags | (getattr(mmap, "MAP_POPULATE", 0) if held else 0))
    if populate and not held:
        populate_mapping(mm, advice)
    return mm


def remove_path(path: Path) -> None:
    """Remove a file or directory tree memckpt created; missing is fine."""
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
