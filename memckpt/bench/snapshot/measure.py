"""The methods ``memckpt bench snapshot`` times on one state (see :mod:`memckpt.bench.snapshot.command`):
a raw memcpy, memckpt's snapshot in sync and overlap mode, torch.save into a buffer and to
disk; the state they run on, and the process's memory figures they record."""

from __future__ import annotations

import gc
import io
import math
import os
import resource
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional

from memckpt.bench.foreign_load import Quiet
from memckpt.util.fsutil import fs_type

DEFAULT_LAYERS = 16
WARMUP_SNAPSHOTS = 2  # the first snapshot into each of the two slots allocates it
OVERLAP_COMPUTE_FACTOR = 1.5  # simulated forward+backward = 1.5 x the memcpy time
_MM_N = 256  # side of the matrices of the simulated forward+backward


# -- memory accounting --------------------------------------------------------------------------
def rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024



# -- the state under test -----------------------------------------------------------------------
def build_state(target_bytes: int, layers: int = DEFAULT_LAYERS, seed: int = 0,
                device: str = "cpu"):
    """About ``layers`` d x d nn.Linear layers + AdamW after one step: params + 2 moments ~ target.

    Each layer holds 6 tensors (weight, bias, and their exp_avg, exp_avg_sq); AdamW adds a
    scalar step tensor per parameter.
    """
    import torch
    torch.manual_seed(seed)
    elems = max(1, target_bytes // 12)  # float32 params, exp_avg, exp_avg_sq: 12 bytes/param
    d = max(8, int(math.sqrt(elems / layers)) // 8 * 8)
    n = max(1, round(elems / (d * d + d)))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(n)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # moments unique to the seed (a rank's, with ZeRO)
        p.grad = torch.full_like(p, 1e-3 * (1 + seed))
    opt.step()  # creates exp_avg and exp_avg_sq
    opt.zero_grad(set_to_none=True)  # live state = params + AdamW state, no grads
    return model, opt


def _timed(fn: Callable[[], Any], repeats: int, quiet: Quiet, warmup: int = 0) -> list[float]:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats:
        gc.collect()
        quiet.settle()
        with quiet.span():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        if quiet.keep():
            times.append(dt)
    return times



# -- methods ------------------------------------------------------------------------------------
def measure_memcpy(tensors, repeats: int, quiet: Quiet) -> dict[str, Any]:
    """Raw copy_ of every tensor into views of one preallocated, pre-faulted uint8 buffer."""
    import torch
    offsets, off = [], 0
    for _, t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + 63) // 64 * 64
    cuda = any(t.is_cuda for _, t in tensors)
    buf = torch.empty(max(off, 1), dtype=torch.uint8, pin_memory=cuda)  # the D2H bound: pinned
    buf.zero_()  # fault every page in, as memckpt does when it allocates a slot
    views = [buf[o: o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
             for o, (_, t) in zip(offsets, tensors)]
    pairs = [(v, t) for v, (_, t) in zip(views, tensors)]

    def copy(back: bool = False):
        with torch.no_grad():
            for v, t in pairs:
                (t.copy_(v, non_blocking=cuda) if back else v.copy_(t, non_blocking=cuda))
        if cuda:
            torch.cuda.synchronize()

    times = _timed(copy, repeats, quiet, warmup=1)
    for v, (_, t) in zip(views, tensors):  # the limit must also be a correct copy
        if not torch.equal(v.to(t.device), t):
            raise RuntimeError("memcpy baseline produced a wrong copy")
    # the other direction (host to device, or host to host): what a restore is bound by
    back = _timed(lambda: copy(back=True), repeats, quiet, warmup=1)
    return {"times": times, "back_times": back, "device": "cuda" if cuda else "cpu"}


def _ckpt(mode: str, ram_root: Optional[str]):
    from memckpt.checkpointer import Checkpointer
    from memckpt.config import Config
    return Checkpointer(Config(job_name=f"bench-{os.getpid()}-{mode}", ram_root=ram_root,
                               snapshot_mode=mode))


def _free(ckpt) -> None:
    """Close and delete the slots; close(unlink=True) leaves the empty job directory."""
    ckpt.close(unlink=True)
    try:
        ckpt.directory.parent.rmdir()
    except OSError:
        pass


def _check_holds(ckpt, step: int) -> None:
    """The last snapshot must verify and be of ``step``."""
    with ckpt.engine.reading() as shard:
        if shard.step != step:
            raise RuntimeError(f"memckpt holds step {shard.step}, expected {step}")


def measure_memckpt_sync(state, repeats: int, quiet: Quiet, ram_root: Optional[str], rss_base: int,
                         rss_state: int, state_bytes: int) -> dict[str, Any]:
    """Checkpointer.step() in sync mode. Between repeats the background seal is awaited
    untimed, as the next training step would hide it."""
    ckpt = _ckpt("sync", ram_root)
    try:
        step = 0
        for _ in range(WARMUP_SNAPSHOTS):
            step += 1
            ckpt.step(state, step)
            ckpt.wait()
        gc.collect()
        rss_warm = rss_bytes()
        allocs_warm = ckpt.stats.allocations
        times: list[float] = []
        seals, captures, engine_stall = [], [], []
        while len(times) < repeats:
            gc.collect()
            quiet.settle()
            step += 1
            with quiet.span():
                t0 = time.perf_counter()
                ckpt.step(state, step)
                t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            if not quiet.keep():
                continue
            times.append(t1 - t0)
            seals.append(t2 - t1)
            engine_stall.append(ckpt.stats.last_stall_s)
            t3 = time.perf_counter()
            state.capture(step)  # alone, to see what the capture itself costs
            captures.append(time.perf_counter() - t3)
        allocs_end = ckpt.stats.allocations
        _check_holds(ckpt, step)
    finally:
        _free(ckpt)
    return {"times": times,
            "rss_after_warmup_bytes": rss_warm,
            "rss_over_state": round((rss_warm - rss_base) / state_bytes, 3),
            "snapshot_rss_over_state": round((rss_warm - rss_state) / state_bytes, 3),
            "allocations_after_warmup": allocs_warm, "allocations": allocs_end,
            "allocations_flat": allocs_warm == WARMUP_SNAPSHOTS and allocs_end == allocs_warm,
            "seal_s": median(seals), "capture_s": median(captures),
            "engine_stall_s": median(engine_stall)}


def measure_restore(state, repeats: int, quiet: Quiet, ram_root: Optional[str],
                    bound_s: float) -> dict[str, Any]:
    """Checkpointer.restore() from a RAM slot into the live state (on its device), each
    repeat by a new Checkpointer of the same job (as a restarted process would: its
    constructor maps and pins the slots, untimed)."""
    from memckpt.checkpointer import Checkpointer
    ckpt = _ckpt("sync", ram_root)
    ckpt.step(state, 1)
    ckpt.wait()
    ckpt.close()
    times: list[float] = []
    try:
        while len(times) < repeats:
            again = Checkpointer(ckpt.config)
            gc.collect()
            quiet.settle()
            with quiet.span():
                t0 = time.perf_counter()
                step = again.restore(state)
                dt = time.perf_counter() - t0
            again.close()
            if step != 1:
                raise RuntimeError(f"restored step {step}, expected 1")
            if quiet.keep():
                times.append(dt)
    finally:
        _free(ckpt)
    return {"times": times, "bound_s": bound_s}


def measure_first_snapshot(state, repeats: int, quiet: Quiet,
                           ram_root: Optional[str]) -> dict[str, Any]:
    """The first snapshot of a job: cold (its slot mapped, populated, pinned on the step),
    and after restore() prepared both slots in the background (waited for, untimed)."""
    cold: list[float] = []
    warm: list[float] = []
    for prepared, out in ((False, cold), (True, warm)):
        while len(out) < repeats:
            ckpt = _ckpt("sync", ram_root)
            try:
                if prepared:
                    ckpt.restore(state)  # nothing to restore: prepares the slots
                    ckpt.engine.wait_prepared()
                gc.collect()
                quiet.settle()
                with quiet.span():
                    t0 = time.perf_counter()
                    ckpt.step(state, 1)
                    dt = time.perf_counter() - t0
                ckpt.wait()
            finally:
                _free(ckpt)
            if quiet.keep():
                out.append(dt)
    return {"times": warm, "cold_s": median(cold), "colds_s": cold}


def matmul_unit():
    import torch
    g = torch.Generator().manual_seed(1)
    a = torch.randn(_MM_N, _MM_N, generator=g)
    b = torch.randn(_MM_N, _MM_N, generator=g)
    c = torch.empty(_MM_N, _MM_N)

    def run(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b, out=c)
    return run


def calibrate_compute(target_s: float, quiet: Quiet) -> tuple[Callable[[], None], int, float]:
    """A forward+backward stand-in (matmuls on unrelated tensors) lasting about ``target_s``."""
    run = matmul_unit()
    run(20)
    per = min(_timed(lambda: run(20), 5, quiet)) / 20
    n = max(1, math.ceil(target_s / per))
    alone = median(_timed(lambda: run(n), 3, quiet))
    return (lambda: run(n)), n, alone


def measure_memckpt_overlap(state, opt, repeats: int, quiet: Quiet, ram_root: Optional[str],
                            memcpy_s: float, state_bytes: int, rss_base: int) -> dict[str, Any]:
    """Overlap mode in a training loop: step(), simulated forward+backward, optimizer.step().

    The visible stall is step() plus the wait in optimizer.step's pre-hook for the copy.
    The loop runs back to back (settling for quiet only before it), so a background seal
    still running when the next snapshot is due shows up in step(). On CPU the background
    copy also takes cores from the forward+backward: reported as ``compute_slowdown_s``.
    """
    compute, n_mm, compute_alone = calibrate_compute(OVERLAP_COMPUTE_FACTOR * memcpy_s, quiet)
    quiet.reset()  # count the training loop only
    ckpt = _ckpt("overlap", ram_root)
    marks: list[float] = []
    claims: list[float] = []
    handle = None
    try:
        step = 0

        def iteration():
            nonlocal step
            step += 1
            waited = ckpt.stats.waited_s
            t0 = time.perf_counter()
            ckpt.step(state, step)  # registers memckpt's pre-hook on the first call
            t1 = time.perf_counter()
            claims.append(ckpt.stats.waited_s - waited)  # step() waiting for the last seal
            compute()
            t2 = time.perf_counter()
            opt.step()
            t3 = marks[-1] if marks and marks[-1] >= t2 else time.perf_counter()
            return t1 - t0, t3 - t2, t2 - t1

        for _ in range(WARMUP_SNAPSHOTS):
            iteration()
        # Registered after memckpt's hook, so it fires once memckpt's wait is over.
        handle = opt.register_step_pre_hook(lambda *_: marks.append(time.perf_counter()))
        gc.collect()
        rss_warm = rss_bytes()
        allocs_warm = ckpt.stats.allocations
        steps: list[float] = []
        waits, computes, claim_waits = [], [], []
        gc.collect()
        quiet.settle()
        while len(steps) < repeats:
            with quiet.span():
                s, w, c = iteration()
            if not quiet.keep():
                quiet.settle()
                continue
            claim_waits.append(claims[-1])
            steps.append(s)
            waits.append(w)
            computes.append(c)
        ckpt.wait()
        allocs_end = ckpt.stats.allocations
        _check_holds(ckpt, step)
    finally:
        if handle is not None:
            handle.remove()
        _free(ckpt)
    slowdown = max(0.0, median(computes) - compute_alone)
    return {"times": [s + w for s, w in zip(steps, waits)],
            "step_s": median(steps), "hook_wait_s": median(waits),
            "seal_wait_s": median(claim_waits), "seal_waits_s": claim_waits,
            "compute_alone_s": compute_alone, "compute_overlap_s": median(computes),
            "compute_slowdown_s": slowdown,
            "stall_with_slowdown_s": median(s + w for s, w in zip(steps, waits)) + slowdown,
            "compute_matmuls": n_mm,
            "rss_after_warmup_bytes": rss_warm,
            "rss_over_state": round((rss_warm - rss_base) / state_bytes, 3),
            "allocations": allocs_end,
            "allocations_flat": allocs_warm == WARMUP_SNAPSHOTS and allocs_end == allocs_warm}


def measure_save_buffer(model, opt, repeats: int, quiet: Quiet) -> dict[str, Any]:
    import torch
    sizes = []

    def save():
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        sizes.append(buf.tell())
        buf.close()

    return {"times": _timed(save, repeats, quiet), "bytes_written": sizes[-1]}


def measure_save_disk(model, opt, repeats: int, quiet: Quiet, directory: Path) -> dict[str, Any]:
    import torch
    path = directory / f"bench-{os.getpid()}.pt"
    sizes = []

    def save():
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
            sizes.append(f.tell())

    try:
        times = []
        for _ in range(repeats):
            times += _timed(save, 1, quiet)
            path.unlink()  # untimed
    finally:
        if path.exists():
            path.unlink()
    return {"times": times, "bytes_written": sizes[-1], "dir": str(directory),
            "dir_fs": fs_type(directory)}

