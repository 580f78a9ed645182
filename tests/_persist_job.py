"""Helper process and shared workload for the persistence tests (tests/test_persist_single.py).

Not a test module. ``Workload`` (a small MLP with dropout, AdamW and a warmup +
cosine schedule, fed by per-step batches plus noise from the torch, numpy and
python RNGs, so every part of the state must come back for an exact resume) is
imported by the tests; run as a script it plays one role in its own process:

``train``   train with one persistence tier, printing ``STEP <s> <loss>`` after each
            ``ckpt.step``. ``--pause-after S`` prints ``PAUSED`` after step S and
            waits to be killed; ``--signals`` installs the SIGTERM/SIGINT handlers
            and, once ``should_stop`` is set, prints ``STOPPED <s>``, closes the
            Checkpointer and exits 0.
``resume``  a fresh process on the same roots: restore (auto-resume from the tier),
            continue to ``--upto``, then run an uninterrupted reference from scratch
            to the same step. Writes ``<out>/result.json`` (restored step, losses)
            and ``<out>/{resumed,reference}.pt`` (final parameters and optimizer).
``big``     a ~200 MB single-matrix model persisted every step: step 1 is persisted
            (``PERSISTED 1``), then each later step prints ``SUBMITTED <s>`` and waits
            for its persistence before the next, until killed.
``big-resume``  restore the big model (RAM gone: from the tier), print
            ``RESTORED <s> EXACT <bool>`` (the weights equal init + s), then take and
            persist one more step and print ``PERSISTED <s>``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import memckpt

IN, OUT = 12, 4
BIG = 7168  # 7168 x 7168 float32 = 196 MiB


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch per step, from its own generator (independent of the global RNG)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, IN, generator=g)
    return x, torch.randn(16, OUT, generator=g)


class Workload:
    """Model, optimizer, scheduler and step function; ``seed`` only sets the initial state."""

    def __init__(self, seed: int = 0) -> None:
        seed_all(seed)
        self.model = nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Dropout(p=0.2),
                                   nn.Linear(32, OUT))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.05)
        warm = torch.optim.lr_scheduler.LinearLR(self.opt, start_factor=0.1, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=20, eta_min=1e-4)
        self.sched = torch.optim.lr_scheduler.SequentialLR(self.opt, [warm, cos], milestones=[3])
        self.state = memckpt.TrainState(model=self.model, optimizer=self.opt, scheduler=self.sched)

    def train_step(self, step: int) -> float:
        self.model.train()
        x, y = batch_for(step)
        noise = torch.from_numpy(np.random.standard_normal(tuple(x.shape)).astype(np.float32))
        x = x + 0.1 * noise + 0.01 * torch.randn(x.shape)
        scale = 1.0 + random.random()
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y) * scale
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss.item()

    def final(self) -> dict:
        """Parameters, optimizer and scheduler state, detached from the live objects."""
        return copy.deepcopy({"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                              "sched": self.sched.state_dict()})


def make_config(job: str, ram_root: str, tiers, stop_file: str | None = None) -> memckpt.Config:
    """``tiers``: (uri, every, keep_last) triples."""
    return memckpt.Config(job_name=job, ram_root=ram_root, stop_file=stop_file,
                          persistence=tuple(memckpt.PersistTier(u, every=e, keep_last=k)
                                            for u, e, k in tiers))


def _say(*words) -> None:
    print(*words, flush=True)


def _land(ckpt: memckpt.Checkpointer, step: int, timeout_s: float) -> None:
    """Until ``step``, just submitted, is persisted: sealed (which submits its persistence),
    then written to every tier."""
    ckpt.wait()
    if not ckpt.persister.flush(timeout_s):
        raise SystemExit(f"step {step} was not persisted within {timeout_s:g} s")


def _wait_forever() -> None:
    while True:
        time.sleep(3600)


# -- roles --------------------------------------------------------------------------------------
def train(args) -> None:
    w = Workload(0)
    ckpt = memckpt.Checkpointer(make_config(args.job, args.ram_root, [(args.tier, args.every,
                                                                        args.keep)]))
    if args.signals:
        ckpt.install_signal_handlers()
    start = ckpt.restore(w.state)
    assert start == 0, f"expected a fresh start, restored step {start}"
    for step in range(1, args.upto + 1):
        loss = w.train_step(step)
        ckpt.step(w.state, step)
        if args.land_each and step % args.every == 0:  # else a newer step may supersede it
            _land(ckpt, step, 60)
        _say("STEP", step, repr(loss))
        if ckpt.should_stop:
            _say("STOPPED", step)
            break
        if args.pause_after == step:
            _say("PAUSED")
            _wait_forever()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    ckpt.close()
    _say("DONE")


def resume(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = Workload(1)  # another initial state: everything must come from the checkpoint
    ckpt = memckpt.Checkpointer(make_config(args.job, args.ram_root, [(args.tier, args.every,
                                                                        args.keep)]))
    restored = ckpt.restore(w.state)
    resumed = {}
    for step in range(restored + 1, args.upto + 1):
        resumed[step] = w.train_step(step)
        ckpt.step(w.state, step)
    ckpt.close(unlink=True)
    torch.save(w.final(), out / "resumed.pt")

    ref = Workload(0)
    reference = {step: ref.train_step(step) for step in range(1, args.upto + 1)}
    torch.save(ref.final(), out / "reference.pt")
    (out / "result.json").write_text(json.dumps({
        "restored": restored, "resumed": resumed, "reference": reference,
        "events": [{k: v for k, v in e.items() if k != "time"} for e in ckpt.events]}))


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = nn.Parameter(torch.rand(BIG, BIG, generator=g))


def _big_ckpt(args) -> memckpt.Checkpointer:
    return memckpt.Checkpointer(make_config(args.job, args.ram_root, [(args.tier, 1, 2)]))


def big(args) -> None:
    model = Big()
    state = memckpt.TrainState(model=model)
    ckpt = _big_ckpt(args)
    for step in range(1, args.upto + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.step(state, step)
        _say("SUBMITTED", step)
        _land(ckpt, step, 120)
        _say("PERSISTED", step)
    _wait_forever()


def big_resume(args) -> None:
    model = Big()
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    state = memckpt.TrainState(model=model)
    ckpt = _big_ckpt(args)
    restored = ckpt.restore(state)
    for _ in range(restored):
        expected.add_(1.0)
    _say("RESTORED", restored, "EXACT", torch.equal(model.weight.detach(), expected))
    del expected
    step = restored + 1
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.step(state, step)
    ckpt.close(unlink=True)  # flushes the persistence of `step`
    _say("PERSISTED", step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("train", "resume", "big", "big-resume"))
    ap.add_argument("--ram-root", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--tier", required=True, help="a directory or s3:// URI")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--upto", type=int, default=10)
    ap.add_argument("--pause-after", type=int)
    ap.add_argument("--signals", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--land-each", action="store_true",
                    help="wait for each persisted step to land before the next step")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    {"train": train, "resume": resume, "big": big, "big-resume": big_resume}[args.role](args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
