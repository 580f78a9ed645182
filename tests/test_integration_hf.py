"""The Hugging Face Trainer front door: a Trainer process SIGKILLed mid-epoch, the same script
run again, resumes from RAM by itself and ends bit-identical to a run that never failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import memckpt  # noqa: E402
from memckpt.errors import StateError  # noqa: E402
from memckpt.integrations.hf import attach  # noqa: E402
from memckpt.integrations.saver import Saver  # noqa: E402

JOB = Path(__file__).with_name("_hf_job.py")
ROOT = Path(__file__).resolve().parent.parent
VOLATILE = ("_runtime", "_per_second")  # wall-clock figures in the Trainer's log entries


def run_job(ram_root: str, job: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(JOB), "--ram-root", ram_root, "--job", job,
                           "--out", str(out), *extra], env=env, capture_output=True, text=True,
                          timeout=600)


def result(out: Path) -> tuple[list[dict], int, dict[str, torch.Tensor]]:
    res = json.loads((out / "result.json").read_text())
    # wall-clock figures apart, the last entry (the summary: train_loss) included
    log = [{k: v for k, v in entry.items() if not k.endswith(VOLATILE)}
           for entry in res["log_history"]]
    return log, res["resumed_from"], torch.load(out / "weights.pt")


def assert_same(got: Path, want: Path) -> None:
    log, _, weights = result(got)
    ref_log, _, ref_weights = result(want)
    assert [e["step"] for e in log] == [e["step"] for e in ref_log]
    assert log == ref_log  # losses, grad norms, learning rates, eval losses: every digit
    assert "train_loss" in log[-1]  # the summary averages the whole run, as if never killed
    assert weights.keys() == ref_weights.keys()
    differ = [k for k in weights if not torch.equal(weights[k], ref_weights[k])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}"


@pytest.mark.parametrize("accum,kill_at,resume_at,mode", [(1, 9, 8, "sync"), (2, 5, 4, "overlap")])
def test_sigkilled_trainer_resumes_bit_identical(ram_root, tmp_path, accum, kill_at, resume_at,
                                                 mode):
    """``overlap``: the snapshot copies the parameters and optimizer state while the next
    step's forward and backward run (the optimizer's step waits for it)."""
    ref = run_job(ram_root, "reference", tmp_path / "ref", "--accum", str(accum))  # sync mode
    flags = ("--accum", str(accum), "--mode", mode)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_job(ram_root, "job", tmp_path / "run", *flags, "--kill-at", str(kill_at))
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (Path(ram_root) / "job" / "rank0").glob("slot*.shard"))
    resumed = run_job(ram_root, "job", tmp_path / "run", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from the RAM snapshot of step {resume_at}" in resumed.stderr
    assert result(tmp_path / "run")[1] == resume_at  # mid-epoch: the epoch is 6 (or 3) steps
    assert_same(tmp_path / "run", tmp_path / "ref")
    if accum == 1:  # the job finished: its RAM is freed and a second run starts fresh
        assert not (Path(ram_root) / "job" / "rank0").exists()
        again = run_job(ram_root, "job", tmp_path / "again", *flags)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resumed from" not in again.stderr and result(tmp_path / "again")[1] == 0
        assert_same(tmp_path / "again", tmp_path / "ref")


def ddp_config(name: str, ram_root: str | None = None) -> memckpt.Config:
    extra = {"ram_root": ram_root} if ram_root else {}
    return memckpt.Config(
        job_name=name, **extra,
        workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                      max_restarts=3, collective_timeout_s=30.0))


SAMPLES = 72  # 3 ranks x 4 per step: 6 optimizer steps an epoch, 12 in all


@pytest.fixture(scope="module")
def ddp_job(cluster):
    """The 3-rank job module, shipped to the workers (which cannot import tests/ or
    examples/)."""
    import ray
    sys.path.insert(0, str(ROOT / "examples"))

    import _hf_ray_job
    import _trainer_result
    import hf_trainer
    for module in (_hf_ray_job, _trainer_result, hf_trainer):
        ray.cloudpickle.register_pickle_by_value(module)
    return _hf_ray_job


@pytest.fixture(scope="module")
def ddp_reference(ddp_job, tmp_path_factory):
    """The uninterrupted 3-rank run under memckpt.run: every rank's result, the run summary."""
    tmp = tmp_path_factory.mktemp("hf-ddp-ref")
    ref = memckpt.run(ddp_job.HFRankJob(str(tmp / "out"), SAMPLES), ddp_config("hf-ddp-ref"),
                      run_dir=tmp / "run", quiet=True)
    assert ref["recoveries"] == [] and [r["world_size"] for r in ref["results"]] == [3, 3, 3]
    assert len([e for e in ref["results"][0]["log_history"] if "eval_loss" in e]) == 3  # 4, 8, 12
    # every step's logged loss reached the coordinator (#52): the run's loss curve
    logged = [e["loss"] for e in ref["results"][0]["log_history"] if "loss" in e]
    assert len(logged) == 12 and ref["losses"] == pytest.approx(logged, rel=1e-6)
    return ref


