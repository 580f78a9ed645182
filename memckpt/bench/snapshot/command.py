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
  memckpt-restore    Checkpointer.restore() from the RAM slot into the live state,
                     against the bound: one copy of the same bytes from (pinned) host
                     memory to the state's device
  memckpt-first      the first snapshot of a job after restore() prepared the slots in
                     the background (the cold first snapshot, which maps them on the
                     step, in the notes)

With --device cuda the state lives on the GPU: memcpy is the device-to-host copy into
pinned memory (the bus's bound), and every method copies from the GPU.

Each size runs in a fresh subprocess (peak RSS stays honest and memory is
returned between sizes); the peak RSS of each method is the process's VmHWM,
reset before the method. Sizes are binary: 100M = 100 MiB, 1G = 1 GiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional

from memckpt.bench.common import (GIB, disk_dir, machine_info, parse_sizes, positive_int,
                                  rows_from_child, standalone, usable_dir, write_rows)
from memckpt.bench.foreign_load import DISCARD_THRESHOLD, QUIET_THRESHOLD, Quiet
from memckpt.bench.snapshot.measure import (DEFAULT_LAYERS, build_state, measure_first_snapshot,
                                            measure_memckpt_overlap, measure_restore,
                                            measure_memckpt_sync, measure_memcpy,
                                            measure_save_buffer, measure_save_disk, peak_rss,
                                            reset_peak_rss, rss_bytes)
from memckpt.bench.snapshot.report import report
from memckpt.util.fsutil import fs_type

METHODS = ("memcpy", "memckpt", "memckpt-overlap", "torch.save-buffer", "torch.save-disk",
           "memckpt-restore", "memckpt-first")
MODES = ("sync", "overlap", "both")
DEFAULT_SIZES = "100M,1G,4G"


# -- argument parsing ---------------------------------------------------------------------------
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
    parser.add_argument("--skip", default="", metavar="LIST",
                        help="methods to leave out, comma-separated (e.g. torch.save-disk)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the training state lives (default cpu)")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every size in this process instead of a fresh one per size")
    parser.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)  # worker: rows -> file


class _Progress:
    def __init__(self, label: str) -> None:
        self.label = label

    def __call__(self, msg: str) -> None:
        print(f"[bench snapshot {self.label}] {msg}", file=sys.stderr, flush=True)



# -- one size -----------------------------------------------------------------------------------
def default_repeats(target_bytes: int) -> int:
    return 5 if target_bytes <= GIB else 3


def _check_room(label: str, target: int, ram_root: Optional[str], directory: Path) -> None:
    import psutil
    from memckpt.engine.buffers import resolve_ram_root
    need = int(3.2 * target) + (1 << 30)  # live state + two slots + interpreter
    avail = psutil.virtual_memory().available
    if need > avail:
        raise MemoryError(f"size {label} needs about {need / GIB:.1f} GiB of RAM (state + two "
                          f"snapshot slots), {avail / GIB:.1f} GiB are available")
    root = resolve_ram_root(ram_root)
    free = shutil.disk_usage(root).free
    if 2 * target > free:
        raise MemoryError(f"size {label} needs {2 * target / GIB:.1f} GiB in ram_root {root}, "
                          f"{free / GIB:.1f} GiB free: use --ram-root or a smaller size")
    free = shutil.disk_usage(directory).free
    if target * 1.1 > free:
        raise MemoryError(f"size {label} needs {target / GIB:.1f} GiB in --dir {directory}, "
                          f"{free / GIB:.1f} GiB free")


