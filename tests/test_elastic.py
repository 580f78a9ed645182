"""Elastic recovery on a local multi-node Ray cluster: three one-rank nodes (one CPU
each, so no node has room for a second rank) and no persisted tier, so a lost node's
rank cannot be placed and the job goes on with fewer ranks from the surviving RAM
copies. Checked bit for bit: the full parameters and optimizer state right after the
resize equal the committed step's; the losses after it equal those of a fresh job of
the smaller size resumed from a persisted copy of that step."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import memckpt
from memckpt.errors import RecoveryError
from memckpt.runtime.chaos.faults import FaultInjector
from conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

STEPS, KILL_AT = 8, 4
# paced at 2 ranks (0.5 s a step) until the added node is seen and the job grows back:
# room for a slow machine's node start (the steps at 3 ranks after it are not paced)
STEPS_GROW = 120


@pytest.fixture(scope="module")
def one_rank_nodes():
    """Three worker nodes with one CPU each: a node runs one rank, never two."""
    import ray

    import _elastic_job
    from memckpt.runtime.tools.local_cluster import LocalCluster
    c = LocalCluster(nodes=3, cpus_per_node=1)
    ray.cloudpickle.register_pickle_by_value(_elastic_job)  # the workers cannot import tests/
    with memckpt.keep_workers():  # each job takes the worker processes the last one left
        yield c
    c.shutdown()


@pytest.fixture
def nodes3(one_rank_nodes):
    while len(one_rank_nodes.nodes) < 3:
        one_rank_nodes.add_node()
    return one_rank_nodes


def config(name: str, min_workers: int = 2, persist: str | None = None,
           num_workers: int = 3) -> memckpt.Config:
    return memckpt.Config(
        job_name=name,
        workers=memckpt.WorkersConfig(num_workers=num_workers, min_workers=min_workers,
                                      cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        persistence=(memckpt.PersistTier(persist, every=1, keep_last=50),) if persist else (),
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      max_restarts=3, collective_timeout_s=30.0,
                                      replace_timeout_s=1.0, warm_spares=False))


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def events_so_far(run_dir) -> list[dict]:
    """The events written so far (a line being written is skipped)."""
    path = run_dir / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def losses_by_step(result: dict) -> dict[int, float]:
    return dict(zip(range(result["first_step"], result["first_step"] + len(result["losses"])),
                    result["losses"]))


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, st in a["optim"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optim"][i][k]), (i, k)


def test_shrink_from_ram_then_matches_a_fresh_smaller_job(nodes3, tmp_path):
    from _elastic_job import ElasticJob
    run_out = tmp_path / "run-out"
    run_out.mkdir()
    inj = FaultInjector(node_killer=nodes3.remove_node).kill_node(rank=1, at_step=KILL_AT)
    result = memckpt.run(ElasticJob(STEPS, str(run_out)), config("elastic-shrink"),
                         run_dir=tmp_path / "run", injector=inj, quiet=True)
    (rec,) = result["recoveries"]
    step = rec["resumed_step"]
    assert rec["resized"] == {"from": 3, "to": 2} and step == KILL_AT - 1
    assert result["world_size"] == 2 and result["results"] == [{"world_size": 2}] * 2
    (resized,) = [e for e in events(tmp_path / "run") if e["event"] == "resized"]
    assert resized["step"] == step and set(resized["sources"]) == {"0", "1", "2"}
    restored = [e for e in events(tmp_path / "run") if e["event"] == "restored"]
    assert restored and all(e["source"].startswith("ram:3->2") for e in restored)
    # right after the resize: the committed step's full state, bit for bit
    assert_same(torch.load(run_out / f"restored-{step}-ws2.pt", weights_only=False),
                torch.load(run_out / f"params-{step}-ws3.pt", weights_only=False))

    # the reference: a 3-rank job persisted up to that step, then a 2-rank job resumed
    # from the persisted copy (resharded from disk)
    nodes3.add_node()  # the reference's first part runs 3 ranks
    ref_out = tmp_path / "ref-out"
    ref_out.mkdir()
    disk = str(tmp_path / "disk")
    memckpt.run(ElasticJob(step, str(ref_out)), config("elastic-ref", 3, disk),
                run_dir=tmp_path / "ref3", quiet=True)
    ref = memckpt.run(ElasticJob(STEPS, str(ref_out)),
                      config("elastic-ref", 2, disk, num_workers=2),
                      run_dir=tmp_path / "ref2", quiet=True)
    assert ref["first_step"] == step + 1
    after = {s: v for s, v in losses_by_step(result).items() if s > step}
    assert after == losses_by_step(ref) and len(after) == STEPS - step
    assert_same(torch.load(run_out / f"params-{STEPS}-ws2.pt", weights_only=False),
                torch.load(ref_out / f"params-{STEPS}-ws2.pt", weights_only=False))


def test_grows_back_when_a_node_is_added(nodes3, tmp_path):
    """A node dies (3 -> 2); a node joins while the job runs at 2: at the next committed
    step the job grows back to 3, resharded from RAM, and finishes; the state right after
    the growth is the committed step's bit for bit."""
    from _elastic_job import ElasticJob
    out = tmp_path / "out"
    out.mkdir()

    inj = FaultInjector(node_killer=nodes3.remove_node).kill_node(rank=1, at_step=3)
    done: dict = {}

    def job() -> None:
        try:
            done["result"] = memckpt.run(ElasticJob(STEPS_GROW, str(out), pace_s=0.5, pace_at=2),
                                         config("elastic-grow"), run_dir=tmp_path / "run",
                                         injector=inj, quiet=True)
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            done["error"] = e

    runner = threading.Thread(target=job)
    runner.start()
    # Ray adds nodes from the main thread only: the job runs in another; once it has
    # shrunk, a node with room joins
    try:
        wait_for(lambda: not runner.is_alive() or any(
            e["event"] == "resized" for e in events_so_far(tmp_path / "run")), 300,
            "the job to shrink to 2 ranks", interval=0.2)
    finally:
        nodes3.add_node()
        runner.join(600)
    if "error" in done:
        raise done["error"]
    result = done["result"]
    resizes = [r["resized"] for r in result["recoveries"]]
    assert resizes == [{"from": 3, "to": 2}, {"from": 2, "to": 3}], result["recoveries"]
    assert result["world_size"] == 3 and len(losses_by_step(result)) == STEPS_GROW
    log = events(tmp_path / "run")
    (pending,) = [e for e in log if e["event"] == "growth_pending"]
    assert pending["to_world_size"] == 3
    grew = result["recoveries"][1]
    s = grew["resumed_step"]
    assert s >= pending["after_step"]
    assert_same(torch.load(out / f"restored-{s}-ws3.pt", weights_only=False),
                torch.load(out / f"params-{s}-ws2.pt", weights_only=False))
    # once the 2-rank layout committed past the shrink, the 3-rank layout's shards were
    # freed (old rank 2's own slots: no rank 2 at 2 ranks), and the job went on exactly
    freed = [e for e in log if e["event"] == "old_layout_freed"]
    assert freed and freed[0]["committed"] > result["recoveries"][0]["resumed_step"]
    assert freed[0]["freed_bytes"] > 0
    assert any("own/rank2" in dirs for dirs in freed[0]["removed"].values()), freed[0]


