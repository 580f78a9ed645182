"""Helper process for tests/test_gpu.py (not a test module): train a small CUDA model with
AdamW for steps 1..upto, snapshotting every step, printing ``step <i>`` once step i is
sealed (``train``); or restore first and go on (``resume``). The final parameters and
optimizer state go to ``--out`` (torch.save), with the restored step in ``restored``."""

from __future__ import annotations

import argparse
import os
import sys

import torch

import memckpt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(64, 256, generator=g).cuda(), torch.randn(64, 16, generator=g).cuda()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("train", "resume"))
    p.add_argument("--ram-root", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--mode", default="sync")
    p.add_argument("--upto", type=int, required=True)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 16)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = memckpt.TrainState(model=model, optimizer=opt)
    ckpt = memckpt.Checkpointer(memckpt.Config(job_name=a.job, ram_root=a.ram_root,
                                               snapshot_mode=a.mode))
    start = ckpt.restore(state) if a.role == "resume" else 0
    devices = {t.device.type for t in opt.state_dict()["state"].get(0, {}).values()
               if t.dim()} | {p.device.type for p in model.parameters()}
    for step in range(start + 1, a.upto + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(state, step)
        ckpt.wait()
        print(f"step {step}", flush=True)
    if a.out:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "restored": start,
                    "devices": sorted(devices)}, a.out)
    sys.stdout.flush()
    os._exit(0)  # leave the slots as a crashed job would


if __name__ == "__main__":
    sys.exit(main())
