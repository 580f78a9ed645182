"""The coordinator's part in persisting to the slower tiers (disk, S3): a requested stop or
persist is pinned to the first step committed at or after it (decided at that commit, so
every rank persists the same step while its snapshot is still in RAM); each tier's folder
for a step is chosen once for every rank; the last rank's shard in writes the manifest
(:meth:`~memckpt.persist.CheckpointStore.commit`). A rank that passed another model's
checkpoint over (``load.on_incompatible="start_fresh"``) protects its folders from this run.

A mixin of :class:`~memckpt.runtime.coordinator.coordinator.Coordinator`: these are its
actor methods, kept apart from the per-step commit path.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from memckpt.persist.catalog import protect
from memckpt.runtime.coordinator.job_state import JobState, StopRequest


class PersistCalls:
    job: str
    fingerprint: str
    world_size: int
    stores: list[Any]  # memckpt.persist.CheckpointStore, one per tier
    _persist_shards: dict[tuple[int, int], dict[int, Any]]  # (tier, step) -> rank -> entry
    _folders: dict[tuple[int, int], str]
    s: JobState
    _cond: asyncio.Condition

    def _save(self) -> None:
        raise NotImplementedError  # the Coordinator's

    def event(self, kind: str, **fields: Any) -> None:
        raise NotImplementedError  # the Coordinator's

    async def request_stop(self, at_step: int, action: str) -> None:
        """Persist the first step committed at or after ``at_step`` to every tier; then the
        driver stops the job (action "stop") or goes on ("persist"). Decided at commit time,
        so every rank persists the same step while its snapshot is still in RAM."""
        self.s.stop = StopRequest(at_step, action)
        self.event("stop_requested", at=at_step, action=action)
        self._save()

    async def stop_state(self) -> Optional[StopRequest]:
        return self.s.stop

    async def clear_stop(self) -> None:
        self.s.stop = None
        self._save()

    async def persist_folder(self, tier: int, step: int) -> str:
        """The folder ``step`` goes into on ``tier``: decided once, the same for every rank."""
        key = (tier, step)
        if key not in self._folders:
            self._folders[key] = self.stores[tier].folder_for(step)
        return self._folders[key]

    async def persist_ready(self, tier: int, step: int, rank: int, entry: Any) -> bool:
        """``rank``'s shard of ``step`` is stored on ``tier``; the last one writes the manifest."""
        got = self._persist_shards.setdefault((tier, step), {})
        got[rank] = entry
        if len(got) < self.world_size:
            return False
        del self._persist_shards[(tier, step)]
        self._folders.pop((tier, step), None)
        store = self.stores[tier]
        t0 = time.time()
        store.commit(step, self.world_size, [got[r] for r in sorted(got)], self.fingerprint,
                     placement={"holders": self.s.holders}, job=self.job)
        self.s.persisted[str(tier)] = step
        self._save()
        self.event("persisted", step=step, tier=store.describe(), manifest_s=time.time() - t0)
        return True

    async def started_over(self, gen: int, rank: int, step: int,
                           folders: dict[int, list[str]]) -> None:
        """``rank`` passed another model's persisted checkpoint over and starts at ``step``
        (load.on_incompatible="start_fresh"): the old model's step is no longer this job's
        committed one, and ``folders`` (per tier) are never written or removed.
        Every rank says so before it snapshots its start, so before this run commits."""
        async with self._cond:
            if gen != self.s.gen:
                return
            protect(self.stores, folders)
            saved = self.s.protected
            for tier, names in folders.items():
                saved[str(tier)] = sorted(set(saved.get(str(tier), [])) | set(names))
            if self.s.committed is not None:
                self.event("started_over", rank=rank, gen=gen, step=step,
                           old_committed=self.s.committed)
                self.s.committed = None
            self._save()

    async def protected(self) -> dict[str, list[str]]:
        """The folders per tier no rank may write (see :meth:`started_over`)."""
        return dict(self.s.protected)

    async def persisted(self) -> dict[str, int]:
        return dict(self.s.persisted)
