"""memckpt.keep_workers(): a driver's consecutive jobs hand their worker processes on.

The unit part checks the book of kept workers without Ray. The drill runs real jobs on the
session's cluster (this module does not set ``KEEP_WORKERS``: it opens its own blocks), kills
a kept process between jobs, changes the job's shape, and checks that the processes end
with the block. That a failed job keeps none is checked in test_runtime.py (its module runs
inside a block).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import psutil
import pytest

import memckpt
from memckpt.demo.job import GPTJob
from memckpt.runtime.driver import kept
from memckpt.runtime.driver.kept import KeptWorkers
from conftest import wait_for
from test_runtime import config

JOB = GPTJob(steps=5, size="tiny", seed=3)


def test_kept_workers_are_taken_by_node_and_shape():
    book = KeptWorkers("job")
    book.put("n1", (1.0, 0.0), "rank-a")
    book.put("n1", (0.0, 0.0), "spare-a")
    book.put("n2", (1.0, 0.0), "rank-b")
    assert len(book) == 3
    assert book.take("n1", (2.0, 0.0)) is None  # another shape: not this one
    assert book.take("n2", (0.0, 0.0)) is None  # no spare kept there
    assert book.take("n1", (1.0, 0.0)) == "rank-a"
    assert book.take("n1", (1.0, 0.0)) is None  # taken once
    assert sorted(book.drain()) == ["rank-b", "spare-a"]
    assert len(book) == 0


def test_outside_a_block_nothing_is_kept():
    assert kept.current() is None


def _kept_pids() -> dict[int, tuple[str, str]]:
    """pid -> (node, "rank" | "spare") of every worker kept now."""
    import ray
    book = kept.current()
    assert book is not None
    out = {}
    for (node, shape), workers in book.idle.items():
        for w in workers:
            info = ray.get(w.info.remote(), timeout=30)
            assert info.node_id == node and info.rank is None  # parked: no rank
            out[info.pid] = (node, "spare" if shape == (0.0, 0.0) else "rank")
    return out


def _gen0_workers(run_dir) -> tuple[dict, dict]:
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    started = next(e for e in evs if e["event"] == "job_started")
    gen0 = next(e for e in evs if e["event"] == "generation_started" and e["gen"] == 0)
    return started, gen0


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_consecutive_jobs_take_the_last_ones_workers(full_cluster, tmp_path):
    cfg = config("kept-a", warm_spares=True)
    with memckpt.keep_workers():
        first = memckpt.run(JOB, cfg, run_dir=tmp_path / "a", quiet=True)
        held = _kept_pids()
        # every rank's worker and every node's spare, parked for the next job
        assert sorted(k for _, k in held.values()) == ["rank"] * 3 + ["spare"] * 3

        # a kept process that dies between jobs is replaced, the others are taken
        victim = next(pid for pid, (_, k) in held.items() if k == "rank")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(victim), 30, f"pid {victim} to end")
        second = memckpt.run(JOB, dataclasses.replace(cfg, job_name="kept-b"),
                             run_dir=tmp_path / "b", quiet=True)
        started, gen0 = _gen0_workers(tmp_path / "b")
        assert started["kept_workers"] == 5
        assert sorted(gen0["workers"].values()) == ["kept", "kept", "new"]
        new_rank = next(r for r, how in gen0["workers"].items() if how == "new")
        assert gen0["assignment"][new_rank] == held[victim][0]  # where the dead one was
        # the same processes trained it, exactly as fresh ones did
        assert second["losses"] == first["losses"]
        assert second["final_digest"] == first["final_digest"]
        again = _kept_pids()
        assert len(set(again) & set(held)) == 5 and victim not in again

        # a job of another shape (2 CPUs a rank, on nodes of 2): the kept 1-CPU workers go
        # to make room, rather than leave it waiting for CPUs that never free
        wide = dataclasses.replace(cfg, job_name="kept-c", workers=memckpt.WorkersConfig(
            num_workers=3, workers_per_node=1, cpus_per_worker=2))
        third = memckpt.run(JOB, wide, run_dir=tmp_path / "c", quiet=True)
        started, gen0 = _gen0_workers(tmp_path / "c")
        assert started["kept_workers"] == 3  # the spares (no CPU) are taken
        assert sorted(gen0["workers"].values()) == ["new"] * 3
        assert len(third["losses"]) == JOB.steps  # (2 threads a rank: other rounding)
        gone = [p for p, (_, k) in again.items() if k == "rank"]
        wait_for(lambda: not any(psutil.pid_exists(p) for p in gone), 30,
                 "the kept 1-CPU workers to end")
        last = _kept_pids()
    # leaving the block ends every process still kept
    wait_for(lambda: not any(psutil.pid_exists(p) for p in last), 30,
             "the kept workers to end with the block")
    assert len(last) == 6 and kept.current() is None
