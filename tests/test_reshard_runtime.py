"""Auto-resume across world sizes under the Ray runtime: a 3-worker job persists and
stops; the same job started with 2 workers on the same root reshards the newest
checkpoint (an event says from 3 to 2 ranks) and trains on from its step."""

from __future__ import annotations

import json
import math

import pytest

import memckpt
from memckpt.demo.job import GPTJob

KEEP_WORKERS = True  # the module's jobs hand their workers on (conftest.cluster)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def config(workers: int, root, stop=None) -> memckpt.Config:
    return memckpt.Config(
        job_name="reshard-rt",
        workers=memckpt.WorkersConfig(num_workers=workers, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        persistence=(memckpt.PersistTier(str(root), every=2, keep_last=3),),
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      collective_timeout_s=30.0),
        stop_file=stop)


def test_three_workers_then_two_resume_resharded(cluster, tmp_path):
    stop = tmp_path / "STOP"
    stop.write_text("4")
    first = memckpt.run(GPTJob(steps=10, size="tiny", seed=5),
                        config(3, tmp_path / "root", str(stop)), run_dir=tmp_path / "first",
                        quiet=True)
    stopped = first["stopped_at"]
    assert stopped is not None
    stop.unlink()
    second = memckpt.run(GPTJob(steps=10, size="tiny", seed=5), config(2, tmp_path / "root"),
                         run_dir=tmp_path / "second", quiet=True)
    ev = [json.loads(x) for x in (tmp_path / "second" / "events.jsonl").read_text().splitlines()]
    (resume,) = [e for e in ev if e["event"] == "auto_resume"]
    assert (resume["step"], resume["from_world_size"], resume["to_world_size"]) == (stopped, 3, 2)
    restored = [e for e in ev if e["event"] == "restored"]
    assert {e["step"] for e in restored} == {stopped} and len(restored) == 2
    losses = second["losses"]  # per step from first_step (the restored one's included)
    assert second["first_step"] <= stopped + 1 and second["first_step"] + len(losses) - 1 == 10
    assert all(math.isfinite(v) for v in losses)
