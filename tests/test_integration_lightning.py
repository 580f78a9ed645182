"""The Lightning front door: a fit() process SIGKILLed mid-epoch (or at an epoch's end), the
same script run again, resumes from RAM at the next batch and ends bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import memckpt  # noqa: E402
from memckpt.errors import StateError  # noqa: E402
from memckpt.integrations.lightning import MemckptCallback  # noqa: E402

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


# (kill at, snapshot every, the step it resumes from): mid-epoch 0; the end of epoch 0
@pytest.mark.parametrize("kill_at,every,resume_at", [
    (4, 3, 3),
    pytest.param(6, 5, 5, marks=pytest.mark.xfail(strict=True, reason=(
        "known gap: a snapshot at an epoch's last optimizer step restores the same batches and "
        "RNG, yet the next epoch's losses differ (docs/integrations.md, Limits)"))),
])
def test_sigkilled_fit_resumes_at_the_next_batch_bit_identical(ram_root, tmp_path, kill_at, every,
                                                                resume_at):
    ref = run_job(ram_root, "reference", tmp_path / "ref", "--accum", "2")
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses, _, ref_weights = result(tmp_path / "ref")
    assert len(ref_losses) == 20  # 2 epochs of 10 batches, 5 optimizer steps each
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


def test_plain_sampler_and_bad_targets_are_refused(ram_root):
    config = memckpt.Config(job_name="refused", ram_root=ram_root)
    with pytest.raises(StateError, match="ResumableSampler"):
        MemckptCallback(config, torch.utils.data.RandomSampler(range(8)))
    callback = MemckptCallback("not a config", memckpt.ResumableSampler(8))
    with pytest.raises(StateError, match="needs a memckpt.Config"):
        callback.setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")
