"""The coordinator's chaos bookkeeping, for drills and ``memckpt kill``: fire-once claims
(a scheduled fault fires once per job, whichever rank reaches it first, across restarts
of the coordinator too), faults a rank asks the driver to carry out (a node, a store), and
the standby flag a steady fault waits for. All of it is in the job's small state
(:class:`~memckpt.runtime.coordinator.job_state.JobState`): written at once, so a restarted
coordinator never fires a fault twice.

A mixin of :class:`~memckpt.runtime.coordinator.coordinator.Coordinator`: these are its
actor methods, kept apart because no training step needs them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from memckpt.runtime.coordinator.job_state import JobState


class DrillCalls:
    s: JobState
    _cond: asyncio.Condition

    def _save(self) -> None:
        raise NotImplementedError  # the Coordinator's

    async def _until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds (checked at every notify); False on timeout."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(predicate), timeout_s)
                return True
            except asyncio.TimeoutError:
                return False

    async def claim(self, key: str, standby_timeout_s: float = 0.0) -> bool:
        """Fire-once: True the first time ``key`` is claimed in this job. With a timeout, a
        steady fault: first wait (up to it) until the job is in standby (set_standby)."""
        if standby_timeout_s > 0 and key not in self.s.fired:
            # on timeout, fire anyway: a drill must not hang on a spare that never came
            await self._until(lambda: self.s.standby or key in self.s.fired,
                              standby_timeout_s)
        if key in self.s.fired:
            return False
        self.s.fired.append(key)
        self.s.fired_at[key] = time.time()
        self._save()
        return True

    async def set_standby(self, ready: bool) -> None:
        """The driver: every node's warm spare is (or is no longer) ready to take over."""
        async with self._cond:
            self.s.standby = ready
            self._save()
            self._cond.notify_all()

    async def request_fault(self, key: str) -> None:
        """A rank reached a scheduled fault the driver must carry out (node, store, ...)."""
        async with self._cond:
            self.s.fault_requests[key] = "requested"
            self._save()

    async def pending_faults(self) -> list[str]:
        return [k for k, v in self.s.fault_requests.items() if v == "requested"]

    async def fault_done(self, key: str) -> None:
        async with self._cond:
            self.s.fault_requests[key] = "done"
            self._save()
            self._cond.notify_all()

    async def wait_fault(self, key: str, timeout_s: float) -> None:
        await self._until(lambda: self.s.fault_requests.get(key) == "done", timeout_s)
