"""A whole node frozen, found by memckpt's own liveness, recovered, then thawed mid-run.

When training reaches ``FREEZE_AT``, every process of rank 1's node is SIGSTOPped (a chaos
fault "node" with signal "STOP", :func:`memckpt.runtime.chaos.faults.freeze_node`): its
raylet, the job's replica store, the rank's worker and the node's agents. Nothing is
reset: no connection closes, so neither Ray nor the other ranks see an error. The node's
store stops reporting; the coordinator names the node "frozen or cut off" after
``heartbeat_timeout_s``, and the driver recovers without it: rank 1 restarts on the node
holding its replica, from RAM.

This cluster's Ray health checks are slower than Ray's defaults (a frozen node is declared
dead after minutes, not about a minute), so Ray never calls the node dead during the
drill: the detection is memckpt's. Once the job has recovered and the live nodes' warm
spares are ready again (none on the frozen node), the test thaws the node
while the job trains on (the new generation holds before ``HOLD_AT`` until then). The
thawed store, still in the old generation, speaks to the coordinator and is refused; the
old worker is killed by the signal sent while it was frozen. The job must end with the
losses and the final digest of the uninterrupted run, bit for bit.

Run alone (it starts its own cluster; not beside another Ray drill)::

    PYTHONPATH=. python -m pytest -q -n 0 tests/test_frozen_node.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import memckpt
from memckpt.demo.job import GPTJob
from memckpt.runtime.ray_nodes import alive_node_ids
from memckpt.runtime.chaos.faults import FaultInjector

from conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.timeout(600)]

JOB = GPTJob(steps=12, size="tiny", seed=3)
FREEZE_AT = 6
HOLD_AT = 10  # after the recovery, the ranks wait before this step until the node thawed
# Ray's defaults (period 3 s, timeout 10 s, 5 failures: a frozen raylet is dead after ~65 s)
# with a higher threshold: a loaded 2-core machine never lets Ray's verdict come first
SLOW_HEALTH_CHECKS = {"health_check_period_ms": 3000, "health_check_timeout_ms": 10000,
                      "health_check_failure_threshold": 20}


class Held:
    """``job``, whose ranks after a recovery (generation 1 on) wait before ``HOLD_AT``
    until the file ``release`` exists: the node thaws while the job runs."""

    def __init__(self, job: GPTJob, release: str) -> None:
        self.job, self.release = job, release

    def __call__(self, ctx: Any) -> Any:
        return self.job(_HeldContext(ctx, self.release))


class _HeldContext:
    def __init__(self, ctx: Any, release: str) -> None:
        self._ctx, self._release = ctx, release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def step(self, state: Any, step: int, **metrics: Any) -> Any:
        while self._ctx.generation > 0 and step == HOLD_AT and not os.path.exists(self._release):
            time.sleep(0.05)
        return self._ctx.step(state, step, **metrics)


class Thaw:
    """The frozen node's processes, as this machine sees them (every node of the cluster
    runs here): SIGCONT thaws them, as a healed partition or a machine that un-hangs."""

    def __init__(self, cluster: Any, node: str) -> None:
        self.node, self.pids = node, cluster.node_pids(node)

    def stopped(self) -> bool:
        import psutil
        return all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in self.pids
                   if psutil.pid_exists(p))

    def __call__(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def slow_cluster():
    """Its own cluster: three 2-CPU nodes, Ray's health checks slower than its defaults
    (the session's shared cluster is left first, as test_elastic's cluster does)."""
    import ray

    from memckpt.runtime.tools.local_cluster import LocalCluster
    if ray.is_initialized():
        ray.shutdown()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    c = LocalCluster(nodes=3, cpus_per_node=2, connect=True, worker_logs=False,
                     health_checks=SLOW_HEALTH_CHECKS)
    try:
        with memckpt.keep_workers():  # the drill's job takes the reference's processes
            yield c
    finally:
        c.shutdown()


def config(name: str) -> memckpt.Config:
    return memckpt.Config(
        job_name=name,
        workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      max_restarts=3, collective_timeout_s=30.0))


def events(run_dir: Path) -> list[dict]:
    out = []
    if (run_dir / "events.jsonl").exists():
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # the line being written
                pass
    return out


def thaw_once_recovered(run_dir: Path, cluster: Any, inj: FaultInjector, release: Path,
                        seen: dict) -> None:
    """Wait for the recovery to finish, note what Ray and the node look like then, thaw
    the node, and wait until its store spoke to the coordinator and was refused; the job
    is released whatever happens (a failure here fails the test, not hangs it)."""
    try:
        wait_for(lambda: any(e["event"] == "recovery_finished" for e in events(run_dir)), 300,
                 "the job to recover from the frozen node")
        thaw = seen["thaw"] = Thaw(cluster, inj.fired[0]["node_id"])
        seen["alive_in_ray_when_recovered"] = thaw.node in alive_node_ids()
        # the spares topped up after the recovery are ready while the node is still frozen
        done = next(e["time"] for e in events(run_dir) if e["event"] == "recovery_finished")
        seen["standby"] = wait_for(
            lambda: [e for e in events(run_dir) if e["event"] == "standby" and e["time"] > done],
            120, "every live node's warm spare to be ready after the recovery")[0]
        seen["still_frozen_when_recovered"] = thaw.stopped()
        thaw()
        seen["refused"] = wait_for(
            lambda: [e for e in events(run_dir)
                     if e["event"] == "stale_node_refused" and e["node"] == thaw.node], 120,
            "the thawed node's store to be refused by the coordinator")
        seen["alive_in_ray_after_thaw"] = thaw.node in alive_node_ids()
    except BaseException as e:  # noqa: BLE001 (re-raised by the test)
        seen["error"] = e
    finally:
        release.touch()


def test_a_frozen_node_is_recovered_then_thawed_and_changes_nothing(slow_cluster, tmp_path):
    import psutil
    release = tmp_path / "release"
    ref = memckpt.run(Held(JOB, str(release)), config("frozen-ref"), run_dir=tmp_path / "ref",
                      quiet=True)
    assert ref["recoveries"] == [] and len(ref["losses"]) == JOB.steps

    inj = FaultInjector().kill_node(rank=1, at_step=FREEZE_AT, signal="STOP")
    run_dir, seen = tmp_path / "run", {}
    thawer = threading.Thread(target=thaw_once_recovered,
                              args=(run_dir, slow_cluster, inj, release, seen), daemon=True)
    thawer.start()
    result = memckpt.run(Held(JOB, str(release)), config("frozen"), run_dir=run_dir,
                         injector=inj, quiet=True)
    thawer.join(timeout=60)
    if "error" in seen:
        raise seen["error"]

    # the fault happened: the whole node, at the step named, and stayed frozen until the
    # job had recovered without it; Ray never declared it dead (the detection was memckpt's)
    (fired,) = inj.fired
    ice = seen["thaw"]
    assert fired["ranks"] == [1] and fired["signal"] == "STOP" and len(ice.pids) >= 3
    assert seen["still_frozen_when_recovered"] and seen["alive_in_ray_when_recovered"]
    assert seen["alive_in_ray_after_thaw"]  # it carried on as the same node

    # the job ends as if nothing happened
    assert result["losses"] == ref["losses"]
    assert result["final_digest"] == ref["final_digest"]

    # what happened is said as it was: a frozen node, not a dead worker or a dead node
    (rec,) = result["recoveries"]
    assert "stopped reporting (frozen or cut off)" in rec["what"], rec["what"]
    assert ice.node[:12] in rec["what"]
    assert rec["frozen_nodes"] == [ice.node] and rec["dead_nodes"] == []
    assert rec["died_ranks"] == [1] and 1 in rec["moved_ranks"]
    assert rec["fault_from"] == "injected"
    assert rec["last_sign_of_life_at"] <= rec["detected_at"]
    ev = events(run_dir)
    # after the recovery, the live nodes' warm spares got ready while the node was frozen:
    # none on it (one there answers nothing, and its pending prefault would have held up
    # the others')
    ready = seen["standby"]["held_bytes"]
    assert ice.node[:12] not in ready and len(ready) == 2, ready
    (detected,) = [e for e in ev if e["event"] == "failure_detected"]
    assert detected["frozen_nodes"] == [ice.node]
    (plan,) = [e for e in ev if e["event"] == "recovery_plan"]
    assert all(ice.node[:12] not in s for s in plan["sources"].values()), plan["sources"]

    # and `memckpt report` draws it so: the frozen node named, the time back counted from
    # the freeze (detection included), not from the plan
    from memckpt.cli.main import main
    assert main(["report", str(run_dir), "--out", str(tmp_path / "t.png"),
                 "--json", str(tmp_path / "t.json")]) == 0
    timeline = json.loads((tmp_path / "t.json").read_text())
    (drawn,) = timeline["failures"]
    assert "stopped reporting (frozen or cut off)" in drawn["what"]
    (back,) = timeline["recoveries"]
    assert back["frozen_nodes"] == [ice.node] and back["dead_nodes"] == []
    phases = back["phases_s"]
    policy = config("x").failure  # its last heartbeat may precede the freeze by an interval
    assert phases["detect"] >= policy.heartbeat_timeout_s - policy.heartbeat_interval_s
    assert phases["total"] >= phases["detect"] + phases["stop"] + phases["plan"]

    # the thawed processes changed nothing: its store was refused (it still spoke for the
    # old generation), and the old worker died of the kill sent while it was frozen
    assert all(e["its_gen"] == 0 and e["gen"] == 1 for e in seen["refused"]), seen["refused"]
    old = fired["pid"]
    wait_for(lambda: not psutil.pid_exists(old)
             or psutil.Process(old).status() == psutil.STATUS_ZOMBIE, 60,
             f"the frozen generation's worker (pid {old}) to be gone after the thaw")
