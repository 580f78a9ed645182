"""The synthetic training job of ``memckpt bench recovery`` (:mod:`memckpt.bench.recovery`).

``RecoveryJob`` is what ``memckpt.run`` runs there: ``state_bytes`` of d x d nn.Linear
params + AdamW state per rank, a fixed compute (matmuls) and an all-reduce of the loss per
step. ``StepTimedJob`` wraps another job (memckpt.demo.job.GPTJob) to time its steps. The
helpers that build the state and run the compute are shared with the restart-every-worker
alternative (:mod:`memckpt.bench.recovery.bench_actors`) and
:mod:`memckpt.bench.compare.alternatives`.
Both jobs are pickled by reference, so they stay at module top level.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from memckpt.runtime.worker.result import RestoreReport

DEFAULT_STATE_MB = 1024
DEFAULT_LAYERS = 16
DEFAULT_KILL_AT = 4  # the fault fires at this step: steps 1..3 run in steady state
DEFAULT_STEPS_AFTER = 3  # steps after the fault (replication samples after the restore)
DEFAULT_COMPUTE_ITERS = 40  # 512x512 matmul + tanh per iteration: ~50 ms on 2 CPU cores
COMPUTE_N = 512


# -- the synthetic state and step -----------------------------------------------------------------
def layout(state_bytes: int, layers: int = DEFAULT_LAYERS) -> tuple[int, int]:
    """(width d, number of layers n) of d x d nn.Linear layers whose params + AdamW moments
    total about ``state_bytes`` (float32: 12 bytes per parameter)."""
    elems = max(1, state_bytes // 12)
    d = max(8, int(math.sqrt(elems / layers)) // 8 * 8)
    n = max(1, round(elems / (d * d + d)))
    return d, n


def state_nbytes(d: int, n: int) -> int:
    """Bytes of the captured state: params, exp_avg, exp_avg_sq and AdamW's step scalars."""
    return n * (d * d + d) * 12 + n * 2 * 4


