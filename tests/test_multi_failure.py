"""Several failures at once, and a failure during a recovery, against real processes.

Issue 26: two workers SIGKILLed in the same instant, a worker killed while another rank's
recovery plans, starts or restores, a node removed while a process on another node dies,
the whole generation killed with its stores alive, two ring-adjacent nodes lost. Every
drill that can recover passes only with the losses and the final digest of the
uninterrupted reference run (the one of test_runtime.py, same job and config).
"""

from __future__ import annotations

import dataclasses

import pytest

import memckpt
from memckpt.errors import RecoveryError
from memckpt.runtime.chaos.faults import FaultInjector, send_signals
import test_runtime
from conftest import fired
from test_runtime import JOB, KILL_AT, assert_same_run, config, events, run_with

KEEP_WORKERS = True  # the module's jobs hand their workers on (conftest.cluster)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

reference = test_runtime.reference  # the uninterrupted run, a fixture of this module too


def kinds(tmp_path) -> list[str]:
    return [e["event"] for e in events(tmp_path)]


def detected(tmp_path) -> list[dict]:
    return [e for e in events(tmp_path) if e["event"] == "failure_detected"]


def test_two_workers_on_two_nodes_killed_in_the_same_instant(full_cluster, reference, tmp_path):
    inj = FaultInjector().kill_workers((0, 1), at_step=KILL_AT)
    result = run_with(inj, "two-at-once", tmp_path)
    assert_same_run(result, reference, tmp_path)
    # one recovery, planned for both (the liveness sweep, or else the stop phase, found the
    # second): no plan reused rank 0's or rank 1's dead worker
    (rec,) = result["recoveries"]
    assert rec["died_ranks"] == [0, 1] and rec["dead_nodes"] == []
    assert rec["resumed_step"] == KILL_AT - 1
    assert set(rec["sources"].values()) == {"local"}  # both from their own node's RAM
    assert fired(events(tmp_path), "worker")["ranks"] == [0, 1]
    (gen1,) = [e for e in events(tmp_path) if e["event"] == "generation_started" and e["gen"] == 1]
    assert gen1["workers"]["0"] != "reused" and gen1["workers"]["1"] != "reused"


def test_the_whole_generation_killed_with_its_stores_alive(full_cluster, reference, tmp_path):
    inj = FaultInjector().kill_workers((0, 1, 2), at_step=KILL_AT)
    result = run_with(inj, "all-at-once", tmp_path)
    assert_same_run(result, reference, tmp_path)
    (rec,) = result["recoveries"]
    assert rec["died_ranks"] == [0, 1, 2] and rec["dead_nodes"] == []
    assert set(rec["sources"].values()) == {"local"}  # every rank from its node's RAM
    assert rec["in_place_ranks"] == [0, 1, 2]


def test_a_worker_killed_while_another_ranks_recovery_restores(full_cluster, reference,
                                                                tmp_path):
    """Rank 1 dies at step 6; once the next generation started (its ranks restoring step 5,
    before the first step after it) rank 2 is SIGKILLed: a second recovery, same step."""
    inj = (FaultInjector().kill_worker(rank=1, at_step=KILL_AT)
           .kill_worker(rank=2, at_step=1, during="restore"))
    result = run_with(inj, "kill-during-restore", tmp_path)
    assert_same_run(result, reference, tmp_path)
    first, second = result["recoveries"]
    assert first["died_ranks"] == [1] and second["died_ranks"] == [2]
    # no step past the restored one committed in between: it died during the restore
    assert first["resumed_step"] == second["resumed_step"] == KILL_AT - 1
    assert "restore phase" in second["what"]


