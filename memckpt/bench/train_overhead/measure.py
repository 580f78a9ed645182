"""The loop ``memckpt bench train-overhead`` times: a compute-bound step (matmuls standing
in for forward and backward, then a real AdamW update of the whole state) followed by
``Checkpointer.step`` every step, per snapshot mode and ``engine.on_sealing`` policy."""

from __future__ import annotations

import os
import shutil
import time
from statistics import median
from typing import Callable, Optional

import torch

from memckpt.bench.snapshot.measure import build_state
from memckpt.checkpointer import Checkpointer
from memckpt.config import Config, EngineConfig
from memckpt.format.state import TrainState

WARMUP_STEPS = 2
VARIANTS: tuple[tuple[str, Optional[str], Optional[str]], ...] = (
    ("none", None, None), ("sync-wait", "sync", "wait"), ("sync-skip", "sync", "skip"),
    ("overlap-wait", "overlap", "wait"), ("overlap-skip", "overlap", "skip"))


def compute_for(seconds: float, device: str) -> Callable[[], None]:
    """Matmuls on tensors of their own lasting about ``seconds`` (calibrated here)."""
    n = 1024 if device == "cuda" else 256
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)

    def run(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b, out=c)
        if device == "cuda":
            torch.cuda.synchronize()  # a loss.item() at the end of the step
    run(10)
    t0 = time.perf_counter()
    run(50)
    per = (time.perf_counter() - t0) / 50
    k = max(1, round(seconds / per))
    return lambda: run(k)


def loop(state: TrainState, opt: torch.optim.Optimizer, compute: Callable[[], None],
         steps: int, ckpt: Optional[Checkpointer]) -> tuple[list[float], tuple[int, int]]:
    """Step times of ``steps`` steps after warm-up (compute, update, snapshot), and the
    (landed, requested) counts at the end of the warm-up."""
    times: list[float] = []
    base = (0, 0)
    for step in range(1, WARMUP_STEPS + steps + 1):
        if step == WARMUP_STEPS + 1 and ckpt is not None:
            ckpt.wait()
            base = (ckpt.stats.landed, ckpt.stats.requested)
        t0 = time.perf_counter()
        compute()
        opt.step()
        if ckpt is not None:
            ckpt.step(state, step)
        if step > WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    return times, base


def measure(target_bytes: int, device: str, steps: int, compute_s: float,
            ram_root: Optional[str], seal_threads: int,
            say: Callable[[str], None]) -> list[dict]:
    """One dict per variant: the step times and what landed (see :class:`..rows.Row`)."""
    model, opt = build_state(target_bytes, device=device)
    for p in model.parameters():  # a gradient to apply at every step
        p.grad = torch.full_like(p, 1e-4)
    state = TrainState(model=model, optimizer=opt)
    nbytes = state.capture(0).nbytes
    compute = compute_for(compute_s, device)
    out = []
    for variant, mode, policy in VARIANTS:
        ckpt = None
        if mode is not None:
            ckpt = Checkpointer(Config(
                job_name=f"bench-overhead-{os.getpid()}", ram_root=ram_root, snapshot_mode=mode,
                engine=EngineConfig(seal_threads=seal_threads, on_sealing=policy or "wait")))
            ckpt.restore(state)  # nothing to restore: prepares the slots in the background
            ckpt.engine.wait_prepared()
        try:
            times, (landed0, requested0) = loop(state, opt, compute, steps, ckpt)
            if ckpt is not None:
                ckpt.wait()
                landed = ckpt.stats.landed - landed0
                requested = ckpt.stats.requested - requested0
                threads = ckpt.engine.seal_threads
            else:
                landed = requested = threads = 0
        finally:
            if ckpt is not None:
                ckpt.close(unlink=True)
                shutil.rmtree(ckpt.directory.parent, ignore_errors=True)  # the job's folder
        say(f"{variant}: median step {median(times) * 1e3:.1f} ms; {landed} of {requested} "
            "snapshots landed")
        out.append(dict(variant=variant, mode=mode, on_sealing=policy, state_bytes=nbytes,
                        steps=steps, step_times_s=tuple(times), landed=landed,
                        requested=requested, seal_threads=threads))
    return out
