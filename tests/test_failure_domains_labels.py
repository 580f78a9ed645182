"""placement.failure_domain read from the nodes' Ray labels by both front doors, and the
layouts that cannot keep copies outside a domain refused at start by name. Ray is imported
but no cluster starts: ``ray.nodes()`` is replaced by a fixed node table."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memckpt import Config, PlacementConfig, WorkersConfig
from memckpt.errors import PlacementError
from memckpt.ray_train.layout import holders_for

ONE_RACK = ("placement.failure_domain='rack': every node is in rack 'r1'; copies need a "
            "second rack: add nodes with another 'rack' label or set failure_domain=None")


def table(*racks):
    """``ray.nodes()`` of a 0-CPU head without labels and one 2-CPU node per rack value
    (None: a node without the label)."""
    head = {"NodeID": "head" * 7, "Alive": True, "Resources": {"CPU": 0}, "Labels": {}}
    return [head] + [{"NodeID": f"node{i:02d}" + "0" * 22, "Alive": True,
                      "Resources": {"CPU": 2.0},
                      "Labels": {"ray.io/node-id": "x", **({"rack": r} if r else {})}}
                     for i, r in enumerate(racks)]


@pytest.fixture
def nodes(monkeypatch):
    import ray

    def use(*racks):
        monkeypatch.setattr(ray, "nodes", lambda: table(*racks))
    return use


def config(label="rack", standby=0):
    return Config(job_name="racks",
                  workers=WorkersConfig(num_workers=4, workers_per_node=1, cpus_per_worker=2),
                  placement=PlacementConfig(replicas=1, standby_nodes=standby,
                                            failure_domain=label))


def runtime(cfg, tmp_path):
    from memckpt.runtime.driver.driver import Runtime
    return Runtime(lambda ctx: None, cfg, tmp_path, quiet=True)


def test_domains_of_the_jobs_nodes_from_their_labels(nodes):
    from memckpt.runtime.driver.actors import failure_domains
    nodes("r1", "r2", None)
    ids = [n["NodeID"] for n in table("r1", "r2", None)]
    assert failure_domains(config(None), ids) is None  # not set: labels are not read
    assert failure_domains(config(), ids[1:3]) == {ids[1]: "r1", ids[2]: "r2"}
    # a node that joined a running job without the label: left out (its own domain)
    assert failure_domains(config(), ids[1:], strict=False) == {ids[1]: "r1", ids[2]: "r2"}
    with pytest.raises(PlacementError, match=r"\['node02000000'\] have no 'rack' label"):
        failure_domains(config(), ids[1:])


def test_a_job_on_one_rack_is_refused_at_start_naming_the_label(nodes, tmp_path):
    nodes("r1", "r1", "r1", "r1")
    with pytest.raises(PlacementError) as e:
        runtime(config(), tmp_path).initial_layout()
    assert str(e.value) == ONE_RACK


def test_a_job_over_two_racks_places_copies_in_the_other(nodes, tmp_path):
    nodes("r1", "r1", "r2", "r2", "r3")
    assignment, holders, _ = runtime(config(standby=1), tmp_path).initial_layout()
    rack = {n["NodeID"]: n["Labels"].get("rack") for n in table("r1", "r1", "r2", "r2", "r3")}
    assert len(set(assignment.values())) == 4 and all(len(hs) == 1 for hs in holders.values())
    assert all(rack[h] != rack[assignment[r]] for r, hs in holders.items() for h in hs)


def test_a_node_of_the_job_without_the_label_is_refused_at_start(nodes, tmp_path):
    nodes("r1", "r1", "r2", None)
    with pytest.raises(PlacementError, match="have no 'rack' label"):
        runtime(config(), tmp_path).initial_layout()


def test_a_recovery_takes_a_node_without_the_label_as_its_own_domain_and_says_so_once(
        nodes, tmp_path):
    nodes("r1", "r2", None)
    ids = [n["NodeID"] for n in table("r1", "r2", None)][1:]
    rt = runtime(config(), tmp_path)
    cap = dict.fromkeys(ids, 1)
    assert rt.recovery._domains(cap) == {ids[0]: "r1", ids[1]: "r2"}
    rt.recovery._domains(cap)
    assert [(e["nodes"], e["label"]) for e in rt.events if e["event"] == "unlabelled_nodes"] \
        == [([ids[2]], "rack")]
    assert runtime(config(None), tmp_path).recovery._domains(cap) is None


def test_ray_train_refuses_the_first_group_on_one_rack_and_not_a_restart():
    assignment = {r: f"n{r}" for r in range(4)}
    one_rack = {n: "r1" for n in assignment.values()}
    cfg = config()
    with pytest.raises(PlacementError) as e:
        holders_for(assignment, cfg, domains=one_rack, strict=True)
    assert str(e.value) == ONE_RACK
    # a restart on the nodes left (one rack): copies go on inside it, as a recovery's do
    held = holders_for(assignment, cfg, {0: ("n1",)}, domains=one_rack)
    assert all(len(hs) == 1 and assignment[r] not in hs for r, hs in held.items())
    # a strategy that does not fit these nodes (groups of 3 for 6, restarted on 4) still
    # falls back, outside the rack
    two = {n: f"r{i % 2}" for i, n in enumerate(assignment.values())}
    grouped = Config(workers=WorkersConfig(num_workers=6), placement=PlacementConfig(
        strategy="group", group_size=3, replicas=1, failure_domain="rack"))
    held = holders_for(assignment, grouped, domains=two, strict=True)
    assert all(two[h] != two[assignment[r]] for r, hs in held.items() for h in hs)


def test_local_cluster_nodes_carry_their_labels(monkeypatch):
    """LocalCluster hands each node's labels to Ray's Cluster.add_node (no node starts)."""
    import ray.cluster_utils

    from memckpt.runtime.tools.local_cluster import LocalCluster
    added = []

    class FakeCluster:
        address = "127.0.0.1:6379"

        def __init__(self, **_):
            pass

        def add_node(self, **kwargs):
            added.append(kwargs.get("labels"))
            return type("Node", (), {"node_id": f"n{len(added)}"})()

        def wait_for_nodes(self):
            pass

    monkeypatch.setattr(ray.cluster_utils, "Cluster", FakeCluster)
    for name, value in (("RAY_AUTH_MODE", "disabled"), ("RAY_DEDUP_LOGS", "0")):
        monkeypatch.setenv(name, value)  # LocalCluster sets them unless set: restored after
    c = LocalCluster(nodes=3, connect=False, node_labels=[{"rack": "r1"}, {"rack": "r2"}])
    try:
        assert c.add_node({"rack": "r3"}) == "n4"
        assert added == [{"rack": "r1"}, {"rack": "r2"}, None, {"rack": "r3"}]
        # "auto" inside this cluster names it, from the head's own temp dir
        assert (Path(c.temp_dir) / "head" / "ray_current_cluster").read_text() == \
            FakeCluster.address
    finally:
        shutil.rmtree(c.temp_dir, ignore_errors=True)
