"""The rows of ``memckpt bench persist``: each method's median time with its throughput and
its fraction of the raw write to the same place."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

RAW_DISK, RAW_S3 = "raw-disk-write", "raw-s3-upload"


@dataclass(frozen=True)
class Row:
    method: str  # raw-disk-write, memckpt-disk, raw-s3-upload, memckpt-s3
    state_bytes: int
    median_s: float
    throughput_Bps: float
    fraction_of_raw: float  # the raw write's time / this one's (1.0 for the raw write)

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it."""
        return {"benchmark": "persist", **asdict(self)}


def rows_at(nbytes: int, times: dict[str, float]) -> list[Row]:
    """One shard size's rows from each method's median seconds (the raw writes included)."""
    return [Row(method, nbytes, t, nbytes / t,
                times[RAW_S3 if "s3" in method else RAW_DISK] / t)
            for method, t in times.items()]
