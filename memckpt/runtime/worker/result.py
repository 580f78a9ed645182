"""What a worker tells the driver: who it is (:class:`WorkerInfo`, defined in
:mod:`memckpt.runtime.ray_nodes` beside the other processes' whereabouts, since the
coordinator keeps it too and imports no worker code), what a generation of its
rank ended with (:class:`WorkerResult`), what the rank's restore measured
(:class:`RestoreReport`) and its replica traffic (:class:`ReplicationTotals`). One definition
each, imported by both ends (the driver's messages to the worker are in
:mod:`memckpt.runtime.worker.spec`); where the driver writes one to JSON (the run summary, an
event), :func:`dataclasses.asdict` gives the keys it always had."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from memckpt.runtime.ray_nodes import WorkerInfo

__all__ = ["ReplicationTotals", "RestoreReport", "WorkerInfo", "WorkerResult"]


def _non_negative(owner: object, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{type(owner).__name__}.{name} must be a number, got {value!r}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{type(owner).__name__}.{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class RestoreReport:
    """What one rank's restore took (seconds, and bytes fetched), and whether it sent its
    restored shard out to its holders again. ``None``: a phase this restore's path does not
    have (only a peer's restore connects to a store and installs a fetched shard; a rank
    whose own slot holds the step is not snapshotted again)."""

    fetch_and_load_s: float = 0.0  # the whole restore: read or fetch, verify, load the state
    connect_s: Optional[float] = None  # a peer's: connecting to its store
    install_s: Optional[float] = None  # a peer's: slot allocation + fetch + verification
    fetch_s: float = 0.0  # a peer's: the bytes over TCP, slot allocation apart
    slot_alloc_s: float = 0.0  # a peer's: allocating the slot the bytes land in
    fetch_bytes: int = 0  # bytes fetched from a peer, or read through the universal restore
    resnapshot_s: Optional[float] = None  # copying the restored state out again
    recopied: bool = False  # the restored step went out again to the rank's holders

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "recopied":
                if not isinstance(value, bool):
                    raise TypeError(f"RestoreReport.recopied must be a bool, got {value!r}")
            elif value is not None:
                _non_negative(self, f.name, value)
        if not isinstance(self.fetch_bytes, int):
            raise TypeError(f"RestoreReport.fetch_bytes must be an int, got {self.fetch_bytes!r}")


@dataclass(frozen=True)
class ReplicationTotals:
    """A finished generation's replica traffic from one rank: bytes it sent its holders, and
    bytes holders filled from copies on their own node instead (DDP's identical parameters)."""

    sent_bytes: int
    filled_bytes: int

    def __post_init__(self) -> None:
        _non_negative(self, "sent_bytes", self.sent_bytes)
        _non_negative(self, "filled_bytes", self.filled_bytes)


@dataclass(frozen=True)
class WorkerResult:
    """What :meth:`memckpt.runtime.worker.worker.Worker.run` returns for one generation of a
    rank: finished (``result``, ``digest``, ``replication``), or ``stopped`` at the step a
    requested stop persisted. ``restore``: the rank's restore at the generation's start, None
    on a fresh start; ``source``: where a finished rank's state was restored from."""

    rank: int
    result: Any = None  # what the training function returned (the user's own)
    digest: Optional[str] = None  # the final state's digest
    stopped: Optional[int] = None  # the step a requested stop ended the generation after
    restore: Optional[RestoreReport] = None
    source: Optional[str] = None
    replication: Optional[ReplicationTotals] = None

    def __post_init__(self) -> None:
        _non_negative(self, "rank", self.rank)
        if self.stopped is not None:
            _non_negative(self, "stopped", self.stopped)
            if self.digest is not None or self.result is not None or self.replication is not None:
                raise ValueError("a stopped generation's WorkerResult carries no result, "
                                 "digest or replication")
