"""Helper process for the exact-resume tests (tests/test_checkpointer.py).

Not a test module. Two roles, each run as a separate Python process, for one or
more cases ``--case job:scenario:upto`` (each case has its own job directory
under ``--ram-root`` and reseeds every RNG, so cases do not interact):

``first``   seed, build, train steps 1..upto snapshotting every step into RAM,
            print ``<job> step <i> <loss>`` after each snapshot, then leave
            abruptly (``os._exit``) without closing the Checkpointer, as a crashed
            job would. The parent may also SIGKILL it mid-run.
``resume``  a fresh process: build, restore the newest snapshot from the same
            RAM root, continue to ``upto`` (or restored + ``--extra``), then run
            an uninterrupted reference (fresh seeds, snapshotting every step under
            another job name) to the same step. Losses go to
            ``<out>/<job>/result.json``, final parameters and optimizer state to
            ``<out>/<job>/{resumed,reference}.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import memckpt

SCENARIOS = ("sgd", "adamw", "data", "rng", "overlap")
IN, OUT = 12, 4


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch per step, from its own generator (independent of global RNG)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, IN, generator=g)
    return x, torch.randn(8, OUT, generator=g)


class Batches:
    """Cycles a DataLoader over epochs; the iterator is created lazily."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.it = loader, None

    def next(self):
        if self.it is None:
            self.it = iter(self.loader)
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


class Job:
    """One scenario's model, optimizer, scheduler, data and step function."""

    def __init__(self, scenario: str, ram_root: str, job: str) -> None:
        seed_all(0)
        self.scenario = scenario
        dropout = scenario in ("rng", "overlap", "data")
        layers = [nn.Linear(IN, 32), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(p=0.3))
        layers.append(nn.Linear(32, OUT))
        self.model = nn.Sequential(*layers)
        self.scheduler = None
        self.sampler = None
        self.batches = None
        if scenario in ("sgd", "data", "rng"):
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9,
                                       nesterov=scenario == "rng", weight_decay=1e-3)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.05)
            warm = torch.optim.lr_scheduler.LinearLR(self.opt, start_factor=0.1, total_iters=3)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=20, eta_min=1e-4)
            self.scheduler = torch.optim.lr_scheduler.SequentialLR(self.opt, [warm, cos], milestones=[3])
        if scenario == "data":
            g = torch.Generator().manual_seed(1)
            xs, ys = torch.randn(26, IN, generator=g), torch.randn(26, OUT, generator=g)
            ds = TensorDataset(xs, ys, torch.arange(26))
            self.sampler = memckpt.ResumableSampler(len(ds), shuffle=True, seed=7)
            # A private generator: DataLoader.__iter__ otherwise draws a seed from the
            # global torch RNG each time an iterator is created.
            loader = DataLoader(ds, batch_size=4, sampler=self.sampler, num_workers=0,
                                generator=torch.Generator())
            self.batches = Batches(loader)
        mode = "overlap" if scenario == "overlap" else "sync"
        self.config = memckpt.Config(job_name=job, ram_root=ram_root, snapshot_mode=mode)
        self.state = memckpt.TrainState(model=self.model, optimizer=self.opt,
                                        scheduler=self.scheduler, data=self.sampler)
        self.ckpt = memckpt.Checkpointer(self.config)
        self.seen: dict[int, list[int]] = {}

    def train_step(self, step: int) -> float:
        self.model.train()
        if self.batches is not None:
            x, y, ids = self.batches.next()
            self.seen[step] = ids.tolist()
        else:
            x, y = batch_for(step)
        scale = 1.0
        if self.scenario in ("rng", "overlap"):
            # numpy and python RNG streams feed the loss, so they must resume exactly
            noise = torch.from_numpy(np.random.standard_normal(tuple(x.shape)).astype(np.float32))
            x = x + 0.1 * noise
            scale = 1.0 + random.random()
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y) * scale
        loss.backward()
        self.opt.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.item()

    def final(self) -> dict:
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optim": self.opt.state_dict()}


def _case(text: str) -> tuple[str, str, int]:
    job, scenario, upto = text.split(":")
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return job, scenario, int(upto)


def first(ram_root: str, job_name: str, scenario: str, upto: int) -> None:
    job = Job(scenario, ram_root, job_name)
    for step in range(1, upto + 1):
        loss = job.train_step(step)
        job.ckpt.step(job.state, step)
        print(f"{job_name} step {step} {loss!r}", flush=True)
    job.ckpt.wait()


def resume(ram_root: str, job_name: str, scenario: str, upto: int, extra: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    job = Job(scenario, ram_root, job_name)
    restored = job.ckpt.restore(job.state)
    upto = upto or restored + extra
    resumed = {}
    for step in range(restored + 1, upto + 1):
        resumed[step] = job.train_step(step)
        job.ckpt.step(job.state, step)
    job.ckpt.close()
    torch.save(job.final(), out / "resumed.pt")

    ref = Job(scenario, ram_root, job_name + "-ref")
    reference = {}
    for step in range(1, upto + 1):
        reference[step] = ref.train_step(step)
        ref.ckpt.step(ref.state, step)
    ref.ckpt.close(unlink=True)
    torch.save(ref.final(), out / "reference.pt")
    (out / "result.json").write_text(json.dumps({
        "restored": restored, "upto": upto, "resumed": resumed, "reference": reference,
        "resumed_seen": job.seen, "reference_seen": ref.seen,
    }))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("first", "resume"))
    ap.add_argument("--ram-root", required=True)
    ap.add_argument("--case", action="append", type=_case, required=True,
                    help="job:scenario:upto (resume: upto 0 means restored + --extra)")
    ap.add_argument("--extra", type=int, default=0)
    ap.add_argument("--out", help="resume: results go to <out>/<job>/")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for job_name, scenario, upto in args.case:
        if args.role == "first":
            first(args.ram_root, job_name, scenario, upto)
        else:
            resume(args.ram_root, job_name, scenario, upto, args.extra, Path(args.out) / job_name)
    if args.role == "first":
        sys.stdout.flush()
        os._exit(0)  # no close(): the process just ends, as a crashed one would


if __name__ == "__main__":
    main()
