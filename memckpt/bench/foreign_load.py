"""What other processes take from the CPU while a benchmark measures (the machine may be
shared): :class:`Quiet` for repeats timed in this process (``/proc/stat``), and
:class:`ForeignLoad` / :func:`wait_quiet` for measurements that span a Ray cluster this
process started (its whole process tree counts as ours)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

QUIET_THRESHOLD = 0.10  # --wait-quiet: start a measurement once others use less than this
DISCARD_THRESHOLD = 0.25  # Quiet with --wait-quiet: run a repeat again if others took more


def cpu_counters() -> Optional[tuple[float, float, float]]:
    """(machine busy CPU-seconds, machine total CPU-seconds, this process's CPU-seconds)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return (sum(vals) - vals[3] - vals[4]) / hz, sum(vals) / hz, t.user + t.system


class Quiet:
    """Repeats on a shared machine: how much CPU other processes took while we timed.

    ``span()`` wraps each timed repeat; ``keep()`` then adds up the CPU time *other*
    processes spent during it (``foreign()``, a share of all cores). With ``wait_s`` > 0,
    ``settle()`` first waits (at most ``wait_s``) until they use under ``threshold`` of
    the machine, and ``keep()`` rejects a repeat of 50 ms or more during which they took
    over ``DISCARD_THRESHOLD`` (at most ``max_discards`` per method), so it is run again.
    """

    def __init__(self, wait_s: float = 0.0, threshold: float = QUIET_THRESHOLD) -> None:
        self.wait_s, self.threshold = wait_s, threshold
        self._last: Optional[tuple[float, float]] = None
        self.reset()

    def reset(self, max_discards: Optional[int] = None) -> None:
        self.busy = self.total = self.waited_s = 0.0
        self.timeouts = self.discarded = 0
        if max_discards is not None:
            self.max_discards = max_discards

    def settle(self) -> None:
        if self.wait_s <= 0:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.wait_s:
            start = cpu_counters()
            time.sleep(0.3)
            end = cpu_counters()
            if start is None or end is None:
                break
            busy, total, own = (e - s for e, s in zip(end, start))
            if total <= 0 or max(0.0, busy - own) / total <= self.threshold:
                break
        else:
            self.timeouts += 1
        self.waited_s += time.monotonic() - t0

    @contextmanager
    def span(self) -> Iterator[None]:
        start = cpu_counters()
        try:
            yield
        finally:
            end = cpu_counters()
            self._last = None
            if start is not None and end is not None:
                busy, total, own = (e - s for e, s in zip(end, start))
                self._last = (max(0.0, busy - own), total)

    def keep(self) -> bool:
        """After a span: False when it ran under foreign load and should be repeated."""
        last, self._last = self._last, None
        if last is None:
            return True
        foreign, total = last
        noisy = self.wait_s > 0 and total >= 0.1 and foreign / total > DISCARD_THRESHOLD
        if noisy and self.discarded < getattr(self, "max_discards", 0):
            self.discarded += 1
            return False
        self.busy += foreign
        self.total += total
        return True

    def foreign(self) -> Optional[float]:
        return round(self.busy / self.total, 3) if self.total > 0 else None



# -- a measurement that spans this process's tree (a Ray cluster it started) ---------------------
def _process_table() -> dict[int, tuple[int, float, float]]:
    """pid -> (parent pid, create time, CPU seconds) of every process we may read."""
    import psutil
    out = {}
    for p in psutil.process_iter(["pid", "ppid", "create_time", "cpu_times"]):
        info = p.info
        ct = info.get("cpu_times")
        if ct is not None:
            out[info["pid"]] = (info["ppid"], info["create_time"], ct.user + ct.system)
    return out


def _descendants(table: dict[int, tuple[int, float, float]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    mine, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in mine:
            mine.add(pid)
            todo.extend(children.get(pid, ()))
    return mine


class ForeignLoad:
    """CPU share of all cores taken by processes outside this process's tree (this driver and
    the Ray cluster it started) between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._start: dict[int, tuple[int, float, float]] = {}

    def start(self) -> "ForeignLoad":
        self._t0 = time.monotonic()
        self._start = _process_table()
        return self

    def stop(self) -> Optional[float]:
        try:
            end = _process_table()
        except Exception:  # noqa: BLE001 (no psutil view of the machine: unknown)
            return None
        wall = time.monotonic() - self._t0
        mine = _descendants(end, os.getpid()) | _descendants(self._start, os.getpid())
        used = 0.0
        for pid, (_, created, cpu) in end.items():
            if pid in mine:
                continue
            before = self._start.get(pid)
            used += cpu - before[2] if before and before[1] == created else cpu
        cores = os.cpu_count() or 1
        return round(max(0.0, used) / (wall * cores), 3) if wall > 0 else None


def wait_quiet(max_wait_s: float, log: Callable[[str], None],
               threshold: float = QUIET_THRESHOLD) -> Optional[float]:
    """Wait (at most ``max_wait_s``) until other processes use under ``threshold`` of the CPU
    over a 2 s window; returns the last share seen."""
    if max_wait_s <= 0:
        return None
    t0, share, said = time.monotonic(), None, False
    while time.monotonic() - t0 < max_wait_s:
        probe = ForeignLoad().start()
        time.sleep(2.0)
        share = probe.stop()
        if share is None or share < threshold:
            return share
        if not said:
            log(f"other processes use {100 * share:.0f}% of the CPU: waiting up to "
                f"{max_wait_s:.0f} s for a quieter machine")
            said = True
    log(f"still {100 * (share or 0):.0f}% foreign CPU after {max_wait_s:.0f} s: measuring anyway")
    return share

