"""What a node's store sends the coordinator, one definition for both ends: per step a
:class:`ReadyBatch` (``node_ready``), per heartbeat interval a :class:`Heartbeat`
(``node_heartbeat``), and step summaries (:class:`~memckpt.policy.step_metrics.StepSummary`)
on both or alone (``node_metrics``). Each is the same size whatever the node's ranks, except
for the ranks it names: those placed short of their holders, or late to beat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memckpt.policy.step_metrics import StepSummary


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
