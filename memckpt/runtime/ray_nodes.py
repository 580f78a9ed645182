"""The cluster's nodes as every process sees them: which are alive, pinning a task or an
actor to one, and where a process runs (:class:`Whereabouts`: the coordinator's, a store's;
:class:`WorkerInfo`: a worker's, with its rank). Shared by every room of the runtime (the
records cross from one process to another: a worker registers with the coordinator, which
``memckpt status`` shows and ``memckpt kill`` reads); imports none of them, nor Ray until
a call needs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypedDict


def on_node(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def alive_node_ids() -> set[str]:
    import ray
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _check_id(owner: object, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{type(owner).__name__}.{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Whereabouts:
    """A process on the cluster: its Ray node and its pid (a store's ``ping``, the
    coordinator's ``whereabouts``: what a fault aimed at it signals)."""

    node_id: str
    pid: int

    def __post_init__(self) -> None:
        _check_id(self, "pid", self.pid)


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's process: the rank it runs (None: a spare, or parked between jobs), its pid
    and its Ray node. The coordinator keeps one per rank (``workers`` in ``memckpt status``,
    written with :func:`dataclasses.asdict`: :class:`WorkerInfoFields`)."""

    rank: Optional[int]
    pid: int
    node_id: str

    def __post_init__(self) -> None:
        if self.rank is not None:
            _check_id(self, "rank", self.rank)
        _check_id(self, "pid", self.pid)


class WorkerInfoFields(TypedDict):
    """:class:`WorkerInfo` as JSON (the coordinator's status, its saved state)."""

    rank: Optional[int]
    pid: int
    node_id: str
