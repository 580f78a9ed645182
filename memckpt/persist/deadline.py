"""A hard deadline over a sequence of storage calls, with a progress line while it waits.

botocore bounds each request (connect and read timeouts, a few attempts), but a
discovery is many requests (list pages, one manifest per folder), and a local
directory on a hung network mount has no timeout at all. So the calls run on a
daemon thread and the caller waits for them up to the deadline. A thread given up
on is left to end by itself: its current request ends at its own timeout, and
nothing it does afterwards is used.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

log = logging.getLogger("memckpt.persist")
T = TypeVar("T")


class DeadlineExceeded(Exception):
    """``fn`` did not return within the deadline (it may still be running)."""


def progress_interval(timeout_s: float) -> float:
    """How often a waiter says it still waits: every 5 s, more often under a short bound."""
    return min(5.0, max(0.2, timeout_s / 4))


def call_within(fn: Callable[[], T], timeout_s: float, waiting_on: str) -> T:
    """``fn()``'s result (or its exception), or :class:`DeadlineExceeded` after ``timeout_s``.

    Logs ``memckpt: still waiting for <waiting_on> (N s of M s)`` at :func:`progress_interval`.
    """
    done = threading.Event()
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="memckpt-deadline", daemon=True).start()
    t0 = time.monotonic()
    every = progress_interval(timeout_s)
    while not done.wait(min(every, max(0.0, t0 + timeout_s - time.monotonic()))):
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            raise DeadlineExceeded(waiting_on)
        log.warning("memckpt: still waiting for %s (%.0f s of %.0f s)", waiting_on, waited,
                    timeout_s)
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]
