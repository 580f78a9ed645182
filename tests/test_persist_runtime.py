"""The persisted tier under the Ray runtime: fallback when every RAM copy is lost,
auto-resume after the whole cluster died, and the stop file."""

from __future__ import annotations

import json

import pytest

import memckpt
from memckpt.demo.job import GPTJob
from memckpt.runtime.chaos.faults import FaultInjector
from memckpt.persist import CheckpointStore
from s3_server import aws_test_env, s3_endpoint, s3_uri  # noqa: F401 (fixtures)
from test_runtime import run_record

KEEP_WORKERS = True  # the module's jobs hand their workers on (conftest.cluster)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

JOB = GPTJob(steps=12, size="tiny", seed=5)


def config(name: str, root, every: int = 2, **extra) -> memckpt.Config:
    return memckpt.Config(
        job_name=name,
        workers=memckpt.WorkersConfig(num_workers=3, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        persistence=(memckpt.PersistTier(str(root), every=every, keep_last=3),),
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      collective_timeout_s=30.0),
        **extra)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("ref-root")
    return memckpt.run(JOB, config("p-ref", root), run_dir=tmp_path_factory.mktemp("ref"),
                       quiet=True)


def events(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_reference_persists_every_k_steps(reference, tmp_path_factory):
    assert reference["persisted"] == {"0": 12}


def test_lost_ram_copies_fall_back_to_persisted(full_cluster, reference, tmp_path):
    """A node and its replica holder die together: RAM cannot help, disk does."""
    import ray

    from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE, coordinator_name

    def kill_with_holder(node_id: str) -> None:
        coord = ray.get_actor(coordinator_name("p-lost"), namespace=COORDINATOR_NAMESPACE)
        (holder,) = ray.get(coord.status.remote())["holders"]["1"]
        full_cluster.remove_node(node_id)
        full_cluster.remove_node(holder)

    full_cluster.add_node()  # room for the displaced ranks: 2 survivors x 2 CPUs would do too
    inj = FaultInjector(node_killer=kill_with_holder).kill_node(rank=1, at_step=11)
    run_dir = tmp_path / "run"
    result = memckpt.run(JOB, config("p-lost", tmp_path / "root"), run_dir=run_dir,
                         injector=inj, quiet=True)
    assert result["losses"] == reference["losses"]
    assert result["final_digest"] == reference["final_digest"]
    (rec,) = result["recoveries"]
    # a step persisted (every 2 steps) before the nodes died at step 11: which one depends
    # on how far the uploads had got by then (a newer due step supersedes a pending one),
    # not on anything the product promises about timing
    log = events(run_dir)
    persisted = {e["step"] for e in log if e["event"] == "persisted"}
    assert rec["resumed_step"] in persisted and rec["resumed_step"] <= 10, (rec, persisted)
    (fallback,) = [e for e in log if e["event"] == "fallback_to_persisted"]
    assert fallback["step"] == rec["resumed_step"]
    assert set(rec["sources"].values()) == {"persisted"}


def test_stop_file_persists_and_stops(full_cluster, tmp_path):
    stop = tmp_path / "STOP"
    stop.write_text("5")
    result = memckpt.run(JOB, config("p-stop", tmp_path / "root", every=100,
                                     stop_file=str(stop)),
                         run_dir=tmp_path / "run", quiet=True)
    assert result["stopped_at"] is not None and result["stopped_at"] >= 5
    assert result["final_digest"] is None
    manifest, _ = CheckpointStore(str(tmp_path / "root")).latest_valid(world_size=3)
    assert manifest.step == result["stopped_at"]


@pytest.mark.chaos
def test_whole_cluster_lost_then_new_job_auto_resumes(tmp_path, reference, s3_endpoint, s3_uri,
                                                      monkeypatch):
    """Kill every node mid-run (no RAM copy survives), start a new cluster, same S3 root (a
    real endpoint: moto's server on loopback; new raylets inherit the environment). The same
    with a disk tier is the demo's drill (test_demo_ray.py, ``--fault cluster``)."""
    from memckpt.runtime.tools.local_cluster import LocalCluster
    monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", s3_endpoint)
    root = s3_uri
    ray_mod = pytest.importorskip("ray")
    ray_mod.shutdown()  # leave the module's shared cluster for a private one
    first = LocalCluster(nodes=3, cpus_per_node=2)
    try:
        inj = FaultInjector(node_killer=lambda _: [first.remove_node(n) for n in list(first.nodes)])
        inj.kill_node(rank=0, at_step=9)
        with pytest.raises(memckpt.MemckptError):
            memckpt.run(JOB, config("p-cluster", root), run_dir=tmp_path / "first", injector=inj,
                        quiet=True)
    finally:
        first.shutdown()
    persisted = CheckpointStore(str(root)).latest_valid(world_size=3)[0].step
    assert persisted in (6, 8)  # every 2 steps; 8 may still have been uploading at the kill
    second = LocalCluster(nodes=3, cpus_per_node=2)
    try:
        result = memckpt.run(JOB, config("p-cluster", root), run_dir=tmp_path / "second",
                             quiet=True)
    finally:
        second.shutdown()
    assert "auto_resume" in [e["event"] for e in events(tmp_path / "second")]
    assert result["first_step"] == persisted + 1
    assert result["losses"] == reference["losses"][persisted:]  # the rest redone identically
    assert result["final_digest"] == reference["final_digest"]


def tree(root) -> dict[str, str]:
    import hashlib
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.chaos
def test_start_fresh_beside_another_models_newer_checkpoints(full_cluster, reference, tmp_path):
    """A new model on a root where another model persisted up to step 12
    (load.on_incompatible="start_fresh"): it starts at 0; a worker killed at step 5
    recovers from RAM at the new run's own committed step, not the old model's 12; the old
    checkpoints stay byte for byte; and a restart resumes the new model's newest persisted
    step (6), passing the old model's newer ones over."""
    root = tmp_path / "root"
    memckpt.run(GPTJob(steps=12, size="mini", seed=1), config("p-old", root),
                run_dir=tmp_path / "old", quiet=True)
    before = tree(root)
    assert {k.split("/")[0] for k in before} >= {f"step-{s:010d}" for s in (8, 10, 12)}
    fresh = memckpt.LoadSpec(on_incompatible="start_fresh")
    inj = FaultInjector().kill_worker(rank=1, at_step=5)
    result = memckpt.run(JOB, config("p-new", root, load=fresh), run_dir=tmp_path / "new",
                         injector=inj, quiet=True)
    assert result["first_step"] == 1
    assert result["losses"] == reference["losses"], run_record(tmp_path / "new")
    assert result["final_digest"] == reference["final_digest"]
    (rec,) = result["recoveries"]
    assert 1 <= rec["resumed_step"] <= 4  # from RAM: the old model's step 12 is not this run's
    assert "persisted" not in rec["sources"].values()
    evs = events(tmp_path / "new")
    (over,) = [e for e in evs if e["event"] == "started_over"]  # said once, by the first rank
    assert over["old_committed"] == 12 and over["step"] == 0
    assert sorted({e["step"] for e in evs if e["event"] == "persist_refused"}) == [8, 10, 12]
    after = tree(root)
    assert {k: after[k] for k in before} == before  # never written, never removed
    assert any(k.startswith(f"step-{6:010d}/") for k in after)

    again = memckpt.run(JOB, config("p-new", root, load=fresh), run_dir=tmp_path / "again",
                        quiet=True)
    assert again["first_step"] == 7
    assert again["losses"] == reference["losses"][6:]
    assert again["final_digest"] == reference["final_digest"]
    assert tree(root).items() >= before.items()
