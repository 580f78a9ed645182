"""memckpt's Ray metrics, scraped from the nodes' Prometheus endpoints after a real run."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict

import pytest

import memckpt
from memckpt.demo.job import GPTJob
from memckpt.runtime.coordinator.metrics import failure_target
from memckpt.runtime.coordinator.messages import Progress
from memckpt.runtime.driver.driver import progress_line
from conftest import wait_for

KEEP_WORKERS = True  # the module's jobs hand their workers on (conftest.cluster)

JOB = GPTJob(steps=12, size="tiny", seed=3)
KILL_AT = 6
SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.mark.parametrize("what, target", [
    ("rank 1's worker died", "worker"),
    ("rank(s) [2] stopped heart-beating (hung)", "hung"),
    ("rank(s) [0] unreachable", "unreachable"),
    ("rank 0 lost a peer: Connection closed by peer", "peer"),
])
def test_failure_target(what, target):
    assert failure_target(what) == target


def test_progress_line():
    prog = Progress(2, 6, max_step=7, last_loss=3.14159, steps_per_s=4.04, stall_ms=1.26, lag=1)
    assert progress_line(2, prog) == ("gen 2 step 7 loss 3.1416 4.0 steps/s committed 6 "
                                      "stall 1.3 ms lag 1")
    empty = Progress(0, None, max_step=0)
    assert "loss - - steps/s committed - stall - ms lag -" in progress_line(0, empty)


def scrape(job: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every node's Prometheus endpoint: memckpt samples of ``job``, summed over the
    processes that reported them, keyed by (name, the labels memckpt sets)."""
    import ray
    out: dict = defaultdict(float)
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
            m = SAMPLE.match(line)
            if not m or not m.group(1).startswith("ray_memckpt_"):
                continue
            labels = dict(LABEL.findall(m.group(2)))
            if labels.get("job") != job:
                continue
            mine = tuple(sorted((k, v) for k, v in labels.items()
                                if k in ("rank", "target", "phase", "le")))
            out[(m.group(1), mine)] += float(m.group(3))
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, v2) in ls for k, v2 in labels.items()))


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_metrics_reach_prometheus(cluster, tmp_path):
    job = "metrics-kill"
    config = memckpt.Config(
        job_name=job,
        workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0),
        chaos=(memckpt.ChaosEvent(step=KILL_AT, target="worker", rank=1),))
    result = memckpt.run(JOB, config, run_dir=tmp_path, quiet=True)
    assert len(result["recoveries"]) == 1

    # Counters and histograms outlive the coordinator's process in the agents' export; its
    # gauges (committed step, lag, recovery phases) are served only while the job runs.
    def complete(s: dict) -> bool:  # Ray's agents export every few seconds
        return (total(s, "ray_memckpt_failures_total") >= 1
                and total(s, "ray_memckpt_replicated_bytes_total") > 0
                and total(s, "ray_memckpt_snapshot_stall_seconds_count") >= JOB.steps
                and total(s, "ray_memckpt_snapshots_landed_total") >= 3 * (JOB.steps - 1))

    seen: list[dict] = []

    def complete_samples() -> dict | None:
        seen.append(scrape(job))
        return seen[-1] if complete(seen[-1]) else None

    samples = wait_for(complete_samples, 45,
                       lambda: f"memckpt metrics of job {job!r}: {dict(seen[-1])}", interval=0.5)

    assert total(samples, "ray_memckpt_failures_total", target="worker") == 1
    # one series per job, not per rank (#40): every step, including the redone one,
    # observed once (its slowest rank's stall)
    assert not any(("rank", r) in labels for (_, labels) in samples for r in "012")
    assert total(samples, "ray_memckpt_snapshot_stall_seconds_count") >= JOB.steps
    assert total(samples, "ray_memckpt_snapshot_stall_seconds_sum") > 0
    # "wait" (the default): every due snapshot landed (a step's report may precede its
    # seal, hence each rank's last one may be missing), none skipped
    assert total(samples, "ray_memckpt_snapshots_landed_total") >= 3 * (JOB.steps - 1)
    assert total(samples, "ray_memckpt_snapshots_skipped_total") == 0
