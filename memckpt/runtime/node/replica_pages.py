"""A holder's two replica slots of a rank share the pages of the chunks that did not change.

The holder side of :mod:`memckpt.engine.shared_pages`: a replica being received takes the
pages of the other replica slot (the rank's newest complete copy here) for every chunk whose
checksum the sender announces as that copy's, and gets its own pages for the rest. A frozen
base is then held once per holder, not twice.

When the transfer begins (its chunk table not known yet), the slot is laid out so that no
byte it receives can land on a page its complete partner uses (:func:`reset`); once the
table is known, the chunks the partner already has are mapped to its pages and the pages
they leave are punched (:func:`lay_out`). A slot file resized or removed first has its
partner copy home the pages it keeps there (:func:`release`).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Callable, Collection, Optional

from memckpt.engine import shared_pages
from memckpt.engine.buffers import MADV_POPULATE_WRITE, RamRegion, populate_mapping
from memckpt.errors import ChecksumError, MemckptError
from memckpt.format import shard as fmt
from memckpt.runtime.wire.ram_files import peek_step

Ranges = list[tuple[int, int]]


def identity(path: Path) -> Optional[tuple[int, int]]:
    """What a cached mapping of slot file ``path`` is valid for: its inode and its sidecar's
    (the pages it shares with its partner, :mod:`memckpt.engine.shared_pages`)."""
    try:
        ino = path.stat().st_ino
    except FileNotFoundError:
        return None
    try:
        return ino, shared_pages.sidecar(path).stat().st_ino
    except FileNotFoundError:
        return ino, 0


def partner_away(path: Path) -> Ranges:
    """The byte ranges of ``path``'s file that its partner, if complete, lives in."""
    other = shared_pages.partner(path)
    if peek_step(other) is None:
        return []
    try:
        return shared_pages.read_away(other)
    except MemckptError:
        return []  # its pages are gone: it is not read (each restore verifies)


def open_for_write(path: Path, nbytes: int,
                   partner_region: Callable[[Path], RamRegion]) -> tuple[RamRegion, Ranges]:
    """``path`` mapped at ``nbytes`` for a transfer to write, and the ranges of it mapped to
    its partner's file. A file of that size keeps its pages and its record; one that grows
    grows in place (the pages its partner keeps in it stay); anything else is made anew,
    after the partner copied home what it kept in it (:func:`release`)."""
    away = partner_away(path)
    try:
        size: Optional[int] = path.stat().st_size
    except FileNotFoundError:
        size = None
    if size == nbytes:
        try:
            return shared_pages.open_slot(path, populate=False), shared_pages.read_away(path)
        except MemckptError:  # its record names a partner file replaced since
            shared_pages.write_away(path, [])
            return RamRegion.open(path, populate=False), []
    if away and size is not None and nbytes > size:
        os.truncate(path, nbytes)
        shared_pages.write_away(path, [])
        return RamRegion.open(path, populate=False), []
    release(path, partner_region)
    shared_pages.write_away(path, [])
    # not faulted in: the chunks to receive are, once known (lay_out); the header's room is
    # taken only as far as it is written
    return RamRegion.reuse_or_create(path, nbytes, populate=False), []


def release(path: Path, partner_region: Callable[[Path], RamRegion]) -> None:
    """Before ``path``'s file is removed or made anew: its complete partner copies home the
    pages it keeps there (``partner_region``: the store's mapping of a file)."""
    away = partner_away(path)
    if away:
        shared_pages.take_home(partner_region(shared_pages.partner(path)), away)


def reset(region: RamRegion, path: Path, homes: Ranges) -> Ranges:
    """Lay out ``path``'s mapping ``region`` (its ``homes`` the ranges now mapped to the
    partner's file) for a transfer: its own pages, except where its complete partner lives
    in them, whose ranges go to the partner's own (unused) pages. Nothing received can then
    land on a page the partner uses; a chunk kept in place stays where it was. Returns the
    new homes (also recorded, as the slot is flagged incomplete)."""
    theirs = partner_away(path)
    shared_pages.map_over(region, path, homes)
    shared_pages.map_over(region, shared_pages.partner(path), theirs)
    shared_pages.write_away(path, theirs)
    return theirs


