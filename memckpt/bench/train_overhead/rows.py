"""One measured loop of ``memckpt bench train-overhead``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Row:
    variant: str  # "none" (no snapshots), or "<mode>-<on_sealing>"
    mode: Optional[str]  # snapshot_mode; None without snapshots
    on_sealing: Optional[str]  # engine.on_sealing; None without snapshots
    device: str
    state_bytes: int
    steps: int
    step_s: float  # median step time
    step_times_s: tuple[float, ...]
    overhead: Optional[float]  # step_s / the no-snapshot loop's - 1
    requested: int  # snapshots due (one per step)
    landed: int  # snapshots sealed
    seal_threads: int
    machine: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
