"""The rows of ``memckpt bench reshard``: one per (source, new world size)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Row:
    source: str  # ram, disk or dcp
    from_ranks: int
    to_ranks: int
    state_bytes: int  # the whole state the writers wrote
    seconds: float  # the slowest rank's restore
    bytes_read: Optional[int]  # by every rank together; None where not counted (dcp)
    peak_rss: int  # the largest rank's RSS high-water mark during its restore
    peak_growth: int  # ... less its RSS just before
    new_shard_bytes: int  # the largest new shard: parameters + 2 moments
    machine: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it."""
        return {"benchmark": "reshard", **asdict(self)}
