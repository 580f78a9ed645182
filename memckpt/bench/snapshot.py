"""Snapshot stall: what one in-RAM snapshot costs the training step.

For each state size, a model (a stack of nn.Linear layers) plus its AdamW state
(exp_avg, exp_avg_sq) is built so that the captured tensors total about that
size, and these methods are timed on the same tensors:

  memcpy             copy_ into one preallocated flat buffer (the limit)
  memckpt            Checkpointer.step() in sync mode, after warm-up
  memckpt-overlap    overlap mode: step() plus the wait in optimizer.step's
                     pre-hook, with a simulated forward+backward (matmuls,
                     ~1.5x the memcpy time) running while the copy proceeds
  torch.save-buffer  torch.save(model + optimizer state_dict) into io.BytesIO
  torch.save-disk    torch.save to a file in --dir, flush + fsync

Each size runs in a fresh subprocess (peak RSS stays honest and memory is
returned between sizes); the peak RSS of each method is the process's VmHWM,
reset before the method. Sizes are binary: 100M = 100 MiB, 1G = 1 GiB.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterator, Optional

from memckpt.bench.common import (finish_report, human_bytes, human_s, machine_info, machine_line,
                                  positive_int, standalone, write_rows)
from memckpt.fsutil import fs_type

METHODS = ("memcpy", "memckpt", "memckpt-overlap", "torch.save-buffer", "torch.save-disk")
MODES = ("sync", "overlap", "both")
DEFAULT_SIZES = "100M,1G,4G"
MIN_SIZE = 64 * 1024
DEFAULT_LAYERS = 16
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_GIB = 1 << 30
WARMUP_SNAPSHOTS = 2  # the first snapshot into each of the two slots allocates it
OVERLAP_COMPUTE_FACTOR = 1.5  # simulated forward+backward = 1.5 x the memcpy time
BUSY_THRESHOLD = 0.05  # foreign CPU share above which a measurement is flagged
QUIET_THRESHOLD = 0.10  # --wait-quiet: start a repeat once others use less than this
DISCARD_THRESHOLD = 0.25  # --wait-quiet: run a repeat again if others took more than this
_MM_N = 256  # side of the matrices of the simulated forward+backward


# -- argument parsing ---------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"100M"`` -> 104857600. Binary units K, M, G, T; an optional ``B``/``iB``; plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: write a number with an optional unit, e.g. 512K, 100M, 1G, 4G")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < MIN_SIZE:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a state must be at least 64K")
    return n


def parse_sizes(text: str) -> list[tuple[str, int]]:
    """``"100M,1G"`` -> [("100M", 104857600), ("1G", 1073741824)]."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts) or not all(parts):
        raise argparse.ArgumentTypeError(f"invalid size list {text!r}: give sizes separated by "
                                         "commas, e.g. 100M,1G,4G")
    return [(p.upper().replace("IB", "").replace("B", ""), parse_size(p)) for p in parts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        metavar="LIST", help=f"state sizes, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                        help="timed repeats per method (default 5 up to 1G, 3 above)")
    parser.add_argument("--mode", choices=MODES, default="both",
                        help="memckpt snapshot mode(s) to measure (default both)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as a JSON list to PATH")
    parser.add_argument("--dir", metavar="DIR", default=None,
                        help="directory for torch.save-disk (default: a temp dir on local disk)")
    parser.add_argument("--ram-root", metavar="DIR", default=None,
                        help="memckpt ram_root for the snapshot slots (default /dev/shm/memckpt)")
    parser.add_argument("--layers", type=positive_int, default=DEFAULT_LAYERS, metavar="N",
                        help=f"nn.Linear layers in the model (default {DEFAULT_LAYERS}; each adds 7 "
                             "tensors: more layers = more per-tensor overhead)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="on a shared machine: before each repeat wait up to SECONDS for other "
                             f"processes to use < {QUIET_THRESHOLD * 100:.0f}%% of the CPU, and run a "
                             f"repeat again (up to 2x --repeats times) if they took > "
                             f"{DISCARD_THRESHOLD * 100:.0f}%% during it (default 0: off)")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every size in this process instead of a fresh one per size")
    parser.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)  # worker: rows -> file


