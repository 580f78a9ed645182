"""A late rank is judged by its silence net of the time its process waited for a CPU
(memckpt.policy.liveness), sampled from /proc (memckpt.runtime.node.procstat): the pure
arithmetic, then real processes (stopped, starved by a busy loop at a higher priority on
their core), then a store's uplink in front of the real coordinator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from memckpt.policy.liveness import (ProcSample, StarvationCredit, net_silence,
                                     starved_limit_s)
from memckpt.runtime.node import procstat
from memckpt.runtime.node.uplink import Uplink
from conftest import wait_for
from test_uplink import NODES, OPEN, coordinator, get  # noqa: F401 (the fixture)


# -- the arithmetic ---------------------------------------------------------------------------
def test_time_waiting_for_a_cpu_is_not_silence():
    credit = StarvationCredit(ProcSample("R", 10.0), at=0.0)
    assert credit.add(ProcSample("R", 11.0), at=1.0) == 1.0
    # several threads waiting at once: at most the wall time between samples counts
    assert credit.add(ProcSample("R", 15.0), at=2.0) == 2.0
    assert net_silence(2.5, credit, timeout_s=2.0) == 0.5


def test_a_stopped_or_dead_process_earns_nothing():
    for state in ("T", "t", "Z", "X"):
        credit = StarvationCredit(ProcSample("R", 0.0), at=0.0)
        assert credit.add(ProcSample(state, 5.0), at=5.0) == 0.0
        assert net_silence(5.0, credit, timeout_s=2.0) == 5.0


def test_a_blocked_process_earns_nothing_and_a_half_starved_one_half():
    credit = StarvationCredit(ProcSample("S", 3.0), at=0.0)
    assert credit.add(ProcSample("S", 3.0), at=4.0) == 0.0  # slept (a deadlock, a dead peer)
    half = StarvationCredit(ProcSample("R", 0.0), at=0.0)
    assert half.add(ProcSample("R", 2.0), at=4.0) == 2.0
    assert net_silence(4.0, half, timeout_s=2.0) == 2.0


def test_no_silence_is_excused_past_the_limit():
    credit = StarvationCredit(ProcSample("R", 0.0), at=0.0)
    credit.add(ProcSample("R", 100.0), at=100.0)
    limit = starved_limit_s(2.0)
    assert net_silence(limit, credit, 2.0) == 0.0
    assert net_silence(limit + 0.1, credit, 2.0) == limit + 0.1
    assert net_silence(3.0, None, 2.0) == 3.0


# -- real processes ---------------------------------------------------------------------------
def _busy(*prefix: str) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", "while True: pass"])


def _pinned_to_cpu0(proc: subprocess.Popen) -> None:
    os.sched_setaffinity(proc.pid, {0})


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="Linux schedstat")
def test_a_process_starved_by_a_higher_priority_loop_on_its_core_waits_for_the_cpu():
    """The victim and a loop niced 15 below it share CPU 0: the victim waits, runnable, for
    nearly all of the window, which its store credits. The same process stopped waits for
    nothing, and says so in its state."""
    victim = _busy()
    hog = None
    try:
        _pinned_to_cpu0(victim)
        hog = subprocess.Popen(["taskset", "-c", "0", "nice", "-n", "-15", sys.executable, "-c",
                                "while True: pass"])
        time.sleep(0.3)  # both running on CPU 0
        before, t0 = procstat.sample(victim.pid), time.monotonic()
        time.sleep(1.0)
        after, t1 = procstat.sample(victim.pid), time.monotonic()
        assert before is not None and after is not None and after.state == "R"
        credit = StarvationCredit(before, t0)
        assert credit.add(after, t1) > 0.5 * (t1 - t0), (before, after)
        victim.send_signal(signal.SIGSTOP)
        wait_for(lambda: (procstat.sample(victim.pid) or ProcSample("?", 0)).state == "T", 10,
                 "the stopped victim's state")
        earned = credit.credit_s
        time.sleep(0.5)
        later = procstat.sample(victim.pid)
        assert later is not None and later.state == "T"
        assert credit.add(later, time.monotonic()) == earned  # nothing more while stopped
    finally:
        for p in (victim, hog):
            if p is not None:
                p.kill()
                p.wait()
    assert procstat.sample(victim.pid) is None  # gone: judged by its heartbeat alone


# -- a store's uplink in front of the coordinator -------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _node_a(handle, clock: Clock, samples: dict[int, ProcSample]) -> Uplink:
    up = Uplink("a", clock=clock, get=get, sample=lambda pid: samples.get(pid))
    for r in NODES["a"]:
        assert up.join(r, 0, NODES["a"], handle, interval_s=0.25, pid=1000 + r, timeout_s=2.0)
        up.beat(r, 0, 5)  # past its first step: judged by the heartbeat timeout
    up.close()  # no beat thread: this test ticks it
    assert up._thread is not None
    up._thread.join(5)
    assert not up._thread.is_alive()
    OPEN.append(up)
    return up


def _tick_until(up: Uplink, clock: Clock, samples: dict[int, ProcSample], until: float,
                waited_per_s: float, state: str = "R") -> None:
    """Ranks 1 and 2 beat every interval; rank 0 is silent, its process waiting
    ``waited_per_s`` seconds for a CPU each second."""
    while clock.t < until:
        clock.t += 0.25
        samples[1000] = ProcSample(state, waited_per_s * clock.t)
        for r in (1, 2):
            up.beat(r, 0, 5)
        up._closed.clear()
        assert up.heartbeat_once()
        up._closed.set()


def _events(handle) -> list[dict]:
    import json
    path = handle.c.run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_starved_rank_is_not_named_hung_and_the_job_is_told(coordinator):  # noqa: F811
    clock, samples = Clock(), {}
    up = _node_a(coordinator, clock, samples)
    _tick_until(up, clock, samples, until=3.0, waited_per_s=1.0)
    hung, silent = coordinator.call("liveness", 2.0, 120.0)
    assert hung == [] and silent == []  # rank 0 silent 3 s, but waited for a CPU throughout
    (said,) = [e for e in _events(coordinator) if e["event"] == "rank_starved"]
    assert said["rank"] == 0 and said["node"] == "a" and said["pid"] == 1000
    _tick_until(up, clock, samples, until=6.0, waited_per_s=1.0)
    assert len([e for e in _events(coordinator) if e["event"] == "rank_starved"]) == 1  # once


@pytest.mark.parametrize("state,waited_per_s", [("T", 1.0), ("S", 0.0)])
def test_a_stopped_or_blocked_rank_is_named_hung_at_the_timeout(coordinator, state,  # noqa: F811
                                                               waited_per_s):
    clock, samples = Clock(), {}
    up = _node_a(coordinator, clock, samples)
    _tick_until(up, clock, samples, until=2.5, waited_per_s=waited_per_s, state=state)
    hung, silent = coordinator.call("liveness", 2.0, 120.0)
    assert hung == [0] and silent == []
    assert not [e for e in _events(coordinator) if e["event"] == "rank_starved"]


def test_a_rank_starved_past_the_limit_is_named_hung(coordinator):  # noqa: F811
    clock, samples = Clock(), {}
    up = _node_a(coordinator, clock, samples)
    _tick_until(up, clock, samples, until=starved_limit_s(2.0) - 1, waited_per_s=1.0)
    assert coordinator.call("liveness", 2.0, 120.0)[0] == []
    _tick_until(up, clock, samples, until=starved_limit_s(2.0) + 1, waited_per_s=1.0)
    assert coordinator.call("liveness", 2.0, 120.0)[0] == [0]
