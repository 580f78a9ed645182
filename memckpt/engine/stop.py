"""Manual control of a running job: the stop file and termination signals.

A stop file holds one whole number (InternEvo's ``stop_file_path``): a positive
step N means "persist at step N and stop cleanly"; a negative -N means "persist
at step N and go on". SIGTERM or SIGINT (preemption, ``ray job stop``) mean
"persist the newest step now and stop".
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

PERSIST, STOP = "persist", "stop"


def read_stop_file(path: Optional[str]) -> Optional[int]:
    """The number in the stop file, or None (missing, empty, or not a whole number)."""
    if not path:
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class Control:
    """Decides, step by step, whether to persist now and whether to stop."""

    def __init__(self, stop_file: Optional[str]) -> None:
        self.stop_file = stop_file
        self.signalled = threading.Event()
        self._handled: set = set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: persist at the next step and stop (main thread only)."""
        def handler(*_):
            if self.signalled.is_set():  # a second signal: stop now, no more persisting
                raise KeyboardInterrupt
            self.signalled.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def at(self, step: int) -> Optional[str]:
        """None, PERSIST (persist and go on) or STOP (persist and stop) for ``step``."""
        if self.signalled.is_set():
            if "signal" in self._handled:
                return None
            self._handled.add("signal")
            return STOP
        n = read_stop_file(self.stop_file)
        if n is None or n == 0 or n in self._handled or step < abs(n):
            return None
        self._handled.add(n)
        return STOP if n > 0 else PERSIST

    def requested(self) -> Optional[tuple[int, str]]:
        """For a driver: a new request as (step to persist at or after, action), or None.
        The coordinator turns it into one committed step all ranks persist."""
        if self.signalled.is_set():
            if "signal" in self._handled:
                return None
            self._handled.add("signal")
            return 0, STOP
        n = read_stop_file(self.stop_file)
        if n is None or n == 0 or n in self._handled:
            return None
        self._handled.add(n)
        return abs(n), (STOP if n > 0 else PERSIST)