def lay_out(region: RamRegion, path: Path, chunks: fmt.Chunks, data_len: int,
            partner: Optional[fmt.Shard], keep: Collection[int], homes: Ranges,
            before: Ranges) -> tuple[set[int], Ranges]:
    """Once a transfer's chunk table ``chunks`` is known: its chunks whose checksum is the
    complete ``partner``'s at the same place take the partner's pages (they need not be
    sent), those in ``keep`` (held in place, two steps back) stay unless :func:`reset`
    moved them (from ``before`` to ``homes``), the rest keep pages the partner does not
    use, faulted in. Returns the chunks filled so, and the new homes."""
    geo = shared_pages.Geometry(chunks.data_offset, chunks.chunk_bytes, data_len)
    n = geo.chunks
    share: set[int] = set()
    theirs = partner.chunks if partner is not None else None
    if partner is not None and theirs is not None and (
            theirs.data_offset, theirs.chunk_bytes) == (chunks.data_offset, chunks.chunk_bytes):
        their_len = partner.layout.data_len
        share = {i for i, d in enumerate(chunks.digests)
                 if i < len(theirs.digests) and theirs.digests[i] == d
                 and chunks.span(i, data_len) == theirs.span(i, their_len)}
    in_partner = geo.indices(partner_away(path))
    now = geo.indices(homes)
    keep = set(keep) - (now ^ geo.indices(before))  # moved by the reset: not there any more
    new = shared_pages.plan(n, [c in in_partner for c in range(n)], share=share)
    shared_pages.apply(region, geo, [c in now for c in range(n)], new)
    # a kept chunk stays where it is: since the reset, never on a page the partner uses,
    # which is where the plan writes a chunk it does not share
    filled = share | keep
    for off, length in geo.byte_ranges(c for c in range(n) if c not in filled):
        populate_mapping(region.mm, MADV_POPULATE_WRITE, off, length)
    return filled, geo.byte_ranges(c for c in range(n) if new.away[c])


DROP_PIECE = 1 << 20  # the header room's bytes are read into this much at a time, dropped
PAGE = 4096


def receive(region: RamRegion, offset: int, nbytes: int,
            fill: Callable[[memoryview], None]) -> None:
    """Let ``fill`` write bytes ``offset .. offset+nbytes`` of a shard arriving into
    ``region`` (:func:`memckpt.format.shard.fill_flagged`), but for its header's unused room
    (:func:`memckpt.format.shard.header_room`, known once the prefix is in): read and
    dropped, its pages given back. It holds no byte of the shard, so a transfer never holds
    it (a small shard's 64 KiB steps of room were most of what a receive held over its
    shard)."""
    end, at = offset + nbytes, offset
    if at < fmt.PREFIX.size:
        fmt.fill_flagged(region.array, at, min(end, fmt.PREFIX.size) - at, fill)
        at = min(end, fmt.PREFIX.size)
    try:
        start, stop = fmt.header_room(region.array[:fmt.PREFIX.size], str(region.path))
    except ChecksumError:
        start = stop = end  # not a shard's prefix: the finish's check refuses it
    lo, hi = max(at, start), min(end, stop)
    if hi <= lo:
        fmt.fill_flagged(region.array, at, end - at, fill)
        return
    fmt.fill_flagged(region.array, at, lo - at, fill)
    scratch = memoryview(bytearray(min(DROP_PIECE, hi - lo)))
    for piece in range(lo, hi, len(scratch)):
        fill(scratch[:min(len(scratch), hi - piece)])
    a, b = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE  # whole pages go; the edges read as zeros
    if b > a:
        region.mm.madvise(mmap.MADV_REMOVE, a, b - a)
        region.array[lo:a], region.array[b:hi] = 0, 0
    else:
        region.array[lo:hi] = 0
    fmt.fill_flagged(region.array, hi, end - hi, fill)