# -- memory accounting --------------------------------------------------------------------------
def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _cpu_counters() -> Optional[tuple[float, float, float]]:
    """(machine busy CPU-seconds, machine total CPU-seconds, this process's CPU-seconds)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return (sum(vals) - vals[3] - vals[4]) / hz, sum(vals) / hz, t.user + t.system


class Quiet:
    """Repeats on a shared machine: how much CPU other processes took while we timed.

    ``span()`` wraps each timed repeat; ``keep()`` then adds up the CPU time *other*
    processes spent during it (``foreign()``, a share of all cores). With ``wait_s`` > 0,
    ``settle()`` first waits (at most ``wait_s``) until they use under ``threshold`` of
    the machine, and ``keep()`` rejects a repeat of 50 ms or more during which they took
    over ``DISCARD_THRESHOLD`` (at most ``max_discards`` per method), so it is run again.
    """

    def __init__(self, wait_s: float = 0.0, threshold: float = QUIET_THRESHOLD) -> None:
        self.wait_s, self.threshold = wait_s, threshold
        self._last: Optional[tuple[float, float]] = None
        self.reset()

    def reset(self, max_discards: Optional[int] = None) -> None:
        self.busy = self.total = self.waited_s = 0.0
        self.timeouts = self.discarded = 0
        if max_discards is not None:
            self.max_discards = max_discards

    def settle(self) -> None:
        if self.wait_s <= 0:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.wait_s:
            start = _cpu_counters()
            time.sleep(0.3)
            end = _cpu_counters()
            if start is None or end is None:
                break
            busy, total, own = (e - s for e, s in zip(end, start))
            if total <= 0 or max(0.0, busy - own) / total <= self.threshold:
                break
        else:
            self.timeouts += 1
        self.waited_s += time.monotonic() - t0

    @contextmanager
    def span(self) -> Iterator[None]:
        start = _cpu_counters()
        try:
            yield
        finally:
            end = _cpu_counters()
            self._last = None
            if start is not None and end is not None:
                busy, total, own = (e - s for e, s in zip(end, start))
                self._last = (max(0.0, busy - own), total)

    def keep(self) -> bool:
        """After a span: False when it ran under foreign load and should be repeated."""
        last, self._last = self._last, None
        if last is None:
            return True
        foreign, total = last
        noisy = self.wait_s > 0 and total >= 0.1 and foreign / total > DISCARD_THRESHOLD
        if noisy and self.discarded < getattr(self, "max_discards", 0):
            self.discarded += 1
            return False
        self.busy += foreign
        self.total += total
        return True

    def foreign(self) -> Optional[float]:
        return round(self.busy / self.total, 3) if self.total > 0 else None


# -- the state under test -----------------------------------------------------------------------
def build_state(target_bytes: int, layers: int = DEFAULT_LAYERS, seed: int = 0):
    """About ``layers`` d x d nn.Linear layers + AdamW after one step: params + 2 moments ~ target.

    Each layer holds 6 tensors (weight, bias, and their exp_avg, exp_avg_sq); AdamW adds a
    scalar step tensor per parameter.
    """
    import torch
    torch.manual_seed(seed)
    elems = max(1, target_bytes // 12)  # float32 params, exp_avg, exp_avg_sq: 12 bytes/param
    d = max(8, int(math.sqrt(elems / layers)) // 8 * 8)
    n = max(1, round(elems / (d * d + d)))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(n)])
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


class _Progress:
    def __init__(self, label: str) -> None:
        self.label = label

    def __call__(self, msg: str) -> None:
        print(f"[bench snapshot {self.label}] {msg}", file=sys.stderr, flush=True)


# -- methods ------------------------------------------------------------------------------------
def measure_memcpy(tensors, repeats: int, quiet: Quiet) -> dict[str, Any]:
    """Raw copy_ of every tensor into views of one preallocated, pre-faulted uint8 buffer."""
    import torch
    offsets, off = [], 0
    for _, t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + 63) // 64 * 64
    buf = torch.empty(max(off, 1), dtype=torch.uint8)
    buf.zero_()  # fault every page in, as memckpt does when it allocates a slot
    views = [buf[o: o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
             for o, (_, t) in zip(offsets, tensors)]
    pairs = [(v, t) for v, (_, t) in zip(views, tensors)]

    def copy():
        with torch.no_grad():
            for v, t in pairs:
                v.copy_(t)

    times = _timed(copy, repeats, quiet, warmup=1)
    for v, (_, t) in zip(views, tensors):  # the limit must also be a correct copy
        if not torch.equal(v, t):
            raise RuntimeError("memcpy baseline produced a wrong copy")
    del pairs, views, buf
    return {"times": times}


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
        rss_warm = _rss()
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
        with ckpt.engine.reading() as shard:  # the last snapshot must verify
            if shard.step != step:
                raise RuntimeError(f"memckpt holds step {shard.step}, expected {step}")
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


def _matmul_unit():
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
    run = _matmul_unit()
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
        rss_warm = _rss()
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
        with ckpt.engine.reading() as shard:  # the last snapshot must verify
            if shard.step != step:
                raise RuntimeError(f"memckpt holds step {shard.step}, expected {step}")
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


# -- one size -----------------------------------------------------------------------------------
def default_repeats(target_bytes: int) -> int:
    return 5 if target_bytes <= _GIB else 3


def _check_room(label: str, target: int, ram_root: Optional[str], directory: Path) -> None:
    import psutil
    from memckpt.buffers import resolve_ram_root
    need = int(3.2 * target) + (1 << 30)  # live state + two slots + interpreter
    avail = psutil.virtual_memory().available
    if need > avail:
        raise MemoryError(f"size {label} needs about {need / _GIB:.1f} GiB of RAM (state + two "
                          f"snapshot slots), {avail / _GIB:.1f} GiB are available")
    root = resolve_ram_root(ram_root)
    free = shutil.disk_usage(root).free
    if 2 * target > free:
        raise MemoryError(f"size {label} needs {2 * target / _GIB:.1f} GiB in ram_root {root}, "
                          f"{free / _GIB:.1f} GiB free: use --ram-root or a smaller size")
    free = shutil.disk_usage(directory).free
    if target * 1.1 > free:
        raise MemoryError(f"size {label} needs {target / _GIB:.1f} GiB in --dir {directory}, "
                          f"{free / _GIB:.1f} GiB free")


def run_size(label: str, target: int, repeats: int, mode: str, directory: Path,
             ram_root: Optional[str], wait_quiet: float = 0.0,
             layers: int = DEFAULT_LAYERS) -> list[dict[str, Any]]:
    """Measure every method for one state size in this process; returns the rows."""
    from memckpt.state import TrainState
    say = _Progress(label)
    _check_room(label, target, ram_root, directory)
    gc.collect()
    rss_base = _rss()
    t0 = time.perf_counter()
    model, opt = build_state(target, layers)
    state = TrainState(model=model, optimizer=opt)
    captured = state.capture(0)
    state_bytes = captured.nbytes
    tensors = list(captured.tensors)
    del captured
    gc.collect()
    rss_state = _rss()
    n_params = sum(p.numel() for p in model.parameters())
    say(f"state {state_bytes / (1 << 20):.1f} MiB ({len(model)} x Linear({model[0].in_features}), "
        f"{n_params / 1e6:.1f} M params + AdamW, {len(tensors)} tensors) built in "
        f"{time.perf_counter() - t0:.1f} s; {repeats} repeats")
    machine = machine_info()
    results: dict[str, dict[str, Any]] = {}
    quiet = Quiet(wait_quiet)

    def run(method: str, fn: Callable[[], dict[str, Any]]) -> None:
        gc.collect()
        reset = _reset_peak_rss()
        quiet.reset(max_discards=2 * repeats)
        res = fn()
        res["foreign_cpu"] = quiet.foreign()
        res["quiet_waited_s"] = round(quiet.waited_s, 1)
        res["quiet_timeouts"] = quiet.timeouts
        res["discarded"] = quiet.discarded
        res["peak_rss_bytes"] = _peak_rss()
        res["peak_rss_source"] = "VmHWM" if reset else "ru_maxrss (process peak, never reset)"
        results[method] = res
        gc.collect()
        say(f"{method}: median {median(res['times']) * 1e3:.1f} ms over {len(res['times'])} "
            f"(other processes used {100 * (res['foreign_cpu'] or 0):.0f}% of the CPU meanwhile; "
            f"{quiet.discarded} noisy repeats run again)")

    run("memcpy", lambda: measure_memcpy(tensors, repeats, quiet))
    memcpy_s = median(results["memcpy"]["times"])
    n_tensors = len(tensors)
    del tensors
    if mode in ("sync", "both"):
        run("memckpt", lambda: measure_memckpt_sync(state, repeats, quiet, ram_root, rss_base,
                                                    rss_state, state_bytes))
    if mode in ("overlap", "both"):
        run("memckpt-overlap", lambda: measure_memckpt_overlap(state, opt, repeats, quiet, ram_root,
                                                               memcpy_s, state_bytes, rss_base))
    run("torch.save-buffer", lambda: measure_save_buffer(model, opt, repeats, quiet))
    run("torch.save-disk", lambda: measure_save_disk(model, opt, repeats, quiet, directory))

    ref_memckpt = results.get("memckpt", {}).get("times")
    rows = []
    for method in METHODS:
        if method not in results:
            continue
        res = dict(results[method])
        times = res.pop("times")
        stall = median(times)
        row = {"method": method, "size": label, "target_bytes": target, "state_bytes": state_bytes,
               "tensors": n_tensors, "layers": len(model), "width": model[0].in_features,
               "stall_s": stall, "stall_min_s": min(times), "stall_max_s": max(times),
               "stalls_s": times, "repeats": len(times),
               "ratio_to_memcpy": stall / memcpy_s if memcpy_s > 0 else None,
               "ratio_to_memckpt": stall / median(ref_memckpt) if ref_memckpt else None}
        row.update(res)
        row["rss_with_state_bytes"] = rss_state
        row["machine"] = machine
        rows.append(row)
    del state, model, opt
    gc.collect()
    return rows


# -- orchestration ------------------------------------------------------------------------------
def _run_in_subprocess(label: str, repeats: Optional[int], args: argparse.Namespace,
                       directory: Path) -> list[dict[str, Any]]:
    import memckpt
    pkg_root = str(Path(memckpt.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    fd, out = tempfile.mkstemp(prefix="memckpt-bench-rows-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "memckpt.bench.snapshot", "--sizes", label, "--mode", args.mode,
           "--dir", str(directory), "--in-process", "--rows-out", out]
    if repeats is not None:
        cmd += ["--repeats", str(repeats)]
    if args.ram_root:
        cmd += ["--ram-root", args.ram_root]
    if args.wait_quiet:
        cmd += ["--wait-quiet", str(args.wait_quiet)]
    if args.layers != DEFAULT_LAYERS:
        cmd += ["--layers", str(args.layers)]
    try:
        try:  # the child's progress goes to our stderr (through a pipe if that has no fd)
            fd: Optional[int] = sys.stderr.fileno()
        except (AttributeError, ValueError, OSError):
            fd = None
        if fd is not None:
            proc = subprocess.run(cmd, env=env, stdout=fd, stderr=fd)
        else:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            sys.stderr.write(proc.stdout)
        if proc.returncode != 0:
            raise RuntimeError(f"the measurement of size {label} exited with {proc.returncode}")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def _ratio(x: Optional[float]) -> str:
    return "–" if x is None else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | state size | median stall | × memcpy | × memckpt | peak RSS |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {human_bytes(r['state_bytes'])} | {human_s(r['stall_s'])} | "
                     f"{_ratio(r['ratio_to_memcpy'])} | {_ratio(r['ratio_to_memckpt'])} | "
                     f"{human_bytes(r['peak_rss_bytes'])} |")
    return "\n".join(lines)


def format_notes(rows: list[dict[str, Any]]) -> str:
    out = []
    by = {(r["size"], r["method"]): r for r in rows}
    for size in dict.fromkeys(r["size"] for r in rows):
        parts = []
        m, o = by.get((size, "memckpt")), by.get((size, "memckpt-overlap"))
        if m:
            parts.append(f"memckpt sync: RSS after warm-up = {m['rss_over_state']:.2f} × state "
                         f"(expected ≈ 3: live state + two slots; the slots alone "
                         f"{m['snapshot_rss_over_state']:.2f} ×); slot allocations "
                         f"{m['allocations_after_warmup']} after warm-up, {m['allocations']} at the "
                         f"end ({'flat' if m['allocations_flat'] else 'NOT flat'}); capture() "
                         f"{human_s(m['capture_s'])}; background seal (xxh3) {human_s(m['seal_s'])}")
        if o:
            parts.append(f"memckpt overlap: step() {human_s(o['step_s'])} (of which waiting for "
                         f"the previous seal {human_s(o['seal_wait_s'])}) + pre-hook wait "
                         f"{human_s(o['hook_wait_s'])}; simulated forward+backward "
                         f"{human_s(o['compute_alone_s'])} alone, {human_s(o['compute_overlap_s'])} "
                         f"while the copy runs (+{human_s(o['compute_slowdown_s'])}: visible stall + "
                         f"slowdown = {human_s(o['stall_with_slowdown_s'])}); allocations "
                         f"{'flat' if o['allocations_flat'] else 'NOT flat'} ({o['allocations']})")
        d = by.get((size, "torch.save-disk"))
        if d:
            parts.append(f"torch.save-disk: {d['dir']} ({d['dir_fs']})")
        first = next(r for r in rows if r["size"] == size)
        parts.insert(0, f"model {first['layers']} × Linear({first['width']}) + AdamW, "
                        f"{first['tensors']} tensors")
        out.append(f"- {size}: " + "; ".join(parts))
    return "\n".join(out)


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """The issue's targets, evaluated on the rows at hand: (met, description)."""
    checks = []
    by = {(r["size"], r["method"]): r for r in rows}
    for (size, method), r in by.items():
        big = r["target_bytes"] >= _GIB
        if method == "memckpt" and big:
            checks.append((r["ratio_to_memcpy"] <= 1.3,
                           f"{size}: memckpt sync stall {r['ratio_to_memcpy']:.2f} × memcpy (target ≤ 1.3)"))
        if method == "memckpt-overlap":
            checks.append((r["ratio_to_memcpy"] <= 0.3,
                           f"{size}: overlap visible stall {r['ratio_to_memcpy']:.2f} × memcpy (target ≤ 0.3)"))
        if method == "torch.save-disk" and r["target_bytes"] == _GIB and (size, "memckpt") in by:
            x = r["stall_s"] / by[(size, "memckpt")]["stall_s"]
            checks.append((x >= 10, f"{size}: torch.save-disk / memckpt = {x:.1f} × (target ≥ 10)"))
    return checks


