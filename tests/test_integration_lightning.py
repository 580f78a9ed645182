"""The Lightning front door: a fit() process SIGKILLed mid-epoch (or at an epoch's end), the
same script run again, resumes from RAM at the next batch and ends bit-identical; and fit()
on 3 ranks (DDP) under ``memckpt.run``, a worker SIGKILLed mid-epoch, ends bit-identical too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

L = pytest.importorskip("lightning.pytorch")

import memckpt  # noqa: E402
from memckpt.checkpointer import RestoreAndStep  # noqa: E402
from memckpt.errors import StateError  # noqa: E402
from memckpt.integrations.lightning import MemckptCallback  # noqa: E402
from conftest import shm_base  # noqa: E402

JOB = Path(__file__).with_name("_lightning_job.py")
ROOT = Path(__file__).resolve().parent.parent


def run_job(ram_root: str, job: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(JOB), "--ram-root", ram_root, "--job", job,
                           "--out", str(out), *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def result(out: Path) -> tuple[dict[str, float], int, dict[str, torch.Tensor]]:
    res = json.loads((out / "result.json").read_text())
    return res["losses"], res["resumed_from"], torch.load(out / "weights.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The uninterrupted fit's losses and final weights (one run for the module's drills)."""
    out = tmp_path_factory.mktemp("ref")
    ram_root = tempfile.mkdtemp(prefix="memckpt-test-", dir=shm_base())
    try:
        ref = run_job(ram_root, "reference", out, "--accum", "2")
    finally:
        shutil.rmtree(ram_root, ignore_errors=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses, _, ref_weights = result(out)
    assert len(ref_losses) == 20  # 2 epochs of 10 batches, 5 optimizer steps each
    return ref_losses, ref_weights


# (kill at, snapshot every, the step it resumes from): mid-epoch 0; the end of epoch 0
@pytest.mark.parametrize("kill_at,every,resume_at", [(4, 3, 3), (6, 5, 5)])
def test_sigkilled_fit_resumes_at_the_next_batch_bit_identical(ram_root, tmp_path, reference,
                                                                kill_at, every, resume_at):
    ref_losses, ref_weights = reference
    job, out = f"job{kill_at}", tmp_path / f"run{kill_at}"
    flags = ("--accum", "2", "--every", str(every))
    killed = run_job(ram_root, job, out, *flags, "--kill-at", str(kill_at))
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_job(ram_root, job, out, *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses, resumed_from, weights = result(out)
    assert resumed_from == resume_at
    # the resumed process ran exactly the batches after the snapshot, with the same losses
    assert sorted(losses) == sorted(ref_losses)[2 * resume_at:]
    assert all(losses[k] == ref_losses[k] for k in losses)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert not (Path(ram_root) / job / "rank0").exists()  # finished: the next fit starts fresh


def test_a_fit_resumed_at_an_epoch_end_resumes_again_mid_epoch(ram_root, tmp_path, reference):
    """Killed after step 6, resumed from step 5 (epoch 0's last); that run, snapshotting every
    7 steps, killed after step 8 and resumed from step 7 (mid-epoch 1): the second resume
    reads the epoch counters the first one left as an epoch under way."""
    ref_losses, ref_weights = reference
    out = tmp_path / "run"
    for every, kill_at in ((5, 6), (7, 8)):  # a kill one step after the snapshot it resumes from
        killed = run_job(ram_root, "twice", out, "--accum", "2", "--every", str(every),
                         "--kill-at", str(kill_at))
        assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_job(ram_root, "twice", out, "--accum", "2", "--every", "7")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses, resumed_from, weights = result(out)
    assert resumed_from == 7 and sorted(losses) == [f"1:{b}" for b in range(4, 10)]
    assert all(losses[k] == ref_losses[k] for k in losses)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_plain_sampler_and_bad_targets_are_refused(ram_root):
    config = memckpt.Config(job_name="refused", ram_root=ram_root)
    with pytest.raises(StateError, match="ResumableSampler"):
        MemckptCallback(config, torch.utils.data.RandomSampler(range(8)))
    callback = MemckptCallback("not a config", memckpt.ResumableSampler(8))
    with pytest.raises(StateError, match="needs a memckpt.Config"):
        callback.setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")


def test_ddp_misconfigurations_fail_with_one_line():
    class Ctx(RestoreAndStep):  # stands for memckpt.run's context of rank 1 in 3
        rank, world_size, config = 1, 3, memckpt.Config()

    sampler = memckpt.ResumableSampler(12)
    callback = MemckptCallback(Ctx(), sampler)
    with pytest.raises(StateError, match="num_nodes=ctx.world_size") as err:  # num_nodes left out
        callback.setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")
    assert "\n" not in str(err.value) and "rank 0 of 1" in str(err.value)
    trainer = SimpleNamespace(global_rank=1, world_size=3)
    callback.check_ranks(trainer)  # a sampler made for one process takes the Trainer's ranks
    assert (sampler.rank, sampler.world_size, len(sampler)) == (1, 3, 4)
    with pytest.raises(StateError, match="deals rank 0 of 2, the Trainer runs rank 1 of 3"):
        MemckptCallback(Ctx(), memckpt.ResumableSampler(12, world_size=2)).check_ranks(trainer)
    data = TensorDataset(torch.zeros(12, 1))
    replaced = DataLoader(data, sampler=DistributedSampler(data, num_replicas=3, rank=1))
    with pytest.raises(StateError, match="use_distributed_sampler=False") as err:
        callback.check_loader(SimpleNamespace(world_size=3, train_dataloader=replaced))
    assert "\n" not in str(err.value)
    with pytest.raises(StateError, match="not from the ResumableSampler given"):
        callback.check_loader(SimpleNamespace(world_size=1, train_dataloader=DataLoader(data)))
    callback.check_loader(SimpleNamespace(world_size=3, train_dataloader=DataLoader(data, sampler=sampler)))


def ddp_config(name: str, ram_root: str | None = None) -> memckpt.Config:
    extra = {"ram_root": ram_root} if ram_root else {}
    return memckpt.Config(
        job_name=name, **extra,
        workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25,
                                      heartbeat_timeout_s=2.0, max_restarts=3,
                                      collective_timeout_s=30.0))


SAMPLES = 72  # 2 epochs of 6 batches of 4 samples per rank


@pytest.fixture(scope="module")
def ddp_job():
    """tests/_lightning_ray_job.py, with it and examples/lightning_fit.py sent to the workers
    by value (they cannot import tests/ or examples/)."""
    import ray
    sys.path.insert(0, str(ROOT / "examples"))

    import _lightning_ray_job
    import lightning_fit
    for module in (_lightning_ray_job, lightning_fit):
        ray.cloudpickle.register_pickle_by_value(module)
    return _lightning_ray_job


@pytest.fixture(scope="module")
def ddp_reference(ddp_job, cluster, tmp_path_factory):
    """The uninterrupted 3-rank fit under ``memckpt.run``: every rank's result, the summary."""
    tmp = tmp_path_factory.mktemp("pl-ddp-ref")
    ref = memckpt.run(ddp_job.LightningRankJob(samples=SAMPLES), ddp_config("pl-ddp-ref"),
                      run_dir=tmp / "run", quiet=True)
    assert ref["recoveries"] == []
    assert [(r["rank"], r["world_size"], r["step"]) for r in ref["results"]] == [
        (0, 3, 12), (1, 3, 12), (2, 3, 12)]
    for theirs in ref["results"]:
        assert len(theirs["losses"]) == 12  # 2 epochs of 6 batches
    # the ranks drew different batches (the sampler dealt the data; no rank saw them all)
    assert len({tuple(r["losses"].values()) for r in ref["results"]}) == 3
    # each step's loss reached the coordinator (#52): the job's curve is rank 0's
    # training_step loss, one batch a step
    keys = [f"{(s - 1) // 6}:{(s - 1) % 6}" for s in range(1, 13)]
    assert ref["losses"] == [ref["results"][0]["losses"][k] for k in keys]
    return ref


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    """Each rank's last process ran exactly the batches after the step it resumed from, with
    the uninterrupted run's losses, bit for bit."""
    for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert sorted(mine["losses"]) == sorted(theirs["losses"])[mine["resumed_from"]:]
        differ = {k: (v, theirs["losses"][k]) for k, v in mine["losses"].items()
                  if v != theirs["losses"][k]}
        assert not differ, f"rank {rank}'s losses differ from the uninterrupted run: {differ}"


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_ddp_fit_under_memckpt_run_survives_a_killed_worker(ddp_job, ddp_reference, full_cluster,
                                                            tmp_path):
    """Three ranks, DDP in the process group memckpt made (gloo), the callback on
    ``memckpt.run``'s context; rank 1's worker SIGKILLed at step 5 of 12 (mid-epoch: an epoch
    is 6 steps of 4 samples per rank)."""
    from memckpt.runtime.chaos.faults import FaultInjector
    inj = FaultInjector().kill_worker(rank=1, at_step=5)
    got = memckpt.run(ddp_job.LightningRankJob(samples=SAMPLES), ddp_config("pl-ddp"),
                      run_dir=tmp_path / "run", injector=inj, quiet=True)
    (rec,) = got["recoveries"]
    assert rec["died_ranks"] == [1] and rec["resumed_step"] == 4
    assert [r["resumed_from"] for r in got["results"]] == [4, 4, 4]
    assert_same_batches(got["results"], ddp_reference["results"])
    assert got["losses"] == ddp_reference["losses"]  # the coordinator's curve, across it
    # parameters, optimizer state, scheduler and loop position on every rank, bit for bit
    assert got["final_digest"] == ddp_reference["final_digest"]


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_fit_inside_ray_train_survives_a_lost_node(ddp_job, ddp_reference, full_cluster, tmp_path,
                                                   ram_root):
    """The same fit inside Ray Train (``TorchTrainer``, Ray's ``RayDDPStrategy``,
    ``RayLightningEnvironment`` and ``prepare_trainer``, memckpt's Ray Train callback): rank
    1's node removed at step 5; Ray Train restarts the group and every rank resumes from RAM
    (rank 1 from its peer's replica), ending equal to the ``memckpt.run`` run above."""
    import json

    from conftest import fit_losing_a_node
    name, out = "pl-rt-node", tmp_path / "out"
    out.mkdir()
    fit_losing_a_node(name, ddp_job.ray_train_loop,
                      {"job": ddp_job.LightningRankJob(SAMPLES, ray_train=True), "out": str(out)},
                      ddp_config(name, ram_root), tmp_path)
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(r["rank"], r["world_size"], r["step"]) for r in got] == [(0, 3, 12), (1, 3, 12), (2, 3, 12)]
    resumed = {r["resumed_from"] for r in got}
    assert len(resumed) == 1 and resumed.pop() > 0  # every rank from the same RAM step, not 0
    assert_same_batches(got, ddp_reference["results"])
    # parameters, optimizer state, scheduler and loop position on every rank, bit for bit
    assert [r["digest"] for r in got] == ddp_reference["rank_digests"]
