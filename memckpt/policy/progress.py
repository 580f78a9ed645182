"""When the driver prints its progress line: on a change, at most once a second.

Pure (no Ray, no torch): the driver passes what it last printed and what the coordinator
reports now; a step that takes longer than a second prints nothing new until the step,
the committed step or the generation moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MIN_INTERVAL_S = 1.0  # never more often than this, however fast the steps go


@dataclass(frozen=True)
class ProgressKey:
    """What a reader follows: a new generation (a recovery), a new step, a new commit."""

    gen: int
    step: int
    committed: Optional[int]


def progress_due(last: Optional[ProgressKey], now: ProgressKey, since_last_s: float,
                 min_interval_s: float = MIN_INTERVAL_S) -> bool:
    """True when the line for ``now`` should be printed: something changed since ``last``
    (None: nothing printed yet) and ``since_last_s`` >= ``min_interval_s``."""
    if now.step < 0:  # no rank has reported a step yet
        return False
    return now != last and since_last_s >= min_interval_s
