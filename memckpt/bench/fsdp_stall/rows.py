"""The rows of ``memckpt bench fsdp-stall``: one per rank, written by the rank's process."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Row:
    rank: int
    ranks: int
    device: str  # cpu or cuda
    size_bytes: int  # the whole model's parameters + AdamW state, before sharding
    local_bytes: int  # this rank's share
    dtensors: int  # how many of its tensors are sharded DTensors
    layers: int
    width: int
    repeats: int
    memcpy_s: float  # median copy of the local tensors into one preallocated buffer
    memckpt_s: float  # median Checkpointer.step() stall, sync mode
    ratio_to_memcpy: Optional[float]
    best_ratio_to_memcpy: float  # of the fastest repeats: steadier on a busy machine
    capture_s: float
    gather_s: float  # median full_tensor() of every parameter, for scale
    memcpy_times_s: list[float]
    memckpt_times_s: list[float]
    allocations_flat: bool  # no slot allocation after warm-up
    foreign_cpu: Optional[float]  # the CPU share other processes took meanwhile
    machine: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it."""
        return asdict(self)