def report(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no rows measured"
    head = machine_line(rows[0]["machine"], threads=True)
    return finish_report([head, "", format_table(rows), "", format_notes(rows)], rows,
                         BUSY_THRESHOLD, lambda r: f"{r['size']} {r['method']}", check_targets(rows))


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.snapshot``, ``benchmarks/bench_snapshot.py``."""
    return standalone("memckpt bench snapshot", __doc__, add_arguments, main, argv)


def main(args: argparse.Namespace) -> int:
    if args.dir:
        directory, made = Path(args.dir), False
        directory.mkdir(parents=True, exist_ok=True)
    else:
        # tempfile's default directory, unless that is a tmpfs: then the working directory.
        base = Path(tempfile.gettempdir())
        if fs_type(base) in ("tmpfs", "ramfs"):
            base = Path.cwd()
        directory, made = Path(tempfile.mkdtemp(prefix="memckpt-bench-", dir=base)), True
    if fs_type(directory) in ("tmpfs", "ramfs") and not args.rows_out:
        print(f"memckpt bench snapshot: warning: --dir {directory} is a RAM filesystem; "
              "torch.save-disk will not measure a disk", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    failed = []
    try:
        for label, target in args.sizes:
            repeats = args.repeats or default_repeats(target)
            try:
                if args.in_process:
                    rows += run_size(label, target, repeats, args.mode, directory, args.ram_root,
                                     args.wait_quiet, args.layers)
                else:
                    rows += _run_in_subprocess(label, args.repeats, args, directory)
            except (MemoryError, RuntimeError, OSError) as e:
                print(f"memckpt bench snapshot: size {label}: {e}", file=sys.stderr)
                failed.append(label)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    if args.rows_out:
        with open(args.rows_out, "w") as f:
            json.dump(rows, f)
        return 1 if failed else 0
    write_rows(args.json, rows)
    print(report(rows))
    if failed:
        print(f"\nnot measured: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_cli())
