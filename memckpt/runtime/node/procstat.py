"""A process's state and its threads' waits for a CPU, read from Linux's ``/proc`` (for
:mod:`memckpt.policy.liveness`). Elsewhere, or for a process that is gone, ``None``: its
store judges its rank by its heartbeat alone."""

from __future__ import annotations

import os
from typing import Optional

from memckpt.policy.liveness import ProcSample


def sample(pid: int) -> Optional[ProcSample]:
    """``pid``'s state and the seconds its threads waited runnable for a CPU (schedstat's
    second field, nanoseconds), summed over its threads; None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the name may hold spaces
        waited_ns = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    waited_ns += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended meanwhile
    except (OSError, IndexError):
        return None
    return ProcSample(state, waited_ns / 1e9)
