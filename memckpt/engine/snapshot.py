"""The snapshot engine: captured tensors -> preallocated, double-buffered host RAM.

Two slots live in shared-memory files. A snapshot is written into the slot that
does *not* hold the newest snapshot, so the last complete copy is never
overwritten by one in progress, and a crash mid-copy leaves it intact. After
warm-up nothing is allocated per step: the slots are reused as long as the
state's layout does not change.

Per snapshot the training thread copies the small, step-mutated tensors (buffers,
RNG, scheduler) and, in ``sync`` mode, everything else too. In ``overlap`` mode
(CheckFreq's pipelining) parameters and optimizer state are copied on a
background thread while the next forward and backward run; ``wait_copy()``,
hooked onto ``optimizer.step``, holds the next update until that copy is done.
The checksum and header are always written off the training thread: the data's
chunks are hashed on a small pool of threads (``seal_threads``), which also verifies
a snapshot before it is read back (see :mod:`memckpt.engine.restore`).

A snapshot due while the previous one is still copied or sealed in the background is
waited for (``on_sealing="wait"``, the default: every due snapshot lands) or skipped
(``"skip"``: the step never waits for a seal); :class:`EngineStats` counts what landed.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from memckpt.format import shard as fmt
from memckpt.engine.buffers import RamRegion, populate_mapping
from memckpt.engine import shared_pages, sharing, write_watch
from memckpt.engine.landing import Landing, all_landed
from memckpt.engine.slot import Slot, has_size
from memckpt.engine.stats import EngineStats
from memckpt.engine.unchanged import held_unchanged, known_chunks, stamp
from memckpt.errors import MemckptError, NoSnapshotError
from memckpt.config import SKIP_UNCHANGED
from memckpt.format.state import Captured

log = logging.getLogger("memckpt")


SKIP_LOG_INTERVAL_S = 30.0  # a skipped snapshot is logged at most this often


class SnapshotEngine:
    """Copies captured state into two reused RAM slots under ``directory``.

    Guarantees: ``snapshot()`` returns once the training loop may mutate what it
    is required to protect (everything in ``sync`` mode; all but parameters and
    optimizer state in ``overlap`` mode, until ``wait_copy()`` returns). The
    newest complete snapshot is never overwritten while another is written.
    A failed snapshot leaves its slot marked incomplete; the error is raised from
    ``snapshot()`` or, for background work, from the next ``wait()``/``snapshot()``.
    """

    def __init__(self, directory: Path, *, mode: str = "sync", on_fall_behind: str = "wait",
                 identity: Optional[dict[str, Any]] = None,
                 on_complete: Optional[Callable[[int, Path], None]] = None,
                 gated: bool = False, seal_threads: int = 1, on_sealing: str = "wait",
                 room_check: Optional[Callable[[int], None]] = None,
                 skip_unchanged: str = "verify", share_unchanged: bool = True) -> None:
        self.directory = Path(directory)
        if skip_unchanged not in SKIP_UNCHANGED:
            raise ValueError(f"skip_unchanged={skip_unchanged!r}: one of {SKIP_UNCHANGED}")
        self.skip_unchanged = skip_unchanged
        self._frozen: frozenset[str] = frozenset()  # the snapshot under way's (Captured.frozen)
        self._layout: Optional[tuple[list, fmt.Layout]] = None  # the last capture's
        # called with a slot file's size before one is made or resized: raises when the
        # node cannot afford slots of that size (Checkpointer's RAM budget)
        self.room_check = room_check
        self.directory.mkdir(parents=True, exist_ok=True)
        self.mode = mode
        self.on_fall_behind = on_fall_behind
        self.on_sealing = on_sealing
        self.identity = dict(identity or {})
        self.on_complete = on_complete
        # Gated (multi-node): a new snapshot may only replace the older slot once the
        # newest snapshot is committed everywhere, so the last committed step always
        # has a local copy. Ungated: sealing is committing.
        self.gated = gated
        self.committed: Optional[int] = None
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="memckpt-snapshot")
        # hash a seal's chunks and verify restores (the seal's own thread only waits)
        self.hashers = cf.ThreadPoolExecutor(max_workers=max(1, seal_threads),
                                             thread_name_prefix="memckpt-hash")
        self.seal_threads = max(1, seal_threads)
        self._skip_logged = 0.0
        self._inflight: Optional[cf.Future] = None  # background copy + seal of the newest slot
        self._reserving: Optional[cf.Future] = None  # the other slot, mapped after an install
        self._copy_done = Landing.done()  # the background copy (overlap mode)
        self._error: Optional[BaseException] = None
        self._aborted: Optional[BaseException] = None  # raised by every later snapshot
        self._newest: Optional[int] = None  # index of the slot written last (maybe in flight)
        self._pin = torch.cuda.is_available()
        # the two slots share unchanged chunks' pages: not on pinned (CUDA-registered) slots,
        # whose pages must stay where they were registered
        self.share = (share_unchanged and skip_unchanged != "off" and not self._pin
                      and shared_pages.supported())
        self._skip: Optional[set[str]] = None  # the snapshot under way's unchanged tensors
        # the kernel's word on which pages of the frozen tensors were written: "verify" then
        # compares only those (memckpt.engine.write_watch); opened by the first snapshot
        # with frozen tensors
        self.watch: Optional[write_watch.WriteWatch] = None
        self._may_watch = skip_unchanged == "verify"
        self._known: Optional[Slot] = None  # the slot whose digests its unchanged chunks keep
        self._stream = torch.cuda.Stream() if self._pin else None
        self.slots = [Slot(self.directory / n) for n in fmt.SLOT_NAMES]
        self._adopt_existing()

    # -- existing slots (a previous process's snapshots) -----------------------------------
    def _adopt_existing(self) -> None:
        for i, slot in enumerate(self.slots):
            if not sharing.reopen(slot, pin=self._pin):
                continue  # none, torn or foreign: this slot is simply free
            if self._newest is None or slot.age > self.slots[self._newest].age:
                self._newest = i

    def adopt(self, files: list[Path]) -> list[int]:
        """Make ``files`` (complete shards of this rank already on this node: the replicas
        its holder's store kept, when the rank moved to that node) this engine's slots by
        renaming them in: same filesystem, so no byte is copied, and the next snapshot
        rewrites memory that is already populated. Replaces whatever the slots held (a
        rank moving here has nothing newer). Returns the steps now held, newest first."""
        if len(files) > len(self.slots):
            raise MemckptError(f"{len(files)} shard files for {len(self.slots)} slots")
        self._await_reserve()
        self.wait()
        with self._cond:
            if any(slot.readers for slot in self.slots):
                raise MemckptError(f"{self.directory}: a slot is being read; cannot adopt")
            for slot in self.slots:
                slot.clear()
            self._newest = None
            sharing.move_in(self.slots, files)
            for slot in self.slots[len(files):]:
                slot.path.unlink(missing_ok=True)
            self._adopt_existing()
            self._cond.notify_all()
        return self.steps()

    # -- taking snapshots -------------------------------------------------------------------
    def snapshot(self, captured: Captured, step: int) -> bool:
        """Snapshot ``captured`` as ``step``. Returns False when skipped by policy."""
        t0 = time.perf_counter()
        self._raise_background_error()
        self._await_reserve()
        target = self._claim_target(step)
        if target is None:
            return False
        slot = self.slots[target]
        try:
            self._prepare(slot, captured)
            fmt.mark_writing(slot.mem.array)
            slot.complete, slot.step, slot.dirty = False, None, []
            self._frozen = captured.frozen
            if self._may_watch and self._frozen:
                self._may_watch, self.watch = False, write_watch.WriteWatch.open()
            if self.watch is not None:
                write_watch.look(self.watch, self.slots, captured.tensors, self._frozen)
            self.stats.last_copied_bytes = self.stats.last_unchanged_bytes = 0
            self.stats.last_compared_bytes = 0
            other = self.slots[1 - target]
            partner = sharing.partner_for(slot, other) if self.share else None
            self._skip, self._known = None, partner or slot
            if partner is not None:
                self._skip = self._share_with(slot, partner, captured.tensors)
            elif slot.away or other.away:  # shared pages, but no sharing this time: none kept
                sharing.unshare(slot, other)
                slot.forget()
            meta_blob = captured.meta
            background = [(n, t) for n, t in captured.tensors
                          if self.mode == "overlap" and n in captured.stable]
            foreground = [(n, t) for n, t in captured.tensors
                          if not (self.mode == "overlap" and n in captured.stable)]
            landed = self._copy(slot, foreground)
        except BaseException:
            slot.forget()
            with self._cond:
                if slot.complete:  # failed before touching the slot: the other is still newest
                    self._newest = 1 - target
                self._cond.notify_all()
            raise
        copy_done = self._copy_done = Landing()
        # the seal starts now and hashes each chunk once it landed, while this thread waits
        # for the foreground copy (on a GPU: the device-to-host copy on the side stream)
        self._inflight = self._pool.submit(self._finish, target, landed, copy_done, background,
                                           step, meta_blob)
        landed.wait()
        self.stats.snapshots += 1
        self.stats.last_step = step
        self.stats.last_stall_s = time.perf_counter() - t0
        return True

    def install(self, step: int, receive: Callable[[Callable[[int], np.ndarray]], np.ndarray],
                source: str) -> fmt.Shard:
        """Hold ``step``'s shard received from elsewhere (a peer's replica of this rank) in a
        slot, as if this engine had taken it: ``receive(into)`` streams the bytes into the
        array ``into(nbytes)`` returns (see :meth:`memckpt.runtime.wire.data_plane.StoreConnection.fetch`).
        They are verified before the slot counts; returns the verified shard. A restore
        then needs no second copy to re-snapshot, and the bytes land in populated pages."""
        # A previous install may still be mapping the other slot in the background: let it
        # finish, or both threads would create the same slot file at once.
        self._await_reserve()
        # Not gated: the step being installed is the one the job resumes at, so there is
        # no newer committed copy to protect (and the old commit will never come).
        target = self._claim_target(step, policy="wait", gated=False)
        assert target is not None
        slot = self.slots[target]
        slot.complete, slot.step, slot.views = False, None, {}
        slot.forget()

        def into(nbytes: int) -> np.ndarray:
            if slot.region is None or slot.region.size != nbytes:
                self._map_file(slot, nbytes)
            sharing.unshare(slot, self.slots[1 - self.slots.index(slot)])
            fmt.mark_writing(slot.mem.array)
            return slot.mem.array

        try:
            received = receive(into)
            shard = fmt.accept_received(received, source, step)
            _, slot.layout, slot.header_capacity = fmt.read_header(received, source)
        except BaseException:
            with self._cond:
                if self.slots[1 - target].complete:
                    self._newest = 1 - target
                self._cond.notify_all()
            raise
        slot.views = fmt.tensor_views(slot.mem.tensor, slot.layout, slot.header_capacity)
        if shard.chunks is not None:  # what the next snapshot's unchanged chunks keep
            slot.digests = list(shard.chunks.digests)
        with self._cond:
            slot.step, slot.complete = step, True
            self._cond.notify_all()
        self._reserve_other(target)
        return shard

    def _reserve_other(self, target: int) -> None:
        """After an install into a node with no slots of this rank (a peer restore), map the
        other slot at the same size in the background, while the restore loads: the first
        snapshot would otherwise allocate it on the training thread (2 s for 1 GiB here)."""
        slot, other = self.slots[target], self.slots[1 - target]
        if other.region is not None or slot.layout is None:
            return
        self._reserving = self._pool.submit(self._map_slot, other, slot.layout,
                                            slot.header_capacity, not self.share)

    def _await_reserve(self) -> None:
        future, self._reserving = self._reserving, None
        if future is not None and future.exception() is not None:
            # e.g. no room: the snapshot allocates the slot itself and says what to change
            log.info("memckpt: reserving the second slot failed: %s", future.exception())

    def _claim_target(self, step: int, policy: Optional[str] = None,
                      gated: Optional[bool] = None) -> Optional[int]:
        """Pick the slot to overwrite: never the newest; wait or skip (``policy``, else the
        engine's fall-behind policy) if it is busy (``gated``, else the engine's: also while
        the newest is not committed)."""
        gated = self.gated if gated is None else gated
        t0 = time.perf_counter()
        with self._cond:
            while True:
                self._raise_background_error()
                if self._aborted is not None:
                    raise self._aborted
                newest_busy = self._inflight is not None and not self._inflight.done()
                target = 0 if self._newest is None else 1 - self._newest
                if gated and self._newest is not None and not newest_busy:
                    newest = self.slots[self._newest]
                    newest_busy = newest.complete and newest.step != self.committed
                if not newest_busy and self.slots[target].readers == 0:
                    if self._newest is not None and not self.slots[self._newest].complete:
                        target = self._newest  # the newest failed: overwrite it, keep the older
                    self._newest = target
                    break
                sealing = self._inflight is not None and not self._inflight.done()
                # gated (several ranks): ranks skipping on their own would hold different
                # steps and none would commit, so only failure.on_fall_behind applies there
                if policy is None and sealing and not gated and self.on_sealing == "skip" or \
                        (policy or self.on_fall_behind) == "skip":
                    self._skipped(step, sealing)
                    return None
                self._cond.wait(timeout=0.05)
        self.stats.waited_s += time.perf_counter() - t0
        return target

    def _skipped(self, step: int, sealing: bool) -> None:
        self.stats.skipped += 1
        now = time.monotonic()
        if now - self._skip_logged >= SKIP_LOG_INTERVAL_S:
            self._skip_logged = now
            why = "still being sealed" if sealing else "not yet committed or being read"
            log.info("memckpt: snapshot of step %d skipped: the previous one is %s "
                     "(%d of %d due snapshots landed so far; engine.on_sealing='wait' takes "
                     "every one, at the cost of step time)", step, why, self.stats.landed,
                     self.stats.requested)

    def prepare(self, captured: Captured) -> None:
        """Map, populate (and pin) the slots that hold nothing yet, sized for ``captured``,
        in the background: the first snapshot then copies into memory that is ready
        instead of allocating it on the training thread. Slots holding a snapshot are
        left alone."""
        self._await_reserve()
        layout = self._layout_of(captured)
        cap = fmt.header_capacity_for(
            layout, meta_hint=len(json.dumps(captured.meta, separators=(",", ":"))))
        free = [slot for slot in self.slots if slot.region is None]
        # where slots share pages, one that will share its partner's takes only the pages
        # it writes, at its first snapshot: populated is the one the first snapshot writes
        # with no partner to share with
        first = None if any(s.complete for s in self.slots) else \
            self.slots[0 if self._newest is None else 1 - self._newest]

        def run() -> None:
            for slot in free:
                self._map_slot(slot, layout, cap, populate=not self.share or slot is first)
        if free:
            self._reserving = self._pool.submit(run)

    def wait_prepared(self) -> None:
        """Until slots being prepared in the background (:meth:`prepare`) are mapped."""
        self._await_reserve()

    def _layout_of(self, captured: Captured) -> fmt.Layout:
        """The slots' layout for ``captured``, made again only when a name, shape or dtype
        changed. Frozen tensors first where slots share pages: they then fill whole chunks
        that stay shared, instead of chunks shared with a trained tensor beside them."""
        key = [(n, t.shape, t.dtype, self.share and n in captured.frozen)
               for n, t in captured.tensors]
        if self._layout is None or self._layout[0] != key:
            tensors, at = captured.tensors, -1
            if self.share and captured.frozen:
                tensors = sorted(tensors, key=lambda nt: nt[0] not in captured.frozen)
                at = sum(n in captured.frozen for n, _ in tensors)
            self._layout = (key, fmt.Layout.of(tensors, chunk_at=at))
        return self._layout[1]

    def _prepare(self, slot: Slot, captured: Captured) -> None:
        layout = self._layout_of(captured)
        meta_len = len(json.dumps(captured.meta, separators=(",", ":")))
        need = meta_len + fmt.table_bytes(layout) + 1024
        if slot.layout == layout and slot.region is not None and need <= slot.header_capacity:
            slot.layout = layout  # the same: the next compare is by identity
            return
        cap = fmt.header_capacity_for(layout, meta_hint=meta_len)
        self._map_slot(slot, layout, cap, populate=not (self.share and sharing.alike(
            layout, cap, self.slots[1 - self.slots.index(slot)])))

    def _map_slot(self, slot: Slot, layout: fmt.Layout, cap: int, populate: bool = True) -> None:
        """Map ``slot``'s file sized for ``layout`` with a header of ``cap`` bytes."""
        slot.forget()  # the bytes move (or are new)
        # the data faulted in; the header's room only where a seal writes it
        self._map_file(slot, fmt.region_size(layout, cap), populate=False)
        if populate:
            populate_mapping(slot.mem.mm, offset=fmt.data_offset(cap))
        slot.layout, slot.header_capacity = layout, cap
        slot.views = fmt.tensor_views(slot.mem.tensor, layout, cap)

    def _map_file(self, slot: Slot, nbytes: int, populate: bool = True) -> None:
        """(Re)map ``slot``'s file at ``nbytes``, in place when it already has that size."""
        if self.room_check is not None and not has_size(slot.path, nbytes):
            self.room_check(nbytes)
        sharing.unshare(slot, self.slots[1 - self.slots.index(slot)], nbytes)
        if slot.region is not None:
            slot.views = {}  # the old mapping's last users: its pages go when they do
            slot.region.close(unlink=False)
            slot.region = None
        slot.region = RamRegion.reuse_or_create(slot.path, nbytes, pin=self._pin,
                                                populate=populate)
        self.stats.allocations += 1

    def _copy(self, slot: Slot, tensors: list[tuple[str, torch.Tensor]],
              landing: Optional[Landing] = None) -> Landing:
        """Copy ``tensors`` into ``slot``; returns (or completes ``landing`` with) what
        landed where. A GPU tensor's copy is only queued: it lands later (see Landing)."""
        landing = landing or Landing()
        spans: list[tuple[int, int, Any]] = []
        try:
            assert slot.layout is not None  # _prepare laid the slot out
            where = slot.layout.spans
            kept = self._unchanged(slot, tensors) if self._skip is None else self._skip
            with torch.no_grad():
                if self._stream is not None and any(t.is_cuda for _, t in tensors):
                    # Device-to-host into pinned memory on a side stream, after the compute
                    # stream's pending writes to these tensors; an event after each tensor
                    # tells the seal which bytes are in (the host tensors land at once).
                    self._stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self._stream):
                        for name, t in tensors:
                            if name in kept:
                                spans.append((*where[name], None))
                                continue
                            slot.views[name].copy_(t, non_blocking=True)
                            self._copied(slot, name, t, where[name])
                            event = None
                            if t.is_cuda:
                                # blocking: a waiting thread sleeps instead of spinning (up to
                                # seal_threads of them wait while the training thread runs)
                                event = torch.cuda.Event(blocking=True)
                                event.record(self._stream)
                            spans.append((*where[name], event))
                else:
                    for name, t in tensors:
                        if name not in kept:
                            slot.views[name].copy_(t)
                            self._copied(slot, name, t, where[name])
                        spans.append((*where[name], None))
        finally:
            landing.queued(spans)
        return landing

    def _share_with(self, slot: Slot, partner: Slot, tensors: list[tuple[str, torch.Tensor]]
                    ) -> set[str]:
        """Before ``slot`` is written: the tensors whose bytes are ``partner``'s (the newest
        complete snapshot), not copied, their chunks mapped to the partner's pages
        (:func:`memckpt.engine.sharing.share`)."""
        found = self._unchanged(partner, tensors, compare_unknown=True)
        same = sharing.share(slot, partner, [n for n, _ in tensors], found)
        assert slot.layout is not None
        moved = sum(e - s for s, e in (slot.layout.spans[n] for n in found - same))
        self.stats.unchanged_bytes -= moved  # laid out elsewhere here: copied, counted so
        self.stats.last_unchanged_bytes -= moved
        slot.kept.update((n, partner.kept.get(n) or stamp(t)) for n, t in tensors if n in same)
        write_watch.settled(self.watch, slot, same)
        return same

    def _unchanged(self, slot: Slot, tensors: list[tuple[str, torch.Tensor]],
                   compare_unknown: bool = False) -> set[str]:
        """:func:`memckpt.engine.unchanged.held_unchanged` with this engine's mode, counted."""
        if self.skip_unchanged == "off":
            return set()
        found, compared = held_unchanged(slot.kept, slot.views, tensors, self.skip_unchanged,
                                         self._frozen, self.map_fn, compare_unknown,
                                         write_watch.suspects(self.watch, slot))
        write_watch.settled(self.watch, slot, found)
        self.stats.last_compared_bytes += compared
        assert slot.layout is not None  # _prepare laid the slot out
        where = slot.layout.spans
        nbytes = sum(where[name][1] - where[name][0] for name in found)
        self.stats.unchanged_bytes += nbytes
        self.stats.last_unchanged_bytes += nbytes
        return found

    def _copied(self, slot: Slot, name: str, t: torch.Tensor, span: tuple[int, int]) -> None:
        slot.kept[name] = stamp(t)
        write_watch.settled(self.watch, slot, (name,))
        slot.dirty.append(span)
        nbytes = span[1] - span[0]
        self.stats.copied_bytes += nbytes
        self.stats.last_copied_bytes += nbytes

    def _finish(self, index: int, landed: Landing, copy_done: Landing, background: list,
                step: int, meta: dict[str, Any]) -> None:
        slot = self.slots[index]
        try:
            # completes copy_done even when the copy fails: wait_copy() never hangs
            self._copy(slot, background, copy_done)
            t0 = time.perf_counter()
            header = dict(self.identity, meta=meta, created_at=time.time())
            assert slot.layout is not None  # _prepare laid the slot out
            chunks: list[str] = []
            sharing.clear_gaps(slot, punch=self.share)
            fmt.seal(slot.mem.array, slot.layout, slot.header_capacity, step, header,
                     self.map_fn, ready=all_landed([landed, copy_done]),
                     known=known_chunks((self._known or slot).digests, slot.layout.data_len,
                                        slot.dirty),
                     chunks_out=chunks)
            slot.digests = chunks
            if self.share:  # not under CUDA's registration of the slot
                shared_pages.punch_zeros(slot.mem)
            self.stats.last_seal_s = time.perf_counter() - t0
            self.stats.landed += 1
            slot.step, slot.complete = step, True
            if self.on_complete is not None:
                self.on_complete(step, slot.path)
        except BaseException as e:  # kept, re-raised on the training thread
            slot.forget()
            self._error = e
            raise
        finally:
            with self._cond:
                self._cond.notify_all()

    def map_fn(self, fn: Callable[[Any], Any], items: Any) -> Iterator[Any]:
        """``map`` over the hashing threads, in order (a seal's or a check's chunks)."""
        items = list(items)
        if self.seal_threads == 1 or len(items) < 2:
            return map(fn, items)
        return self.hashers.map(fn, items)

    def _raise_background_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def discard_newer(self, step: int) -> None:
        """Invalidate held snapshots newer than ``step`` (a rollback made them obsolete)."""
        self._discard(lambda s: s > step)

    def discard_step(self, step: int) -> None:
        """Invalidate the snapshot of ``step`` (found corrupt): nothing restores or sends it."""
        self._discard(lambda s: s == step)

    def _discard(self, doomed: Callable[[int], bool]) -> None:
        self.wait()
        with self._cond:
            for slot in self.slots:
                if slot.complete and slot.step is not None and doomed(slot.step):
                    fmt.mark_writing(slot.mem.array)
                    slot.complete, slot.step = False, None
                    slot.forget()  # found corrupt, maybe: never a source of digests
            done = [i for i, s in enumerate(self.slots) if s.complete]
            self._newest = max(done, key=lambda i: self.slots[i].age) if done else None

    def abort(self, error: BaseException) -> None:
        """Fail the snapshot the training thread waits in (and every later one) with
        ``error``: the commit it waits for will never come (recovery took over)."""
        with self._cond:
            self._aborted = error
            self._cond.notify_all()

    def set_committed(self, step: int) -> None:
        """Record that ``step`` is committed everywhere (gated mode)."""
        with self._cond:
            self.committed = step
            self._cond.notify_all()

    def wait_copy(self) -> None:
        """Block until the in-flight copy has read every tensor (safe to mutate them)."""
        self._copy_done.wait()  # on a GPU: the side stream's copy done (GIL released)

    def wait(self) -> None:
        """Block until the in-flight snapshot is sealed; re-raise a background error."""
        fut = self._inflight
        if fut is not None:
            try:
                fut.result()
            except BaseException:
                pass
        self._raise_background_error()

    # -- reading ----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the complete snapshots held, newest first."""
        with self._cond:
            return sorted((s.step for s in self.slots if s.complete and s.step is not None),
                          reverse=True)

    def path_of(self, step: int) -> Path:
        """The file of the slot holding ``step``'s complete snapshot (the directory if none)."""
        with self._cond:
            return next((s.path for s in self.slots if s.complete and s.step == step),
                        self.directory)

    @contextmanager
    def reading(self, step: Optional[int] = None, verify: bool = True) -> Iterator[fmt.Shard]:
        """Pin a complete snapshot (newest, or ``step``) so it is not overwritten while read."""
        with self._cond:
            cands = [s for s in self.slots if s.complete and (step is None or s.step == step)]
            if not cands:
                raise NoSnapshotError(f"no complete snapshot{'' if step is None else f' of step {step}'}"
                                      f" in {self.directory}")
            slot = max(cands, key=lambda s: s.age)
            slot.readers += 1
        try:
            shard = fmt.open_shard(slot.mem.array, str(slot.path), verify=False)
            if verify:
                fmt.verify_data(shard, str(slot.path), map_fn=self.map_fn)
            yield shard
        finally:
            with self._cond:
                slot.readers -= 1
                self._cond.notify_all()

    def close(self, unlink: bool = False) -> None:
        """Finish background work and release the slots (``unlink`` deletes them)."""
        try:
            self._await_reserve()
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.hashers.shutdown(wait=True)
            if self.watch is not None:
                self.watch.close()
            for slot in self.slots:
                slot.release(unlink)
