"""What a rank's two slots share: the engine's side of :mod:`memckpt.engine.shared_pages`.

Before a slot is written, the chunks holding only tensors unchanged since its partner (the
newest complete snapshot) took them are mapped to the partner's pages, and every other chunk
to the page the partner does not use, where the copy then lands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

from memckpt.engine import shared_pages
from memckpt.engine.buffers import MADV_POPULATE_WRITE, populate_mapping
from memckpt.engine.slot import Slot


def partner_for(slot: Slot, other: Slot) -> Optional[Slot]:
    """``other`` if ``slot`` may share chunks with it: complete and laid out alike."""
    if (not other.complete or other.region is None or other.layout != slot.layout
            or other.header_capacity != slot.header_capacity):
        return None
    return other


def geometry(slot: Slot) -> shared_pages.Geometry:
    assert slot.layout is not None
    return shared_pages.Geometry.of(slot.layout, slot.header_capacity)


def ranges(slot: Slot, chunks: list[bool]) -> list[tuple[int, int]]:
    """The byte ranges of ``slot``'s file holding the chunks flagged in ``chunks``."""
    return geometry(slot).byte_ranges(c for c, a in enumerate(chunks) if a)


def share(slot: Slot, partner: Slot, names: Iterable[str], same: set[str]) -> None:
    """Lay out ``slot`` (flagged incomplete, about to be written) against ``partner``:
    ``same`` names the tensors whose bytes are the partner's, the rest of ``names`` will
    be copied. A chunk no copied tensor touches takes the partner's pages; the others get
    pages of their own, with the partner's bytes of that chunk first where an unchanged
    tensor has bytes in it (one that straddles the chunk's edge): then no unchanged
    tensor is copied, and no chunk is half shared."""
    assert slot.layout is not None and slot.region is not None
    assert partner.region is not None
    geo = geometry(slot)
    size, spans = geo.chunk_bytes, slot.layout.spans

    def chunks_of(name: str) -> range:
        start, end = spans[name]
        return range(start // size, (end - 1) // size + 1) if end > start else range(0)
    written = {c for name in names if name not in same for c in chunks_of(name)}
    mixed = {c for name in same for c in chunks_of(name) if c in written}
    n = geo.chunks
    new = shared_pages.plan(n, partner.away or [False] * n,
                            share=(c for c in range(n) if c not in written))
    shared_pages.apply(slot.region, geo, slot.away or [False] * n, new)
    slot.away = list(new.away) if any(new.away) else None
    for off, length in geo.byte_ranges(written):  # faulted in now, not a page per copy
        populate_mapping(slot.region.mm, MADV_POPULATE_WRITE, off, length)
    for off, length in geo.byte_ranges(mixed):
        slot.region.array[off: off + length] = partner.region.array[off: off + length]


def unshare(slot: Slot, partner: Slot, rewritten: bool) -> None:
    """Before ``slot`` is remapped or received into: it takes its own pages back, and where
    its file is about to be replaced or ``rewritten`` whole, ``partner`` first copies home
    the pages it has in it (:func:`memckpt.engine.shared_pages.take_home`)."""
    if rewritten and partner.away and partner.region is not None and partner.layout:
        shared_pages.take_home(partner.region, ranges(partner, partner.away))
        partner.away = None
    if slot.away and slot.region is not None:
        shared_pages.map_over(slot.region, slot.path, ranges(slot, slot.away))
    slot.away = None
    shared_pages.sidecar(slot.path).unlink(missing_ok=True)


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
    for slot, src in zip(slots, files):
        src.replace(slot.path)
        if shared_pages.sidecar(src).exists():
            shared_pages.sidecar(src).replace(shared_pages.sidecar(slot.path))
