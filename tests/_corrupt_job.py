"""A training function for tests/test_runtime.py, pickled by value to the workers: the
wrapped job, except that rank 1 of the first generation flips one byte in the data of
its own committed snapshot right before a fault kills it at ``at_step``. Its restore
must then find the local copy corrupt and take the peer's replica instead."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from memckpt.format import shard as fmt


@dataclass(frozen=True)
class CorruptOwnSlotThenDie:
    job: Any
    at_step: int
    rank: int = 1

    def __call__(self, ctx: Any) -> Any:
        if ctx.generation == 0 and ctx.rank == self.rank:
            ctx = _Corrupting(ctx, self.at_step)
        return self.job(ctx)


class _Corrupting:
    """Delegates to a WorkerContext; corrupts the committed snapshot before ``at_step``."""

    def __init__(self, ctx: Any, at_step: int) -> None:
        self._ctx, self._at = ctx, at_step

    def step(self, state: Any, step: int, **metrics: float) -> None:
        if step == self._at:
            flip_committed(self._ctx, step - 1)
        return self._ctx.step(state, step, **metrics)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def flip_committed(ctx: Any, step: int, timeout_s: float = 60.0) -> None:
    """Wait until ``step`` is committed (every copy acknowledged, so a recovery resumes
    there), then flip a byte in the middle of its data in this rank's own slot file."""
    engine = ctx.ckpt.engine
    deadline = time.time() + timeout_s
    while engine.committed is None or engine.committed < step:
        if time.time() > deadline:
            raise AssertionError(f"step {step} was not committed within {timeout_s} s")
        time.sleep(0.01)
    with engine.reading(step, verify=True) as shard:  # intact until now
        at = fmt.data_offset(shard.header_capacity) + shard.layout.data_len // 2
    (slot,) = [s for s in engine.slots if s.complete and s.step == step]
    with open(slot.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
