"""What a snapshot need not copy: tensors unchanged since their slot last took them.

A rank's two slots alternate, so a slot being written held the same tensors two snapshots
ago. A tensor whose bytes are still those (a frozen base model, a buffer nothing wrote) is
left where it is: not copied, its chunks not hashed again by the seal (their digests are
the slot's last seal's), and not sent again to holders (a holder leaves the chunks its copy
already has in place: :meth:`memckpt.runtime.node.replica_store.ReplicaStore.fill_local`).

Whether it is unchanged is decided by a stamp taken when it was copied (see :func:`stamp`)
and, under ``EngineConfig.skip_unchanged="verify"``, a compare of its bytes with the slot's:
a write through ``p.data`` moves no version counter, and must never leave a step restored
stale. A frozen tensor the kernel watches (:mod:`memckpt.engine.write_watch`) is compared
only where it may have been written: the pages the kernel saw written, and its two ends.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from memckpt.engine.buffers import same_bytes
from memckpt.format import shard as fmt


def stamp(t: torch.Tensor) -> tuple:
    """What must be the same for a tensor's bytes to be unchanged since its last copy: the
    tensor object itself, its version counter (shared with the live tensor it aliases and
    bumped by every in-place op autograd sees, in ``no_grad`` too), where it points, its
    storage (held by the stamp, so no other storage can take its address meanwhile: a
    capture's detached views of a parameter share it, a new RNG state tensor does not),
    its shape, strides, dtype and device."""
    storage = t.untyped_storage()
    return (t, t._version, t.data_ptr(), storage, storage._cdata, tuple(t.shape), t.stride(),
            t.dtype, t.device)


def same_stamp(old: tuple, t: torch.Tensor) -> bool:
    """Whether ``t``'s :func:`stamp` now is ``old``. The same tensor object (a capture's alias
    of a parameter, kept from one capture to the next while the parameter is what it was:
    :class:`memckpt.format.state.TrainState`) is checked on its version counter and address
    alone: every in-place op on it, those that change its shape or storage too (``set_``,
    ``resize_``, ``t_``), bumps its version."""
    if old[0] is t:
        return old[1] == t._version and old[2] == t.data_ptr()
    new = stamp(t)
    return old[1:3] == new[1:3] and old[4:] == new[4:]


def verdict(old: Optional[tuple], t: torch.Tensor, held: torch.Tensor, mode: str,
            frozen: bool = False) -> Optional[bool]:
    """Whether ``held`` (the slot's copy of ``t``, stamped ``old`` when it was taken) still
    is ``t``'s bytes: False (changed, or cannot tell cheaply), True (on the stamp alone) or
    None (the bytes must be compared: :func:`same_bytes_many`). ``mode`` "verify": the
    stamp, then the bytes (a GPU tensor cannot be compared cheaply: False); "trust": the
    stamp alone for a ``frozen`` parameter (no optimizer writes it, through ``p.data`` or a
    fused kernel, as they may a trained one's), "verify" for the rest; "off": False."""
    if mode == "off" or old is None or not same_stamp(old, t):
        return False
    if mode == "trust" and frozen:
        return True
    if t.is_cuda or not t.is_contiguous() or not held.is_contiguous():
        return False
    return None


def held_unchanged(kept: Mapping[str, tuple], views: Mapping[str, torch.Tensor],
                   tensors: Sequence[tuple[str, torch.Tensor]], mode: str,
                   frozen: Collection[str], map_fn: Callable[[Callable[[Any], Any], Iterable[Any]],
                                                             Iterator[Any]],
                   compare_unknown: bool = False,
                   suspect: Optional[Mapping[str, Sequence[tuple[int, int]]]] = None
                   ) -> tuple[set[str], int]:
    """The names of ``tensors`` whose bytes a slot (its ``views``, the stamps it ``kept``)
    still holds, and the bytes compared to tell: :func:`verdict`, then the byte compares on
    ``map_fn``'s threads.
    ``compare_unknown``: a tensor the slot holds no stamp of (a slot a previous process
    wrote, the one a restore loaded) is compared too, where it can be cheaply.
    ``suspect``: for a stamped tensor, the only byte ranges (from its first byte) that may
    differ from the slot's copy; none: it is unchanged without a compare."""
    if not (kept or compare_unknown):
        return set(), 0
    found, compare = set(), []
    for name, t in tensors:
        held = views.get(name)
        if held is None:  # the slot was laid out without it
            continue
        old = kept.get(name)
        if old is None and compare_unknown:
            says = None if (not t.is_cuda and t.is_contiguous() and held.is_contiguous()
                            and t.dtype == held.dtype and t.shape == held.shape) else False
        else:
            says = verdict(old, t, held, mode, name in frozen)
        if says:
            found.add(name)
        elif says is None:
            ranges = None if suspect is None or old is None else suspect.get(name)
            if ranges is not None and not ranges:
                found.add(name)
            else:
                compare.append((name, t, held, ranges))
    if not compare:
        return found, 0
    same = same_bytes_many([(t, held) for _, t, held, _ in compare], map_fn,
                           [ranges for *_, ranges in compare])
    found.update(name for (name, *_), ok in zip(compare, same) if ok)
    return found, sum(t.numel() * t.element_size() if ranges is None
                      else sum(hi - lo for lo, hi in ranges) for _, t, _, ranges in compare)


COMPARE_PIECE = 8 << 20  # bytes a compare task takes: a big tensor spreads over the threads


def same_bytes_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    map_fn: Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]],
                    ranges: Optional[Sequence[Optional[Sequence[tuple[int, int]]]]] = None
                    ) -> list[bool]:
    """For each (tensor, the slot's copy) whether their bytes are equal (only in its
    ``ranges``, where given: byte ranges from the first byte): memcmp (which releases the
    GIL) in tasks of about COMPARE_PIECE bytes, through ``map_fn`` (the seal threads' ``map``,
    idle while a snapshot copies: the comparison of a frozen base then takes the cores the
    copy would have). Small pieces share a task; a single task runs on the calling thread
    (a hop to a pool thread costs more than comparing a few small tensors)."""
    tasks: list[list[tuple[int, int, int, int]]] = [[]]
    room = COMPARE_PIECE
    for i, (t, held) in enumerate(pairs):
        n, a, b = t.numel() * t.element_size(), t.data_ptr(), held.data_ptr()
        only = ranges[i] if ranges else None
        for lo, hi in (only if only is not None else [(0, n)]):
            hi = min(hi, n)
            for off in range(lo, max(hi, lo + 1), COMPARE_PIECE):
                size = max(0, min(COMPARE_PIECE, hi - off))
                if size > room and tasks[-1]:
                    tasks.append([])
                    room = COMPARE_PIECE
                tasks[-1].append((i, a + off, b + off, size))
                room -= size

    def run(task: list[tuple[int, int, int, int]]) -> list[tuple[int, bool]]:
        return [(i, same_bytes(a, b, size)) for i, a, b, size in task]

    same = [True] * len(pairs)
    for results in (map(run, tasks) if len(tasks) == 1 else map_fn(run, tasks)):
        for i, ok in results:
            same[i] = same[i] and ok
    return same


def known_chunks(digests: Optional[Sequence[str]], data_len: int,
                 dirty: Iterable[tuple[int, int]]) -> Optional[dict[int, str]]:
    """Of a slot's last seal's chunk ``digests``, those that still hold: the chunks no byte
    range in ``dirty`` (the tensors the snapshot under way copied, the chunks it wrote)
    touches. None when the slot has no usable digests. Digests of a shard laid out in
    another length (a partner of another layout) count up to the shorter one's end: its
    chunks that differ are in ``dirty``."""
    if digests is None:
        return None
    size = fmt.chunk_bytes_for(data_len)
    digests = digests[: -(-data_len // size)]
    touched: set[int] = set()
    for start, end in dirty:
        touched.update(fmt.chunks_covering(start, end, size))
    return {i: d for i, d in enumerate(digests) if i not in touched}
