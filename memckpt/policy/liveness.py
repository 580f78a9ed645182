"""Whether a rank that stopped beating is hung or only starved of CPU.

A rank's heartbeat thread needs a CPU (and the GIL) to beat. On a node whose cores are taken
by something else (a data loader, another job, a busy loop at a higher priority) a live rank
can stay silent past ``failure.heartbeat_timeout_s``: killing it rolls every rank back to the
last commit for nothing. So a late rank's silence is counted net of the time its process
waited, runnable, for a CPU (Linux's per-thread ``schedstat``). A stopped process (SIGSTOP, a
frozen cgroup), a deadlock, or a wait on a dead peer accrues no such wait, and is found at the
timeout as before; a process that never gets a CPU is found at :func:`starved_limit_s`.

Pure: the node side reads the samples (``runtime/node/procstat.py``) and feeds them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LATE_BEATS = 2  # a rank silent this many heartbeat intervals is sampled from then on
STARVED_LIMIT = 10  # x the heartbeat timeout: no silence is excused beyond it


@dataclass(frozen=True)
class ProcSample:
    """One look at a process: its state letter (``R`` running or runnable, ``S`` sleeping,
    ``D`` in uninterruptible wait, ``T``/``t`` stopped, ``Z``/``X`` dead) and the seconds
    its threads spent waiting, runnable, for a CPU, summed over them."""

    state: str
    waited_s: float


def starved_limit_s(timeout_s: float) -> float:
    """The longest silence CPU starvation excuses: past it a rank is hung whatever waited."""
    return STARVED_LIMIT * timeout_s


class StarvationCredit:
    """One late rank's seconds of silence spent waiting for a CPU, from the first sample on.

    Each :meth:`add` credits at most the time since the previous sample (threads waiting at
    once are not counted twice); a stopped or dead process earns nothing."""

    def __init__(self, first: ProcSample, at: float) -> None:
        self.last, self.at = first, at
        self.credit_s = 0.0

    def add(self, sample: ProcSample, at: float) -> float:
        """Take a new sample; returns the credit so far."""
        if sample.state not in ("T", "t", "Z", "X"):
            waited = max(0.0, sample.waited_s - self.last.waited_s)
            self.credit_s += min(waited, max(0.0, at - self.at))
        self.last, self.at = sample, at
        return self.credit_s


def net_silence(age_s: float, credit: Optional[StarvationCredit], timeout_s: float) -> float:
    """A rank's silence as liveness judges it: ``age_s`` less what it waited for a CPU,
    never less than zero, and all of it once it passes :func:`starved_limit_s`."""
    if credit is None or age_s > starved_limit_s(timeout_s):
        return age_s
    return max(0.0, age_s - credit.credit_s)
