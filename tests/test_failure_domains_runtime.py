"""A whole rack lost at once, on a local cluster whose nodes carry a ``rack`` label.

Four one-rank nodes, two in rack r1 and two in r2, and ``placement.failure_domain="rack"``:
every rank's copy sits in the other rack. When training reaches ``KILL_AT``, rank 0's rack
goes (both its nodes, two ranks, in the same moment) while two r3 nodes join as the spare
capacity the moved ranks restart on. The job must recover from the copies in the
surviving rack's RAM (no storage is configured) and end with the losses and the final
digest of the uninterrupted run, bit for bit; every holder of every generation sits in
another rack than the node it protects.

The rack is rank 0's, whichever it is: Ray lists nodes in no fixed order, so which ranks
run in r1 is only known once the job runs. The r3 nodes join only when the rack is lost,
so that the job's four nodes are r1, r1, r2, r2 and not four of six.

Run alone (it starts its own cluster; not beside another Ray drill)::

    PYTHONPATH=. python -m pytest -q -n 0 tests/test_failure_domains_runtime.py
"""

from __future__ import annotations

import json

import pytest

import memckpt
from memckpt.demo.job import GPTJob
from memckpt.runtime.chaos.faults import FaultInjector

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.timeout(600)]

JOB = GPTJob(steps=12, size="tiny", seed=3)
KILL_AT = 6
RACKS = ("r1", "r1", "r2", "r2")


@pytest.fixture(scope="module")
def racked():
    """Its own cluster: four 2-CPU nodes labelled ``RACKS`` (the session's shared cluster is
    left first, as test_elastic's cluster does); node id -> rack, kept up to date."""
    import ray

    from memckpt.runtime.tools.local_cluster import LocalCluster
    if ray.is_initialized():  # connected to the session's cluster: this one instead
        ray.shutdown()
    c = LocalCluster(nodes=4, cpus_per_node=2, node_labels=[{"rack": r} for r in RACKS],
                     connect=True, worker_logs=False)
    rack = dict(zip(c.nodes, RACKS))
    try:
        with memckpt.keep_workers():  # the drill's job takes the reference's processes
            yield c, rack
    finally:
        c.shutdown()


def config(name: str) -> memckpt.Config:
    """Four ranks, one per node (a rank takes a node's 2 CPUs), a copy each in another rack."""
    return memckpt.Config(
        job_name=name,
        workers=memckpt.WorkersConfig(num_workers=4, workers_per_node=1, cpus_per_worker=2),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1, failure_domain="rack"),
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      max_restarts=3, collective_timeout_s=30.0,
                                      warm_spares=False))


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def assert_outside(rack: dict[str, str], assignment: dict, holders: dict) -> None:
    """Every rank has a holder, none in its own node's rack."""
    for r, hs in holders.items():
        assert hs and all(rack[h] != rack[assignment[r]] for h in hs), (r, assignment[r], hs)


def test_a_whole_rack_lost_recovers_from_the_other_racks_ram(racked, tmp_path):
    c, rack = racked
    ref = memckpt.run(JOB, config("rack-ref"), run_dir=tmp_path / "ref", quiet=True)
    assert ref["recoveries"] == [] and len(ref["losses"]) == JOB.steps

    removed: list[str] = []

    def lose_rack(node: str) -> None:
        """Two r3 nodes join (the room the lost ranks restart in), then every node of
        ``node``'s rack goes at once."""
        for _ in range(2):
            rack[c.add_node({"rack": "r3"})] = "r3"
        for n in [n for n in list(c.nodes) if rack[n] == rack[node]]:
            removed.append(n)
            c.remove_node(n)

    inj = FaultInjector(node_killer=lose_rack).kill_node(rank=0, at_step=KILL_AT)
    result = memckpt.run(JOB, config("rack-lost"), run_dir=tmp_path / "run", injector=inj,
                         quiet=True)
    assert result["losses"] == ref["losses"]
    assert result["final_digest"] == ref["final_digest"]

    log = events(tmp_path / "run")
    (started,) = [e for e in log if e["event"] == "job_started"]
    before = started["assignment"]
    assert sorted(rack[n] for n in before.values()) == sorted(RACKS)  # one rank a node
    lost_rack = rack[removed[0]]
    assert len(removed) == 2 and {rack[n] for n in removed} == {lost_rack}
    lost_ranks = sorted(int(r) for r, n in before.items() if n in removed)
    assert len(lost_ranks) == 2  # both nodes of the rack ran a rank

    # one recovery, for both ranks at once, from RAM: the step before the one being taken
    (rec,) = result["recoveries"]
    assert sorted(rec["dead_nodes"]) == sorted(removed)
    assert sorted(rec["died_ranks"]) == lost_ranks == sorted(rec["moved_ranks"])
    assert rec["resumed_step"] == KILL_AT - 1
    for r, source in rec["sources"].items():
        if int(r) in lost_ranks:  # from its copy in the other rack, over the network
            assert source.startswith("peer:"), (r, source)
            (peer,) = [n for n in rack if n.startswith(source[len("peer:"):])]
            assert rack[peer] not in (lost_rack, "r3"), (r, source)
        else:
            assert source == "local", (r, source)
    assert not any("failure domain" in note for note in rec["notes"]), rec["notes"]
    restored = [e for e in log if e["event"] == "restored" and e["gen"] == 1]
    assert sorted(e["rank"] for e in restored) == [0, 1, 2, 3]
    assert all(e["source"].startswith(("local:", "peer:")) for e in restored), restored

    # every generation's copies outside the rack of the node they protect
    gens = [e for e in log if e["event"] == "generation_started"]
    assert [g["gen"] for g in gens] == [0, 1]
    for g in gens:
        assert_outside(rack, g["assignment"], g["holders"])
    after = gens[1]["assignment"]
    assert {rack[after[str(r)]] for r in lost_ranks} == {"r3"}  # restarted on the new nodes
    assert not [e for e in log if e["event"] in ("unlabelled_nodes", "job_failed")]