@pytest.mark.chaos
@pytest.mark.parametrize("phase", ["plan", "start"])
def test_a_survivor_killed_while_the_recovery_plans_or_starts(full_cluster, reference,
                                                              tmp_path, phase):
    """Rank 1 dies; a survivor the recovery means to reuse is SIGKILLed before the plan
    (plan: the sweep of the survivors finds it) or after it (start: its worker does not
    answer when the generation starts). Planned again with both: recovered, exact.

    The victim is picked when the phase comes, among the survivors the recovery still
    holds: one that did not return within the stop phase's grace was killed by the
    recovery itself (CI run 23: rank 2, so a fault aimed at rank 2
    hit a process already gone and tested nothing)."""
    inj = (FaultInjector().kill_worker(rank=1, at_step=KILL_AT)
           .kill_worker(rank=None, at_step=1, during=phase))
    result = run_with(inj, f"kill-during-{phase}", tmp_path)
    assert_same_run(result, reference, tmp_path)
    (victim,) = [f["ranks"] for f in result["faults"] if f["key"].endswith(f"during-{phase}")]
    assert victim != [1]
    last = result["recoveries"][-1]
    assert last["resumed_step"] == KILL_AT - 1
    assert victim[0] in last["died_ranks"]
    assert any(f"{phase} phase" in e["what"] for e in detected(tmp_path))
    assert "job_failed" not in kinds(tmp_path)


@pytest.mark.chaos
def test_a_node_removed_while_a_worker_on_another_node_is_killed(full_cluster, reference,
                                                                  tmp_path):
    """Rank 1's node is removed and, in the same moment, rank 2's process is SIGKILLed on
    its node (whose store holds rank 1's replica): every copy survives, so it recovers."""
    import ray

    from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE, coordinator_name

    def node_and_worker(node_id: str) -> None:
        coord = ray.get_actor(coordinator_name("node-and-worker"),
                              namespace=COORDINATOR_NAMESPACE)
        w2 = ray.get(coord.status.remote())["workers"]["2"]
        send_signals([(w2["node_id"], w2["pid"])], "KILL")
        full_cluster.remove_node(node_id)

    inj = FaultInjector(node_killer=node_and_worker).kill_node(rank=1, at_step=KILL_AT)
    result = run_with(inj, "node-and-worker", tmp_path)
    assert_same_run(result, reference, tmp_path)
    rec = result["recoveries"][-1]
    assert len(rec["dead_nodes"]) == 1 and 2 in rec["died_ranks"]
    assert rec["resumed_step"] == KILL_AT - 1
    assert rec["sources"]["1"] != "persisted"  # from its replica in RAM


def test_two_ring_adjacent_nodes_lost_ends_the_job_naming_the_fix(full_cluster, tmp_path):
    """Ranks 1 and 2's nodes die at once; rank 1's only replica was on rank 2's node. No
    persisted tier: the job fails within a bound, naming the rank, its lost copies and the
    settings that would have saved them."""
    inj = FaultInjector(node_killer=full_cluster.remove_node).kill_nodes((1, 2), at_step=KILL_AT)
    with pytest.raises(RecoveryError) as e:
        run_with(inj, "adjacent-lost", tmp_path)
    msg = str(e.value)
    assert "rank(s) [1]" in msg and "own copy on" in msg and "replicas on" in msg
    for setting in ("placement.replicas", "placement.standby_nodes", "persistence tier"):
        assert setting in msg
    ev = events(tmp_path)
    killed = fired(ev, "node")
    (failed,) = [x for x in ev if x["event"] == "job_failed"]
    assert failed["time"] - killed["time"] < 60.0  # Ray's verdict on the nodes, then the plan


@pytest.mark.chaos
def test_two_ring_adjacent_nodes_lost_resume_from_the_persisted_tier(full_cluster, reference,
                                                                      tmp_path):
    full_cluster.add_node()  # room for the displaced ranks
    cfg = dataclasses.replace(config("adjacent-persisted"), persistence=(
        memckpt.PersistTier(str(tmp_path / "root"), every=2, keep_last=3),))
    inj = FaultInjector(node_killer=full_cluster.remove_node).kill_nodes((1, 2), at_step=KILL_AT)
    result = memckpt.run(JOB, cfg, run_dir=tmp_path / "run", injector=inj,
                         quiet=True)
    assert_same_run(result, reference, tmp_path)
    (rec,) = result["recoveries"]
    assert set(rec["sources"].values()) == {"persisted"} and rec["resumed_step"] in (2, 4)
    assert "fallback_to_persisted" in kinds(tmp_path / "run")