def assert_same_ranks(got: list[dict], want: list[dict]) -> None:
    """Every rank's log (losses, grad norms, learning rates, evaluations, the summary) and
    final parameters equal the uninterrupted run's, bit for bit."""
    assert len(got) == len(want) == 3
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        assert [e.get("step") for e in mine["log_history"]] == \
            [e.get("step") for e in theirs["log_history"]]
        assert mine["log_history"] == theirs["log_history"], f"rank {rank}'s log differs"
        assert mine["weights"] == theirs["weights"], f"rank {rank}'s parameters differ"


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_ddp_trainer_under_memckpt_run_survives_a_killed_worker(ddp_job, ddp_reference, full_cluster,
                                                               tmp_path):
    """DDP under the Trainer (gloo), memckpt attached to ``memckpt.run``'s context; rank 1's
    worker SIGKILLed at step 5 of 12 (mid-epoch: an epoch is 6 steps)."""
    from memckpt.runtime.chaos.faults import FaultInjector
    inj = FaultInjector().kill_worker(rank=1, at_step=5)
    got = memckpt.run(ddp_job.HFRankJob(str(tmp_path / "out"), SAMPLES), ddp_config("hf-ddp"),
                      run_dir=tmp_path / "run", injector=inj, quiet=True)
    (rec,) = got["recoveries"]
    assert rec["died_ranks"] == [1] and rec["resumed_step"] == 4
    assert [r["resumed_from"] for r in got["results"]] == [4, 4, 4]
    assert_same_ranks(got["results"], ddp_reference["results"])
    # parameters, optimizer state and scheduler on every rank, bit for bit
    assert got["final_digest"] == ddp_reference["final_digest"]
    # and the loss curve the coordinator kept, across the recovery
    assert got["losses"] == pytest.approx(ddp_reference["losses"], rel=1e-6)


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_trainer_inside_ray_train_survives_a_lost_node(ddp_job, ddp_reference, full_cluster,
                                                       tmp_path, ram_root):
    """The same Trainer inside Ray Train (``TorchTrainer`` + ``prepare_trainer`` + memckpt's
    callback): the node of rank 1 removed at step 5; Ray Train restarts the group and every
    rank resumes from RAM (rank 1 from its peer's replica), ending equal to the run above."""
    from conftest import fit_losing_a_node
    name, out = "hf-rt-node", tmp_path / "out"
    out.mkdir()
    fit_losing_a_node(name, ddp_job.ray_train_loop,
                      {"job": ddp_job.HFRankJob(str(out), SAMPLES, ray_train=True)},
                      ddp_config(name, ram_root), tmp_path)
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["resumed_from"] > 0 for r in got)  # from memckpt's RAM, not from step 0
    assert_same_ranks(got, ddp_reference["results"])


def tiny_trainer(tmp_path: Path, **kwargs) -> transformers.Trainer:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    sys.path.insert(0, str(ROOT / "examples"))
    from hf_trainer import Tokens
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    if "model_init" not in kwargs:
        kwargs["model"] = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                                     n_layer=1, n_head=2))
    return transformers.Trainer(args=args, train_dataset=Tokens(8, 1), **kwargs)


class Wrapped:
    """An optimizer wrapper memckpt does not know (it is no torch.optim.Optimizer)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd) -> None:
        self.inner.load_state_dict(sd)


def test_unknown_optimizer_wrapper_fails_before_the_first_step(ram_root, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = Wrapped(torch.optim.AdamW(model.parameters(), lr=1e-3))
    sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lambda s: 1.0)
    trainer = tiny_trainer(tmp_path, model=model, optimizers=(opt, sched))
    attach(trainer, memckpt.Config(job_name="wrapped", ram_root=ram_root))
    with pytest.raises(StateError) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message and "Wrapped" in message and "torch.optim.Optimizer" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no step ran


def test_model_init_and_non_trainers_are_refused(ram_root, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = memckpt.Config(job_name="refused", ram_root=ram_root)
    trainer = tiny_trainer(tmp_path, model_init=lambda: GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)))
    with pytest.raises(StateError, match="model_init"):
        attach(trainer, config)
    with pytest.raises(StateError, match="needs a transformers.Trainer"):
        attach(object(), config)
    with pytest.raises(StateError, match="needs a memckpt.Config"):
        attach(tiny_trainer(tmp_path), "not a config")
    with pytest.raises(StateError, match="serves one process.*memckpt.run"):
        Saver(config, rank=1, world_size=2, who="torchrun")  # DDP needs a committing front door


def test_import_memckpt_never_imports_the_trainers():
    code = ("import sys, memckpt, memckpt.integrations, memckpt.integrations.saver; "
            "memckpt.Checkpointer, memckpt.TrainState, memckpt.ResumableSampler; "
            "sys.exit(','.join(m for m in ('transformers', 'lightning', 'accelerate')"
            " if m in sys.modules) or None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr or "imported a trainer library"
