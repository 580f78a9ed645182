"""What a rank's two slots share: the engine's side of :mod:`memckpt.engine.shared_pages`.

Before a slot is written, the chunks holding only tensors unchanged since its partner (the
newest complete snapshot) took them are mapped to the partner's pages, and every other chunk
to the page the partner does not use, where the copy then lands.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from memckpt.engine import shared_pages
from memckpt.engine.buffers import MADV_POPULATE_WRITE, populate_mapping
from memckpt.engine.slot import Slot, read_slot
from memckpt.errors import MemckptError
from memckpt.format import shard as fmt


def partner_for(slot: Slot, other: Slot) -> Optional[Slot]:
    """``other`` if ``slot`` may share chunks with it: complete, its data where ``slot``'s
    is, in chunks of the same size (its layout may differ: the chunks both lay out alike
    are shared)."""
    if slot.layout is None or not alike(slot.layout, slot.header_capacity, other):
        return None
    return other


def alike(layout: fmt.Layout, header_capacity: int, other: Slot) -> bool:
    """Whether a slot laid out so may share chunks with ``other`` (see :func:`partner_for`)."""
    if not other.complete or other.region is None or other.layout is None:
        return False
    mine = shared_pages.Geometry.of(layout, header_capacity)
    return (mine.data_offset, mine.chunk_bytes) == (geometry(other).data_offset,
                                                   geometry(other).chunk_bytes)


def geometry(slot: Slot) -> shared_pages.Geometry:
    assert slot.layout is not None
    return shared_pages.Geometry.of(slot.layout, slot.header_capacity)


def ranges(slot: Slot, chunks: list[bool]) -> list[tuple[int, int]]:
    """The byte ranges of ``slot``'s file holding the chunks flagged in ``chunks``."""
    return geometry(slot).byte_ranges(c for c, a in enumerate(chunks) if a)


def share(slot: Slot, partner: Slot, names: Sequence[str], same: set[str]) -> set[str]:
    """Lay out ``slot`` (flagged incomplete, about to be written) against ``partner``:
    ``same`` names the tensors whose bytes are the partner's. Returns those left uncopied:
    the ones the partner lays out where ``slot`` does. A chunk no copied tensor touches,
    laid out alike in both, takes the partner's pages; the others get pages of their own,
    with the partner's bytes of that chunk first where an uncopied tensor has bytes in it
    (one that straddles the chunk's edge): no chunk is half shared."""
    assert slot.layout is not None and slot.region is not None
    assert partner.layout is not None and partner.region is not None
    ask = _Asked(slot.layout, partner.layout, frozenset(same), tuple(names),
                 tuple(partner.away) if partner.away else None,
                 tuple(slot.away) if slot.away else None)
    laid = slot.laid if isinstance(slot.laid, _Laid) and slot.laid.asked == ask else None
    if laid is None:  # else laid out as last time: a job's steady steps
        laid = slot.laid = _lay_out(slot, partner, ask)
    # the seal hashes every chunk written here; the shared ones keep the partner's digests
    slot.dirty.extend(laid.dirty)
    shared_pages.carry_out(slot.region, laid.moves)
    slot.away = list(laid.away) if laid.away is not None else None
    for off, length in laid.populate:  # faulted in now, not a page per copy
        populate_mapping(slot.region.mm, MADV_POPULATE_WRITE, off, length)
    for off, length in laid.mixed:
        slot.region.array[off: off + length] = partner.region.array[off: off + length]
    return set(laid.same)


@dataclass(frozen=True)
class _Asked:
    """What :func:`share` was asked for a slot: its layout and its partner's (by identity:
    a slot keeps its layout object while it is unchanged), the tensors unchanged, the
    tensors written, and where both slots' chunks live now."""

    mine: fmt.Layout
    theirs: fmt.Layout
    same: frozenset[str]
    names: tuple[str, ...]
    partner_away: Optional[tuple[bool, ...]]
    was: Optional[tuple[bool, ...]]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Asked) and self.mine is other.mine
                and self.theirs is other.theirs and self.same == other.same
                and self.names == other.names and self.partner_away == other.partner_away
                and self.was == other.was)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class _Laid:
    """What :func:`share` decided for ``asked``: kept on the slot and reused while it is
    asked the same again."""

    asked: _Asked
    same: frozenset[str]  # the tensors left uncopied
    dirty: tuple[tuple[int, int], ...]  # the data's byte ranges written (hashed by the seal)
    away: Optional[tuple[bool, ...]]  # the slot's homes after
    moves: shared_pages.Moves
    populate: tuple[tuple[int, int], ...]  # the file's byte ranges written
    mixed: tuple[tuple[int, int], ...]  # those prefilled with the partner's bytes


def _lay_out(slot: Slot, partner: Slot, ask: _Asked) -> _Laid:
    geo, theirs = geometry(slot), geometry(partner)
    size, spans, their_spans = geo.chunk_bytes, ask.mine.spans, ask.theirs.spans
    same = frozenset(name for name in ask.same if their_spans.get(name) == spans[name])
    written = {c for name in ask.names if name not in same
               for c in fmt.chunks_covering(*spans[name], size)}
    n, m = geo.chunks, theirs.chunks
    if ask.mine is not ask.theirs and ask.mine != ask.theirs:
        written |= set(range(n)) - _alike(ask.mine, ask.theirs, geo, theirs)
    mixed = {c for name in same for c in fmt.chunks_covering(*spans[name], size) if c in written}
    partner_away = [bool(ask.partner_away and c < m and ask.partner_away[c]) for c in range(n)]
    new = shared_pages.plan(n, partner_away, share=(c for c in range(n) if c not in written))
    moves = shared_pages.Moves.of(geo, ask.was or [False] * n, new)
    end = theirs.data_offset + theirs.data_len
    return _Laid(ask, same,
                 tuple((c * size, min((c + 1) * size, geo.data_len)) for c in sorted(written)),
                 new.away if any(new.away) else None, moves,
                 tuple(geo.byte_ranges(written)),
                 tuple((off, min(length, end - off)) for off, length in geo.byte_ranges(mixed)))


