"""What a snapshot engine counts: snapshots taken, landed and skipped, bytes copied and left."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineStats:
    snapshots: int = 0  # snapshots started (their copy taken)
    landed: int = 0  # snapshots sealed: complete and restorable
    skipped: int = 0  # due but not taken: the previous one was still busy (policy "skip")
    waited_s: float = 0.0  # fall-behind policy "wait": time the step spent waiting
    allocations: int = 0  # slot (re)allocations; stays flat after warm-up
    copied_bytes: int = 0  # tensor bytes copied into slots, all snapshots
    unchanged_bytes: int = 0  # tensor bytes found unchanged in their slot: not copied
    last_copied_bytes: int = 0  # the newest snapshot's
    last_unchanged_bytes: int = 0
    # the newest snapshot's bytes compared with a slot's to tell whether they changed
    # (skip_unchanged="verify"; only the pages written, where the kernel watches them)
    last_compared_bytes: int = 0
    last_stall_s: float = 0.0
    last_step: Optional[int] = None
    last_seal_s: float = 0.0  # the seal of the newest snapshot (on a GPU it runs behind the copy)

    @property
    def requested(self) -> int:
        """Snapshots that were due: taken or skipped."""
        return self.snapshots + self.skipped
