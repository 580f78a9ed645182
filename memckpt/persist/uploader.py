"""Background persistence of committed RAM snapshots to the slower tiers (disk, S3).

One thread per process. ``submit(step, tiers)`` only records the request (a
newer one replaces, and so supersedes, an older one still waiting), so the
training step never waits for storage, whatever the storage does. The step's
own copy into the staging buffer (RAM to RAM) happens at submit when the buffer
is free; while an upload holds it, the thread copies the step from its RAM slot
once the upload ends (if the slot still holds it). Retryable storage errors
(endpoint down, throttling, timeouts) are reported and retried with exponential
backoff until they succeed or a newer step supersedes them; a hung request ends
at the tier's request timeout. :meth:`Persister.close` waits for what is pending
only while the storage makes progress, and says which step it left unpersisted.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from memckpt.engine.buffers import RamRegion
from memckpt.config import PersistTier
from memckpt.errors import NoSnapshotError
from memckpt.persist.catalog import CheckpointStore
from memckpt.errors import PersistError
from memckpt.persist.manifest import ShardEntry
from memckpt.format.shard import Shard

log = logging.getLogger("memckpt.persist")
BACKOFF_MAX_S = 30.0

# step -> a context manager pinning that step's snapshot and yielding its Shard
Reader = Callable[[int], AbstractContextManager[Shard]]


@dataclass
class _Job:
    step: int
    tiers: tuple[int, ...]
    staged: bool = False  # its bytes are already in the staging buffer


class Persister:
    """Writes this rank's shard of due steps to each tier; ``on_written`` commits them.

    A step a tier already holds committed is not written again; when that checkpoint
    is another world size's (``world_size`` given), a ``persist_refused`` event says so.

    ``folder_for(tier, step)`` names the folder the step goes into (decided once
    per step for all ranks); ``on_written(tier, step, entry)`` is called after the
    shard is stored (single process: commit the manifest; multi-rank: tell the
    coordinator, which commits once every rank's shard is in).
    """

    def __init__(self, tiers: Sequence[PersistTier], rank: int, reader: Reader, staging: Path,
                 folder_for: Callable[[int, int], str],
                 on_written: Callable[[int, int, ShardEntry], None],
                 on_event: Callable[..., None], world_size: Optional[int] = None) -> None:
        self.tiers = tuple(tiers)
        self.stores = [CheckpointStore(t) for t in self.tiers]
        for store in self.stores:  # on the constructing thread, before the first step
            store.backend.prepare()
        self.rank, self.reader, self.staging_path = rank, reader, staging
        self.folder_for, self.on_written, self.on_event = folder_for, on_written, on_event
        self.world_size = world_size  # a committed step of another world size is never touched
        self._staging: Optional[RamRegion] = None
        self._cond = threading.Condition()
        self._pending: Optional[_Job] = None
        self._busy = False
        self._closed = False
        self._wake = 0  # bumped by drain(): a retry waiting out its backoff tries again now
        self._drain_since: Optional[float] = None  # the first drain since something landed
        self._writing: Optional[int] = None  # the tier the thread is writing to
        self._failing: set[int] = set()  # tiers whose last attempt failed (retryable)
        self._progress_at = time.monotonic()  # the thread's last step forward
        self._wanted: dict[int, int] = {}  # tier -> newest step submitted
        self._last_error: dict[int, str] = {}  # tier -> why its newest attempt failed
        self._delay: dict[int, float] = {}  # tier -> its current backoff (while failing)
        self._retry_at: dict[int, float] = {}  # tier -> when it may be tried again
        self.last_persisted: dict[int, int] = {}  # tier -> step
        self._thread = threading.Thread(target=self._loop, name="memckpt-persister", daemon=True)
        self._thread.start()

    def due(self, step: int) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.tiers) if step % t.every == 0)

    def submit(self, step: int, tiers: Sequence[int], stage_now: bool = False,
               wait: bool = False) -> bool:
        """Persist ``step`` to ``tiers`` in the background; False if skipped.

        ``stage_now`` copies the snapshot into the staging buffer on the calling thread
        when no upload holds the buffer (call it while the step's slot is guaranteed in
        RAM); otherwise the thread copies it from its slot when the upload ends, and a
        request still waiting is superseded. Nothing here waits for storage unless
        ``wait`` (a requested persist: stop file, signal, :meth:`persist_now`): then it
        waits for a healthy upload to free the buffer, never for one to a tier that is
        failing or silent for its ``close_timeout_s``.
        """
        tiers = tuple(tiers)
        if not tiers:
            return False
        with self._cond:
            if wait and self._busy:
                while self._busy and not self._stuck() and not self._closed:
                    self._cond.wait(0.5)
            if self._pending is not None:
                self._superseded(self._pending.step, step)
                self._pending = None
            staged = stage_now and not self._busy
            if staged and self._stage(step) is None:
                return False
            for tier in tiers:
                self._wanted[tier] = max(step, self._wanted.get(tier, step))
            self._pending = _Job(step, tiers, staged=staged)
            self._cond.notify_all()
        return True

    def _superseded(self, step: int, by: int) -> None:
        self.on_event("persist_superseded", step=step, by=by)
        log.info("memckpt: the persist of step %d gives way to step %d", step, by)

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is pending or being written; False on timeout."""
        deadline = time.time() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.time()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _stuck(self) -> bool:
        """The upload in progress goes to a tier whose last attempt failed, or that has been
        silent for its ``close_timeout_s`` (under the lock)."""
        tier = self._writing
        if not self._busy or tier is None:
            return False
        quiet = self._quiet(tier, self._progress_at)
        return tier in self._failing or quiet >= self.stores[tier].close_timeout_s

    def _quiet(self, tier: int, since: float) -> float:
        """Seconds since ``tier`` last made progress, or since ``since``. A drain counts from
        its own start, not from the thread's: the thread taking up the next job, or the next
        attempt, is not the tier answering (a hung tier would otherwise hold close for one
        close_timeout_s per job it takes up)."""
        last = max(since, self.stores[tier].backend.last_progress)
        return time.monotonic() - last

    def drain(self, max_s: Optional[float] = None) -> bool:
        """Wait for what is pending or being written while storage makes progress.

        A tier that neither answers nor moves bytes for its ``close_timeout_s`` (dead,
        hung, or failing on every retry) is given up on, counting from the first drain
        since something last landed (so a second drain does not wait again); so is
        everything after ``max_s``. A retry waiting out its backoff tries again at once.
        True if nothing is left pending or in flight.
        """
        with self._cond:
            self._wake += 1
            self._cond.notify_all()
            start = time.monotonic()
            if self._pending is not None or self._busy:
                log.info("memckpt: waiting for the persist in flight to %s (a tier silent for "
                         "its close_timeout_s is given up on)", ", ".join(self.describe()))
            while self._pending is not None or self._busy:
                if max_s is not None and time.monotonic() - start >= max_s:
                    return False
                tier = self._writing if self._writing is not None else self._next_tier()
                limit = self.stores[tier].close_timeout_s
                if self._drain_since is None:  # (again, once something landed)
                    self._drain_since = time.monotonic()
                quiet = self._quiet(tier, self._drain_since)
                if quiet >= limit:
                    return False
                self._cond.wait(min(0.5, limit - quiet))
        return True

    def close(self) -> list[str]:
        """:meth:`drain`, then stop the thread (a request still hanging ends at its own
        timeout; nothing after it is written). Returns one line per tier whose newest
        submitted step did not land (empty: everything did), also logged and reported
        as ``persist_abandoned`` events. Idempotent."""
        if self._closed:
            return []
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            left = {t: step for t, step in self._wanted.items()
                    if self.last_persisted.get(t, -1) < step}
            errors = dict(self._last_error)
        lines = []
        for tier, step in sorted(left.items()):
            store = self.stores[tier]
            why = errors.get(tier) or (f"it made no progress for {store.close_timeout_s:g} s "
                                       "(PersistTier.close_timeout_s)")
            lines.append(f"step {step} was not persisted to {store.backend.location()}: {why}")
            self.on_event("persist_abandoned", step=step, tier=store.describe(), reason=why)
            log.warning("memckpt: %s", lines[-1])
        return lines

    def _next_tier(self) -> int:
        job = self._pending
        return job.tiers[0] if job is not None and job.tiers else 0

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, self._pending, self._busy = self._pending, None, True
                self._progress_at = time.monotonic()
            assert job is not None  # the wait above ends on a pending job or on close
            try:
                self._run(job)
            except BaseException as e:  # never kill the thread: report and go on
                self.on_event("persist_failed", step=job.step, error=str(e))
                log.warning("memckpt: persisting step %d failed: %s", job.step, e)
            finally:
                with self._cond:
                    self._busy, self._writing = False, None
                    self._progress_at = time.monotonic()
                    self._cond.notify_all()

    def _stage(self, step: int) -> Optional[memoryview]:
        try:
            with self.reader(step) as shard:
                n = len(shard.raw)
                if self._staging is None or self._staging.size != n:
                    if self._staging is not None:
                        self._staging.close(unlink=True)
                    self._staging = RamRegion.create(self.staging_path, n)
                self._staging.array[:n] = shard.raw
        except NoSnapshotError:
            reason = "the snapshot left RAM before it could be staged"
            self.on_event("persist_skipped", step=step, reason=reason)
            log.info("memckpt: not persisting step %d: %s", step, reason)
            return None
        return memoryview(self._staging.array)

    def _run(self, job: _Job) -> None:
        data = memoryview(self._staging.array) if job.staged and self._staging else None
        for tier in job.tiers:
            store = self.stores[tier]
            with self._cond:
                if self._closed:
                    return
                self._writing = tier
                self._progress_at = time.monotonic()
                self._cond.notify_all()  # a waiting submit re-checks whether this tier fails
            while True:
                if not self._back_off(tier, job.step):
                    return
                if data is None:  # copied from its slot only now: a superseded job never is
                    data = self._stage(job.step)
                    if data is None:
                        with self._cond:
                            for t in job.tiers:
                                self._last_error[t] = (f"step {job.step} left RAM before it "
                                                       "could be staged")
                        return
                t0 = time.perf_counter()
                try:
                    held = store.committed(job.step)
                    folder = self.folder_for(tier, job.step)
                    refused = None
                    if held is not None and self.world_size not in (None, held.world_size):
                        refused = f"a checkpoint of {held.world_size} ranks"
                    elif folder in store.protected:
                        refused = "another model's checkpoint (started fresh beside it)"
                    if refused:
                        self.on_event("persist_refused", step=job.step, tier=store.describe(),
                                      reason=f"{store.describe()}/{folder} holds {refused}; "
                                             "left untouched")
                        break
                    if held is not None:
                        self._landed(tier, job.step)
                        break  # already persisted (e.g. again at shutdown)
                    if self._closed:  # close() gave up on this tier: write nothing more
                        return
                    entry = store.write_shard(job.step, self.rank, data, verify=False,
                                              folder=folder, replace=True)
                    if self._closed:
                        return
                    self.on_written(tier, job.step, entry)
                    self.on_event("shard_persisted", step=job.step,
                                  tier=store.describe(), bytes=entry.size,
                                  seconds=time.perf_counter() - t0)
                    self._landed(tier, job.step)
                    break
                except PersistError as e:
                    if not self._failed(tier, job.step, e):
                        break

    def _failed(self, tier: int, step: int, e: PersistError) -> bool:
        """Record a failed attempt; True if it is worth another (after the tier's backoff)."""
        store = self.stores[tier]
        with self._cond:
            if self._closed:  # an attempt close() gave up on, ending late: nothing to say
                return False
            self._last_error[tier] = f"its last attempt (step {step}) failed: {e.message}"
            if e.retryable:
                delay = self._delay[tier] = min(BACKOFF_MAX_S, self._delay.get(tier, 0.5) * 2)
                self._retry_at[tier] = time.monotonic() + delay
                self._failing.add(tier)
                self._cond.notify_all()  # a submit waiting for this upload stops waiting
        if not e.retryable:
            self.on_event("persist_failed", step=step, tier=store.describe(), error=str(e))
            log.warning("memckpt: persisting step %d failed: %s", step, e)
            return False
        self.on_event("persist_retry", step=step, tier=store.describe(), error=str(e),
                      retry_in_s=delay)
        log.warning("memckpt: persisting step %d: %s (retrying in %.0f s, or with a newer "
                    "step)", step, e.message, delay)
        return True

    def _back_off(self, tier: int, step: int) -> bool:
        """Wait out a failing tier's backoff (across steps, so a throttling store is not
        hammered); False if a newer step supersedes this one or the persister closes.
        :meth:`drain` cuts the wait short for a last try."""
        with self._cond:
            wake = self._wake
            while True:
                if self._closed:
                    return False
                if self._pending is not None and tier in self._failing:
                    self._superseded(step, self._pending.step)
                    return False
                left = self._retry_at.get(tier, 0.0) - time.monotonic()
                if left <= 0 or self._wake != wake:
                    return True
                self._cond.wait(left)

    def _landed(self, tier: int, step: int) -> None:
        with self._cond:
            self._failing.discard(tier)
            self._last_error.pop(tier, None)
            self._delay.pop(tier, None)
            self._retry_at.pop(tier, None)
            self.last_persisted[tier] = max(step, self.last_persisted.get(tier, step))
            self._progress_at = time.monotonic()
            self._drain_since = None

    def describe(self) -> list[str]:
        return [s.describe() for s in self.stores]


def persisted_restore(stores: Sequence[CheckpointStore], world_size: int,
                      below: Optional[int] = None
                      ) -> tuple[Optional[int], Optional[Any], list[str]]:
    """The checkpoint to resume from across tiers: (tier index, manifest, skipped reasons).

    The newest complete checkpoint (older than step ``below`` when given), whatever wrote
    it: one of another world size is resharded (:mod:`memckpt.format.reshard`, its reads verified
    chunk by chunk); one of this world size is verified first (every shard) and skipped for
    an older one when corrupt. A changed setting (snapshot interval, tiers) does not block
    a resume, and a different model is refused by name when it is loaded.
    """
    from memckpt.persist.catalog import find_latest
    store, newest, _ = find_latest(list(stores), verify=False, below=below)
    if store is not None and newest is not None and newest.world_size != world_size:
        return list(stores).index(store), newest, []
    store, manifest, reasons = find_latest(list(stores), world_size=world_size, verify=True,
                                           below=below)
    if store is None:
        return None, None, reasons
    return list(stores).index(store), manifest, reasons