def _alike(mine: fmt.Layout, other: fmt.Layout, geo: shared_pages.Geometry,
           theirs: shared_pages.Geometry) -> set[int]:
    """The chunks two layouts of one data offset and chunk size lay out alike: the same
    tensors at the same places, the same length (kept for the pair last asked about: a
    layout changes once in a while, and each snapshot asks again)."""
    key = (id(mine), id(other))
    if _ALIKE[0] is not None and _ALIKE[0][0] == key and _ALIKE[0][1] == (mine, other):
        return _ALIKE[0][2]
    size = geo.chunk_bytes

    def contents(layout: fmt.Layout) -> dict[int, set[tuple[str, tuple[int, int]]]]:
        out: dict[int, set[tuple[str, tuple[int, int]]]] = {}
        for name, span in layout.spans.items():
            for c in fmt.chunks_covering(*span, size):
                out.setdefault(c, set()).add((name, span))
        return out
    mine_in, theirs_in = contents(mine), contents(other)
    last = min(geo.chunks, theirs.chunks) - 1  # a shorter last chunk is not alike
    alike = {c for c in range(last + 1) if mine_in.get(c) == theirs_in.get(c) and (
        c < last or geo.byte_ranges([c]) == theirs.byte_ranges([c]))}
    _ALIKE[0] = (key, (mine, other), alike)
    return alike


_ALIKE: list[Optional[tuple[tuple[int, int], tuple[fmt.Layout, fmt.Layout], set[int]]]] = [None]


def unshare(slot: Slot, partner: Slot, nbytes: Optional[int] = None) -> None:
    """Before ``slot`` is remapped at ``nbytes`` (None: kept, but received into whole): it
    takes its own pages back, and the pages ``partner`` has in its file stay the partner's.
    A file that grows is grown in place (its pages stay, and another process's mapping of
    it stays valid); one rewritten whole or made anew (smaller) has the partner copy those
    pages home first (:func:`memckpt.engine.shared_pages.take_home`)."""
    try:
        size: Optional[int] = slot.path.stat().st_size
    except FileNotFoundError:
        size = None
    if partner.away and partner.region is not None and partner.layout and size is not None:
        if nbytes is not None and nbytes > size:
            os.truncate(slot.path, nbytes)
        elif nbytes is None or nbytes != size:
            shared_pages.take_home(partner.region, ranges(partner, partner.away))
            partner.away = None
    if slot.away and slot.region is not None:
        shared_pages.map_over(slot.region, slot.path, ranges(slot, slot.away))
    slot.away = None
    shared_pages.sidecar(slot.path).unlink(missing_ok=True)


def reopen(slot: Slot, pin: bool) -> bool:
    """Map ``slot``'s file as a previous process left it, where it holds a complete
    snapshot (False: none, torn or foreign): its layout and step, the chunks it shares with
    its partner, and its seal's digests (what the next snapshot's unchanged chunks keep)."""
    opened = read_slot(slot.path, populate=True, pin=pin)
    if opened is None:
        return False
    region, header, layout, cap = opened
    slot.region, slot.layout, slot.header_capacity = region, layout, cap
    slot.step, slot.complete = int(header["step"]), True
    slot.views = fmt.tensor_views(region.tensor, layout, cap)
    found(slot)
    chunks = fmt.Chunks.of(header, fmt.data_offset(cap))
    if chunks is not None and len(chunks.digests) == geometry(slot).chunks:
        slot.digests = list(chunks.digests)
    return True


def found(slot: Slot) -> None:
    """Read which chunks of ``slot`` (just adopted from its file) live in its partner's."""
    away = geometry(slot).indices(shared_pages.read_away(slot.path))
    slot.away = [c in away for c in range(geometry(slot).chunks)] if away else None


def move_in(slots: Sequence[Slot], files: Sequence[Path]) -> None:
    """Rename ``files`` (a rank's replica files) over ``slots``' files, their sidecars with
    them (a pair moved together are still partners); the slots' own sidecars go."""
    for slot in slots:
        slot.away = None
        shared_pages.sidecar(slot.path).unlink(missing_ok=True)
    for src in files:  # one moving without its partner takes its pages home first
        if shared_pages.sidecar(src).exists() and shared_pages.partner(src) not in files:
            try:
                region = shared_pages.open_slot(src, populate=False)
            except MemckptError:  # its partner's pages are gone: a restore's verify says so
                shared_pages.sidecar(src).unlink()
                continue
            try:
                shared_pages.take_home(region, shared_pages.read_away(src))
            finally:
                region.close()
    for slot, src in zip(slots, files):
        src.replace(slot.path)
        if shared_pages.sidecar(src).exists():
            shared_pages.sidecar(src).replace(shared_pages.sidecar(slot.path))


def clear_gaps(slot: Slot, punch: bool) -> None:
    """Zero the pages of ``slot`` (about to be sealed) that hold no tensor byte
    (:func:`memckpt.format.shard.gap_runs`): what its readers send as zeros. ``punch``: give
    them back (they read as zeros) rather than write zeros (a CUDA-registered slot)."""
    assert slot.layout is not None and slot.region is not None
    for off, length in fmt.gap_runs(slot.layout, slot.header_capacity):
        if punch:
            slot.region.mm.madvise(mmap.MADV_REMOVE, off, length)
        else:
            slot.region.array[off: off + length] = 0
