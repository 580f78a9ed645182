"""The rows of ``memckpt bench elastic``: one per way back from a lost node."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Row:
    method: str  # "memckpt elastic (RAM reshard)" or "restart + DCP load (disk)"
    state_mb_per_rank: int
    seconds: float  # node death -> every rank's first step at the new size
    detect_s: float  # node death -> the failure detected
    restored_s: float  # node death -> every rank's state loaded
    from_world_size: int
    to_world_size: int
    step: int  # the committed step both resume from

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it."""
        return {"benchmark": "elastic", **asdict(self)}
