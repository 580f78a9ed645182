"""Two slots that share the pages of what did not change.

A rank's two slot files (``slot0.shard``, ``slot1.shard``) each hold one step. Where a data
chunk of the slot being written is the same as the other slot's (a frozen base model, a
buffer nothing wrote), the two share one physical copy: the chunk's *home* is a page range
in one of the two files, and a slot whose chunk lives in its partner's file says so in a
sidecar, ``slot<i>.shard.homes`` (byte ranges, and the partner file's inode so a replaced
partner is noticed). Readers map the slot file and map the partner's pages over those
ranges (:func:`open_slot`), so every reader sees one contiguous shard, as before.

The rule that keeps a complete slot whole: a page a complete slot uses is never written.
A chunk the new snapshot writes goes to the home its partner does *not* use: its own file's
page, or, where the partner itself lives in this slot's file there, the partner file's page
(which the partner then does not use). A home neither slot uses is punched out of its file
(the RAM goes back). See :func:`plan` (pure) and :func:`apply` (acts on the files).
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from memckpt.engine.buffers import RamRegion, populate_mapping
from memckpt.errors import MemckptError
from memckpt.format import shard as fmt

SUFFIX = ".homes"
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


# -- pure: where each chunk lives ------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """For the slot being written: ``away[c]`` is True where its chunk ``c`` lives in the
    partner's file; ``punch_own`` / ``punch_partner`` the chunks whose page in this slot's
    file / the partner's file no slot uses any more."""

    away: tuple[bool, ...]
    punch_own: tuple[int, ...]
    punch_partner: tuple[int, ...]


def plan(n: int, partner_away: Optional[Sequence[bool]], share: Iterable[int]) -> Plan:
    """Where the ``n`` chunks of the slot being written live.

    ``partner_away``: the complete partner's homes (None: no complete partner laid out
    alike: every chunk is written into this slot's own file, nothing is punched).
    ``share``: chunks equal to the partner's, which take the partner's home. Every other
    chunk is written, into the home the partner does not use (where a chunk this slot
    holds as it is to be already lives, when its home is not the partner's)."""
    if partner_away is None:
        return Plan((False,) * n, (), ())
    if len(partner_away) != n:
        raise ValueError(f"partner has {len(partner_away)} chunks, this slot {n}")
    theirs = np.asarray(partner_away, dtype=bool)  # True: the partner lives in *our* file
    shared = np.zeros(n, dtype=bool)
    shared[np.fromiter(share, dtype=np.int64)] = True
    away = np.where(shared, ~theirs, theirs)  # shared: the partner's home, seen from here
    return Plan(tuple(away.tolist()), tuple(np.flatnonzero(away & ~theirs).tolist()),
                tuple(np.flatnonzero(~away & theirs).tolist()))


def runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Chunk indices as sorted [first, end) runs."""
    idx = np.unique(np.fromiter(indices, dtype=np.int64))
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts, ends = idx[np.r_[0, breaks]], idx[np.r_[breaks - 1, len(idx) - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist()))


@dataclass(frozen=True)
class Geometry:
    """Where a slot's data chunks sit in its file: what turns chunk runs into page ranges."""

    data_offset: int
    chunk_bytes: int
    data_len: int

    @property
    def chunks(self) -> int:
        return -(-self.data_len // self.chunk_bytes)

    def byte_ranges(self, indices: Iterable[int]) -> list[tuple[int, int]]:
        """(offset, length) in the file of each run of ``indices``; page-aligned starts."""
        out = []
        for a, b in runs(indices):
            start = self.data_offset + a * self.chunk_bytes
            end = self.data_offset + min(b * self.chunk_bytes, self.data_len)
            out.append((start, end - start))
        return out

    def indices(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        out: set[int] = set()
        for off, length in ranges:
            first = (off - self.data_offset) // self.chunk_bytes
            out.update(range(first, first + -(-length // self.chunk_bytes)))
        return out

    @staticmethod
    def of(layout: fmt.Layout, header_capacity: int) -> "Geometry":
        return Geometry(fmt.data_offset(header_capacity), fmt.chunk_bytes_for(layout.data_len),
                        layout.data_len)


# -- the files -------------------------------------------------------------------------------
def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def partner(path: Path) -> Path:
    """The other slot file of the pair ``path`` is one of."""
    names = fmt.SLOT_NAMES
    if path.name not in names:
        raise ValueError(f"{path} is not a slot file ({names})")
    return path.with_name(names[1 - names.index(path.name)])


def read_away(path: Path) -> list[tuple[int, int]]:
    """The byte ranges of slot ``path`` that live in its partner's file ([] for none).
    Raises :class:`MemckptError` when the sidecar is torn or its partner file was replaced
    since (those bytes are gone: the slot cannot be read)."""
    try:
        body = json.loads(sidecar(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise MemckptError(f"{sidecar(path)}: unreadable ({e})") from None
    try:
        ino = partner(path).stat().st_ino
    except FileNotFoundError:
        ino = -1
    if body.get("partner_ino") != ino:
        raise MemckptError(f"{path}: the partner file its shared pages live in was replaced")
    return [(int(a), int(n)) for a, n in body["ranges"]]


def write_away(path: Path, ranges: Sequence[tuple[int, int]]) -> None:
    """Record (atomically, before the slot is flagged complete) which byte ranges of
    ``path`` live in its partner's file; none removes the record."""
    side = sidecar(path)
    if not ranges:
        side.unlink(missing_ok=True)
        return
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps({"partner_ino": partner(path).stat().st_ino,
                               "ranges": [list(r) for r in ranges]}))
    os.replace(tmp, side)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.fallocate.restype = ctypes.c_int
    return libc


def supported() -> bool:
    """Whether pages can be mapped over a mapping and punched out of files here (Linux)."""
    try:
        _libc()
        return hasattr(mmap, "MAP_SHARED") and os.uname().sysname == "Linux"
    except (OSError, AttributeError):
        return False


def map_over(region: RamRegion, source: Path, ranges: Iterable[tuple[int, int]]) -> None:
    """Map ``source``'s pages over ``region``'s at the same offsets (the partner's, for
    shared chunks; the slot's own file, to take a chunk back). The pages are not faulted in."""
    ranges = list(ranges)
    if not ranges:
        return
    base = region.array.ctypes.data
    fd = os.open(source, os.O_RDWR)
    try:
        for off, length in ranges:
            got = _libc().mmap(base + off, length, mmap.PROT_READ | mmap.PROT_WRITE,
                               mmap.MAP_SHARED | 0x10, fd, off)  # 0x10: MAP_FIXED
            if got is None or got == ctypes.c_void_p(-1).value or got != base + off:
                raise MemckptError(f"cannot map {source} over {region.path} at {off} "
                                   f"({os.strerror(ctypes.get_errno())})")
    finally:
        os.close(fd)


def punch(path: Path, ranges: Iterable[tuple[int, int]]) -> None:
    """Give the pages of ``ranges`` in ``path`` back (its size stays; they read as zeros)."""
    ranges = list(ranges)
    if not ranges:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        for off, length in ranges:
            if _libc().fallocate(fd, _PUNCH, off, length) != 0:
                raise MemckptError(f"cannot free pages of {path} "
                                   f"({os.strerror(ctypes.get_errno())})")
    finally:
        os.close(fd)


def open_slot(path: Path, populate: bool = True, pin: bool = False) -> RamRegion:
    """Map slot file ``path`` as one shard: its partner's pages over the ranges that live
    there (``pin``, CUDA registration, only for a slot that shares none). Raises
    :class:`MemckptError` when those cannot be found (see :func:`read_away`)."""
    away = read_away(path) if path.name in fmt.SLOT_NAMES else []
    region = RamRegion.open(path, populate=False, pin=pin and not away)
    if away:
        map_over(region, partner(path), away)
    if populate:  # the data: a hole faulted in (the header's room) would take RAM
        populate_mapping(region.mm, offset=data_start(region))
    return region


def data_start(region: RamRegion) -> int:
    """Where a shard's data begins in ``region`` (0 where its prefix is not one)."""
    try:
        magic, _, _, cap = fmt.PREFIX.unpack_from(region.array, 0)[:4]
    except struct.error:
        return 0
    return fmt.PREFIX.size + cap if magic == fmt.MAGIC and cap > 0 else 0


def punch_zeros(region: RamRegion) -> None:
    """Give back the pages of a complete shard's mapping ``region`` that hold no byte of it
    (:func:`memckpt.format.shard.zero_runs`: the header's room past the header, alignment
    gaps), in whichever file each lives: they read as zeros, as they were."""
    for off, length in fmt.zero_runs(region.array, str(region.path)):
        region.mm.madvise(mmap.MADV_REMOVE, off, length)


def read_bytes(path: Path) -> np.ndarray:
    """A copy of the bytes of the shard file ``path`` as readers see them (a slot's shared
    pages included): ``np.fromfile`` reads a slot's own file alone."""
    if path.name in fmt.SLOT_NAMES and read_away(path):
        region = open_slot(path, populate=False)
        try:
            return np.array(region.array)
        finally:
            region.close()
    return np.fromfile(path, dtype=np.uint8)


@dataclass(frozen=True)
class Moves:
    """What making a slot's mapping follow a :class:`Plan` does to the files (byte ranges):
    the pages given back in its own file and its partner's, the chunks mapped to the
    partner's pages or back to its own, and the record of its pages away (None: as it is,
    unless it has none yet). Pure, so a slot laid out as it was last time reuses it."""

    punch_own: tuple[tuple[int, int], ...]
    map_away: tuple[tuple[int, int], ...]
    map_home: tuple[tuple[int, int], ...]
    punch_partner: tuple[tuple[int, int], ...]
    record: tuple[tuple[int, int], ...]
    moved: bool

    @staticmethod
    def of(geometry: Geometry, was: Sequence[bool], new: Plan) -> "Moves":
        """From homes ``was`` (until now) to ``new``."""
        now, before = np.asarray(new.away, dtype=bool), np.asarray(was, dtype=bool)
        moved_away = np.flatnonzero(now & ~before).tolist()
        moved_home = np.flatnonzero(before & ~now).tolist()
        ranges = geometry.byte_ranges
        return Moves(tuple(ranges(new.punch_own)), tuple(ranges(moved_away)),
                     tuple(ranges(moved_home)), tuple(ranges(new.punch_partner)),
                     tuple(ranges(np.flatnonzero(now).tolist())),
                     bool(moved_away or moved_home))


def apply(region: RamRegion, geometry: Geometry, was: Sequence[bool], new: Plan) -> None:
    """Make the mapping ``region`` of the slot being written (flagged incomplete) follow
    ``new``: remap the chunks whose home moved, record them, and punch the homes no slot
    uses. ``was``: its homes until now."""
    carry_out(region, Moves.of(geometry, was, new))


def carry_out(region: RamRegion, moves: Moves) -> None:
    """:func:`apply` with its :class:`Moves` worked out."""
    path = region.path
    # punched before they are mapped over: our own mapping of them goes with them
    punch(path, moves.punch_own)
    map_over(region, partner(path), moves.map_away)
    map_over(region, path, moves.map_home)
    punch(partner(path), moves.punch_partner)
    if moves.moved or not sidecar(path).exists():  # else recorded as it is
        write_away(path, moves.record)


def take_home(region: RamRegion, away: Sequence[tuple[int, int]]) -> None:
    """Copy the pages slot ``region`` has in its partner's file into its own and map them
    there, then drop the record: before the partner's file is replaced or rewritten whole
    (a resize, a restore into it), which would otherwise take this slot's bytes with it."""
    if not away:
        return
    own = RamRegion.open(region.path, populate=False)
    try:
        for off, length in away:
            own.array[off: off + length] = region.array[off: off + length]
    finally:
        own.close()
    write_away(region.path, [])
    map_over(region, region.path, away)
