"""The coordinator's small state: what must survive its restart, one typed record.

A :class:`~memckpt.runtime.coordinator.state_store.StateStore` keeps it as JSON (Ray's GCS
by default); :meth:`JobState.load` reads a record any earlier version wrote (keys it does
not know are dropped, missing ones take their defaults). ``memckpt status`` shows its
fields under the same names.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Optional, cast

from memckpt.runtime.coordinator.messages import ElasticInfo, JobStateFields
from memckpt.runtime.ray_nodes import WorkerInfo


@dataclass
class StopRequest:
    """Persist the first step committed at or after ``at`` to every tier, then "stop" or
    "persist" (go on); ``step``: that step, once decided (at its commit)."""

    at: int
    action: str
    step: Optional[int] = None


def _worker_info(saved: object) -> Optional[WorkerInfo]:
    """A saved worker's record (its fields, as every version wrote them); None for one that
    is not (dropped: its rank registers again with its next generation)."""
    try:
        return WorkerInfo(**saved) if isinstance(saved, dict) else None
    except (TypeError, ValueError):
        return None


@dataclass
class JobState:
    """Membership, the committed step and the rare decisions (see the coordinator's module
    docstring for when it is written)."""

    gen: int = -1
    assignment: dict[str, str] = field(default_factory=dict)  # str(rank) -> node
    holders: dict[str, list[str]] = field(default_factory=dict)  # str(rank) -> replica holders
    committed: Optional[int] = None
    workers: dict[str, WorkerInfo] = field(default_factory=dict)  # str(rank) -> its process
    fired: list[str] = field(default_factory=list)  # fire-once chaos keys claimed
    fired_at: dict[str, float] = field(default_factory=dict)
    stores: dict[str, str] = field(default_factory=dict)  # node -> its replica store's name
    stop: Optional[StopRequest] = None
    persisted: dict[str, int] = field(default_factory=dict)  # str(tier) -> newest step
    protected: dict[str, list[str]] = field(default_factory=dict)  # str(tier) -> folders
    elastic: Optional[ElasticInfo] = None  # the driver's view of an elastic job's size
    standby: bool = False  # every node's warm spare is ready
    fault_requests: dict[str, str] = field(default_factory=dict)  # key -> requested / done
    started_at: float = field(default_factory=time.time)
    restarts_of_coordinator: int = 0
    done: bool = False

    def dump(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def load(cls, saved: bytes) -> "JobState":
        raw = json.loads(saved)
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in raw.items() if k in known}
        stop = fields.get("stop")
        fields["stop"] = StopRequest(**stop) if isinstance(stop, dict) else None
        fields["workers"] = {r: info for r, info in
                             ((r, _worker_info(w)) for r, w in (fields.get("workers") or {}).items())
                             if info is not None}
        return cls(**fields)

    def as_dict(self) -> JobStateFields:
        """The fields as ``status`` shows them (JSON-ready; the records as their fields)."""
        return cast(JobStateFields, dataclasses.asdict(self))
