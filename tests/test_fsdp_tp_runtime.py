"""FSDP2, tensor-parallel and FSDP x TP jobs under the Ray runtime against real failures.

The demo GPT (``memckpt.demo.job.FSDPJob``) is sharded with ``fully_shard`` on every
block and the root (3 ranks), with Colwise/Rowwise tensor parallelism on each block's
MLP (2 ranks), or both on a 2 x 2 mesh (4 ranks), on a CPU mesh over gloo. Each drill
kills real processes (a worker SIGKILLed, a whole node removed) and passes only if the
job ends with the per-step losses and the final digest (every rank's local parameter and
optimizer chunks, bit for bit) of the uninterrupted run on the same cluster.
"""

from __future__ import annotations

import pytest

import memckpt
from memckpt.demo.job import FSDPJob
from memckpt.runtime.chaos.faults import FaultInjector

KEEP_WORKERS = True  # the module's jobs hand their workers on (conftest.cluster)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

STEPS, KILL_AT = 6, 4
JOBS = {  # name -> (job, ranks, ranks per node)
    "fsdp": (FSDPJob(steps=STEPS, size="tiny", seed=3), 3, 1),
    "tp": (FSDPJob(steps=STEPS, size="tiny", seed=3, tp=2), 2, 1),
    "fsdp_tp": (FSDPJob(steps=STEPS, size="tiny", seed=3, tp=2), 4, 2),
}


def config(kind: str, name: str, persist=()) -> memckpt.Config:
    _, ranks, per_node = JOBS[kind]
    return memckpt.Config(
        job_name=f"{kind}-{name}",
        workers=memckpt.WorkersConfig(num_workers=ranks, workers_per_node=per_node,
                                      cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        persistence=tuple(memckpt.PersistTier(str(p), every=1, keep_last=2) for p in persist),
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25, heartbeat_timeout_s=3.0,
                                      max_restarts=3, collective_timeout_s=60.0))


def run(kind: str, name: str, tmp_path, injector=None, persist=()) -> dict:
    return memckpt.run(JOBS[kind][0], config(kind, name, persist), run_dir=tmp_path,
                       injector=injector, quiet=True)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The uninterrupted run of each job, once per module, on the shared cluster."""
    cache: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in cache:
            while len(cluster.nodes) < 3:
                cluster.add_node()
            result = run(kind, "reference", tmp_path_factory.mktemp(f"ref-{kind}"))
            assert result["recoveries"] == [] and len(result["losses"]) == STEPS
            # sharded: every rank holds different chunks, so no two rank digests agree
            digests = result["rank_digests"]
            assert len(set(digests)) == len(digests), digests
            cache[kind] = result
        return cache[kind]

    return get


def assert_same_run(result: dict, reference: dict) -> None:
    assert result["losses"] == reference["losses"]
    assert result["rank_digests"] == reference["rank_digests"]
    assert result["final_digest"] == reference["final_digest"]


@pytest.mark.parametrize("kind", ["fsdp", "tp", "fsdp_tp"])
def test_sigkilled_worker_of_a_sharded_job_resumes_exactly(full_cluster, reference, kind,
                                                           tmp_path):
    ref = reference(kind)
    inj = FaultInjector().kill_worker(rank=1, at_step=KILL_AT)
    result = run(kind, "kill-worker", tmp_path, inj)
    assert_same_run(result, ref)
    (rec,) = result["recoveries"]
    assert rec["died_ranks"] == [1] and rec["dead_nodes"] == []
    assert rec["resumed_step"] == KILL_AT - 1
    assert set(rec["sources"].values()) == {"local"}


@pytest.mark.chaos
def test_fsdp_job_survives_the_loss_of_a_node(full_cluster, reference, tmp_path):
    ref = reference("fsdp")
    inj = FaultInjector(node_killer=full_cluster.remove_node).kill_node(rank=1, at_step=KILL_AT)
    result = run("fsdp", "kill-node", tmp_path, inj)
    assert_same_run(result, ref)
    (rec,) = result["recoveries"]
    assert len(rec["dead_nodes"]) == 1 and rec["moved_ranks"] == [1]
    assert rec["resumed_step"] == KILL_AT - 1


@pytest.mark.chaos
def test_fsdp_job_falls_back_to_the_persisted_tier(full_cluster, reference, tmp_path):
    """A node and its replica holder die together: no RAM copy of rank 1's shard is left,
    so every rank reloads its local chunks from the disk tier, and the run is still exact."""
    import ray

    from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE, coordinator_name

    ref = reference("fsdp")

    def kill_with_holder(node_id: str) -> None:
        coord = ray.get_actor(coordinator_name("fsdp-lost"), namespace=COORDINATOR_NAMESPACE)
        (holder,) = ray.get(coord.status.remote())["holders"]["1"]
        full_cluster.remove_node(node_id)
        full_cluster.remove_node(holder)

    full_cluster.add_node()  # room for the displaced ranks
    inj = FaultInjector(node_killer=kill_with_holder).kill_node(rank=1, at_step=KILL_AT)
    result = run("fsdp", "lost", tmp_path / "run", inj, persist=[tmp_path / "root"])
    assert_same_run(result, ref)
    (rec,) = result["recoveries"]
    assert 1 <= rec["resumed_step"] < KILL_AT  # a trained step, from disk
    assert set(rec["sources"].values()) == {"persisted"}
