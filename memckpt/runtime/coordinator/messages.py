"""What the coordinator is sent and answers, one definition for both ends.

A node's store sends it, per step, a :class:`ReadyBatch` (``node_ready``), per heartbeat
interval a :class:`Heartbeat` (``node_heartbeat``), and step summaries
(:class:`~memckpt.policy.step_metrics.StepSummary`) on both or alone (``node_metrics``).
Each is the same size whatever the node's ranks, except for the ranks it names: those placed
short of their holders, or late to beat.

The driver sends an elastic job's size (:class:`ElasticInfo`, ``set_elastic``) and events
(:data:`EventFields`, ``log_event``), and polls :class:`Progress`. ``memckpt status`` (and
``memckpt kill``) read :class:`CoordinatorStatus`: JSON-ready, its keys the ones the status
always had (``--json`` prints it as is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TypedDict

from memckpt.policy.step_metrics import StepSummary
from memckpt.runtime.ray_nodes import WorkerInfoFields

# An event's fields (``events.jsonl``, ``log_event``, the Ray metrics it counts): free-form
# key/values by nature, each event kind its own (docs/operations.md lists them). The one
# ``Any``-valued mapping that crosses to the coordinator (tests/test_no_untyped_messages.py).
EventFields = Mapping[str, Any]


@dataclass(frozen=True)
class ReadyBatch:
    """Every local rank's shard of ``step`` is placed: ``ready`` of them on all the holders
    their specs name (``expected``: :func:`~memckpt.policy.placement.holders_digest` of those
    ranks' holders, for the coordinator to check against its placement); ``placed``: each
    other rank -> the holders it did place on (the coordinator judges those itself)."""

    gen: int
    step: int
    ready: int
    expected: str
    placed: dict[int, tuple[str, ...]] = field(default_factory=dict)
    metrics: tuple[StepSummary, ...] = ()

    @property
    def readies(self) -> bool:
        """It says where ranks placed (False: a step's summaries alone, relayed for a step
        no rank snapshotted: a node runs at least one rank, so a real batch names some)."""
        return bool(self.ready or self.placed)


@dataclass(frozen=True)
class Heartbeat:
    """The node's sign of life: the newest step its ranks reached (``top``), the age of its
    oldest rank's last sign (``oldest_s``), each rank silent longer than the node's
    ``late_s`` -> (its age, its step), and the metrics still held. ``ram``: (bytes its
    memckpt files hold, its budget), every few seconds."""

    gen: int
    top: int
    oldest_s: float
    late: dict[int, tuple[float, int]] = field(default_factory=dict)
    metrics: tuple[StepSummary, ...] = ()
    ram: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class Progress:
    """The coordinator's answer to the driver's poll (ten a second), read from counters:
    the generation, the committed step, the newest step any rank finished and the step
    every rank reached (-1 until each has reported), rank 0's pace over the last seconds,
    the newest step's largest snapshot stall so far, and how far commits lag behind."""

    gen: int
    committed: Optional[int]
    min_step: int = -1
    max_step: int = -1
    last_loss: Optional[float] = None
    steps_per_s: Optional[float] = None
    stall_ms: Optional[float] = None
    lag: Optional[int] = None


# An elastic job's last resize (``elastic.last_resize``): "from" is a keyword, hence the
# functional form. ``sources``: old rank -> where its chunks were read ("ram:<node>").
Resize = TypedDict("Resize", {"from": int, "to": int, "step": int, "why": str,
                              "sources": dict[str, list[str]]})


class ElasticInfo(TypedDict, total=False):
    """The driver's view of an elastic job's size, sent to ``set_elastic`` in parts (each
    call updates the keys it names) and shown by ``memckpt status`` under ``elastic``."""

    world_size: int
    num_workers: int
    min_workers: Optional[int]  # Config.workers.min_workers
    grow: bool
    pending_growth: Optional[int]  # the size the job grows to at the next committed step
    last_resize: Resize


class StopFields(TypedDict):
    """:class:`~memckpt.runtime.coordinator.job_state.StopRequest` as JSON."""

    at: int
    action: str
    step: Optional[int]


class UnitStatus(TypedDict):
    """A node's (or a lone rank's) latest step summary, as ``memckpt status`` shows it."""

    step: int
    ranks: int
    stall_max_s: float
    time: float
    landed: float
    requested: float
    age_s: float  # since its last report


class NodeBeat(TypedDict):
    """A node store's last heartbeat: its age, its newest step, its oldest rank's age."""

    age_s: float
    step: int
    oldest_rank_age_s: float


class RankBeat(TypedDict):
    """A rank named late by its store, or heard alone: its last sign's age, its step."""

    age_s: float
    step: int


class NodeRam(TypedDict):
    """A node's memckpt files in RAM, its budget and the peak (bytes)."""

    held: int
    budget: int
    peak: int


class LivenessStatus(TypedDict):
    """The liveness part of the status (:meth:`~memckpt.runtime.coordinator.heartbeats.Liveness.status`)."""

    node_beats: dict[str, NodeBeat]
    heartbeats: dict[str, RankBeat]  # str(rank) -> its last sign


class JobStateFields(TypedDict):
    """:class:`~memckpt.runtime.coordinator.job_state.JobState` as JSON, field by field."""

    gen: int
    assignment: dict[str, str]  # str(rank) -> node
    holders: dict[str, list[str]]  # str(rank) -> replica holders
    committed: Optional[int]
    workers: dict[str, WorkerInfoFields]  # str(rank) -> its worker's process
    fired: list[str]
    fired_at: dict[str, float]
    stores: dict[str, str]  # node -> its replica store's actor name
    stop: Optional[StopFields]
    persisted: dict[str, int]
    protected: dict[str, list[str]]
    elastic: Optional[ElasticInfo]
    standby: bool
    fault_requests: dict[str, str]
    started_at: float
    restarts_of_coordinator: int
    done: bool


class CoordinatorStatus(JobStateFields, LivenessStatus):
    """``Coordinator.status()``: the job's state (:class:`JobStateFields`) and what is live:
    each unit's progress, the snapshots landed, beats (:class:`LivenessStatus`), nodes' RAM,
    and the node messages refused as stale."""

    units: dict[str, UnitStatus]
    snapshots: dict[str, float]  # "requested", "landed", "skipped" over the ranks
    node_ram: dict[str, NodeRam]
    refused_stale: int
