"""The Ray Train front door's pure decisions, without Ray: the run's config, replica holders
over the nodes Ray Train chose, the persisted tier inside the run's folder, and the restore
plan for ranks a scheduler already placed (recovery_plan.plan_in_place)."""

from __future__ import annotations

import pytest

import memckpt
from memckpt.errors import ConfigError, RecoveryError
from memckpt.ray_train.layout import KEEP_ALL, holders_for, run_config, train_tier
from memckpt.policy.recovery_plan import plan_in_place


def base(**kw) -> memckpt.Config:
    return memckpt.Config(job_name="t", placement=memckpt.PlacementConfig("ring", 1), **kw)


def test_run_config_takes_the_worker_count_and_appends_the_ray_train_tier():
    tier = train_tier("/runs/exp", "local", 50)
    cfg = run_config(base(persistence=(memckpt.PersistTier("/fast", every=10),)), 4, tier)
    assert cfg.workers.num_workers == 4 and cfg.workers.workers_per_node == 1
    assert [t.uri for t in cfg.persistence] == ["/fast", "/runs/exp/memckpt"]
    assert cfg.persistence[-1].every == 50 and cfg.persistence[-1].keep_last == KEEP_ALL
    assert cfg.failure.warm_spares is False and cfg.placement.standby_nodes == 0


def test_run_config_checks_placement_against_the_worker_count():
    strict = memckpt.Config(job_name="t", placement=memckpt.PlacementConfig("ring", 2))
    with pytest.raises(ConfigError, match="replicas"):
        run_config(strict, 2, None)  # 2 nodes cannot hold 2 peer copies each


def test_train_tier_follows_the_storage_filesystem():
    assert train_tier("bucket/prefix/exp", "s3", 5).uri == "s3://bucket/prefix/exp/memckpt"
    with pytest.raises(ConfigError, match="checkpoint_every=None"):
        train_tier("x", "gcs", 5)


def test_holders_never_sit_on_the_ranks_own_node():
    assignment = {0: "a", 1: "b", 2: "c"}
    holders = holders_for(assignment, base())
    assert holders == {0: ("b",), 1: ("c",), 2: ("a",)}
    # a restart that put two ranks on one node: still a peer for each
    packed = holders_for({0: "a", 1: "a", 2: "b"}, base())
    assert all(assignment_node not in hs for assignment_node, hs in
               zip(("a", "a", "b"), (packed[0], packed[1], packed[2])))
    assert holders_for({0: "a", 1: "a"}, base()) == {0: (), 1: ()}  # one node: no peer


def test_plan_in_place_restores_each_rank_from_its_own_node_first():
    previous = {0: "a", 1: "b", 2: "c"}
    now = {0: "b", 1: "a", 2: "c"}  # Ray Train swapped ranks 0 and 1
    inventory = {"a": {0: [4, 5], 2: [5]}, "b": {1: [4, 5], 0: [5]}, "c": {2: [4, 5], 1: [5]}}
    plan = plan_in_place(previous, now, {0: ("a",), 1: ("c",), 2: ("b",)}, ["a", "b", "c"],
                         inventory, committed=5)
    assert plan.step == 5 and plan.assignment == now
    assert plan.sources[0] == ("b", "a")  # b holds its replica: renamed in, no copy
    assert set(plan.sources[1]) == {"b", "c"}  # a holds nothing of rank 1: fetched from a peer
    assert plan.moved == (0, 1)


def test_plan_in_place_without_a_copy_of_some_rank_names_it():
    with pytest.raises(RecoveryError, match=r"rank\(s\) \[1\]"):
        plan_in_place({0: "a", 1: "b"}, {0: "a", 1: "a"}, {0: (), 1: ()}, ["a"],
                      {"a": {0: [3]}}, committed=3)


def test_only_worker_and_node_faults_at_a_step_can_be_scheduled_under_ray_train():
    for ev in (memckpt.ChaosEvent(3, "store", 1), memckpt.ChaosEvent(3, "coordinator"),
               memckpt.ChaosEvent(3, "random")):
        cfg = base(workers=memckpt.WorkersConfig(num_workers=3), chaos=(ev,))
        with pytest.raises(ConfigError, match=f"chaos targets \\['{ev.target}'\\].*memckpt kill"):
            run_config(cfg, 3, None)
    cfg = base(workers=memckpt.WorkersConfig(num_workers=3),
               chaos=(memckpt.ChaosEvent(3, "worker", 1, during="restore"),))
    with pytest.raises(ConfigError, match="during='restore' is not available under Ray Train"):
        run_config(cfg, 3, None)
    cfg = base(workers=memckpt.WorkersConfig(num_workers=3),
               chaos=(memckpt.ChaosEvent(3, "node", 1, at_byte=4096),))
    with pytest.raises(ConfigError, match="at_byte is not available under Ray Train"):
        run_config(cfg, 3, None)
    ok = (memckpt.ChaosEvent(3, "worker", ranks=(0, 1)), memckpt.ChaosEvent(4, "node", 2))
    cfg = base(workers=memckpt.WorkersConfig(num_workers=3), chaos=ok)
    assert run_config(cfg, 3, None).chaos == ok
