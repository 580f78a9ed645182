"""Background persistence of committed RAM snapshots to the slower tiers (disk, S3).

One thread per process. ``submit(step, tiers)`` only records the request (a
newer one replaces an older one still waiting), so the training step never
waits for storage. The thread pins the snapshot slot just long enough to copy
it into a staging buffer in RAM, releases it, and uploads from the staging
copy, so a slow upload never holds a slot the snapshot engine needs. Retryable
storage errors (endpoint down, throttling) are reported and retried with
exponential backoff until they succeed or a newer step supersedes them; the
RAM tier is unaffected throughout.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from memckpt.buffers import RamRegion
from memckpt.config import PersistTier
from memckpt.errors import NoSnapshotError
from memckpt.persist.catalog import CheckpointStore
from memckpt.persist.errors import PersistError
from memckpt.persist.manifest import ShardEntry
from memckpt.shard import Shard

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
        self.rank, self.reader, self.staging_path = rank, reader, staging
        self.folder_for, self.on_written, self.on_event = folder_for, on_written, on_event
        self.world_size = world_size  # a committed step of another world size is never touched
        self._staging: Optional[RamRegion] = None
        self._cond = threading.Condition()
        self._pending: Optional[_Job] = None
        self._busy = False
        self._closed = False
        self._writing: Optional[int] = None  # the tier the thread is writing to
        self._failing: set[int] = set()  # tiers whose last attempt failed (retryable)
        self.last_persisted: dict[int, int] = {}  # tier -> step
        self._thread = threading.Thread(target=self._loop, name="memckpt-persister", daemon=True)
        self._thread.start()

    def due(self, step: int) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.tiers) if step % t.every == 0)

    def submit(self, step: int, tiers: Sequence[int], stage_now: bool = False,
               wait: bool = False) -> bool:
        """Persist ``step`` to ``tiers`` in the background; False if skipped.

        ``stage_now`` copies the snapshot into the staging buffer on the calling thread
        (call it while the step's slot is guaranteed in RAM). If an upload still uses the
        buffer, ``wait`` waits for it; otherwise this step is skipped and said so. An
        upload to a tier that is failing (retrying with backoff) is never waited for nor
        a reason to skip: this newer step supersedes it, and the thread stages it from
        its slot (if still in RAM), so storage being down never holds the caller.
        """
        tiers = tuple(tiers)
        if not tiers:
            return False
        with self._cond:
            if stage_now and self._busy:
                if not wait and not self._stuck():
                    self.on_event("persist_skipped", step=step,
                                  reason="the previous step is still being written")
                    return False
                self._cond.wait_for(lambda: not self._busy or self._stuck() or self._closed)
                if self._busy:  # the upload in progress is failing: supersede it
                    stage_now = False
            if stage_now:
                if self._pending is not None:
                    self.on_event("persist_superseded", step=self._pending.step, by=step)
                    self._pending = None
                if self._stage(step) is None:
                    return False
            elif self._pending is not None:
                self.on_event("persist_superseded", step=self._pending.step, by=step)
            self._pending = _Job(step, tiers, staged=stage_now)
            self._cond.notify_all()
        return True

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
        """The upload in progress goes to a tier whose last attempt failed (under the lock)."""
        return self._busy and self._writing in self._failing

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                self._run(job)
            except BaseException as e:  # never kill the thread: report and go on
                self.on_event("persist_failed", step=job.step, error=str(e))
            finally:
                with self._cond:
                    self._busy, self._writing = False, None
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
            self.on_event("persist_skipped", step=step,
                          reason="the snapshot left RAM before it could be staged")
            return None
        return memoryview(self._staging.array)

    def _run(self, job: _Job) -> None:
        data = memoryview(self._staging.array) if job.staged else self._stage(job.step)
        if data is None:
            return
        for tier in job.tiers:
            store = self.stores[tier]
            delay = 1.0
            with self._cond:
                self._writing = tier
                self._cond.notify_all()  # a waiting submit re-checks whether this tier fails
            while True:
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
                        self._healthy(tier)
                        break  # already persisted (e.g. again at shutdown)
                    entry = store.write_shard(job.step, self.rank, data, verify=False,
                                              folder=folder, replace=True)
                    self.on_written(tier, job.step, entry)
                    self.last_persisted[tier] = job.step
                    self.on_event("shard_persisted", step=job.step,
                                  tier=store.describe(), bytes=entry.size,
                                  seconds=time.perf_counter() - t0)
                    self._healthy(tier)
                    break
                except PersistError as e:
                    if not e.retryable:
                        self.on_event("persist_failed", step=job.step,
                                      tier=store.describe(), error=str(e))
                        break
                    self.on_event("persist_retry", step=job.step,
                                  tier=store.describe(), error=str(e), retry_in_s=delay)
                    with self._cond:  # a newer step supersedes this one
                        self._failing.add(tier)
                        self._cond.notify_all()  # a submit waiting for this upload stops waiting
                        self._cond.wait_for(lambda: self._pending is not None or self._closed,
                                            timeout=delay)
                        if self._pending is not None or self._closed:
                            return
                    delay = min(BACKOFF_MAX_S, delay * 2)

    def _healthy(self, tier: int) -> None:
        with self._cond:
            self._failing.discard(tier)

    def describe(self) -> list[str]:
        return [s.describe() for s in self.stores]


def persisted_restore(stores: Sequence[CheckpointStore], world_size: int
                      ) -> tuple[Optional[int], Optional[Any], list[str]]:
    """The checkpoint to resume from across tiers: (tier index, manifest, skipped reasons).

    The newest complete checkpoint, whatever wrote it: one of another world size is
    resharded (:mod:`memckpt.reshard`, its reads verified chunk by chunk); one of this
    world size is verified first (every shard) and skipped for an older one when
    corrupt. A changed setting (snapshot interval, tiers) does not block a resume, and
    a different model is refused by name when it is loaded.
    """
    from memckpt.persist.catalog import find_latest
    store, newest, _ = find_latest(list(stores), verify=False)
    if store is not None and newest.world_size != world_size:
        return list(stores).index(store), newest, []
    store, manifest, reasons = find_latest(list(stores), world_size=world_size, verify=True)
    if store is None:
        return None, None, reasons
    return list(stores).index(store), manifest, reasons