def build_state(d: int, n: int, fresh: bool, seed: int = 0):
    """``n`` x Linear(d, d) + AdamW. ``fresh``: initialised, with one optimizer step taken so
    the AdamW state exists. Otherwise an uninitialised skeleton for a restore to fill (the
    restore brings the optimizer state; both sides of the benchmark build the same way)."""
    import torch
    from torch.nn.utils import skip_init

    model = torch.nn.Sequential(*[skip_init(torch.nn.Linear, d, d) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if fresh:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-0.02, 0.02, generator=g)
        for p in model.parameters():  # moments unique to the seed (the rank), as with ZeRO:
            p.grad = torch.full_like(p, 1e-3 * (1 + seed))  # no holder has them already
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def touch_state(model, opt) -> None:
    """What an optimizer step does to the state, at a fraction of its cost: one value in every
    4 KiB page of every parameter and moment changes. A holder leaves the chunks its copy
    holds unchanged in place (#50): a state nothing changed would cross as headers alone."""
    import torch
    with torch.no_grad():
        for t in [*model.parameters(), *(v for st in opt.state.values() for v in st.values()
                                          if torch.is_tensor(v) and v.dim())]:
            t.view(-1)[::1024].add_(1e-6)


def compute_inputs(seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(COMPUTE_N, COMPUTE_N, generator=g)
    w = torch.randn(COMPUTE_N, COMPUTE_N, generator=g) / math.sqrt(COMPUTE_N)
    return x, w


def compute_loss(x, w, iters: int):
    """The fixed per-step compute: ``iters`` matmuls; returns a scalar loss."""
    import torch
    y = x
    for _ in range(iters):
        y = torch.tanh(y @ w)
    return y.square().mean()


def all_reduce_mean(loss, world_size: int):
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(loss)
        loss = loss / world_size
    return loss


class _RestoreProbe:
    """Times the load into the model and optimizer inside ``ctx.restore`` (the worker times
    its peer fetch itself, in ``ctx.restore_report``). Undone on exit."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.load_s = 0.0
        self.usage: dict[str, float] = {}  # the loading thread's CPU and page faults

    def __enter__(self) -> "_RestoreProbe":
        probe, self._load = self, self.ctx.ckpt.load_shard

        def load_shard(state: Any, shard: Any, source: str) -> int:
            import resource
            u0 = resource.getrusage(resource.RUSAGE_THREAD)
            t0 = time.perf_counter()
            try:
                return probe._load(state, shard, source)
            finally:
                probe.load_s += time.perf_counter() - t0
                u1 = resource.getrusage(resource.RUSAGE_THREAD)
                probe.usage = {"user_s": u1.ru_utime - u0.ru_utime,
                               "sys_s": u1.ru_stime - u0.ru_stime,
                               "minor_faults": float(u1.ru_minflt - u0.ru_minflt),
                               "involuntary_switches": float(u1.ru_nivcsw - u0.ru_nivcsw)}

        self.ctx.ckpt.load_shard = load_shard
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.ckpt.__dict__.pop("load_shard", None)


@dataclass(frozen=True)
class RecoveryJob:
    """The synthetic training job: ``state_bytes`` of nn.Linear params + AdamW state per rank,
    a fixed compute and an all-reduce of the loss per step (so survivors notice a lost peer,
    as a data-parallel job does), ``ctx.restore`` then ``ctx.step`` like memckpt.demo.job.

    Returns timestamps and restore details for the benchmark (the last generation's)."""

    steps: int = DEFAULT_KILL_AT + DEFAULT_STEPS_AFTER
    state_bytes: int = DEFAULT_STATE_MB << 20
    layers: int = DEFAULT_LAYERS
    compute_iters: int = DEFAULT_COMPUTE_ITERS
    seed: int = 0

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import memckpt

        t_enter = time.time()
        d, n = layout(self.state_bytes, self.layers)
        model, opt = build_state(d, n, fresh=ctx.generation == 0, seed=self.seed + ctx.rank)
        t_built = time.time()
        state = memckpt.TrainState(model=model, optimizer=opt)
        with _RestoreProbe(ctx) as probe:
            start = ctx.restore(state)
        t_restored = time.time()
        x, w = compute_inputs(self.seed)
        marks, compute_s, repl = [], [], []
        first: dict[str, float] = {}
        for step in range(start + 1, self.steps + 1):
            t0 = time.time()
            loss = compute_loss(x, w, self.compute_iters)
            t1 = time.time()
            compute_s.append(t1 - t0)
            loss = all_reduce_mean(loss, ctx.world_size)
            touch_state(model, opt)
            t2 = time.time()
            ctx.step(state, step, loss=float(loss))
            marks.append(time.time())
            if not first:  # the first step after the (re)start, in wall-clock times
                first = {"t_compute": t0, "t_all_reduce": t1, "t_snapshot": t2}
            now = ctx.stats()
            repl.append((int(now["sent_bytes"]), float(now["replicate_s"])))
        rep = ctx.restore_report or RestoreReport()  # None: a fresh start
        return {
            "first_step": first,
            "rank": ctx.rank, "generation": ctx.generation, "node_id": ctx.node_id,
            "restored_step": start, "source": ctx.restore_source,
            "holders": list(ctx.spec.holders), "t_enter": t_enter, "t_built": t_built,
            "t_restored": t_restored, "first_step_done_at": marks[0] if marks else None,
            "step_marks": marks, "compute_s": compute_s, "replication": repl,
            "fetch_s": rep.fetch_s, "slot_alloc_s": rep.slot_alloc_s,
            "fetch_bytes": rep.fetch_bytes, "load_s": probe.load_s,
            "connect_s": rep.connect_s or 0.0, "install_s": rep.install_s,
            "load_usage": probe.usage,
            "fetch_and_load_s": rep.fetch_and_load_s if ctx.restore_report else None,
            # time the snapshots waited for a free slot (the gate: the newest step committed)
            "snapshot_waited_s": ctx.stats()["slot_waited_s"],
            "snapshot_allocations": ctx.stats()["slot_allocations"],
            "slot_bytes": slot_file_bytes(ctx),
        }


def slot_file_bytes(ctx: Any) -> int:
    """The size of this rank's own snapshot slot file, the larger of the two: one copy of
    its shard as memckpt holds it in RAM (header and data), the unit its host-RAM footprint
    is counted in. 0 before a first snapshot."""
    sizes = [s.path.stat().st_size for s in ctx.ckpt.engine.slots if s.path.exists()]
    return max(sizes, default=0)


class _TimedContext:
    """Delegates to a WorkerContext and notes when each ``step`` call begins."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.marks: list[tuple[int, float]] = []
        self.inside: list[tuple[int, float]] = []  # time spent in ctx.step (snapshot, waits)
        self.state_bytes: Optional[int] = None

    def step(self, state: Any, step: int, **metrics: float) -> None:
        t0 = time.perf_counter()
        self.marks.append((step, t0))
        if self.state_bytes is None:
            self.state_bytes = state.capture(step).nbytes
        try:
            return self._ctx.step(state, step, **metrics)
        finally:
            self.inside.append((step, time.perf_counter() - t0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


@dataclass(frozen=True)
class StepTimedJob:
    """Runs ``inner(ctx)`` and reports the wall time between consecutive ``ctx.step`` calls
    (one whole step: compute plus the previous step's snapshot and report)."""

    inner: Any

    def __call__(self, ctx: Any) -> dict[str, Any]:
        timed = _TimedContext(ctx)
        result = self.inner(timed)
        intervals = [(s, b - a) for (_, a), (s, b) in zip(timed.marks, timed.marks[1:])]
        stats = ctx.stats()
        return {"rank": ctx.rank, "result": result, "intervals": intervals,
                "inside": timed.inside, "state_bytes": timed.state_bytes,
                "snapshots": stats["snapshots"], "waited_s": stats["waited_s"],
                "replicate_s": stats["replicate_s"], "sent_bytes": stats["sent_bytes"],
                "filled_bytes": stats["filled_bytes"]}