@pytest.mark.chaos
def test_two_nodes_lost_shrinks_twice(nodes3, tmp_path):
    from _elastic_job import ElasticJob
    out = tmp_path / "out"
    out.mkdir()
    inj = (FaultInjector(node_killer=nodes3.remove_node)
           .kill_node(rank=2, at_step=3).kill_node(rank=1, at_step=6))
    result = memckpt.run(ElasticJob(STEPS, str(out)), config("elastic-twice", 1),
                         run_dir=tmp_path / "run", injector=inj, quiet=True)
    assert [r["resized"] for r in result["recoveries"]] == [{"from": 3, "to": 2},
                                                            {"from": 2, "to": 1}]
    assert result["world_size"] == 1 and len(losses_by_step(result)) == STEPS
    for rec in result["recoveries"]:
        s = rec["resumed_step"]
        size = rec["resized"]["to"]
        assert_same(torch.load(out / f"restored-{s}-ws{size}.pt", weights_only=False),
                    torch.load(out / f"params-{s}-ws{rec['resized']['from']}.pt",
                               weights_only=False))


def test_below_min_workers_fails_naming_the_setting_and_node(nodes3, tmp_path):
    from _elastic_job import ElasticJob
    out = tmp_path / "out"
    out.mkdir()
    killed = []

    def kill_two(node: str) -> None:
        other = next(n for n in nodes3.nodes if n != node)
        killed.extend([node, other])
        nodes3.remove_node(node)
        nodes3.remove_node(other)

    inj = FaultInjector(node_killer=kill_two).kill_node(rank=1, at_step=KILL_AT)
    with pytest.raises(RecoveryError) as e:
        memckpt.run(ElasticJob(STEPS, str(out)), config("elastic-below"), run_dir=tmp_path / "run",
                    injector=inj, quiet=True)
    assert "workers.min_workers=2" in str(e.value)
    assert any(n[:12] in str(e.value) for n in killed)