def run_size(label: str, target: int, repeats: int, mode: str, directory: Path,
             ram_root: Optional[str], wait_quiet: float = 0.0,
             layers: int = DEFAULT_LAYERS, device: str = "cpu",
             skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Measure every method for one state size in this process; returns the rows."""
    from memckpt.format.state import TrainState
    say = _Progress(label)
    _check_room(label, target, ram_root, directory)
    gc.collect()
    rss_base = rss_bytes()
    t0 = time.perf_counter()
    model, opt = build_state(target, layers, device=device)
    state = TrainState(model=model, optimizer=opt)
    captured = state.capture(0)
    state_bytes = captured.nbytes
    tensors = list(captured.tensors)
    del captured
    gc.collect()
    rss_state = rss_bytes()
    n_params = sum(p.numel() for p in model.parameters())
    say(f"state {state_bytes / (1 << 20):.1f} MiB ({len(model)} x Linear({model[0].in_features}), "
        f"{n_params / 1e6:.1f} M params + AdamW, {len(tensors)} tensors) built in "
        f"{time.perf_counter() - t0:.1f} s; {repeats} repeats")
    machine = machine_info()
    results: dict[str, dict[str, Any]] = {}
    quiet = Quiet(wait_quiet)

    def run(method: str, measure: Callable[..., dict[str, Any]], *args: Any) -> None:
        if method in skip:
            return
        gc.collect()
        reset = reset_peak_rss()
        quiet.reset(max_discards=2 * repeats)
        res = measure(*args)
        res["foreign_cpu"] = quiet.foreign()
        res["quiet_waited_s"] = round(quiet.waited_s, 1)
        res["quiet_timeouts"] = quiet.timeouts
        res["discarded"] = quiet.discarded
        res["peak_rss_bytes"] = peak_rss()
        res["peak_rss_source"] = "VmHWM" if reset else "ru_maxrss (process peak, never reset)"
        results[method] = res
        gc.collect()
        say(f"{method}: median {median(res['times']) * 1e3:.1f} ms over {len(res['times'])} "
            f"(other processes used {100 * (res['foreign_cpu'] or 0):.0f}% of the CPU meanwhile; "
            f"{quiet.discarded} noisy repeats run again)")

    run("memcpy", measure_memcpy, tensors, repeats, quiet)
    memcpy_s = median(results["memcpy"]["times"])
    n_tensors = len(tensors)
    del tensors
    if mode in ("sync", "both"):
        run("memckpt", measure_memckpt_sync, state, repeats, quiet, ram_root, rss_base, rss_state,
            state_bytes)
    if mode in ("overlap", "both"):
        run("memckpt-overlap", measure_memckpt_overlap, state, opt, repeats, quiet, ram_root,
            memcpy_s, state_bytes, rss_base)
    run("torch.save-buffer", measure_save_buffer, model, opt, repeats, quiet)
    run("torch.save-disk", measure_save_disk, model, opt, repeats, quiet, directory)
    run("memckpt-restore", measure_restore, state, repeats, quiet, ram_root,
        median(results["memcpy"]["back_times"]))
    run("memckpt-first", measure_first_snapshot, state, min(repeats, 3), quiet, ram_root)

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
        row["device"] = device
        row["rss_with_state_bytes"] = rss_state
        row["machine"] = machine
        rows.append(row)
    del state, model, opt
    gc.collect()
    return rows



# -- orchestration ------------------------------------------------------------------------------
def _run_in_subprocess(label: str, repeats: Optional[int], args: argparse.Namespace,
                       directory: Path) -> list[dict[str, Any]]:
    argv = ["--sizes", label, "--mode", args.mode, "--dir", str(directory), "--in-process",
            "--device", args.device, "--skip", args.skip]
    if repeats is not None:
        argv += ["--repeats", str(repeats)]
    if args.ram_root:
        argv += ["--ram-root", args.ram_root]
    if args.wait_quiet:
        argv += ["--wait-quiet", str(args.wait_quiet)]
    if args.layers != DEFAULT_LAYERS:
        argv += ["--layers", str(args.layers)]
    return rows_from_child("memckpt.bench.snapshot.command", argv, "--rows-out",
                           f"the measurement of size {label}")


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.snapshot.command``, ``benchmarks/bench_snapshot.py``."""
    return standalone("memckpt bench snapshot", __doc__, add_arguments, main, argv)


def main(args: argparse.Namespace) -> int:
    if args.dir:
        directory, made = usable_dir(args.dir), False
    else:
        directory, made = disk_dir(None, "memckpt-bench-"), True
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
                                     args.wait_quiet, args.layers, args.device,
                                     tuple(m for m in args.skip.split(",") if m))
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
