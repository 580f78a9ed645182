"""memckpt inside Ray Train (``TorchTrainer`` + ``MemckptCallback``) against real failures.

One local 3-node cluster for the module. Each fault test kills real processes (a
worker's SIGKILL or SIGSTOP, a whole raylet with its processes) and passes only when
the run's per-step losses and every rank's final digest equal those of the
uninterrupted TorchTrainer run, and when the restore came from where the test says
(own node's RAM, a peer's store, Ray Train's checkpoint). After every run no memckpt
actor is alive and the run's RAM folder is empty.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import memckpt
from memckpt.demo.job import GPTJob

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

JOB = GPTJob(steps=12, size="tiny", seed=3)
KILL_AT = 6
EVERY = 4  # Ray Train checkpoints every 4 steps


def train_loop(cfg: dict) -> None:
    """The TorchTrainer's ``train_loop_per_worker``: the demo GPT with memckpt's context."""
    from memckpt.ray_train import context
    ctx = context()
    cfg["job"](ctx)
    ctx.finish()
    out = Path(cfg["out"])
    (out / f"rank{ctx.rank}.digest").write_text(ctx.digest() or "")


def config(name: str, ram_root: str, **kw) -> memckpt.Config:
    return memckpt.Config(
        job_name=name, ram_root=ram_root,
        workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailurePolicy(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      collective_timeout_s=60.0), **kw)


def fit(cfg: memckpt.Config, tmp: Path, job: GPTJob = JOB, max_failures: int = 3,
        storage: Path | None = None, name: str | None = None):
    """Run the trainer; (result, per-step losses, rank digests, events)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from memckpt.ray_train import MemckptCallback
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_loop, train_loop_config={"job": job, "out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1},
                                               placement_strategy="SPREAD"),
        run_config=ray.train.RunConfig(
            name=name or cfg.job_name, storage_path=str(storage or tmp / "storage"),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            callbacks=[MemckptCallback(cfg, checkpoint_every=EVERY, run_dir=tmp / "run")]))
    result = trainer.fit()
    return result, losses(tmp / "run"), digests(out), events(tmp / "run")


def losses(run_dir: Path) -> list[float]:
    by_step: dict[int, float] = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step[rec["step"]] = rec["loss"]  # a redone step: the last line wins
    return [by_step[s] for s in sorted(by_step)]


def digests(out: Path) -> list[str]:
    return [(out / f"rank{r}.digest").read_text() for r in range(3)]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def assert_clean(ram_root: str) -> None:
    """No memckpt actor alive, nothing left in the job's RAM folder."""
    import ray
    deadline = time.time() + 30
    while True:
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(("memckpt-coordinator-", "memckpt-store-"))]
        left = [p for p in Path(ram_root).rglob("*") if p.is_file()]
        if not alive and not left:
            return
        if time.time() > deadline:
            raise AssertionError(f"leaked: actors {alive}, files {left}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    ram = str(tmp / "ram")
    result, loss, digest, ev = fit(config("rt-reference", ram), tmp)
    assert result.error is None
    assert len(loss) == JOB.steps
    assert not [e for e in ev if e["event"] == "recovery_plan"]
    (gen0,) = [e for e in ev if e["event"] == "generation_started"]
    assert len(set(gen0["assignment"].values())) == 3  # 3 workers on 3 nodes
    assert_clean(ram)
    return loss, digest


def test_sigkill_worker_restores_from_own_nodes_ram(full_cluster, reference, tmp_path, ram_root):
    cfg = config("rt-kill", ram_root, chaos=(memckpt.ChaosEvent(KILL_AT, "worker", 1, "KILL"),))
    result, loss, digest, ev = fit(cfg, tmp_path)
    assert result.error is None
    assert (loss, digest) == reference
    (plan,) = [e for e in ev if e["event"] == "recovery_plan"]
    assert plan["resumed_step"] == KILL_AT - 1
    restored = [e for e in ev if e["event"] == "restored" and e["gen"] == 1]
    assert len(restored) == 3
    # every rank from RAM (its own node's slot or a peer's store), none from storage_path
    assert all(e["source"].startswith(("local:", "peer:")) for e in restored), restored
    assert_clean(ram_root)
