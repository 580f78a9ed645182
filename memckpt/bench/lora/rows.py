"""The rows of ``memckpt bench lora``: one per checkpointer of the job, medians over its
steady steps, with the ratios against "off" (the whole state copied) and against the
trainable part alone."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from statistics import median
from typing import Any, Optional

LABELS = {"verify": 'skip_unchanged="verify"', "trust": 'skip_unchanged="trust"',
          "off": 'skip_unchanged="off" (all copied)', "trainable": "trainable part alone"}


@dataclass(frozen=True)
class Row:
    variant: str  # "verify", "trust", "off" (the whole job's state), "trainable" (the adapter alone)
    label: str
    skip_unchanged: str
    preset: str
    job_state_bytes: int  # what TrainState(model, optimizer) captures of the whole job
    frozen_share: float  # the frozen base's share of job_state_bytes
    state_bytes: int  # what this row's TrainState captures
    shard_bytes: int  # one sealed snapshot, header included: what a holder reusing nothing receives
    steps: int  # steady steps the medians are over (after `warmup` snapshots)
    warmup: int
    blocked_s: float  # Checkpointer.step: the time the training loop waited
    stall_s: float  # of which the engine's copy (EngineStats.last_stall_s)
    seal_s: float  # the seal after it, off the training thread
    copied_bytes: int  # EngineStats.last_copied_bytes
    unchanged_bytes: int  # EngineStats.last_unchanged_bytes: left where they were
    sent_bytes: int  # what StoreConnection.send returned: the bytes that crossed to the holder
    send_s: float
    ram_bytes: int  # allocated bytes of the checkpointer's two slots
    ram_over_state: float  # ram_bytes / state_bytes
    holder_bytes: int  # allocated bytes of its holder's two replica slots
    held_over_state: float  # (ram_bytes + holder_bytes) / state_bytes: the footprint, k=1
    blocked_vs_off: Optional[float]
    blocked_vs_trainable: Optional[float]
    copied_vs_off: Optional[float]
    sent_vs_off: Optional[float]
    sent_vs_shard: float
    blocked_per_step_s: tuple[float, ...]
    foreign_cpu: Optional[float]  # other processes' share of the CPU while it snapshotted
    quiet_timeouts: int  # --wait-quiet: steps whose wait for a quiet machine ran out
    machine: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it."""
        return {"benchmark": "lora", **dataclasses.asdict(self)}


def _ratio(d: dict[str, float], base: Optional[dict[str, float]], key: str) -> Optional[float]:
    """``d[key]`` over ``base[key]``; None without a base (its row not measured) or at 0."""
    return d[key] / base[key] if base and base[key] else None


def derive(measured: list[dict[str, Any]], preset: str, job_state_bytes: int,
           frozen_share: float, machine: dict[str, Any]) -> list[Row]:
    """Rows from :meth:`memckpt.bench.lora.measure.LoraBench.measured`."""
    med = {m["variant"]: {k: median(s[k] for s in m["steps"])
                          for k in ("blocked_s", "stall_s", "seal_s", "copied_bytes",
                                    "unchanged_bytes", "sent_bytes", "send_s", "shard_bytes")}
           for m in measured}
    off, alone = med.get("off"), med.get("trainable")
    rows = []
    for m in measured:
        d = med[m["variant"]]
        rows.append(Row(
            variant=m["variant"], label=LABELS[m["variant"]], skip_unchanged=m["skip_unchanged"],
            preset=preset, job_state_bytes=job_state_bytes, frozen_share=frozen_share,
            state_bytes=m["state_bytes"], shard_bytes=int(d["shard_bytes"]), steps=len(m["steps"]),
            warmup=m["warmup"], blocked_s=d["blocked_s"], stall_s=d["stall_s"], seal_s=d["seal_s"],
            copied_bytes=int(d["copied_bytes"]), unchanged_bytes=int(d["unchanged_bytes"]),
            sent_bytes=int(d["sent_bytes"]), send_s=d["send_s"], ram_bytes=m["ram_bytes"],
            ram_over_state=m["ram_bytes"] / m["state_bytes"], holder_bytes=m["holder_bytes"],
            held_over_state=(m["ram_bytes"] + m["holder_bytes"]) / m["state_bytes"],
            blocked_vs_off=_ratio(d, off, "blocked_s"),
            blocked_vs_trainable=_ratio(d, alone, "blocked_s"),
            copied_vs_off=_ratio(d, off, "copied_bytes"),
            sent_vs_off=_ratio(d, off, "sent_bytes"),
            sent_vs_shard=d["sent_bytes"] / d["shard_bytes"],
            blocked_per_step_s=tuple(s["blocked_s"] for s in m["steps"]),
            foreign_cpu=m["foreign_cpu"], quiet_timeouts=m["quiet_timeouts"], machine=machine))
    return rows
